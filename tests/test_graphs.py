"""Decoding forwards through fixed input and output tensors (decoding/graphs.py). On a CPU the
forward runs eagerly on those tensors, so these tests check everything a CUDA graph's replay relies
on but the capture itself (tests/test_cuda.py checks that on a GPU): inputs copied in, outputs
copied out before the next replay, graphs kept with the cache they were captured on and dropped
when it is replaced."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.methods.feature.draft import init_draft
from specdec_cli.methods.feature.draft import wire as wire_feature_draft
from specdec_cli.methods.lookup import LookupFirstDrafter
from specdec_cli.methods.model import ModelDrafter
from specdec_cli.methods.ngram import NgramDrafter

PROMPTS = ["The quick brown fox jumps over", "Hello", "A longer prompt than the others, with more words in it"]


def decode(target, draft, prompts, params, graphs: bool, tree=None, max_new=40):
    """Tokens per row, and the target's CachedModel (to look at its graphs)."""
    cached_target = CachedModel(target, target.config.vocab_size, graphs=graphs)
    drafter = ModelDrafter(CachedModel(draft, draft.config.vocab_size, graphs=graphs)) if draft is not None else None
    decoder = SpeculativeDecoder(cached_target, drafter, params, 4, set(), tree)
    results = decoder.generate_batch(prompts, max_new, seed=3, ignore_eos=True)
    return [r.token_ids for r in results], cached_target


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("rows", [1, 3])
def test_fixed_tensors_decode_the_eager_loops_tokens(tiny_target, noisy_draft, tokenizer, temperature, rows):
    """Same computations, same random draws: the same tokens, greedy and sampled, one row and a
    ragged batch (its first, ragged forwards run eagerly, the rest through the fixed tensors)."""
    prompts = [tokenizer.encode(p) for p in PROMPTS[:rows]]
    params = SamplingParams(temperature=temperature)
    eager, _ = decode(tiny_target, noisy_draft, prompts, params, graphs=False)
    graphed, target = decode(tiny_target, noisy_draft, prompts, params, graphs=True)
    assert graphed == eager
    assert target.graphed.steps, "no forward went through the fixed tensors"


def test_a_tree_block_and_target_alone_decode_the_eager_loops_tokens(tiny_target, noisy_draft, tokenizer):
    prompts = [tokenizer.encode(PROMPTS[0])]
    tree = TreeShape(depth=3, top_k=2, max_nodes=6)
    for draft, shape in ((noisy_draft, tree), (None, None)):
        eager, _ = decode(tiny_target, draft, prompts, SamplingParams(), graphs=False, tree=shape)
        graphed, _ = decode(tiny_target, draft, prompts, SamplingParams(), graphs=True, tree=shape)
        assert graphed == eager


def test_outputs_are_copied_out_before_the_next_replay(tiny_target, tokenizer):
    target = CachedModel(tiny_target, tiny_target.config.vocab_size, graphs=True)
    target.reset(64)
    target.forward(torch.tensor([tokenizer.encode("Hello there")]), logits="none")
    first = target.forward(torch.tensor([[5]])).logits
    kept, shapes = first.clone(), len(target.graphed.steps)
    target.forward(torch.tensor([[6]]))  # the same shapes: a replay
    assert len(target.graphed.steps) == shapes
    assert torch.equal(first, kept)


def test_graphs_stay_with_their_cache_and_go_when_it_is_replaced(tiny_target, noisy_draft, tokenizer):
    target = CachedModel(tiny_target, tiny_target.config.vocab_size, graphs=True)
    decoder = SpeculativeDecoder(
        target, ModelDrafter(CachedModel(noisy_draft, 256, graphs=True)), SamplingParams(), 4, set()
    )
    prompt = tokenizer.encode(PROMPTS[0])
    first = decoder.generate(prompt, 24, seed=0, ignore_eos=True).token_ids
    cache, steps = target.cache, dict(target.graphed.steps)
    again = decoder.generate(prompt, 24, seed=0, ignore_eos=True).token_ids
    assert again == first and target.cache is cache  # a request that fits reuses cache and graphs
    assert all(target.graphed.steps[key] is step for key, step in steps.items())
    decoder.generate_batch([prompt, prompt], 24, seed=0, ignore_eos=True)  # two rows: a new cache
    assert target.cache is not cache and len(target.lengths) == 2
    # only graphs captured on the new cache: the key's input shapes first, positions [rows, width] among them
    assert all(dict(key[0])["positions"][0] == 2 for key in target.graphed.steps)


def pair(kind: str, target, draft, graphs: bool):
    """The target's CachedModel, the drafter of `kind`, and every CachedModel in them."""
    vocab, cpu = target.config.vocab_size, torch.device("cpu")
    if kind == "feature":
        feature = wire_feature_draft(init_draft(target, 1, torch.arange(vocab)).eval(), vocab, 0.0, graphs)
        cached_target = CachedModel(target, vocab, feature.state_layers, graphs=graphs)
        return cached_target, feature.drafter, [cached_target, feature.drafter.model]
    cached_target, cached_draft = CachedModel(target, vocab, graphs=graphs), CachedModel(draft, vocab, graphs=graphs)
    drafter = {
        "ngram": lambda: NgramDrafter(3, 1, vocab, cpu),
        "lookup-first": lambda: LookupFirstDrafter(NgramDrafter(3, 1, vocab, cpu), ModelDrafter(cached_draft)),
    }.get(kind, lambda: ModelDrafter(cached_draft))()
    return cached_target, drafter, [cached_target, cached_draft]


@pytest.mark.parametrize("kind", ["model", "model-tree", "feature", "ngram", "lookup-first"])
@pytest.mark.parametrize("rows, temperature", [(1, 0.0), (4, 1.0)])
def test_each_shape_is_traced_once_without_a_graph_break(tiny_target, noisy_draft, tokenizer, kind, rows, temperature):
    """The proof without a GPU that shapes are static: every forward that would replay a graph runs
    through torch.compile(fullgraph=True, dynamic=False) instead. A graph break fails the trace, and
    the count of traces must equal the count of distinct shapes: a shape traced twice would mean the
    forward depends on something its shapes do not say (a graph captured for it would be wrong).
    Shapes recur, so there are far fewer than blocks; 128 tokens, the same as the eager loop's."""
    prompts = [tokenizer.encode(p) for p in (PROMPTS * 2)[:rows]]
    params, tree = SamplingParams(temperature=temperature), TreeShape(3, 2, 6) if kind == "model-tree" else None

    def tokens(compiled: bool):
        target, drafter, models = pair(kind, tiny_target, noisy_draft, graphs=compiled)
        for model in models if compiled else ():
            model.graphed.forward = torch.compile(model.step, backend="eager", fullgraph=True, dynamic=False)
        decoder = SpeculativeDecoder(target, drafter, params, 4, set(), tree)
        results = decoder.generate_batch(prompts, 128, seed=5, ignore_eos=True)
        shapes = sum(model.graphed.captures for model in models if model.graphed is not None)
        return [r.token_ids for r in results], shapes, max(len(r.steps) for r in results)

    eager, _, _ = tokens(compiled=False)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=256):
        compiled, shapes, blocks = tokens(compiled=True)
    assert compiled == eager
    assert shapes > 1 and counters["stats"]["unique_graphs"] == shapes
    assert shapes < blocks  # shapes recur: far fewer than the blocks (and the draft's steps in them)
    assert not counters["graph_break"]
