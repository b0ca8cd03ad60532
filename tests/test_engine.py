"""The decode loop on tiny real models: greedy identity, cache rollback, EOS and length limits."""

from __future__ import annotations

import pytest
import torch

from specdec_cli.models.checkpoints import build_tiny
from specdec_cli.config import TinyModel
from specdec_cli.drafters.model import ModelDrafter
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.decoding.metrics import acceptance_rate, mean_accepted_length

from conftest import cached

GREEDY = SamplingParams()
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


@pytest.fixture(scope="module")
def noisy_draft():
    return build_tiny(TinyModel(seed=0, noise=0.005)).eval()


def target_only(model, prompt_ids, max_new, params=GREEDY, seed=0, eos=frozenset(), static=False):
    decoder = SpeculativeDecoder(cached(model, static), None, params, 1, set(eos))
    return decoder.generate(prompt_ids, max_new, seed)


def speculative(target, draft, prompt_ids, max_new, gamma, params=GREEDY, seed=0, eos=frozenset(),
                static=False):
    drafter = ModelDrafter(cached(draft, static)) if draft is not None else NgramDrafter(
        3, 1, target.config.vocab_size, torch.device("cpu"))
    decoder = SpeculativeDecoder(cached(target, static), drafter, params, gamma, set(eos))
    return decoder.generate(prompt_ids, max_new, seed)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache"])
@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
def test_identical_draft_accepts_everything(tiny_target, tokenizer, gamma, static):
    prompt = tokenizer.encode(PROMPT)
    max_new = 4 * (gamma + 1)
    baseline = target_only(tiny_target, prompt, max_new, static=static)
    result = speculative(tiny_target, tiny_target, prompt, max_new, gamma, static=static)
    assert result.token_ids == baseline.token_ids
    assert mean_accepted_length(result.steps) == gamma + 1
    assert acceptance_rate(result.steps) == 1.0


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_output_is_the_targets_with_a_different_draft(tiny_target, noisy_draft, tokenizer, gamma,
                                                            static):
    prompt = tokenizer.encode(PROMPT)
    baseline = target_only(tiny_target, prompt, 48, static=static)
    result = speculative(tiny_target, noisy_draft, prompt, 48, gamma, static=static)
    assert result.token_ids == baseline.token_ids
    rate = acceptance_rate(result.steps)
    assert 0 < rate < 1  # some drafts rejected: rollback and catch-up paths were exercised


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_output_is_the_targets_with_the_ngram_drafter(tiny_target, tokenizer, gamma):
    prompt = tokenizer.encode(PROMPT * 2)
    baseline = target_only(tiny_target, prompt, 40)
    result = speculative(tiny_target, None, prompt, 40, gamma)
    assert result.token_ids == baseline.token_ids
    assert sum(s.drafted for s in result.steps) > 0


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(max_n=2, min_n=1, vocab_size=10, device=torch.device("cpu"))
    drafter.start([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], max_tokens=20, target_states=None)
    assert drafter.lookup(3) == [5, 6, 1]  # bigram (1, 2) last seen before 5
    drafter.start([7, 8, 9], max_tokens=20, target_states=None)
    assert drafter.lookup(3) == []


def test_sampling_is_reproducible_with_a_seed(tiny_target, noisy_draft, tokenizer):
    prompt = tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    first = speculative(tiny_target, noisy_draft, prompt, 30, 3, params, seed=7)
    again = speculative(tiny_target, noisy_draft, prompt, 30, 3, params, seed=7)
    other = speculative(tiny_target, noisy_draft, prompt, 30, 3, params, seed=8)
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


@pytest.mark.parametrize("max_new", [1, 2, 5, 9, 10])
def test_never_more_than_max_new_tokens(tiny_target, tokenizer, max_new):
    result = speculative(tiny_target, tiny_target, tokenizer.encode(PROMPT), max_new, gamma=4)
    assert len(result.token_ids) == max_new
    assert result.stop_reason == "length"


def test_nothing_after_eos(tiny_target, tokenizer):
    prompt = tokenizer.encode(PROMPT)
    free_run = target_only(tiny_target, prompt, 30).token_ids
    eos = free_run[5]  # pretend the 6th greedy token is EOS: it lands inside a block
    cut = free_run.index(eos) + 1
    for gamma in (2, 4):
        result = speculative(tiny_target, tiny_target, prompt, 30, gamma, eos={eos})
        assert result.token_ids == free_run[:cut]
        assert result.stop_reason == "eos"
    assert target_only(tiny_target, prompt, 30, eos={eos}).token_ids == free_run[:cut]
