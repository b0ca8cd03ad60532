"""Token recycling (Luo et al., arXiv 2408.08696): no draft model, no training. For every token the
drafter keeps the `candidates` tokens the target ranked highest next after it, the last time a
verification fed it that token: an adjacency table [V, candidates] on the device that every
verification updates from its own logits (`observe`), at no extra forward. Drafts follow the table
from the row's last token: a chain along each token's first candidate, a tree by a fixed template
(the shape's most promising (parent, rank) slots, ranks weighted 1 / (rank + 1) along the path). The
table lives as long as the drafter, so a run's earlier requests warm it up for its later ones; before
a token has been verified its candidates are placeholders (tokens 0 .. candidates - 1).

The drafts depend only on earlier blocks' logits, fixed before this block's draws, and a node's
children are distinct (a top-k's indices), so q is one-hot and the exact rules apply.
"""

from __future__ import annotations

import heapq
from functools import cache

import torch

from specdec_cli.decoding.drafter import Drafter, Drafts, Rows, States
from specdec_cli.decoding.host import to_device
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.decoding.tree import DraftTree
from specdec_cli.methods.context import one_hot
from specdec_cli.methods.registry import Built, Target


@cache
def template(shape: TreeShape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tree's (parent slot, rank) per node, parents first: the max_nodes nodes of rank < top_k
    and depth <= depth with the largest product of 1 / (rank + 1) along their path."""
    parents: list[int] = []
    ranks: list[int] = []
    frontier = [(-1.0 / (rank + 1), rank, 0, rank, 1) for rank in range(shape.top_k)]  # (-weight, order, ...)
    order = shape.top_k
    while frontier and len(parents) < shape.max_nodes:
        negative, _, parent, rank, depth = heapq.heappop(frontier)
        parents.append(parent)
        ranks.append(rank)
        if depth < shape.depth:
            for child in range(shape.top_k):
                heapq.heappush(frontier, (negative / (child + 1), order, len(parents), child, depth + 1))
                order += 1
    return tuple(parents), tuple(ranks)


def last_occurrences(rows: torch.Tensor, sink: int) -> torch.Tensor:
    """`rows` [n] with every occurrence of a row but its last sent to `sink`: index_copy_ with duplicate
    indices leaves the winner undefined on CUDA, so a row could mix two top-k lists (and propose
    duplicate siblings, breaking the tree rule). Comparisons on the device: no host sync."""
    later = torch.ones(len(rows), len(rows), dtype=torch.bool, device=rows.device).triu(1)
    repeated_later = ((rows[:, None] == rows[None, :]) & later).any(dim=1)
    return torch.where(repeated_later, sink, rows)


class RecyclingDrafter(Drafter):
    observes = True

    def __init__(self, candidates: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        # row vocab_size: where updates for positions that held no token go
        self.table = torch.arange(candidates, device=device).repeat(vocab_size + 1, 1)
        self.last: list[int] = []  # each row's last token

    @property
    def device(self) -> torch.device:
        return self.table.device

    def start(self, prompts: Rows, max_tokens: int, target_states: States) -> None:
        self.last = [prompt[-1] for prompt in prompts]

    def observe(self, inputs: torch.Tensor, logits: torch.Tensor) -> None:
        """A verification's inputs [B, n] (-1 where a position held no token) and the target's logits
        after each [B, n, V]: each input token's candidates become the target's top ones there."""
        rows = last_occurrences(torch.where(inputs >= 0, inputs, self.vocab_size).flatten(), self.vocab_size)
        ranked = logits[..., : self.vocab_size].topk(self.table.shape[1], dim=-1).indices
        self.table.index_copy_(0, rows, ranked.flatten(0, 1))

    def propose(self, num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None) -> Drafts:
        token = to_device(self.last, self.device)
        drafts = []
        for _ in range(num_draft_tokens):
            token = self.table[token, 0]
            drafts.append(token)
        tokens = torch.stack(drafts, dim=1)
        return tokens, None if params.greedy else one_hot(tokens, self.vocab_size)

    def propose_tree(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        parents, ranks = template(shape)
        nodes = to_device([self.last], self.device).T  # [B, 1 + nodes]: the root (the last token), then the nodes
        for parent, rank in zip(parents, ranks):
            nodes = torch.cat([nodes, self.table[nodes[:, parent], rank][:, None]], dim=1)
        parent_slots = to_device([list(parents)], self.device).expand(len(self.last), -1)
        return DraftTree(nodes[:, 1:], parent_slots, shape.depth)

    def commit(self, draft_ids: Rows, num_accepted: list[int], next_tokens: list[int], target_states: States) -> None:
        self.last = list(next_tokens)

    def follow(self, tokens: Rows, target_states: States) -> None:
        self.last = [new[-1] for new in tokens]

    def keep(self, rows: list[int]) -> None:
        self.last = [self.last[r] for r in rows]


def build(settings, target: Target) -> Built:
    return Built(RecyclingDrafter(settings.candidates, target.vocab_size, target.device))
