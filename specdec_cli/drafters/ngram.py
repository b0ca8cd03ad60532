"""Prompt lookup: drafts copied from earlier in the context, no model at all."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from specdec_cli.config import TreeShape
from specdec_cli.decoding.host import to_device
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.decoding.tree import DraftTree
from specdec_cli.drafters.base import NOT_DRAFTED, Drafts, PathCommit, Rows, States


class NgramDrafter(PathCommit):
    """Find the last earlier occurrence of the context's final n-gram (longest n first) and propose
    the tokens that followed it. Deterministic, so q is one-hot."""

    reads_target_states = False

    def __init__(self, max_n: int, min_n: int, vocab_size: int, device: torch.device):
        self.max_n, self.min_n = max_n, min_n
        self.vocab_size = vocab_size
        self.device = device
        self.contexts: list[list[int]] = []  # one per row

    def start(self, prompts: Rows, max_tokens: int, target_states: States) -> None:
        self.contexts = [list(prompt) for prompt in prompts]

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

    def lookup(self, gamma: int, row: int = 0) -> list[int]:
        return next(self.continuations(gamma, row), [])

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

    def propose_tree(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        """Several earlier occurrences of the context's final n-gram as branches (`lookup_tree`).
        Deterministic, like the chain: q is one-hot on every child, and `try_children`'s rule is exact
        at every temperature."""
        return self.tree(self.find_trees(shape), shape.depth)

    def find_trees(self, shape: TreeShape) -> list[tuple[list[int], list[int]]]:
        """Each row's `lookup_tree` (host lists: deciding on them costs no device sync)."""
        return [self.lookup_tree(shape, row) for row in range(len(self.contexts))]

    def tree(self, found: list[tuple[list[int], list[int]]], depth: int) -> DraftTree:
        """The rows' tries as one tree; a row that found less has placeholders."""
        width = max(1, *(len(tokens) for tokens, _ in found))
        padded = [tokens + [0] * (width - len(tokens)) for tokens, _ in found]
        padded += [parents + [-1] * (width - len(parents)) for _, parents in found]
        tokens, parents = to_device(padded, self.device).view(2, len(found), width)
        return DraftTree(tokens, parents, depth)

    def propose(self, gamma: int, params: SamplingParams, generator: torch.Generator | None) -> Drafts:
        return self.drafts(self.find(gamma), params)

    def find(self, gamma: int) -> list[list[int]]:
        """Each row's lookup (host lists: deciding on them costs no device sync)."""
        return [self.lookup(gamma, row) for row in range(len(self.contexts))]

    def drafts(self, found: list[list[int]], params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [B, g], -1 where a row found less, and their one-hot q (None when greedy)."""
        width = max(map(len, found), default=0)
        tokens = to_device([ids + [NOT_DRAFTED] * (width - len(ids)) for ids in found], self.device)
        tokens = tokens.view(len(found), width)
        if params.greedy:
            return tokens, None
        drafted = tokens >= 0
        probs = torch.zeros(*tokens.shape, self.vocab_size, device=self.device)
        probs.scatter_(-1, tokens.clamp_min(0)[..., None], drafted[..., None].float())
        return tokens, probs

    def commit(self, draft_ids: Rows, num_accepted: list[int], next_tokens: list[int], target_states: States) -> None:
        for context, ids, accepted, token in zip(self.contexts, draft_ids, num_accepted, next_tokens):
            context += ids[:accepted] + [token]

    def keep(self, rows: list[int]) -> None:
        self.contexts = [self.contexts[r] for r in rows]
