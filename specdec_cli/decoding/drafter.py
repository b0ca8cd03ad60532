"""The drafter contract: what the decode loop (decoding/engine.py) asks of every drafting method.

A drafter drafts for B rows (sequences) at once and sees the same context as the target in each.
Shapes: g <= num_draft_tokens draft positions, V the target's vocabulary size, H the target's hidden size.
A draft id of -1 marks a position a row did not draft (prompt lookup found less for it): its q is
all zeros, so the acceptance test rejects it, and the target's own token takes its place.

Every drafter drafts chains (`propose`/`commit`) and trees (`propose_tree`/`commit_tree`,
decoding/tree.py). What some can do besides, they declare, and the loop and the assembly read the
declarations rather than the classes: `reads_target_states`, `stops_when_unsure` (it drafts token
by token, so a confidence threshold can end its block early), `observes` (`observe` sees every
verification's logits) and `copies_context` (it drafts a span copied from the row's tokens, so once a
short block accepts all it drafted, the next one mostly drafts the rest of that span: `specdec tune`
predicts shorter blocks from longer ones by that). Every drafter `follow`s blocks it did not draft:
another drafter's (prompt lookup's ahead of a draft model) or none (the target alone, where a schedule
drafts nothing).
"""

from __future__ import annotations

import torch

from specdec_cli.decoding.params import SamplingParams, TreeShape

NOT_DRAFTED = -1
Rows = list[list[int]]  # token ids per row
States = torch.Tensor | None  # the target's hidden states, for drafters that read them
Drafts = tuple[torch.Tensor, torch.Tensor | None]  # draft tokens [B, g] and their q [B, g, V] (None: greedy)


class Drafter:
    # `start`, `commit` and `follow` get the target's hidden states (those of the layers the draft
    # reads, side by side; None otherwise)
    reads_target_states = False
    stops_when_unsure = False
    observes = False
    copies_context = False

    def start(self, prompts: Rows, max_tokens: int, target_states: States) -> None:
        """New sequences of at most `max_tokens` tokens each. `target_states` [B, max(P) - 1, H]: the
        target's states at every prompt token but the last, right-padded (row b's first P_b - 1 are
        real). Runs before the decode clock starts, so a drafter's pass over the prompts is prefill."""
        raise NotImplementedError

    def propose(self, num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None) -> Drafts:
        """Up to `num_draft_tokens` (>= 1) draft tokens per row [B, g] (g may be 0; -1 where a row drafted
        less) and the distributions q [B, g, V] they were drawn from, warped as the target's p is
        (None when greedy: nothing reads q)."""
        raise NotImplementedError

    def commit(self, draft_ids: Rows, num_accepted: list[int], next_tokens: list[int], target_states: States) -> None:
        """The block's outcome per row: the g ids `propose` returned, how many the target accepted,
        and the token it emitted after them. `target_states` [B, g + 1, H]: the target's states at
        [the block's first input, drafts]; row b's first num_accepted[b] + 1 are verified context."""
        raise NotImplementedError

    def propose_tree(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None):
        """A draft tree (decoding/tree.py's `DraftTree`) of at most `shape`."""
        raise NotImplementedError

    def commit_tree(self, path: torch.Tensor, *block) -> None:
        """path [B, depth + 1] the accepted path's tree slots, then `commit`'s arguments, along the
        path. By default the path is committed as a chain's block: right for a drafter that keeps
        nothing of a tree's nodes."""
        self.commit(*block)

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (the others finished)."""
        raise NotImplementedError

    def follow(self, tokens: Rows, target_states: States) -> None:
        """The rows' contexts grew by `tokens` in a block this drafter did not draft (another's accepted
        drafts and the target's token, or the target's token alone), instead of a `propose`/`commit`.
        `target_states` [B, >= len, H]: the target's states at the block's first input and the
        accepted drafts, i.e. at the token before each of `tokens`."""
        raise NotImplementedError

    def observe(self, inputs: torch.Tensor, logits: torch.Tensor) -> None:
        """(`observes`) Every verification's input tokens [B, n] (-1: no token) and the target's
        logits after each [B, n, V], once the block's drafts are fixed: it shapes later blocks only."""
        raise NotImplementedError
