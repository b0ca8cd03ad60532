"""`specdec tune`: its arithmetic on measured-looking numbers worked by hand, and the command end to end on
the tiny pair (the choices it prints are the ones it measured, the config it writes runs as written)."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
import yaml
from typer.testing import CliRunner

from specdec_cli.bench.plan import Mode, make_plan
from specdec_cli.bench.prompts import Prompt
from specdec_cli.bench.run import MakeBatchGenerator, batch_generator, run_rounds
from specdec_cli.bench.tuning import (
    CONFIG_STYLE,
    Choice,
    Probe,
    Setting,
    finalists,
    mean_accepted,
    predicted_speedups,
    probed_speedup,
    schedule_ranges,
    written_setting,
    written_style,
)
from specdec_cli.cli import app
from specdec_cli.commands.tune import tuned_config, with_setting
from specdec_cli.config import Schedule, load_config, parse_config
from specdec_cli.decoding.metrics import StepRecord
from specdec_cli.decoding.params import BatchSchedule, SamplingParams, TreeShape
from specdec_cli.pair import load_pair

runner = CliRunner()


@pytest.mark.parametrize(
    "chosen, ranges",
    [
        ({1: 3, 2: 3, 4: 2, 8: 0}, [[1, 3, 3], [4, 7, 2], [8, 8, 0]]),
        ({2: 1, 8: 1}, [[1, 8, 1]]),  # equal neighbours merge; the first range starts at 1
        ({1: 0}, [[1, 1, 0]]),
    ],
)
def test_the_schedule_holds_each_choice_from_its_batch_size_to_the_next(chosen, ranges):
    assert schedule_ranges(chosen) == ranges
    schedule = BatchSchedule.parse(ranges)  # vLLM's form, which the config reads back
    for size, tokens in chosen.items():
        assert schedule.tokens(size) == tokens
    assert schedule.tokens(1000) == chosen[max(chosen)]


def test_finalists_are_the_target_alone_the_config_and_the_predicted_best():
    predicted = {"0": 1.0, "1": 1.3, "2": 1.5, "3": 1.4, "4": 1.1, "4 block": 1.45}
    assert finalists(predicted, {"4"}, count=2) == ["0", "2", "4", "4 block"]
    assert finalists(predicted, {"2"}, count=1) == ["0", "2", "4 block"]
    assert finalists(predicted, {"4"}, count=0) == ["0", "4"]
    assert finalists(predicted, {"4", "1"}, count=1) == ["0", "1", "2", "4"]


def test_the_measured_best_is_chosen_over_the_predicted():
    choice = Choice(1, 0.0, {"0": 1.0, "1": 1.2, "2": 1.6}, {"0": 1.0, "1": 1.3, "2": 1.1}, {}, "2")
    assert choice.chosen == "1"
    assert Choice(1, 0.0, {"0": 1.0, "1": 1.2, "2": 1.6}, {}, {}, "2").chosen == "2"  # nothing ran: the prediction
    assert Choice(1, 0.0, {"0": 1.0, "1": 0.9}, {"0": 1.0, "1": 1.0}, {}, "1").chosen == "0"  # a tie: fewer drafts


def test_the_prediction_of_shorter_blocks_worked_by_hand():
    """Blocks of the full length 2 accepted 2, 1, 0 and 2 drafts: cut to 1 draft, they keep 1, 1, 0, 1. A
    setting that is more than a length is probed by its tokens/s. Every prediction but the target alone's
    is then scaled by the full drafting's measured speedup over its probed one."""
    steps = [StepRecord(2, a, a + 1, draft_seconds=0.1, verify_seconds=0.3) for a in (2, 1, 0, 2)]
    probe = Probe(
        2,
        block_seconds={"1": 0.25, "2": 0.4},
        rows_per_block={"1": 2.0, "2": 1.5},
        tokens_per_second={"0": 10.0, "2 threshold 0.4": 13.0},
    )
    probed = {
        "2": 1.5 * (1 + 5 / 4) / 0.4 / 10.0,
        "1": 2.0 * (1 + 3 / 4) / 0.25 / 10.0,
        "0": 1.0,
        "2 threshold 0.4": 1.3,
    }
    settings = [Setting(2), Setting(1), Setting(0), Setting(2, threshold=0.4)]
    assert {s.label: probed_speedup(probe, s, steps, replay=False) for s in settings} == pytest.approx(probed)
    predicted = predicted_speedups(probe, settings, steps, False, full=Setting(2), measured_full=0.9)
    scale = 0.9 / probed["2"]
    assert predicted == pytest.approx({label: p * (scale if label != "0" else 1) for label, p in probed.items()})
    assert predicted["2"] == pytest.approx(0.9)


