"""The drafter contract: what the decode loop (decoding/engine.py) asks of every kind of drafter.

A drafter sees the same context as the target. Model drafters also `follow(tokens, target_states)`:
the context grew by tokens that another drafter drafted (drafters/lookup.py). Shapes: g <= gamma draft tokens, V the target's
vocabulary size, H the target's hidden size; every tensor has a leading batch dimension of 1.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specdec_cli.decoding.params import SamplingParams


class Drafter(Protocol):
    # whether `start` and `commit` get the target's last-layer hidden states (None otherwise)
    reads_target_states: bool

    def start(self, prompt_ids: list[int], max_tokens: int, target_states: torch.Tensor | None) -> None:
        """A new sequence of at most `max_tokens` tokens. `target_states` [1, P - 1, H]: the target's
        states at every prompt token but the last (None for a one-token prompt). Runs before the
        decode clock starts, so a drafter's pass over the prompt counts as prefill."""

    def propose(self, gamma: int, params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to `gamma` (>= 1) draft tokens [1, g] (g may be 0) and the distributions q [1, g, V]
        they were drawn from, warped as the target's p is (None when greedy: nothing reads q)."""

    def commit(self, draft_ids: list[int], num_accepted: int, next_token: int,
               target_states: torch.Tensor | None) -> None:
        """The block's outcome: the g ids `propose` returned, how many of them the target accepted,
        and the token it emitted after them. `target_states` [1, num_accepted + 1, H]: the target's
        states at [the block's first input, accepted drafts]."""
