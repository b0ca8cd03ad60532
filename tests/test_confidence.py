"""Drafting stops at the first draft token the draft gives less than `confidence_threshold`: blocks get
shorter, and the output stays the target's (greedy identity, batch rows, the statistical checks)."""

from __future__ import annotations

import pytest
import torch
from conftest import cached

from specdec_cli import verify
from specdec_cli.config import TinyModel, load_config
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.drafters import model as model_drafters
from specdec_cli.drafters.feature import FeatureDrafter
from specdec_cli.drafters.model import ModelDrafter
from specdec_cli.models.checkpoints import build_tiny
from specdec_cli.models.feature_draft import init_draft
from specdec_cli.models.pair import load_pair

GREEDY = SamplingParams()
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown", "Once upon a time, there", "abc abc"]
GAMMA = 4


@pytest.fixture(scope="module")
def noisy_draft():
    return build_tiny(TinyModel(seed=0, noise=0.005)).eval()


def drafter(kind: str, target, noisy_draft, threshold: float):
    if kind == "model":
        return ModelDrafter(cached(noisy_draft), threshold)
    return FeatureDrafter(cached(init_draft(target, 1, torch.arange(target.config.vocab_size)).eval()), threshold)


def drafted_before_the_limit(steps) -> list[int]:
    return [s.drafted for s in steps[:-GAMMA]]  # the last blocks are cut by max_new_tokens anyway


@pytest.mark.parametrize("kind", ["model", "feature"])
@pytest.mark.parametrize("threshold", [0.2, 0.4])
def test_greedy_output_is_the_targets_with_shorter_blocks(tiny_target, noisy_draft, tokenizer, kind, threshold):
    prompt = tokenizer.encode(PROMPTS[0])
    alone = SpeculativeDecoder(cached(tiny_target), None, GREEDY, 1, set()).generate(prompt, 48, 0)
    always = SpeculativeDecoder(cached(tiny_target), drafter(kind, tiny_target, noisy_draft, 0), GREEDY, GAMMA, set())
    stopping = SpeculativeDecoder(
        cached(tiny_target), drafter(kind, tiny_target, noisy_draft, threshold), GREEDY, GAMMA, set()
    )
    full, short = always.generate(prompt, 48, 0), stopping.generate(prompt, 48, 0)
    assert short.token_ids == full.token_ids == alone.token_ids
    assert set(drafted_before_the_limit(full.steps)) == {GAMMA}
    drafted = drafted_before_the_limit(short.steps)
    assert 0 in drafted and any(0 < d < GAMMA for d in drafted), drafted  # stopped at the first and later tokens


@pytest.mark.parametrize("kind", ["model", "feature"])
def test_each_row_is_its_prompt_alone(tiny_target, noisy_draft, tokenizer, kind):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    alone = SpeculativeDecoder(cached(tiny_target), None, GREEDY, 1, set())
    expected = [alone.generate(p, 32, 0).token_ids for p in prompts]
    drafts = drafter(kind, tiny_target, noisy_draft, 0.3)
    decoder = SpeculativeDecoder(cached(tiny_target), drafts, GREEDY, GAMMA, set())
    rows = decoder.generate_batch(prompts, 32, 0)
    assert [r.token_ids for r in rows] == expected
    assert any(d < GAMMA for r in rows for d in drafted_before_the_limit(r.steps))


@pytest.fixture
def stopping_pair(write_config):
    config = {"speculation": {"num_draft_tokens": GAMMA, "confidence_threshold": 0.3}, "runtime": {"threads": 1}}
    return load_pair(load_config(str(write_config(config))))


def failing_checks(pair, params) -> list[str]:
    prompt = pair.encode("Hello there, how are you?")
    rows = verify.check_model(pair, prompt, "p", params, 300, seed=0, significance=0.01)
    verify.holm(rows, 0.01)
    return [r.check for r in rows if not r.passed]


def test_sampled_output_is_distributed_as_the_target(stopping_pair, monkeypatch):
    params = SamplingParams(temperature=0.6)
    steps = stopping_pair.decoder(params).generate(stopping_pair.encode(PROMPTS[0]), 40, 0).steps
    assert any(d < GAMMA for d in drafted_before_the_limit(steps))  # the checks below see shorter blocks
    assert failing_checks(stopping_pair, params) == []
    # the bug this guards against: stopping at a draft token because of the token drawn (its own q)
    # rather than the draft's distribution; the checks see it
    drawn = {}

    def draft_token(logits, params, generator):
        drawn["token"], q = real_draft_token(logits, params, generator)
        return drawn["token"], q

    def confident_in_the_drawn_token(logits, q, threshold):
        return bool((q.gather(-1, drawn["token"][:, None]) >= threshold).any())

    real_draft_token = model_drafters.draft_token
    monkeypatch.setattr(model_drafters, "draft_token", draft_token)
    monkeypatch.setattr(model_drafters, "confident", confident_in_the_drawn_token)
    assert failing_checks(stopping_pair, params)