@pytest.mark.parametrize(
    "tokens, cut, replayed",
    [
        (4, 11 / 5, 11 / 5),  # the full length: what was measured, either way
        (2, 7 / 5, 16 / 7 - 1),  # blocks of 3 tokens emit the 5, 2, 1, 5 and 3 tokens in 2, 1, 1, 2, 1 blocks
        (1, 4 / 5, 16 / 10 - 1),  # blocks of 2 tokens: in 3, 1, 1, 3, 2 blocks
        (0, 0.0, 0.0),
    ],
)
def test_shorter_blocks_are_cut_or_replayed_worked_by_hand(tokens, cut, replayed):
    """Full blocks of 4 that accepted 4, 1, 0, 4 and 2 drafts, as blocks of fewer: cut, each keeps its first
    accepted ones; replayed (a drafter that copies the context), a block's a + 1 tokens take
    ceil((a + 1) / (tokens + 1)) blocks."""
    steps = [StepRecord(4, a, a + 1, draft_seconds=0.0, verify_seconds=0.1) for a in (4, 1, 0, 4, 2)]
    assert mean_accepted(steps, tokens, replay=False) == pytest.approx(cut)
    assert mean_accepted(steps, tokens, replay=True) == pytest.approx(replayed)


def test_drafters_that_copy_the_context_say_so(write_config):
    """Prompt lookup and suffix decoding draft spans of the context; a draft model does not."""
    copies = {}
    for name, draft in (
        ("ngram", {"ngram": {"max_n": 3, "min_n": 1}}),
        ("suffix", {"suffix": {"max_spec_factor": 2.0}}),
        ("model", {}),
    ):
        pair = load_pair(load_config(str(write_config({"draft": draft} if draft else {}))))
        copies[name] = pair.drafter.copies_context
    assert copies == {"ngram": True, "suffix": True, "model": False}


TREE = Setting(3, tree=TreeShape(3, 2, 6))
OPTIONS = {s.label: s for s in [Setting(0), Setting(1), Setting(2), Setting(2, verification="block"), TREE]}


def cells(best: dict[tuple[float, int], dict[str, float]]) -> list[Choice]:
    return [Choice(size, t, measured, measured, {}, "2") for (t, size), measured in best.items()]


def test_another_style_is_written_only_where_it_was_best_wherever_it_changes_decoding():
    """The block rule changes sampled chains only: written when it was measured best at every sampled
    batch size (or the target alone was); a tree has no off, so it must be best everywhere."""
    block = cells(
        {
            (0.0, 1): {"0": 1.0, "1": 1.2, "2": 1.3},  # greedy: the rule does not apply
            (1.0, 1): {"0": 1.0, "2": 1.1, "2 block": 1.2},
            (1.0, 4): {"0": 1.0, "2": 0.8, "2 block": 0.9},  # the target alone, which a schedule can give
        }
    )
    assert written_style(block, OPTIONS) == Setting(0, verification="block")
    assert [written_setting(c, Setting(0, verification="block"), OPTIONS) for c in block] == ["2", "2 block", "0"]
    block[1].measured["2"] = 1.25  # the config's own rule best at one sampled size: the config's own style
    assert written_style(block, OPTIONS) == CONFIG_STYLE
    assert [written_setting(c, CONFIG_STYLE, OPTIONS) for c in block] == ["2", "2", "0"]
    tree = cells({(0.0, 1): {"0": 1.0, "2": 1.3, TREE.label: 1.4}, (0.0, 4): {"0": 1.0, "2": 0.9, TREE.label: 0.8}})
    assert written_style(tree, OPTIONS) == CONFIG_STYLE  # the tree lost to the target alone at 4, and cannot be off
    tree[1].measured[TREE.label] = 1.05
    assert written_style(tree, OPTIONS) == TREE.style
    assert [written_setting(c, TREE.style, OPTIONS) for c in tree] == [TREE.label] * 2


@pytest.fixture
def prompts(tmp_path) -> str:
    path = tmp_path / "prompts.txt"
    path.write_text("Hello there\nOnce upon a time\nCount to ten\n")
    return str(path)


