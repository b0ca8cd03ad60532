"""The drafter contract: what the decode loop (decoding/engine.py) asks of every kind of drafter.

A drafter drafts for B rows (sequences) at once and sees the same context as the target in each.
Shapes: g <= gamma draft positions, V the target's vocabulary size, H the target's hidden size.
A draft id of -1 marks a position a row did not draft (prompt lookup found less for it): its q is
all zeros, so the acceptance test rejects it, and the target's own token takes its place.
`keep(rows)` drops the rows that finished. A drafter that can draft after prompt lookup
(drafters/lookup.py) is a `Follower`: it also reads blocks that lookup drafted. A drafter that drafts
trees (decoding/tree.py) also has `propose_tree` and `commit_tree`. A drafter with
`observe(inputs, logits)` is handed every verification's input tokens [B, n] (-1: no token) and the
target's logits after each [B, n, V], once the block's drafts are fixed (drafters/recycling.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from specdec_cli.decoding.params import SamplingParams

NOT_DRAFTED = -1
Rows = list[list[int]]  # token ids per row
States = torch.Tensor | None  # the target's hidden states, for drafters that read them
Drafts = tuple[torch.Tensor, torch.Tensor | None]  # draft tokens [B, g] and their q [B, g, V] (None: greedy)


class Drafter(Protocol):
    # whether `start` and `commit` get the target's hidden states (those of the layers the draft
    # reads, side by side; None otherwise)
    reads_target_states: bool

    def start(self, prompts: Rows, max_tokens: int, target_states: States) -> None:
        """New sequences of at most `max_tokens` tokens each. `target_states` [B, max(P) - 1, H]: the
        target's states at every prompt token but the last, right-padded (row b's first P_b - 1 are
        real). Runs before the decode clock starts, so a drafter's pass over the prompts is prefill."""

    def propose(self, gamma: int, params: SamplingParams, generator: torch.Generator | None) -> Drafts:
        """Up to `gamma` (>= 1) draft tokens per row [B, g] (g may be 0; -1 where a row drafted
        less) and the distributions q [B, g, V] they were drawn from, warped as the target's p is
        (None when greedy: nothing reads q)."""

    def commit(self, draft_ids: Rows, num_accepted: list[int], next_tokens: list[int], target_states: States) -> None:
        """The block's outcome per row: the g ids `propose` returned, how many the target accepted,
        and the token it emitted after them. `target_states` [B, g + 1, H]: the target's states at
        [the block's first input, drafts]; row b's first num_accepted[b] + 1 are verified context."""

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (the others finished)."""


class Follower(Drafter, Protocol):
    def follow(self, tokens: Rows, target_states: States) -> None:
        """The rows' contexts grew by `tokens` in a block another drafter drafted (the accepted drafts
        and the target's token, per row) instead of a `propose`/`commit` of this one. `target_states`
        [B, >= len, H]: the target's states at the block's first input and the accepted drafts, i.e.
        at the token before each of `tokens`."""


class PathCommit:
    """`commit_tree` for a drafter that keeps nothing of a tree but its accepted path (no cache of
    the nodes): after a tree it commits the path as a chain's block."""

    def commit_tree(self, path: torch.Tensor, *block) -> None:
        """path [B, depth + 1] the accepted path's tree slots, then `commit`'s arguments, along the path."""
        self.commit(*block)
