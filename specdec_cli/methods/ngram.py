"""Prompt lookup: drafts copied from earlier in the context, no model at all."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from specdec_cli.decoding.params import TreeShape
from specdec_cli.methods.context import ContextDrafter
from specdec_cli.methods.registry import Built, Target


class NgramDrafter(ContextDrafter):
    """Find the last earlier occurrence of the context's final n-gram (longest n first) and propose
    the tokens that followed it. Deterministic, so q is one-hot."""

    def __init__(self, max_n: int, min_n: int, vocab_size: int, device: torch.device):
        super().__init__(vocab_size, device)
        self.max_n, self.min_n = max_n, min_n

    def continuations(self, length: int, row: int = 0) -> Iterator[list[int]]:
        """What followed each earlier occurrence of the row's final n-gram, up to `length` tokens (at
        least one): longest n first, then the most recent occurrence first, as it best predicts what
        comes next."""
        ctx = self.contexts[row]
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            suffix = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):  # right to left
                if ctx[start : start + n] == suffix:
                    yield ctx[start + n : start + n + length]

    def lookup(self, num_draft_tokens: int, row: int = 0) -> list[int]:
        return next(self.continuations(num_draft_tokens, row), [])

    def lookup_tree(self, shape: TreeShape, row: int) -> tuple[list[int], list[int]]:
        """The first top_k `continuations` (depth tokens each) that add to the tree, merged into a trie
        of at most max_nodes nodes: its tokens and parent slots (0: the root; node i is slot i + 1),
        a parent before its children, siblings in the order of the continuations that brought them."""
        tokens: list[int] = []
        parents: list[int] = []
        slot_of: dict[tuple[int, int], int] = {}  # (parent slot, token) -> the node's slot
        branches = 0
        for continuation in self.continuations(shape.depth, row):
            parent, grew = 0, False
            for token in continuation:
                if (parent, token) not in slot_of:
                    if len(tokens) == shape.max_nodes:
                        break
                    tokens.append(token)
                    parents.append(parent)
                    slot_of[parent, token] = len(tokens)
                    grew = True
                parent = slot_of[parent, token]
            branches += grew
            if branches == shape.top_k or len(tokens) == shape.max_nodes:
                break
        return tokens, parents


def build(settings, target: Target) -> Built:
    """Prompt lookup with `settings`' n-gram sizes (draft.ngram alone, draft.lookup ahead of a model)."""
    return Built(NgramDrafter(settings.max_n, settings.min_n, target.vocab_size, target.device))
