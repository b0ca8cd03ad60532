"""A small causal LM drafting autoregressively over its own KV cache."""

from __future__ import annotations

import torch

from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.decoding.sampling import sample, warp


def draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next draft token [1] from the draft's last logits [1, V], and its q [1, V] (None when greedy)."""
    if params.greedy:
        return logits.argmax(dim=-1), None
    q = warp(logits, params)
    return sample(q, generator), q


def stack_drafts(tokens: list[torch.Tensor], probs: list[torch.Tensor | None]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.stack(tokens, dim=1), None if probs[0] is None else torch.stack(probs, dim=1)


class ModelDrafter:
    """Feeds each context token once: `pending` holds the tokens the draft has not read yet."""

    reads_target_states = False

    def __init__(self, model: CachedModel):
        self.model = model
        self.pending: list[int] = []

    def start(self, prompt_ids: list[int], max_tokens: int, target_states: torch.Tensor | None) -> None:
        self.model.reset(max_tokens)
        if len(prompt_ids) > 1:
            self.model.forward(self._tensor(prompt_ids[:-1]), last_only=True)
        self.pending = prompt_ids[-1:]

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], device=self.model.device)

    def propose(self, gamma: int, params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens, probs = [], []
        next_input = self._tensor(self.pending)
        for _ in range(gamma):
            token, q = draft_token(self.model.forward(next_input, last_only=True).logits[:, -1], params, generator)
            tokens.append(token)
            probs.append(q)
            next_input = token[:, None]
        self.pending = []  # all fed except the last draft token, which commit() settles
        return stack_drafts(tokens, probs)

    def commit(self, draft_ids: list[int], num_accepted: int, next_token: int,
               target_states: torch.Tensor | None) -> None:
        gamma = len(draft_ids)
        if num_accepted == gamma:
            # the last draft token was never fed to the draft model: catch up on it now
            self.pending = [draft_ids[-1], next_token]
        else:
            self.model.rollback(gamma - 1 - num_accepted)
            self.pending = [next_token]

    def follow(self, tokens: list[int], target_states: torch.Tensor | None) -> None:
        """The context grew by `tokens` in a block another drafter drafted: read them next time."""
        self.pending += tokens
