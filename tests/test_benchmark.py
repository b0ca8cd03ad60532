"""specdec benchmark: aggregation on hand-made records, and end-to-end runs on tiny real models."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch
import yaml
from typer.testing import CliRunner

from specdec_cli.bench import charts
from specdec_cli.bench.measure import Measure
from specdec_cli.bench.plan import Plan
from specdec_cli.bench.prompts import Prompt
from specdec_cli.bench.report import mode_label
from specdec_cli.bench.run import run_benchmark
from specdec_cli.bench.summary import gate_failures, summarize, summarize_mode
from specdec_cli.cli import app
from specdec_cli.config import TinyModel, parse_config
from specdec_cli.decoding.metrics import StepRecord, per_token_acceptance
from specdec_cli.errors import EXIT_BAD_INPUT, EXIT_GATE_FAILED
from specdec_cli.loading.checkpoints import build_tiny, byte_tokenizer
from specdec_cli.pair import load_pair

# draft identical to the target: every draft token is accepted, greedy or sampled
SAME_PAIR = {
    "name": "tiny-same",
    "target": {"tiny": {"seed": 0}},
    "draft": {"tiny": {"seed": 0}},
    "sampling": {"temperature": 0.0, "seed": 0},
    "speculation": {"num_draft_tokens": 3},
    "generation": {
        "max_new_tokens": 12,
        "ignore_eos": True,
    },  # a multiple of num_draft_tokens + 1 for num_draft_tokens 1, 2, 3
    "runtime": {"device": "cpu", "dtype": "float32"},
}

runner = CliRunner()


def run_cli(*args: str, command: str = "benchmark") -> tuple[int, str, str]:
    result = runner.invoke(app, [command, *args])
    return result.exit_code, result.stdout, result.stderr


def write_pair(folder: Path, **changes) -> Path:
    """SAME_PAIR with `changes` (whole sections), as a config file."""
    path = folder / f"{changes.get('name', SAME_PAIR['name'])}.yaml"
    path.write_text(yaml.safe_dump({**SAME_PAIR, **changes}))
    return path


@pytest.fixture
def same_config(tmp_path) -> Path:
    return write_pair(tmp_path)


def written_record(tmp_path: Path, name: str) -> Path:
    """The one benchmark run folder of config `name` in this test's $SPECDEC_RUNS_DIR (see conftest)."""
    [folder] = (tmp_path / "runs").glob(f"*-benchmark-{name}")
    return folder


def assert_charts(folder: Path, *texts: str) -> None:
    """The run folder's chart.png decodes as an image, its chart.svg is an SVG whose text holds `texts`,
    and its report.md shows the one and links both."""
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(folder / "chart.png").shape
    assert height > 500 and width > 500
    svg = ElementTree.parse(folder / "chart.svg").getroot()
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    words = " ".join(svg.itertext())
    for text in texts:
        assert text in words
    report = (folder / "report.md").read_text()
    assert "![charts](chart.png)" in report and "[chart.svg](chart.svg)" in report


