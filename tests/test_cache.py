"""The KV cache of decoding/cache.py, with literal lengths: ragged rows, rollback, a tree's path
kept, rows leaving; after a rollback or rows leaving, the next forward's logits are those of a fresh
cache fed the same tokens (stale entries past a row's length are never read)."""

from __future__ import annotations

import torch
from conftest import cached

from specdec_cli.decoding.cache import right_padded

ROWS = [[5, 6, 7, 8, 9], [20, 21, 22]]  # two rows of different lengths
NEXT = [[30, 31, 32, 33], [40, 41, 42, 43]]


def fresh_logits(model, context: list[int], new: list[int]) -> torch.Tensor:
    """The logits at `new` after `context`, in a cache that saw nothing else."""
    reference = cached(model)
    reference.reset(32)
    reference.forward(torch.tensor([context]), logits="none")
    return reference.forward(torch.tensor([new])).logits[0]


def prefilled(model):
    cache = cached(model)
    cache.reset(32, batch=2)
    cache.forward(right_padded(ROWS, cache.device)[0], counts=[len(r) for r in ROWS], logits="none")
    return cache


def test_ragged_rows_keep_their_own_lengths(tiny_target):
    cache = prefilled(tiny_target)
    assert cache.lengths == [5, 3]  # the shorter row's padding went to the scratch slot
    logits = cache.forward(torch.tensor(NEXT)).logits
    assert cache.lengths == [9, 7]
    for row in range(2):
        torch.testing.assert_close(logits[row], fresh_logits(tiny_target, ROWS[row], NEXT[row]), atol=1e-5, rtol=1e-5)


def test_rollback_forgets_each_rows_last_tokens(tiny_target):
    cache = prefilled(tiny_target)
    cache.forward(torch.tensor(NEXT))
    cache.rollback([3, 1])  # row 0 keeps 1 of its 4 new tokens, row 1 keeps 3
    assert cache.lengths == [6, 6]
    cache.rollback(2)
    assert cache.lengths == [4, 4]
    logits = cache.forward(torch.tensor([[50, 51], [52, 53]])).logits
    assert cache.lengths == [6, 6]
    torch.testing.assert_close(logits[0], fresh_logits(tiny_target, ROWS[0][:4], [50, 51]), atol=1e-5, rtol=1e-5)
    context = ROWS[1] + NEXT[1][:1]
    torch.testing.assert_close(logits[1], fresh_logits(tiny_target, context, [52, 53]), atol=1e-5, rtol=1e-5)


def test_compact_keeps_a_trees_accepted_path(tiny_target):
    """The slots move; what the moved entries mean (keys computed in the tree's own positions and
    mask) is the tree's test (test_tree.py)."""
    cache = cached(tiny_target)
    cache.reset(32)
    cache.forward(torch.tensor([ROWS[0]]), logits="none")
    cache.forward(torch.tensor([NEXT[0]]))  # slots 5-8 hold the entries of 30, 31, 32, 33
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.cache.layers]
    cache.compact([5], torch.tensor([[0, 2, 3]]), [2])  # the path 30, 32, 33, of which 30, 32 kept
    assert cache.lengths == [7]
    for layer, (keys, values) in zip(cache.cache.layers, before):
        for old, new in ((keys, layer.keys), (values, layer.values)):
            torch.testing.assert_close(new[:, :, :8], old[:, :, [0, 1, 2, 3, 4, 5, 7, 8]])


def test_rows_leaving_keep_the_others_cache(tiny_target):
    cache = prefilled(tiny_target)
    cache.forward(torch.tensor(NEXT), logits="none")
    cache.keep([1])
    assert cache.lengths == [7]
    logits = cache.forward(torch.tensor([[70, 71]])).logits[0]
    torch.testing.assert_close(logits, fresh_logits(tiny_target, ROWS[1] + NEXT[1], [70, 71]), atol=1e-5, rtol=1e-5)
