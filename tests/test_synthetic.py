"""Synthetic acceptance (speculation.synthetic_acceptance, benchmark --synthetic-acceptance): a loop
benchmark that keeps drafts by chance, labelled as such, refused wherever output must be the target's."""

from __future__ import annotations

import json

import pytest
import torch
from scipy import stats
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.decoding.verification import GreedyChain, SyntheticAcceptance
from specdec_cli.errors import EXIT_BAD_INPUT

runner = CliRunner()
DRAFTS, BLOCKS = 4, 4000


def accepted_counts(rate: float) -> torch.Tensor:
    """Accepted drafts of BLOCKS chains of DRAFTS drafts under synthetic acceptance at `rate`."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(BLOCKS, DRAFTS + 1, 50, generator=generator)
    drafts = torch.randint(0, 50, (BLOCKS, DRAFTS), generator=generator)
    num_accepted, next_token = SyntheticAcceptance(GreedyChain(), rate).verify(
        drafts, None, logits, SamplingParams(), generator
    )
    # the token after the kept drafts is the target's own there
    assert torch.equal(next_token, logits[torch.arange(BLOCKS), num_accepted].argmax(-1))
    return num_accepted


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.8, 1.0])
def test_each_draft_is_kept_with_the_rate_given_the_ones_before(rate):
    counts = torch.bincount(accepted_counts(rate), minlength=DRAFTS + 1).numpy()
    # a chain keeps exactly i drafts with probability rate^i (1 - rate), all of them with rate^DRAFTS
    law = [rate**i * (1 - rate) for i in range(DRAFTS)] + [rate**DRAFTS]
    if rate in (0.0, 1.0):
        assert counts.tolist() == [BLOCKS * p for p in law]
        return
    assert stats.chisquare(counts, [BLOCKS * p for p in law]).pvalue > 1e-3
    # the same test rejects a rate 0.05 off: it can fail
    wrong = [(rate - 0.05) ** i * (1.05 - rate) for i in range(DRAFTS)] + [(rate - 0.05) ** DRAFTS]
    assert stats.chisquare(counts, [BLOCKS * p for p in wrong]).pvalue < 1e-3


def benchmark(config, *args: str):
    base = ["benchmark", "-c", config, "--category", "qa", "--limit", "2", "--warmup", "0"]
    return runner.invoke(app, [*base, "--num-draft-tokens-list", "3", *args])


def test_benchmark_keeps_drafts_by_the_rate_and_says_it_is_a_loop_benchmark(write_config):
    config = str(write_config({"runtime": {"threads": 1}}))
    for rate, length in ((1.0, 4.0), (0.0, 1.0)):
        run = benchmark(config, "--temperatures", "0,1", "--synthetic-acceptance", str(rate), "--json")
        assert run.exit_code == 0, run.output
        record = json.loads(run.stdout)
        assert record["settings"]["synthetic_acceptance"] == rate
        for row in (r for r in record["summary"] if r["group"] == "overall"):
            assert row["mean_accepted_length"] == length and row["greedy_identical"] is None
    table = benchmark(config, "--temperatures", "0", "--synthetic-acceptance", "0.5", "--no-record")
    assert table.exit_code == 0, table.output
    assert "SYNTHETIC acceptance 0.5" in table.stdout and "the output is not the target's" in table.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--synthetic-acceptance", "1.5"], "synthetic_acceptance must be in [0, 1], got 1.5"),
        (["--synthetic-acceptance", "nan"], "synthetic_acceptance must be in [0, 1], got nan"),
        (["--synthetic-acceptance", "0.5", "--peer", "hf"], "--synthetic-acceptance measures specdec's own loop"),
        (["--synthetic-acceptance", "0.5", "--tree", "2,2,4"], "--synthetic-acceptance measures specdec's own loop"),
    ],
)
def test_benchmark_refuses_what_synthetic_acceptance_cannot_measure(write_config, args, message):
    run = benchmark(str(write_config()), *args)
    assert run.exit_code == EXIT_BAD_INPUT and run.stderr.startswith(f"Error: {message}")


@pytest.mark.parametrize("command", [["generate", "-p", "Hi"], ["verify-distribution"], ["tune"]])
def test_commands_whose_output_must_be_the_targets_refuse_it(write_config, command):
    config = str(write_config({"speculation": {"num_draft_tokens": 3, "synthetic_acceptance": 0.5}}))
    run = runner.invoke(app, [command[0], "-c", config, *command[1:]])
    assert run.exit_code == EXIT_BAD_INPUT
    assert run.stderr.startswith("Error: speculation.synthetic_acceptance keeps drafts by chance")