@pytest.fixture
def tuned(write_config, prompts, tmp_path):
    config = write_config({"speculation": {"num_draft_tokens": 3}})
    run = runner.invoke(
        app,
        ["tune", "-c", str(config), "--json", "--sample", "2", "--max-new-tokens", "12"]
        + ["--batch-sizes", "1,2", "--temperatures", "0,1", "--prompts", prompts, "--runs-dir", str(tmp_path / "runs")],
    )
    assert run.exit_code == 0, run.output
    (folder,) = (tmp_path / "runs").iterdir()
    return json.loads(run.stdout), folder


def test_tune_keeps_the_measured_best_at_every_batch_size_and_temperature(tuned):
    record, folder = tuned
    assert not record["partial"]
    assert {(c["batch_size"], c["temperature"]) for c in record["choices"]} == {(1, 0), (2, 0), (1, 1), (2, 1)}
    for choice in record["choices"]:
        measured = choice["measured"]
        assert set(measured) >= {"0", "3"}  # the target alone and the config as it is ran beside the others
        others = {"3 threshold 0.2", "3 threshold 0.4", "tree 3,2,6"} | (
            {"3 block"} if choice["temperature"] else set()
        )
        assert set(choice["predicted"]) == {"0", "1", "2", "3"} | others  # the rule changes sampled chains only
        assert measured[choice["chosen"]] == max(measured.values())
        assert choice["written"] in measured
    # the acceptance that predicts is the full drafting's on every prompt at that batch size
    assert {(a["temperature"], a["batch_size"]) for a in record["acceptance"]} == {(0, 1), (0, 2), (1, 1), (1, 2)}
    assert {r["setting"] for r in record["acceptance_runs"]} == {"0", "3"}  # beside the target alone
    for choice in record["choices"]:  # the finalists ran round by round on the same batches, as often
        ran_alike(record["batch_runs"], choice, choice["measured"])
    for seen in record["acceptance"]:  # the full drafting beside the target alone, on every prompt
        runs = [
            r
            for r in record["acceptance_runs"]
            if (r["batch_size"], r["temperature"]) == (seen["batch_size"], seen["temperature"])
        ]
        by_setting = {label: [r["prompt_ids"] for r in runs if r["setting"] == label] for label in ("0", "3")}
        assert by_setting["0"] == by_setting["3"]
        assert len({p for ids in by_setting["3"] for p in ids}) == 3
        full = [s for r in runs if r["setting"] == "3" for rep in r["repeats"] for s in rep["steps"]]
        assert seen["blocks"] == len(full)
        assert seen["mean_accepted"]["3"] == pytest.approx(sum(s[1] for s in full) / len(full))
        repeats = len(runs[0]["repeats"])  # 3 prompts: 3 batches of 1, or 2 batches of 2 run twice
        assert repeats == (1 if seen["batch_size"] == 1 else 2)
        speedups = [
            tokens_per_second([r["repeats"][i] for r in runs if r["setting"] == "3"])
            / tokens_per_second([r["repeats"][i] for r in runs if r["setting"] == "0"])
            for i in range(repeats)
        ]
        assert seen["full_drafting_speedup"] == pytest.approx(statistics.median(speedups))
    assert not any(a["replayed"] for a in record["acceptance"])  # a draft model's shorter blocks are cut
    for probe in record["probes"]:  # every candidate probed round by round, likewise
        runs = ran_alike(record["probe_runs"], probe, probe["block_seconds"])
        for label, seconds in probe["block_seconds"].items():  # of each batch's repeats, the median counts
            medians = [
                sorted(r["repeats"], key=lambda rep: rep["decode_seconds"])[(len(r["repeats"]) - 1) // 2]
                for r in runs
                if r["setting"] == label
            ]
            assert seconds == pytest.approx(
                sum(m["decode_seconds"] for m in medians) / sum(m["blocks"] for m in medians)
            )
    if record["style"] is None:  # the config's own chain: the schedule holds each size's written length
        greedy = {c["batch_size"]: int(c["written"]) for c in record["choices"] if c["temperature"] == 0}
        schedule = BatchSchedule.parse(record["schedule"]["greedy"])
        assert {size: schedule.tokens(size) for size in greedy} == greedy
    assert {p.name for p in folder.iterdir()} >= {"record.json", "tuned.yaml", "report.md", "chart.png"}
    report = (folder / "report.md").read_text()
    for choice in record["choices"]:  # the table shows the full drafting measured twice: the spread of one setting
        cell = (choice["batch_size"], choice["temperature"])
        first = next(
            a["full_drafting_speedup"] for a in record["acceptance"] if (a["batch_size"], a["temperature"]) == cell
        )
        assert choice["predicted"]["3"] == pytest.approx(first)
        assert f"{first:.2f}x / {choice['measured']['3']:.2f}x" in report


def ran_alike(runs: list[dict], cell: dict, labels) -> list[dict]:
    """The runs of `cell`'s batch size and temperature, after checking that every label ran the same batches
    as often, and each batch size at least 3 batch runs (3 prompts in batches of 2: twice each)."""
    runs = [r for r in runs if (r["batch_size"], r["temperature"]) == (cell["batch_size"], cell["temperature"])]
    by_setting = {
        label: [(r["prompt_ids"], len(r["repeats"])) for r in runs if r["setting"] == label] for label in labels
    }
    assert len(set(map(str, by_setting.values()))) == 1
    assert sum(repeats for _, repeats in by_setting["0"]) >= 3
    return runs


def test_the_tuned_config_runs_as_written_and_stays_exact(tuned, tmp_path):
    record, folder = tuned
    cfg = load_config(str(folder / "tuned.yaml"))
    assert cfg.speculation.schedule == (record["schedule"] and Schedule(**record["schedule"]))
    pair = load_pair(cfg)
    prompts = [pair.encode(p) for p in ("Hello there", "Once upon a time", "Count to ten")]
    alone = pair.decoder(SamplingParams(), speculative=False).generate_batch(prompts, 12, seed=0)
    tuned_rows = pair.decoder(SamplingParams()).generate_batch(prompts, 12, seed=0)
    assert [r.token_ids for r in tuned_rows] == [r.token_ids for r in alone]


def greedy_tune(config, prompts: str, *args: str) -> dict:
    """`specdec tune --json` of `config`, greedy at batch sizes 1 and 2, short: its record."""
    run = runner.invoke(
        app,
        ["tune", "-c", str(config), "--json", "--no-record", "--sample", "1", "--max-new-tokens", "8"]
        + ["--batch-sizes", "1,2", "--temperatures", "0", "--prompts", prompts, *args],
    )
    assert run.exit_code == 0, run.output
    return json.loads(run.stdout)


def test_the_vllm_setting_is_written_where_vllm_has_the_draft(write_config, prompts):
    config = write_config({"draft": {"ngram": {"max_n": 3, "min_n": 1}}, "speculation": {"num_draft_tokens": 3}})
    record = greedy_tune(config, prompts, "--finalists", "0")
    (speculative,) = record["vllm_speculative_config"].values()
    assert speculative["method"] == "ngram"
    assert all(a["replayed"] for a in record["acceptance"])  # prompt lookup's shorter blocks are replayed
    assert speculative["num_speculative_tokens_per_batch_size"] == record["schedule"]["greedy"]
    assert record["vllm_unavailable"] is None


def test_a_config_with_a_schedule_runs_its_own_length_and_keeps_what_was_not_tuned(write_config, prompts):
    schedule = {"greedy": [[1, 4, 2]], "sampled": [[1, 1, 1], [2, 4, 0]]}
    record = greedy_tune(write_config({"speculation": {"num_draft_tokens": 3, "schedule": schedule}}), prompts)
    for choice in record["choices"]:
        assert choice["config_label"] == "2"
        assert {"0", "2", "3"} <= set(choice["measured"])  # alone, the config's own, the full drafting
    assert record["schedule"]["sampled"] == schedule["sampled"]  # only greedy was tuned
    assert set(record["vllm_speculative_config"]) == {"greedy", "sampled"}


def test_a_spent_budget_keeps_the_predictions(write_config, prompts):
    """The full drafting's run beside the target alone and the probes always run (they predict); the budget
    stops the finalists. --repeats repeats the runs that measure, not the probe's (3 batch runs each)."""
    record = greedy_tune(write_config(), prompts, "--budget-minutes", "0", "--repeats", "4")
    assert record["partial"]
    assert {(r["batch_size"], r["num_draft_tokens"]) for r in record["acceptance_runs"]} == {(1, 0), (1, 3)}
    assert {len(r["repeats"]) for r in record["acceptance_runs"]} == {4}
    assert {len(r["repeats"]) for r in record["probe_runs"]} == {3}  # --sample 1: one batch of 1
    assert record["batch_runs"] == []
    for choice in record["choices"]:
        assert choice["measured"] == {}  # no finalist ran
        predicted = choice["predicted"]
        assert choice["chosen"] == max(predicted, key=predicted.get)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-sizes", "0,2"], "--batch-sizes must be >= 1"),
        (["--temperatures", "-1"], "--temperatures must be finite numbers >= 0"),
    ],
)
def test_bad_input_is_one_error_line(write_config, args, message):
    config = write_config()
    run = runner.invoke(app, ["tune", "-c", str(config), "--no-record", *args])
    assert run.exit_code == 2
    assert run.stderr.startswith(f"Error: {message}") and run.stderr.count("\n") == 1, run.stderr


