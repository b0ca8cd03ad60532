"""Greedy divergences classed as rounding or a bug (decoding/drift.py), on real tiny models: a target
built to sit on a near-tie, and broken loops that must be classed bugs, in the triage itself, in
verify-distribution's greedy check and in benchmark's records, table and exit code."""

from __future__ import annotations

import json

import pytest
import torch
from broken_rules import verify_greedy_within_top_two
from conftest import cached
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.config import TinyModel
from specdec_cli.decoding import drift, sampling
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.errors import EXIT_CHECK_FAILED
from specdec_cli.loading.checkpoints import build_tiny
from specdec_cli.methods.model import ModelDrafter

GREEDY = SamplingParams()
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
FLOAT32 = drift.resolution(torch.float32)


def decode(target, draft, prompt: list[int], tokens: int = 32):
    drafter = None if draft is None else ModelDrafter(cached(draft))
    return SpeculativeDecoder(cached(target), drafter, GREEDY, 3, set()).generate(prompt, tokens, 0)


@pytest.fixture(scope="module")
def near_tie(tokenizer):
    """The tiny target with a token's head row a hair from the row of the token it emits most: wherever
    either leads, the two sit closer than float32 resolves. Returns (model, the two tokens)."""
    model = build_tiny(TinyModel(seed=0)).eval()
    alone = decode(model, None, tokenizer.encode(PROMPT)).token_ids
    leader = max(set(alone), key=alone.count)
    twin = (leader + 1) % model.config.vocab_size
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[leader] * (1 + 1e-6)
    return model, (leader, twin)


def test_a_flip_at_a_near_tie_is_rounding(near_tie, tokenizer):
    model, pair = near_tie
    prompt = tokenizer.encode(PROMPT)
    alone = decode(model, None, prompt)
    position = next(i for i, t in enumerate(alone.token_ids) if t in pair)
    # the other of the two at that token: what a forward rounding the other way would have emitted
    flipped = alone.token_ids[:position] + [pair[0] + pair[1] - alone.token_ids[position]]
    found = drift.triage(
        cached(model), prompt, (alone.token_ids, alone.steps), (flipped, alone.steps[: position + 1]), FLOAT32
    )
    assert found.position == position and found.rounding and found.gap < FLOAT32 and found.difference < FLOAT32
    assert found.alone_margin < FLOAT32 and not found.reproduced  # the replays do not flip it here
    assert found.describe().startswith(f"token {position + 1}: rounding")


def test_an_exact_loop_on_the_near_tie_leaves_nothing_to_triage(near_tie, tokenizer):
    model, _ = near_tie
    prompt = tokenizer.encode(PROMPT)
    draft = build_tiny(TinyModel(seed=0, noise=0.005)).eval()
    alone, speculative = decode(model, None, prompt), decode(model, draft, prompt)
    assert speculative.token_ids == alone.token_ids
    runs = [(r.token_ids, r.steps) for r in (alone, speculative)]
    assert drift.triage(cached(model), prompt, *runs, FLOAT32) is None


def test_a_loop_accepting_the_targets_second_choice_is_a_bug(tiny_target, noisy_draft, tokenizer, monkeypatch):
    prompt = tokenizer.encode(PROMPT)
    alone = decode(tiny_target, None, prompt)
    monkeypatch.setattr(sampling, "verify_greedy", verify_greedy_within_top_two)
    broken = decode(tiny_target, noisy_draft, prompt)
    runs = [(r.token_ids, r.steps) for r in (alone, broken)]
    found = drift.triage(cached(tiny_target), prompt, *runs, FLOAT32)
    assert found is not None and not found.rounding and found.gap > FLOAT32
    picked, emitted = found.alone_token, found.speculative_token
    assert found.reason == f"the verification forward picks token {picked}, the loop emitted {emitted}"


runner = CliRunner()


def test_benchmark_records_a_bug_shows_it_and_exits_3(write_config, monkeypatch):
    config = str(write_config({"runtime": {"threads": 1}}))
    args = ["benchmark", "-c", config, "--category", "qa", "--limit", "2", "--temperatures", "0", "--warmup", "0"]
    args += ["--num-draft-tokens-list", "3", "--json"]
    exact = runner.invoke(app, args)
    assert exact.exit_code == 0, exact.output
    runs = json.loads(exact.stdout)["runs"]
    assert [r["repeats"][0]["greedy_divergence"] for r in runs if r["num_draft_tokens"]] == [None, None]

    monkeypatch.setattr(sampling, "verify_greedy", verify_greedy_within_top_two)
    broken = runner.invoke(app, args)
    assert broken.exit_code == EXIT_CHECK_FAILED
    assert "Error: greedy output left the target alone's by more than rounding, a bug: " in broken.stderr
    record = json.loads(broken.stdout)
    found = [r["repeats"][0]["greedy_divergence"] for r in record["runs"] if r["num_draft_tokens"]]
    assert any(d is not None and not d["rounding"] for d in found)
    overall = next(r for r in record["summary"] if r["group"] == "overall")
    assert overall["greedy_not_rounding"] == sum(d is not None and not d["rounding"] for d in found) > 0

    table = runner.invoke(app, args[:-1] + ["--no-record"])
    assert "NOT by rounding (a bug)" in table.stdout
