"""The decode loop on tiny real models: greedy identity, cache rollback, EOS and length limits."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import cached
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from specdec_cli.config import TinyModel, load_config
from specdec_cli.decoding.cache import EAGER_KEY_SLOTS_STEP, KEY_SLOTS_STEP, CachedModel, right_padded
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.metrics import acceptance_rate, mean_accepted_length
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.decoding.verification import BlockVerification, TokenVerification
from specdec_cli.errors import SpecdecError
from specdec_cli.loading.checkpoints import build_tiny
from specdec_cli.methods.feature.draft import init_draft
from specdec_cli.methods.feature.drafter import FeatureDrafter
from specdec_cli.methods.model import ModelDrafter
from specdec_cli.methods.ngram import NgramDrafter
from specdec_cli.pair import load_pair

GREEDY = SamplingParams()
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


def target_only(model, prompt_ids, max_new, params=GREEDY, seed=0, eos=frozenset()):
    decoder = SpeculativeDecoder(cached(model), None, params, 1, set(eos))
    return decoder.generate(prompt_ids, max_new, seed)


def speculative(target, draft, prompt_ids, max_new, num_draft_tokens, params=GREEDY, seed=0, eos=frozenset()):
    drafter = (
        ModelDrafter(cached(draft))
        if draft is not None
        else NgramDrafter(3, 1, target.config.vocab_size, torch.device("cpu"))
    )
    decoder = SpeculativeDecoder(cached(target), drafter, params, num_draft_tokens, set(eos))
    return decoder.generate(prompt_ids, max_new, seed)


@pytest.mark.parametrize("num_draft_tokens", [1, 2, 4, 7])
def test_identical_draft_accepts_everything(tiny_target, tokenizer, num_draft_tokens):
    prompt = tokenizer.encode(PROMPT)
    max_new = 4 * (num_draft_tokens + 1)
    baseline = target_only(tiny_target, prompt, max_new)
    result = speculative(tiny_target, tiny_target, prompt, max_new, num_draft_tokens)
    assert result.token_ids == baseline.token_ids
    assert mean_accepted_length(result.steps) == num_draft_tokens + 1
    assert acceptance_rate(result.steps) == 1.0


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 5])
def test_greedy_output_is_the_targets_with_a_different_draft(tiny_target, noisy_draft, tokenizer, num_draft_tokens):
    prompt = tokenizer.encode(PROMPT)
    baseline = target_only(tiny_target, prompt, 48)
    result = speculative(tiny_target, noisy_draft, prompt, 48, num_draft_tokens)
    assert result.token_ids == baseline.token_ids
    rate = acceptance_rate(result.steps)
    assert 0 < rate < 1  # some drafts rejected: rollback and catch-up paths were exercised


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(max_n=2, min_n=1, vocab_size=10, device=torch.device("cpu"))
    drafter.start([[1, 2, 3, 4, 1, 2, 5, 6, 1, 2]], max_tokens=20, target_states=None)
    assert drafter.lookup(3) == [5, 6, 1]  # bigram (1, 2) last seen before 5
    drafter.start([[7, 8, 9]], max_tokens=20, target_states=None)
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
    result = speculative(tiny_target, tiny_target, tokenizer.encode(PROMPT), max_new, num_draft_tokens=4)
    assert len(result.token_ids) == max_new
    assert result.stop_reason == "length"


def test_nothing_after_eos(tiny_target, tokenizer):
    prompt = tokenizer.encode(PROMPT)
    free_run = target_only(tiny_target, prompt, 30).token_ids
    eos = free_run[5]  # pretend the 6th greedy token is EOS: it lands inside a block
    cut = free_run.index(eos) + 1
    for num_draft_tokens in (2, 4):
        result = speculative(tiny_target, tiny_target, prompt, 30, num_draft_tokens, eos={eos})
        assert result.token_ids == free_run[:cut]
        assert result.stop_reason == "eos"
    assert target_only(tiny_target, prompt, 30, eos={eos}).token_ids == free_run[:cut]


def sliding_window_model(noise: float = 0.0):
    """A tiny Qwen2 whose second layer attends over a window of 8 tokens (Mistral, Gemma 2/3 and
    Qwen2 with use_sliding_window mix such layers in the same way)."""
    config = Qwen2Config(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        max_position_embeddings=512,
        initializer_range=0.3,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).eval()
        with torch.no_grad():
            for weight in model.parameters():
                weight.add_(torch.randn_like(weight) * noise)
    return model


@torch.no_grad()
def greedy_without_cache(model, prompt_ids, max_new):
    """The reference: every token from a full forward over the whole sequence, no cache to get wrong."""
    ids = list(prompt_ids)
    for _ in range(max_new):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def test_sliding_window_layers_roll_back_exactly(tokenizer):
    target = sliding_window_model()
    assert target.config.layer_types == ["full_attention", "sliding_attention"]
    prompt = tokenizer.encode("The quick brown fox")  # 19 tokens: past the window of 8 from the start
    reference = greedy_without_cache(target, prompt, 40)
    result = speculative(target, sliding_window_model(noise=0.02), prompt, 40, 3)
    assert result.token_ids == reference
    assert 0 < acceptance_rate(result.steps) < 1  # rollbacks happened, well past the window
    assert target_only(target, prompt, 40).token_ids == reference


def test_models_with_state_that_cannot_be_rolled_back_are_refused(tiny_target):
    model = build_tiny(TinyModel(seed=0))
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(SpecdecError, match="linear_attention layers.*cannot be rolled back"):
        cached(model)


def test_a_feature_draft_reads_the_prompt_before_decoding_starts(tiny_target, tokenizer):
    """Its pass over the prompt belongs to prefill: after `start` only the prompt's last input is left,
    so the first block's drafting time is that of one token, whatever the prompt's length."""
    draft = init_draft(tiny_target, 1, torch.arange(tiny_target.config.vocab_size)).eval()
    prompt = tokenizer.encode(PROMPT)
    target = cached(tiny_target)
    target.reset(len(prompt))
    states = target.forward(torch.tensor([prompt[:-1]]), hidden=True).hidden
    drafter = FeatureDrafter(draft, draft.config.vocab_size)
    drafter.start([prompt], len(prompt) + 8, states)
    assert drafter.pending == [prompt[-1:]] and drafter.model.lengths == [len(prompt) - 2]


def test_showing_tokens_is_not_decoding_time(tiny_target, tokenizer):
    """The display's pauses (1.6 s in all) stay off the decode clock: 16 tiny forwards take a small
    fraction of that even on a loaded machine."""
    pauses = []

    def slow_display(tokens, from_draft):
        time.sleep(0.1)
        pauses.append(0.1)

    decoder = SpeculativeDecoder(cached(tiny_target), None, GREEDY, 1, set())
    result = decoder.generate(tokenizer.encode(PROMPT), 16, 0, on_tokens=slow_display)
    assert len(pauses) == 16 and result.decode_seconds < sum(pauses) / 2


def test_a_verification_attends_without_copying_keys_and_values_and_gets_the_same_logits(tokenizer):
    reference = build_tiny(TinyModel(seed=0)).eval()  # transformers' own attention, no cache
    model = cached(build_tiny(TinyModel(seed=0)).eval())
    assert reference.config.num_attention_heads > reference.config.num_key_value_heads  # grouped queries
    assert model.model.config._attn_implementation == "grouped_query_sdpa"
    rows = [tokenizer.encode("The quick brown fox"), tokenizer.encode("Hello")]
    model.reset(64, batch=2)
    model.forward(right_padded(rows, model.device)[0], counts=[len(r) for r in rows])
    block = [[5, 6, 7, 8], [9, 10, 11, 12]]  # four tokens per row, after contexts of different lengths
    logits = model.forward(torch.tensor(block)).logits
    with torch.no_grad():
        for row, (context, new) in enumerate(zip(rows, block)):
            expected = reference(torch.tensor([context + new])).logits[0, -len(new) :]
            torch.testing.assert_close(logits[row], expected, atol=1e-5, rtol=1e-5)
            # transformers' own cached decoding of the same model (its generate()) still gets the masks it needs
            cache = DynamicCache(config=model.model.config)
            model.model(torch.tensor([context]), cache=cache)
            own = model.model(torch.tensor([new]), cache=cache).logits[0]
            torch.testing.assert_close(own, expected, atol=1e-5, rtol=1e-5)


def test_block_verification_in_the_loop(tiny_target, noisy_draft, tokenizer):
    """Under block verification, target-only decoding draws what it draws under token verification (no
    drafts, the same random draws), an identical draft keeps every draft, and a noisy one some."""
    prompt, sampled = tokenizer.encode(PROMPT), SamplingParams(temperature=1.0)
    alone = [
        SpeculativeDecoder(cached(tiny_target), None, sampled, 1, set(), rule=rule).generate(prompt, 24, 0).token_ids
        for rule in (TokenVerification(), BlockVerification())
    ]
    assert alone[0] == alone[1]
    rates = [
        acceptance_rate(
            SpeculativeDecoder(
                cached(tiny_target), ModelDrafter(cached(draft)), sampled, 3, set(), rule=BlockVerification()
            )
            .generate(prompt, 32, 0)
            .steps
        )
        for draft in (tiny_target, noisy_draft)
    ]
    assert rates[0] == 1.0 and 0 < rates[1] < 1


@pytest.mark.parametrize("graphs", [False, True])
def test_with_graphs_the_attention_reads_a_few_recurring_key_lengths(tiny_target, noisy_draft, tokenizer, graphs):
    """With graphs a forward's attention reads the cache in steps of KEY_SLOTS_STEP slots, so shapes
    recur from block to block instead of growing by a token each (eagerly in steps of
    EAGER_KEY_SLOTS_STEP); the greedy output stays the target's either way."""
    shapes = set()

    def record(module, args, kwargs):
        shapes.add(tuple(kwargs["attention_mask"].shape[-2:]))  # [queries, keys]

    prompt = tokenizer.encode(PROMPT)
    handle = tiny_target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        target = CachedModel(tiny_target, tiny_target.config.vocab_size, graphs=graphs)
        drafter = ModelDrafter(CachedModel(noisy_draft, noisy_draft.config.vocab_size, graphs=graphs))
        result = SpeculativeDecoder(target, drafter, GREEDY, 4, set()).generate(prompt, 160, seed=0)
    finally:
        handle.remove()
    assert result.token_ids == target_only(tiny_target, prompt, 160).token_ids
    keys = {k for _, k in shapes}
    if graphs:  # 128, then the whole cache but its scratch slot (fewer than 256 here)
        assert len(keys) == 2 and min(keys) == KEY_SLOTS_STEP, keys
    else:
        assert len(keys) > 3 and all(k % EAGER_KEY_SLOTS_STEP == 0 for k in keys), keys
    assert {q for q, _ in shapes} <= {len(prompt) - 1, 1, 2, 3, 4, 5}


