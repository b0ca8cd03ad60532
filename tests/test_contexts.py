"""benchmark --context-lengths: each prompt after a document of real text, measured per length."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specdec_cli.bench.contexts import parse_lengths
from specdec_cli.cli import app
from specdec_cli.errors import EXIT_BAD_INPUT, SpecdecError

runner = CliRunner()


def test_lengths_read_as_tokens_with_k_for_1024():
    assert parse_lengths("4k, 1k,8000,1k") == [1024, 4096, 8000]
    for wrong in ("1k,abc", "0", "-5"):
        with pytest.raises(SpecdecError, match="--context-lengths"):
            parse_lengths(wrong)


def benchmark(config, *args: str):
    base = ["benchmark", "-c", config, "--category", "qa", "--limit", "1", "--warmup", "0", "--temperatures", "0"]
    return runner.invoke(app, [*base, "--num-draft-tokens-list", "3", "--max-new-tokens", "16", *args])


def test_each_length_is_measured_after_a_document_of_about_that_many_tokens(write_config):
    config = str(write_config({"runtime": {"threads": 1}}))
    run = benchmark(config, "--context-lengths", "200,600", "--json")
    assert run.exit_code == 0, run.output
    record = json.loads(run.stdout)
    assert record["settings"]["context_lengths"] == [200, 600]
    assert {(r["context_length"], r["num_draft_tokens"]) for r in record["context_runs"]} == {
        (200, 0),
        (200, 3),
        (600, 0),
        (600, 3),
    }
    rows = record["context_summary"]
    assert [row["context_length"] for row in rows] == [200, 600]
    for row in rows:
        assert abs(row["prompt_tokens"] - row["context_length"]) <= 2  # bytes: the cut is exact but for the template
        assert row["greedy_identical"] == 1 and row["mean_accepted_length"] >= 1
    # the prompts' own runs are those of a plain benchmark
    assert {r["prompt_id"] for r in record["runs"]} == {"qa-1"}
    table = benchmark(config, "--context-lengths", "200", "--no-record")
    assert table.exit_code == 0 and "By context length" in table.stdout


@pytest.mark.parametrize(
    "lengths, message",
    [
        ("4090", "--context-lengths 4090: with 16 new tokens it passes the target's window of 4096 tokens"),
        ("10", "--context-lengths 10: prompt qa-1 alone is longer than that"),
    ],
)
def test_lengths_the_window_or_the_prompt_cannot_hold_are_refused_before_any_work(write_config, lengths, message):
    run = benchmark(str(write_config()), "--context-lengths", lengths)
    assert run.exit_code == EXIT_BAD_INPUT and run.stderr.startswith(f"Error: {message}")
