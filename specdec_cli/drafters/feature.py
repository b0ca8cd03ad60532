"""A feature draft (models/feature_draft.py, EAGLE-style): beside each token it reads a hidden state,
the target's for context the target has verified and its own for the tokens it drafts. Input j is
(state at token j, token j + 1), so it runs one token behind a plain draft."""

from __future__ import annotations

import torch

from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.drafters.model import draft_token, stack_drafts
from specdec_cli.models.feature_draft import feature_inputs


class FeatureDrafter:
    reads_target_states = True

    def __init__(self, model: CachedModel):
        self.model = model
        self.pending: list[int] = []  # context tokens not yet in the draft's cache ...
        self.pending_states: torch.Tensor | None = None  # ... and the states beside them [1, n, H]

    def start(self, prompt_ids: list[int], max_tokens: int, target_states: torch.Tensor | None) -> None:
        self.model.reset(max_tokens)
        self.pending, self.pending_states = prompt_ids[1:], target_states
        if len(self.pending) > 1:  # read the prompt now (prefill); its last input drafts token 1
            self._forward(self.pending[:-1], target_states[:, :-1])
            self.pending, self.pending_states = self.pending[-1:], target_states[:, -1:]

    def _forward(self, ids: list[int] | torch.Tensor, states: torch.Tensor):
        ids = torch.tensor([ids], device=self.model.device) if isinstance(ids, list) else ids
        return self.model.forward(inputs_embeds=feature_inputs(self.model.model, ids, states), last_only=True,
                                  hidden=True)

    def propose(self, gamma: int, params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.pending:  # after a one-token prompt there is no state to read yet
            vocab = self.model.vocab_size
            return (torch.zeros(1, 0, dtype=torch.long, device=self.model.device),
                    None if params.greedy else torch.zeros(1, 0, vocab, device=self.model.device))
        tokens, probs = [], []
        next_input, states = self.pending, self.pending_states
        for _ in range(gamma):
            out = self._forward(next_input, states)
            token, q = draft_token(out.logits[:, -1], params, generator)
            tokens.append(token)
            probs.append(q)
            next_input, states = token[:, None], out.hidden[:, -1:]
        return stack_drafts(tokens, probs)

    def commit(self, draft_ids: list[int], num_accepted: int, next_token: int,
               target_states: torch.Tensor | None) -> None:
        # the drafted positions were computed from the draft's own states: redo them (and the
        # accepted ones) from the target's
        self.model.rollback(len(draft_ids) - 1)
        self.pending = draft_ids[:num_accepted] + [next_token]
        self.pending_states = target_states

    def follow(self, tokens: list[int], target_states: torch.Tensor) -> None:
        """The context grew by `tokens` in a block another drafter drafted; `target_states` are the
        target's at the token before each of them."""
        self.pending += tokens
        self.pending_states = (target_states if self.pending_states is None
                               else torch.cat([self.pending_states, target_states], dim=1))
