"""Drafters that decide their drafts on the host from each row's tokens so far, with no model:
prompt lookup (ngram.py) and suffix decoding (suffix.py). Their drafts are deterministic, so q is
one-hot, and `try_children`'s rule verifies their trees exactly at every temperature (the children
of a node are distinct and fixed before its uniforms are drawn). Deciding on host lists costs no
device sync; the tensors go up through `to_device`.
"""

from __future__ import annotations

import torch

from specdec_cli.decoding.drafter import NOT_DRAFTED, Drafter, Drafts, Rows, States
from specdec_cli.decoding.host import to_device
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.decoding.tree import DraftTree


class ContextDrafter(Drafter):
    """A row's draft is `lookup(num_draft_tokens, row)` (a chain) or `lookup_tree(shape, row)` (tokens and
    parent slots: 0 the root, node i is slot i + 1, a parent before its children, siblings distinct),
    read from `self.contexts`."""

    copies_context = True

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.contexts: list[list[int]] = []  # one per row

    def lookup(self, num_draft_tokens: int, row: int) -> list[int]:
        raise NotImplementedError

    def lookup_tree(self, shape: TreeShape, row: int) -> tuple[list[int], list[int]]:
        raise NotImplementedError

    def start(self, prompts: Rows, max_tokens: int, target_states: States) -> None:
        self.contexts = [list(prompt) for prompt in prompts]

    def propose_tree(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
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

    def propose(self, num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None) -> Drafts:
        return self.drafts(self.find(num_draft_tokens), params)

    def find(self, num_draft_tokens: int) -> list[list[int]]:
        """Each row's lookup (host lists: deciding on them costs no device sync)."""
        return [self.lookup(num_draft_tokens, row) for row in range(len(self.contexts))]

    def drafts(self, found: list[list[int]], params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [B, g], -1 where a row found less, and their one-hot q (None when greedy)."""
        width = max(map(len, found), default=0)
        tokens = to_device([ids + [NOT_DRAFTED] * (width - len(ids)) for ids in found], self.device)
        tokens = tokens.view(len(found), width)
        return tokens, None if params.greedy else one_hot(tokens, self.vocab_size)

    def commit(self, draft_ids: Rows, num_accepted: list[int], next_tokens: list[int], target_states: States) -> None:
        for context, ids, accepted, token in zip(self.contexts, draft_ids, num_accepted, next_tokens):
            context += ids[:accepted] + [token]

    def follow(self, tokens: Rows, target_states: States) -> None:
        """The rows' contexts grew by `tokens` as a block's accepted tokens would grow them."""
        accepted = [new[:-1] for new in tokens]
        self.commit(accepted, [len(ids) for ids in accepted], [new[-1] for new in tokens], target_states)

    def keep(self, rows: list[int]) -> None:
        self.contexts = [self.contexts[r] for r in rows]


def one_hot(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q of deterministic drafts [B, g] -> [B, g, V]: all on the drafted token, zeros where none (-1)."""
    probs = torch.zeros(*tokens.shape, vocab_size, device=tokens.device)
    return probs.scatter_(-1, tokens.clamp_min(0)[..., None], (tokens >= 0)[..., None].float())