def save_checkpoint(model, folder: Path) -> Path:
    """A model as a checkpoint folder with the byte tokenizer, so a config can load it by path."""
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def tokens_by_mode(record: dict) -> dict[tuple[str, int], list[int]]:
    return {(r["engine"], r["num_draft_tokens"]): r["repeats"][0]["token_ids"] for r in record["runs"]}


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "questions.jsonl"
    lines = [
        {"question_id": 1, "category": "chat", "turns": ["Hello there", "And again"]},
        {"question_id": 2, "category": "qa", "turns": ["Why?"]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def make_run(prompt_id: str, num_draft_tokens: int, tps: list[float], steps: list[list], category: str = "c") -> dict:
    repeats = [
        {"tokens_per_second": t, "end_to_end_tokens_per_second": t, "prefill_seconds": 0.1, "steps": steps} for t in tps
    ]
    return {
        "prompt_id": prompt_id,
        "category": category,
        "temperature": 0.0,
        "num_draft_tokens": num_draft_tokens,
        "engine": "specdec",
        "repeats": repeats,
    }


BASE_STEPS = [[0, 0, 1, 0.0, 0.5]] * 4
SPEC_STEPS = [[4, 4, 5, 0.4, 1.0], [4, 1, 2, 0.4, 1.0], [4, 2, 3, 0.4, 1.0], [2, 2, 2, 0.2, 0.6]]


def test_summarize_mode_on_hand_made_records():
    baseline = [make_run("a", 0, [10.0, 12.0], BASE_STEPS), make_run("b", 0, [30.0, 28.0], BASE_STEPS)]
    speculative = [make_run("a", 4, [20.0, 30.0], SPEC_STEPS), make_run("b", 4, [40.0, 50.0], SPEC_STEPS)]
    row = summarize_mode(baseline, speculative, num_draft_tokens=4)
    # per repeat: mean spec / mean base = 30/20 and 40/20; median of the two, then the range
    assert row["speedup"] == pytest.approx((1.75, 1.5, 2.0))
    assert row["end_to_end_speedup"] == pytest.approx((1.75, 1.5, 2.0))  # these records' tok/s include prefill
    assert row["baseline_tokens_per_second"] == pytest.approx((20.0, 20.0, 20.0))
    assert row["mean_accepted_length"] == 3.0  # (5 + 2 + 3 + 2) / 4
    assert row["acceptance_rate"] == pytest.approx(9 / 14)
    assert row["acceptance_by_position"] == pytest.approx([1.0, 0.75, 1 / 3, 1 / 3])
    assert row["per_token_acceptance"] == pytest.approx(9 / 11)  # 9 accepted, 2 rejections
    c = (1.4 / 14) / 0.5  # draft seconds per draft token / target-only seconds per forward
    assert row["cost_ratio"] == pytest.approx(c)
    alpha = 9 / 11
    assert row["predicted_speedup"] == pytest.approx((1 - alpha**5) / ((1 - alpha) * (4 * c + 1)))
    # a block verifies in 0.9 s and drafts in 0.35 s on average, a target-only forward takes 0.5 s
    assert row["verification_cost"] == pytest.approx(0.9 / 0.5)
    assert row["drafting_cost"] == pytest.approx(0.35 / 0.5)
    assert row["predicted_speedup_from_parts"] == pytest.approx((1 + 9 / 4) / (1.8 + 0.7))


def test_pooled_and_per_request_lengths_differ_where_prompts_of_different_lengths_accept_differently():
    long_and_poor = [[4, 0, 1, 0.1, 1.0]] * 6  # 6 blocks, nothing accepted
    short_and_good = [[4, 4, 5, 0.1, 1.0], [4, 3, 4, 0.1, 1.0]]
    baseline = [make_run("a", 0, [10.0], BASE_STEPS), make_run("b", 0, [10.0], BASE_STEPS)]
    speculative = [make_run("a", 4, [10.0], long_and_poor), make_run("b", 4, [20.0], short_and_good)]
    row = summarize_mode(baseline, speculative, num_draft_tokens=4)
    assert row["mean_accepted_length"] == pytest.approx((6 + 9) / 8)  # every block of both prompts
    assert row["per_request_mean_accepted_length"] == pytest.approx((1.0 + 4.5) / 2)  # each prompt's, averaged
    assert row["vllm_mean_acceptance_length"] == pytest.approx(1 + 7 / 8)
    assert row["per_request_vllm_mean_acceptance_length"] == pytest.approx((1.0 + 4.5) / 2)


def test_a_records_repeats_carry_their_prompts_own_figures():
    measure = Measure(6, 0.1, 1.0, [StepRecord(*step) for step in [[4, 4, 5, 0.1, 1.0], [4, 0, 1, 0.1, 1.0]]])
    assert measure.to_dict()["request"] == {
        "mean_accepted_length": 3.0,
        "vllm_mean_acceptance_length": 3.0,
        "acceptance_rate": 0.5,
        "accepted_length_histogram": [1, 0, 0, 0, 1],
        "forwards": 2,
    }


def test_trees_get_the_prediction_from_measured_parts_only():
    baseline = [make_run("a", 0, [10.0], BASE_STEPS)]
    row = summarize_mode(baseline, [make_run("a", 4, [20.0], SPEC_STEPS)], num_draft_tokens=4, tree="4,3,16")
    assert row["predicted_speedup"] is None  # Leviathan's formula is a chain's
    assert row["predicted_speedup_from_parts"] == pytest.approx((1 + 9 / 4) / ((0.9 + 0.35) / 0.5))


def test_cost_ratio_counts_only_blocks_that_drafted():
    # a block where the n-gram drafter found no match: lookup time, no draft token
    no_match = [0, 0, 1, 0.3, 0.5]
    baseline = [make_run("a", 0, [10.0], BASE_STEPS)]
    row = summarize_mode(baseline, [make_run("a", 4, [20.0], SPEC_STEPS + [no_match])], num_draft_tokens=4)
    assert row["cost_ratio"] == pytest.approx((1.4 / 14) / 0.5)  # as without the empty block
    assert row["draft_time_share"] == pytest.approx(1.7 / (1.7 + 3.6 + 0.5))  # its time still counts here


def test_greedy_identical_counts_prompts_with_the_same_tokens():
    runs = [make_run(p, g, [10.0], BASE_STEPS) for p in "ab" for g in (0, 4)]
    for run, tokens in zip(runs, ([1, 2], [1, 2], [1, 2], [1, 3])):  # prompt b's speculative output differs
        run["repeats"][0]["token_ids"] = tokens
    overall = [r for r in summarize(runs) if r["group"] == "overall"]
    assert overall[0]["greedy_identical"] == 1


def test_per_token_acceptance_counts_only_tested_positions():
    steps = [StepRecord(4, 1, 2, 0, 0), StepRecord(4, 0, 1, 0, 0), StepRecord(4, 4, 5, 0, 0)]
    assert per_token_acceptance(steps) == pytest.approx(5 / 7)
    assert per_token_acceptance([StepRecord(0, 0, 1, 0, 0)]) is None


def test_summarize_groups_by_category_and_skips_prompts_missing_a_mode():
    runs = [
        make_run("a", 0, [10.0], BASE_STEPS, "x"),
        make_run("a", 4, [20.0], SPEC_STEPS, "x"),
        make_run("b", 0, [10.0], BASE_STEPS, "y"),
        make_run("b", 4, [40.0], SPEC_STEPS, "y"),
        make_run("c", 0, [10.0], BASE_STEPS, "y"),
    ]  # interrupted before its speculative run
    rows = {r["group"]: r for r in summarize(runs)}
    assert set(rows) == {"x", "y", "overall"}
    assert rows["y"]["prompts"] == 1 and rows["y"]["speedup"][0] == pytest.approx(4.0)
    assert rows["overall"]["speedup"][0] == pytest.approx(3.0)


def test_gate_failures_name_the_mode():
    rows = summarize([make_run("a", 0, [10.0], BASE_STEPS), make_run("a", 4, [15.0], SPEC_STEPS)])
    assert gate_failures(rows, 1.4, 3.0) == []
    assert gate_failures(rows, 2.0, 3.5) == [
        "speedup 1.50 < 2 (greedy, γ=4)",
        "mean accepted length 3.00 < 3.5 (greedy, γ=4)",
    ]


def test_identical_draft_accepts_everything_end_to_end(same_config, tmp_path):
    code, out, err = run_cli(
        "-c",
        str(same_config),
        "--num-draft-tokens-list",
        "1,3",
        "--temperatures",
        "0,1",
        "--category",
        "qa",
        "--limit",
        "1",
        "--repeats",
        "2",
        "--json",
    )
    assert code == 0, err
    record = json.loads(out)
    assert record["command"] == "benchmark" and record["partial"] is False
    assert {"environment", "config", "settings", "summary", "runs", "prompt_set"} <= set(record)
    assert len(record["runs"]) == 2 * 3  # 2 temperatures x (baseline + 2 draft lengths), one prompt
    assert all(len(r["repeats"]) == 2 for r in record["runs"])
    rows = [r for r in record["summary"] if r["group"] == "overall"]
    assert [(r["temperature"], r["num_draft_tokens"]) for r in rows] == [(0.0, 1), (0.0, 3), (1.0, 1), (1.0, 3)]
    for row in rows:
        assert row["mean_accepted_length"] == row["num_draft_tokens"] + 1
        assert row["acceptance_rate"] == 1.0
        assert row["acceptance_by_position"] == [1.0] * row["num_draft_tokens"]
        assert row["greedy_identical"] == (row["prompts"] if row["temperature"] == 0 else None)
        # the target-only forward against the machine's read bandwidth, both measured in this run
        rate = record["environment"]["target_weight_bytes"] / row["target_forward_seconds"]
        assert row["target_weight_read_bytes_per_second"] == pytest.approx(rate)
        bandwidth = record["environment"]["read_bandwidth_bytes_per_second"]
        assert row["target_weight_read_share"] == pytest.approx(rate / bandwidth) and bandwidth > 1e8
    folder = written_record(tmp_path, "tiny-same")
    assert json.loads((folder / "record.json").read_text())["summary"] == record["summary"]
    assert "Speedup by category" in (folder / "report.md").read_text()
    modes = ["greedy, γ=1", "greedy, γ=3", "T=1, γ=1", "T=1, γ=3"]
    assert_charts(folder, "Speedup by category", "Mean accepted length", "Acceptance by draft position", *modes)
    assert "Throughput by batch size" not in (folder / "chart.svg").read_text()  # no --batch-sizes


def test_batch_sizes_add_throughput_to_the_chart(same_config, tmp_path):
    options = "--category qa --limit 2 --batch-sizes 2 --temperatures 0 --warmup 0".split()
    code, out, err = run_cli("-c", str(same_config), *options)
    assert code == 0, err
    assert_charts(written_record(tmp_path, "tiny-same"), "Throughput by batch size", "target alone, greedy")


def test_the_chart_marks_the_crossover():
    # hand-made: speculation pays at batch 1 and 2, not at 4
    def batch_row(size: int, speedup: float) -> dict:
        return {
            "batch_size": size,
            "temperature": 0.0,
            "num_draft_tokens": 3,
            "tree": None,
            "baseline_tokens_per_second": [100.0 * size] * 3,
            "speculative_tokens_per_second": [100.0 * size * speedup] * 3,
            "crossover_batch_size": 4,
        }

    record = {
        "name": "hand-made",
        "timestamp": "20260101T000000Z",
        "summary": [],
        "batch_summary": [batch_row(1, 2.0), batch_row(2, 1.2), batch_row(4, 0.8)],
    }
    svg = charts.draw([(charts.heading(record), record)])["chart.svg"].decode()
    assert "greedy, γ=3: crossover at batch 4" in svg and "nothing measured" in svg
    record["batch_summary"] = [{**row, "crossover_batch_size": None} for row in record["batch_summary"][:2]]
    svg = charts.draw([(charts.heading(record), record)])["chart.svg"].decode()
    assert "crossover at" not in svg and "greedy, γ=3" in svg


def test_prompt_file_multi_turn_counts_both_turns(same_config, prompt_file):
    code, out, err = run_cli(
        "-c", str(same_config), "--prompts", str(prompt_file), "--temperatures", "0", "--warmup", "0", "--json"
    )
    assert code == 0, err
    record = json.loads(out)
    assert [p["category"] for p in record["prompt_set"]] == ["chat", "qa"]
    new_tokens = {r["prompt_id"]: r["repeats"][0]["new_tokens"] for r in record["runs"] if r["num_draft_tokens"] == 0}
    assert new_tokens == {"1": 24, "2": 12}  # two turns of 12 tokens, one turn of 12


def test_a_parquet_prompt_file_runs_its_turns(same_config, prompt_file, tmp_path):
    import pyarrow
    import pyarrow.parquet

    rows = [
        json.loads(line) | {"sub_category": "x", "multiturn": True} for line in prompt_file.read_text().splitlines()
    ]
    rows = [row | {"question_id": str(row["question_id"])} for row in rows]
    path = tmp_path / "speed.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    code, out, err = run_cli(
        "-c", str(same_config), "--prompts", str(path), "--temperatures", "0", "--warmup", "0", "--json"
    )
    assert code == 0, err
    record = json.loads(out)
    new_tokens = {r["prompt_id"]: r["repeats"][0]["new_tokens"] for r in record["runs"] if r["num_draft_tokens"] == 0}
    assert new_tokens == {"1": 24, "2": 12}  # as from the JSONL file: both turns of the first prompt


def test_text_prompts_and_table_output(same_config, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("first prompt\n\nsecond prompt\n")
    code, out, err = run_cli("-c", str(same_config), "--prompts", str(path), "--temperatures", "0", "--warmup", "0")
    assert code == 0, err
    assert "Speedup by category" in out and "Leviathan" in out and "default" in out
    record = json.loads((written_record(tmp_path, "tiny-same") / "record.json").read_text())
    assert [p["turns"] for p in record["prompt_set"]] == [["first prompt"], ["second prompt"]]
    overall = [r for r in record["summary"] if r["group"] == "overall"]
    assert [(r["prompts"], r["mean_accepted_length"]) for r in overall] == [(2, 4.0)]


def test_malformed_prompt_file_is_a_clear_error(same_config, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": \n')
    code, _, err = run_cli("-c", str(same_config), "--prompts", str(path))
    assert code == EXIT_BAD_INPUT
    assert "bad.jsonl:2: malformed JSON" in err


def test_bad_draft_token_list_is_a_clear_error(same_config):
    code, _, err = run_cli("-c", str(same_config), "--num-draft-tokens-list", "1,two")
    assert code == EXIT_BAD_INPUT and "--num-draft-tokens-list" in err


def test_unreachable_accept_length_gate_exits_4(same_config):
    gates = "--category qa --temperatures 0 --warmup 0 --min-accept-length 5 --min-speedup 0".split()
    code, out, err = run_cli("-c", str(same_config), *gates)
    assert code == EXIT_GATE_FAILED
    assert "mean accepted length 4.00 < 5 (greedy, γ=3)" in err
    assert "Speedup by category" in out  # the results are shown and written before the gate fails


def test_compare_two_records(tmp_path):
    # A: an identical draft accepts all 3 drafts per forward; B: prompt lookup on random text, far fewer
    configs = [write_pair(tmp_path), write_pair(tmp_path, name="tiny-ngram", draft={"ngram": {}})]
    for path in configs:
        code, out, err = run_cli("-c", str(path), "--category", "qa", "--temperatures", "0", "--warmup", "0", "--json")
        assert code == 0, err
    a, b = written_record(tmp_path, "tiny-same"), written_record(tmp_path, "tiny-ngram")
    length_b = [r for r in json.loads((b / "record.json").read_text())["summary"] if r["group"] == "overall"][0][
        "mean_accepted_length"
    ]
    assert length_b < 4
    code, out, err = run_cli(str(a), str(b / "record.json"), "--json", command="compare")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert ["greedy, γ=3", "mean accepted length", "4.000", f"{length_b:.3f}", f"{length_b / 4:.2f}×"] in rows
    metrics = [row[1] for row in rows]
    assert (
        "mean accepted length, per-request mean" in metrics and "acceptance length as vLLM, per-request mean" in metrics
    )
    [folder] = (tmp_path / "runs").glob("*-compare-tiny-same-vs-tiny-ngram")
    assert json.loads((folder / "record.json").read_text())["rows"] == rows
    assert_charts(folder, "A: tiny-same", "B: tiny-ngram", "greedy, γ=3")
    assert "| greedy, γ=3 | mean accepted length | 4.000 |" in (folder / "report.md").read_text()
    options = ["--category", "qa", "--temperatures", "0", "--warmup", "0", "--num-draft-tokens-list", "1", "--json"]
    code, out, err = run_cli("-c", str(configs[0]), *options)
    assert code == 0, err
    other = max((tmp_path / "runs").glob("*-benchmark-tiny-same*"))  # the second run of that config
    code, out, err = run_cli(str(a), str(other), "--json", "--no-record", command="compare")
    assert code == 0 and json.loads(out)["rows"] == []  # no common (temperature, num_draft_tokens)
    assert len(list((tmp_path / "runs").glob("*-compare-*"))) == 1  # --no-record: no second folder, no chart


def test_compare_refuses_what_is_not_a_benchmark_record(tmp_path):
    code, _, err = run_cli(str(tmp_path / "missing"), str(tmp_path), command="compare")
    assert code == EXIT_BAD_INPUT and err == f"Error: benchmark record {tmp_path / 'missing'} not found\n"
    (tmp_path / "record.json").write_text('{"command": "generate"}')
    code, _, err = run_cli(str(tmp_path), str(tmp_path), command="compare")
    assert code == EXIT_BAD_INPUT and err == f"Error: {tmp_path / 'record.json'} is not a benchmark record\n"


def test_token_and_block_verification_side_by_side_in_one_run(tmp_path):
    code, out, err = run_cli(
        "-c",
        str(write_pair(tmp_path)),
        *("--category", "qa", "--temperatures", "0,1", "--warmup", "0", "--verification", "token,block"),
    )
    assert code == 0, err
    folder = written_record(tmp_path, "tiny-same")
    record = json.loads((folder / "record.json").read_text())
    # greedy verification is the same under both rules: its chain runs once; the sampled chain under each
    modes = [(r["temperature"], r["num_draft_tokens"], r["verification"]) for r in record["runs"]]
    assert modes == [(0, 0, "token"), (0, 3, "token"), (1, 0, "token"), (1, 3, "token"), (1, 3, "block")]
    overall = {mode_label(r): r for r in record["summary"] if r["group"] == "overall"}
    assert list(overall) == ["greedy, γ=3", "T=1, γ=3", "T=1, γ=3, block"]
    assert [r["verification"] for r in overall.values()] == ["token", "token", "block"]
    # an identical draft: both rules keep every draft
    assert [r["mean_accepted_length"] for r in overall.values()] == [4, 4, 4]
    report = (folder / "report.md").read_text()
    assert "## Speedup by category, token and block verification" in report
    assert "| metric | greedy, γ=3 | T=1, γ=3 | T=1, γ=3, block |" in report
    assert "| overall | 3 |" in report and "| overall | 3, block | n/a |" in report  # no greedy block row
    assert_charts(folder, "T=1, γ=3, block")
    # a record from before rows named their rule: its config's rule, for its sampled chains only
    older = {**record, "config": {"speculation": {"verification": "block"}}, "settings": {}}
    older["summary"] = [
        {k: v for k, v in r.items() if k != "verification"}
        for r in record["summary"]
        if (r["temperature"], r["verification"]) != (1, "token")  # it ran its sampled chain as a block
    ]
    (tmp_path / "older.json").write_text(json.dumps(older))
    code, out, err = run_cli(str(tmp_path / "older.json"), str(folder), "--json", command="compare")
    assert code == 0, err
    assert {row[0] for row in json.loads(out)["rows"]} == {"greedy, γ=3", "T=1, γ=3, block"}
    [compared] = (tmp_path / "runs").glob("*-compare-*")
    report = (compared / "report.md").read_text()
    assert ", block verification), B: " in report and ", token and block verification); tok/s" in report


def test_a_single_rule_names_block_modes_only(tmp_path):
    options = ["--category", "qa", "--temperatures", "0,1", "--warmup", "0", "--verification", "block", "--json"]
    code, out, err = run_cli("-c", str(write_pair(tmp_path)), *options)
    assert code == 0, err
    record = json.loads(out)
    assert [mode_label(r) for r in record["summary"] if r["group"] == "overall"] == ["greedy, γ=3", "T=1, γ=3, block"]
    assert record["settings"]["verifications"] == ["block"]


@pytest.mark.parametrize("value", ["token,fast", "Block"])
def test_a_bad_verification_list_is_one_error_line(same_config, value):
    code, out, err = run_cli("-c", str(same_config), "--verification", value)
    assert code == EXIT_BAD_INPUT and out == ""
    assert (
        err.startswith("Error: --verification takes token, block or both (token,block), got ") and err.count("\n") == 1
    )


def run_peer(config: Path, *args: str) -> dict:
    code, out, err = run_cli("-c", str(config), "--category", "qa", "--warmup", "0", "--peer", "hf", "--json", *args)
    assert code == 0, err
    return json.loads(out)


def test_hf_peer_runs_beside_specdec(tmp_path):
    record = run_peer(write_pair(tmp_path, draft={"ngram": {"max_n": 3}}), "--temperatures", "0,1")
    # plain generate() and transformers' prompt lookup, each beside specdec's speculative run
    assert [
        (p["temperature"], p["engine"], p["num_draft_tokens"], p["specdec_num_draft_tokens"]) for p in record["peers"]
    ] == [
        (0.0, "hf", 0, 3),
        (0.0, "hf prompt lookup", 3, 3),
        (1.0, "hf", 0, 3),
        (1.0, "hf prompt lookup", 3, 3),
    ]
    assert all(p["peer_tokens_per_second"][0] > 0 and p["specdec_tokens_per_second"][0] > 0 for p in record["peers"])
    assert [p["greedy_identical"] for p in record["peers"]] == [1, 1, None, None]
    # the caption says the two n-gram drafters differ
    assert "same loaded models" in record["peer_fairness"] and "earliest match" in record["peer_fairness"]
    hf_runs = [r for r in record["runs"] if r["engine"] != "specdec"]
    assert all(r["repeats"][0]["new_tokens"] == 12 for r in hf_runs)  # ignore_eos honoured
    # the chart sets each peer mode beside specdec's (transformers reports no acceptance by position)
    folder = written_record(tmp_path, SAME_PAIR["name"])
    assert_charts(folder, "Beside the peer: end-to-end tok/s", "T=1, γ=3 beside hf prompt lookup")
    assert "Beside the peer: acceptance" not in (folder / "chart.svg").read_text()


def test_hf_peer_runs_a_draft_model_as_its_assistant(same_config):
    record = run_peer(same_config, "--temperatures", "0")
    assert [(p["engine"], p["num_draft_tokens"]) for p in record["peers"]] == [("hf", 0), ("hf assisted", 3)]
    assert [p["greedy_identical"] for p in record["peers"]] == [1, 1]
    assert "earliest match" not in record["peer_fairness"]


def test_hf_peer_ignores_the_checkpoints_generation_settings(tmp_path):
    # a checkpoint may ship settings specdec does not apply; generate() would take them, greedy too
    target = build_tiny(TinyModel(seed=0))
    target.generation_config.repetition_penalty = 1.5
    target.generation_config.no_repeat_ngram_size = 2
    config = write_pair(
        tmp_path,
        target={"checkpoint": str(save_checkpoint(target, tmp_path / "target"))},
        draft={"ngram": {}},
        generation={"max_new_tokens": 24, "ignore_eos": True},
    )
    record = run_peer(config, "--temperatures", "0")
    tokens = tokens_by_mode(record)
    assert tokens["hf", 0] == tokens["hf prompt lookup", 3] == tokens["specdec", 0] == tokens["specdec", 3]
    # the settings matter here: generate() left to itself takes them and answers otherwise
    prompt = torch.tensor([byte_tokenizer().encode(record["prompt_set"][0]["turns"][0])])
    inherited = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24)
    assert inherited[0, prompt.shape[1] :].tolist() != tokens["specdec", 0]


def test_hf_peer_with_ignore_eos_samples_eos_and_carries_on(tmp_path):
    # a head that makes EOS the greedy choice about half the time (EOS row w, another row -w, rest 0)
    target = build_tiny(TinyModel(seed=0))
    eos = byte_tokenizer().eos_token_id
    with torch.no_grad():
        w = target.lm_head.weight
        w[eos], w[1] = w[0].clone(), -w[0]
        w[[i for i in range(len(w)) if i not in (eos, 1)]] = 0
    config = write_pair(
        tmp_path,
        target={"checkpoint": str(save_checkpoint(target, tmp_path / "target"))},
        draft={"ngram": {}},
        generation={"max_new_tokens": 24, "ignore_eos": True},
    )
    tokens = tokens_by_mode(run_peer(config, "--temperatures", "0"))
    assert eos in tokens["specdec", 0] and len(tokens["specdec", 0]) == 24
    assert tokens["hf", 0] == tokens["specdec", 0] == tokens["hf prompt lookup", 3]


def test_hf_peer_with_a_draft_head_of_another_size(tmp_path):
    # Qwen2.5 0.5B and 7B share a tokenizer but not the head size; transformers' assisted generation refuses
    target, draft = build_tiny(TinyModel(seed=0)), build_tiny(TinyModel(seed=0))
    target.resize_token_embeddings(300)  # the byte tokenizer has 258 tokens: 42 spare rows, as in Qwen
    config = write_pair(
        tmp_path,
        target={"checkpoint": str(save_checkpoint(target, tmp_path / "target"))},
        draft={"checkpoint": str(save_checkpoint(draft, tmp_path / "draft"))},
    )
    code, out, err = run_cli(
        "-c", str(config), "--category", "qa", "--warmup", "0", "--temperatures", "0", "--peer", "hf", "--json"
    )
    assert code == 0, err
    assert "LM head has 258 rows and the target's 300" in " ".join(err.split())  # said before any work
    record = json.loads(out)
    assert [(p["engine"], p["num_draft_tokens"]) for p in record["peers"]] == [("hf", 0), ("hf prompt lookup", 3)]
    assert "cannot run this draft" in record["peer_fairness"]


def test_interrupt_keeps_finished_prompts():
    pair = load_pair(parse_config(SAME_PAIR))
    prompts = [Prompt("a", "c", ("one",)), Prompt("b", "c", ("two",)), Prompt("c", "c", ("three",))]
    plan = Plan([0.0], [2], 6, repeats=1, warmup=0, ignore_eos=True, seed=0, top_k=0, top_p=1.0)

    def interrupt_at_second(i: int, n: int, prompt: Prompt, mode) -> None:
        if i == 1 and mode.num_draft_tokens == 2:
            raise KeyboardInterrupt

    runs, partial = run_benchmark(pair, prompts, plan, interrupt_at_second)
    assert partial is True
    assert [(r["prompt_id"], r["num_draft_tokens"]) for r in runs] == [("a", 0), ("a", 2)]