def test_a_tree_config_is_refused(write_config):
    config = write_config({"speculation": {"tree": {"depth": 2, "max_nodes": 6}}})
    run = runner.invoke(app, ["tune", "-c", str(config), "--no-record"])
    assert run.exit_code == 2
    assert run.stderr.startswith("Error: tune chooses a chain's draft tokens") and run.stderr.count("\n") == 1


def test_a_setting_decodes_with_its_own_threshold_and_tree_and_leaves_the_pair_as_it_was(write_config):
    pair = load_pair(load_config(str(write_config())))
    prompts = [pair.encode(p) for p in ("Hello there", "Once upon a time")]
    alone = [r.token_ids for r in pair.decoder(SamplingParams(), speculative=False).generate_batch(prompts, 12, 0)]
    unsure = with_setting(pair, Setting(3, threshold=0.99))  # a tiny random draft is never that sure
    rows = unsure.decoder(SamplingParams()).generate_batch(prompts, 12, 0)
    assert [r.token_ids for r in rows] == alone
    assert max(s.drafted for r in rows for s in r.steps) <= 1
    assert pair.drafter.confidence_threshold == 0.0
    assert max(s.drafted for r in pair.decoder(SamplingParams()).generate_batch(prompts, 12, 0) for s in r.steps) == 3
    tree = with_setting(pair, TREE).decoder(SamplingParams())  # the setting's config drafts the tree
    assert tree.tree == TREE.tree
    rows = tree.generate_batch(prompts, 12, 0)
    assert [r.token_ids for r in rows] == alone