# quantized products give a row the same result whatever rows come with it; float32's chosen CPU
# product need not (decode_matmul.py), so float32 is not held to this
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("shape", [{"seed": 0}, {"seed": 1, "hidden_size": 576, "num_heads": 9, "num_kv_heads": 3}])
def test_a_chains_verification_gets_the_logits_single_token_steps_get(write_config, shape, weights):
    """Bit for bit, each position of a verification block and of the same tokens fed one at a time,
    at contexts whose key slots cross a step of EAGER_KEY_SLOTS_STEP inside the block, the target
    loaded as the loop loads it. SDPA's CPU kernel rounds by the number of query rows it is given on
    some CPUs (AMD EPYC, 2 threads: the block attended at once differed here), so a chain's tokens
    attend one by one (cache.BY_TOKEN)."""
    changes = {"target": {"tiny": shape}, "draft": {"ngram": {}}, "runtime": {"weights": weights}}
    model = load_pair(load_config(str(write_config(changes)))).target.model
    block = [5, 6, 7, 8, 9]
    for context_length in (20, 30, 61):
        context = [(7 * i + 3) % 200 for i in range(context_length)]
        verified, stepped = cached(model), cached(model)
        for one in (verified, stepped):
            one.reset(128)
            one.forward(torch.tensor([context]))
        at_once = verified.forward(torch.tensor([block])).logits[0]
        one_by_one = torch.cat([stepped.forward(torch.tensor([[token]])).logits[0] for token in block])
        assert torch.equal(at_once, one_by_one), f"context {context_length}"
