"""loading/llama_forward.py against transformers' forward of the same routed model: the same logits
and hidden states, bit for bit, over ragged rows, a rollback and several widths, in float32 and
bfloat16, for a target (token inputs) and a feature draft (input vectors, a head over a subset of the
vocabulary); and which models it serves."""

from __future__ import annotations

import pytest
import torch

from specdec_cli.config import TinyModel
from specdec_cli.decoding.cache import CachedModel, right_padded
from specdec_cli.loading.checkpoints import build_tiny
from specdec_cli.loading.decode_matmul import PROCESS_CHOICE
from specdec_cli.loading.llama_forward import LlamaForward, attach
from specdec_cli.methods.feature.draft import init_draft

STATES = (0, 1, -1)  # the embeddings, the first layer's output, the last after the final norm


def routed(dtype: torch.dtype = torch.float32):
    model = build_tiny(TinyModel(seed=0)).eval().to(dtype)
    PROCESS_CHOICE.route(model)
    attach(model)
    return model


def test_serves_routed_llama_models_as_transformers_builds_them_only():
    assert LlamaForward.serves(routed())
    assert not LlamaForward.serves(build_tiny(TinyModel(seed=0)))  # products not routed: transformers' forward
    eagle_like = routed()
    eagle_like.model.layers[0].input_layernorm = torch.nn.Identity()  # as EAGLE drafts have it
    assert not LlamaForward.serves(eagle_like)
    patched = routed()
    patched.model.norm.forward = lambda x: x
    assert not LlamaForward.serves(patched)
    changed_after_loading = routed()  # as a draft format may change a loaded model
    assert CachedModel(changed_after_loading, changed_after_loading.config.vocab_size).own_forward is not None
    changed_after_loading.model.layers[1].post_attention_layernorm = torch.nn.Identity()
    assert CachedModel(changed_after_loading, changed_after_loading.config.vocab_size).own_forward is None


def run(cache: CachedModel) -> list[torch.Tensor]:
    """Every output of a few forwards: a ragged prefill with states, a step, a block, a rollback, a ragged block."""
    rows = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    cache.reset(64, batch=2)
    ids, counts = right_padded(rows, cache.device)
    outputs = list(cache.forward(ids, counts=counts, hidden=True))
    outputs.append(cache.forward(torch.tensor([[30], [40]])).logits)
    outputs += cache.forward(torch.tensor([[31, 32, 33, 34], [41, 42, 43, 44]]), hidden=True)
    cache.rollback([3, 1])
    return outputs + list(
        cache.forward(torch.tensor([[50, 51, 52], [53, 0, 0]]), counts=[3, 1], logits="last", hidden=True)
    )


def run_on_vectors(cache: CachedModel) -> list[torch.Tensor]:
    """The same for a model fed input vectors (a feature draft), with a prefill that keeps no logits."""
    vectors = torch.randn(2, 9, cache.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    vectors = vectors.to(cache.model.dtype)
    cache.reset(64, batch=2)
    outputs = list(cache.forward(inputs_embeds=vectors[:, :5], counts=[5, 2], logits="none", hidden=True))
    outputs += cache.forward(inputs_embeds=vectors[:, 5:8], hidden=True)
    cache.rollback([2, 0])
    return outputs + list(cache.forward(inputs_embeds=vectors[:, 8:], logits="last", hidden=True))


def same_as_transformers(model, width: int, states: tuple[int, ...], runs) -> None:
    fast = CachedModel(model, width, states)
    assert fast.own_forward is not None
    reference = CachedModel(model, width, states)
    reference.own_forward = None
    ours, theirs = runs(fast), runs(reference)
    assert len(ours) == len(theirs)
    for mine, transformers_own in zip(ours, theirs):
        assert mine.dtype == transformers_own.dtype and torch.equal(mine, transformers_own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_target_gives_what_transformers_gives(dtype):
    model = routed(dtype)
    same_as_transformers(model, model.config.vocab_size, STATES, run)


def test_a_feature_draft_gives_what_transformers_gives():
    target = routed()
    draft = init_draft(target, 1, torch.arange(0, target.config.vocab_size, 3)).eval()
    PROCESS_CHOICE.route(draft)
    attach(draft)
    same_as_transformers(draft, draft.lm_head.weight.shape[0], (-1,), run_on_vectors)