def test_the_written_style_goes_into_tuned_yaml(write_config):
    cfg = load_config(str(write_config()))
    written = parse_config(yaml.safe_load(tuned_config(cfg, TREE.style, None)))
    assert written.speculation.tree == TREE.tree and written.speculation.schedule is None
    block = Setting(0, verification="block", threshold=0.4).style
    schedule = Schedule(greedy=[[1, 2, 3], [3, 8, 0]], sampled=[[1, 8, 2]])
    written = parse_config(yaml.safe_load(tuned_config(cfg, block, schedule)))
    speculation = written.speculation
    assert (speculation.verification, speculation.confidence_threshold, speculation.schedule) == (
        "block",
        0.4,
        schedule,
    )


def test_rounds_run_every_entry_batch_by_batch_repeat_by_repeat(write_config, prompts):
    """run_rounds takes the entries in turn within each repeat of each batch, after one warm-up each."""
    pair = load_pair(load_config(str(write_config())))
    plan = make_plan(pair.config, None, [0.0], 2, 1, None, [2])
    plan = dataclasses.replace(plan, max_new_tokens=6)
    calls = []

    def logged(name: str) -> MakeBatchGenerator:
        def make(pair, mode, plan, max_new_tokens):
            generate = batch_generator(pair, mode, plan, max_new_tokens)

            def run(encoded, seed):
                calls.append((name, len(encoded), max_new_tokens))
                return generate(encoded, seed)

            return run

        return make

    entries = [(Mode(0.0, 0), logged("alone")), (Mode(0.0, 3), logged("speculative"))]
    three = [Prompt(str(i), "test", [text]) for i, text in enumerate(("Hello there", "Once upon a time", "Count"))]
    starts = []
    (alone, speculative), partial = run_rounds(pair, three, plan, 2, entries, starts.append)
    assert not partial and starts == [0, 2]
    warm = [("alone", 2, 6), ("speculative", 2, 6)]  # the warm-up is as short as WARMUP_TOKENS or the plan
    rounds = [[("alone", rows, 6), ("speculative", rows, 6)] * 2 for rows in (2, 1)]  # 2 repeats of each batch
    assert calls == warm + rounds[0] + rounds[1]
    for runs, drafted in ((alone, 0), (speculative, 3)):
        assert [(r["prompt_ids"], r["num_draft_tokens"], len(r["repeats"])) for r in runs] == [
            (["0", "1"], drafted, 2),
            (["2"], drafted, 2),
        ]
    greedy = [rep["token_ids"] for r in alone for rep in r["repeats"]]
    assert greedy == [rep["token_ids"] for r in speculative for rep in r["repeats"]]


def tokens_per_second(done: list[dict]) -> float:
    return sum(d["new_tokens"] for d in done) / sum(d["decode_seconds"] for d in done)
