"""`specdec tune`: its arithmetic on measured-looking numbers worked by hand, and the command end to end on
the tiny pair (the choices it prints are the ones it measured, the config it writes runs as written)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specdec_cli.bench.tuning import Choice, Probe, finalists, predicted_speedup, schedule_ranges
from specdec_cli.cli import app
from specdec_cli.config import load_config
from specdec_cli.decoding.metrics import StepRecord
from specdec_cli.decoding.params import BatchSchedule, SamplingParams
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
    predicted = {0: 1.0, 1: 1.3, 2: 1.5, 3: 1.4, 4: 1.1}
    assert finalists(predicted, {4}, count=2) == [0, 2, 3, 4]
    assert finalists(predicted, {2}, count=1) == [0, 2, 3]
    assert finalists(predicted, {4}, count=0) == [0, 4]
    assert finalists(predicted, {4, 1}, count=1) == [0, 1, 2, 4]


def test_the_measured_best_is_chosen_over_the_predicted():
    choice = Choice(1, 0.0, {0: 1.0, 1: 1.2, 2: 1.6}, {0: 1.0, 1: 1.3, 2: 1.1}, {}, 2)
    assert choice.chosen == 1
    assert Choice(1, 0.0, {0: 1.0, 1: 1.2, 2: 1.6}, {}, {}, 2).chosen == 2  # nothing ran: the prediction
    assert Choice(1, 0.0, {0: 1.0, 1: 0.9}, {0: 1.0, 1: 1.0}, {}, 1).chosen == 0  # a tie: fewer drafts


def test_the_prediction_of_shorter_blocks_worked_by_hand():
    """Blocks of the full length 2 accepted 2, 1, 0 and 2 drafts: cut to 1 draft, they keep 1, 1, 0, 1."""
    steps = [StepRecord(2, a, a + 1, draft_seconds=0.1, verify_seconds=0.3) for a in (2, 1, 0, 2)]
    probe = Probe(2, alone_tokens_per_second=10.0, block_seconds={1: 0.25, 2: 0.4}, rows_per_block={1: 2.0, 2: 1.5})
    assert predicted_speedup(probe, 2, steps) == pytest.approx(1.5 * (1 + 5 / 4) / 0.4 / 10.0)
    assert predicted_speedup(probe, 1, steps) == pytest.approx(2.0 * (1 + 3 / 4) / 0.25 / 10.0)
    assert predicted_speedup(probe, 0, steps) == 1.0


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
        measured = {int(k): v for k, v in choice["measured"].items()}
        assert set(measured) >= {0, 3}  # the target alone and the config as it is ran beside the others
        assert set(int(k) for k in choice["predicted"]) == {0, 1, 2, 3}
        assert measured[choice["chosen"]] == max(measured.values())
    # the acceptance that predicts is the full drafting's on every prompt at that batch size
    assert {(a["temperature"], a["batch_size"]) for a in record["acceptance"]} == {(0, 1), (0, 2), (1, 1), (1, 2)}
    for seen in record["acceptance"]:
        runs = [
            r
            for r in record["batch_runs"]
            if (r["batch_size"], r["num_draft_tokens"], r["temperature"])
            == (seen["batch_size"], 3, seen["temperature"])
        ]
        assert len({p for r in runs for p in r["prompt_ids"]}) == 3
        full = [s for r in runs for rep in r["repeats"] for s in rep["steps"]]
        assert seen["blocks"] == len(full)
        assert seen["mean_accepted"]["3"] == pytest.approx(sum(s[1] for s in full) / len(full))
    greedy = {c["batch_size"]: c["chosen"] for c in record["choices"] if c["temperature"] == 0}
    schedule = BatchSchedule.parse(record["schedule"]["greedy"])
    assert {size: schedule.tokens(size) for size in greedy} == greedy
    assert {p.name for p in folder.iterdir()} >= {"record.json", "tuned.yaml", "report.md", "chart.png"}


def test_the_tuned_config_runs_as_written_and_stays_exact(tuned, tmp_path):
    record, folder = tuned
    cfg = load_config(str(folder / "tuned.yaml"))
    assert cfg.speculation.schedule.greedy == record["schedule"]["greedy"]
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
    assert speculative["num_speculative_tokens_per_batch_size"] == record["schedule"]["greedy"]
    assert record["vllm_unavailable"] is None


def test_a_config_with_a_schedule_runs_its_own_length_and_keeps_what_was_not_tuned(write_config, prompts):
    schedule = {"greedy": [[1, 4, 2]], "sampled": [[1, 1, 1], [2, 4, 0]]}
    record = greedy_tune(write_config({"speculation": {"num_draft_tokens": 3, "schedule": schedule}}), prompts)
    for choice in record["choices"]:
        assert choice["config_tokens"] == 2
        assert {"0", "2", "3"} <= set(choice["measured"])  # alone, the config's own, the full drafting
    assert record["schedule"]["sampled"] == schedule["sampled"]  # only greedy was tuned
    assert set(record["vllm_speculative_config"]) == {"greedy", "sampled"}


def test_a_spent_budget_keeps_the_predictions(write_config, prompts):
    """The full drafting's run and the probes always run (they predict); the budget stops the finalists."""
    record = greedy_tune(write_config(), prompts, "--budget-minutes", "0")
    assert record["partial"]
    assert {(r["batch_size"], r["num_draft_tokens"]) for r in record["batch_runs"]} == {(1, 3)}
    for choice in record["choices"]:
        assert choice["measured"] == {}  # the target alone never ran: nothing to set the full drafting against
        predicted = {int(k): v for k, v in choice["predicted"].items()}
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
