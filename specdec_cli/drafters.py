"""Drafters propose tokens for the target to verify.

A drafter sees the same context as the target. `propose` (gamma >= 1) returns up to gamma tokens
[1, g] and their draft distributions q [1, g, V], warped like the target's p (None when greedy);
`commit` hands back those draft ids, how many were accepted and which token the target produced next.
A drafter with `uses_target_features` also gets the target's last hidden states: for the prompt in
`start`, for the verified tokens in `commit`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec_cli.cached_model import CachedModel
from specdec_cli.distilled import is_feature_draft
from specdec_cli.sampling import SamplingParams, sample, warp


class ModelDrafter:
    """A small causal LM drafting autoregressively over its own KV cache.

    A feature draft (distilled.py, EAGLE-style) also reads a hidden state beside each token: the
    target's for context the target has verified, its own for the tokens it drafts. Input j is
    (state at token j, token j + 1), so it runs one token behind a plain draft.
    """

    def __init__(self, model: CachedModel):
        self.model = model
        self.uses_target_features = is_feature_draft(model.model)
        self.pending: list[int] = []  # context tokens not yet in the draft cache
        self.pending_features: torch.Tensor | None = None  # their states [1, n, hidden], feature drafts

    def start(self, prompt_ids: list[int], max_tokens: int, target_features: torch.Tensor | None) -> None:
        self.model.reset(max_tokens)
        if self.uses_target_features:
            self.pending, self.pending_features = prompt_ids[1:], target_features
            return
        if len(prompt_ids) > 1:
            self.model.forward(self._tensor(prompt_ids[:-1]), last_only=True)
        self.pending = prompt_ids[-1:]

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], device=self.model.device)

    def propose(self, gamma: int, params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.pending:  # a feature draft after a one-token prompt: no state to read yet
            return (torch.zeros(1, 0, dtype=torch.long, device=self.model.device),
                    None if params.greedy else torch.zeros(1, 0, self.model.vocab_size, device=self.model.device))
        tokens, probs = [], []
        next_input, features = self._tensor(self.pending), self.pending_features
        for _ in range(gamma):
            out = self.model.forward(next_input, last_only=True, hidden=self.uses_target_features,
                                     features=features)
            logits = out.logits[:, -1]  # [1, V]
            if params.greedy:
                token = logits.argmax(dim=-1)
            else:
                q = warp(logits, params)
                token = sample(q, generator)
                probs.append(q)
            tokens.append(token)
            next_input = token[:, None]
            features = out.hidden[:, -1:] if self.uses_target_features else None
        self.pending = []  # all fed except the last draft token, which commit() settles
        # greedy verification never reads q
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None

    def commit(self, draft_ids: list[int], num_accepted: int, next_token: int,
               target_features: torch.Tensor | None) -> None:
        """`target_features`: the target's states at [last token, accepted drafts] (feature drafts)."""
        gamma = len(draft_ids)
        if self.uses_target_features:
            # the drafted tokens' cache entries were computed from the draft's own states: redo them
            # (and the accepted ones) from the target's
            self.model.rollback(gamma - 1)
            self.pending = draft_ids[:num_accepted] + [next_token]
            self.pending_features = target_features
        elif num_accepted == gamma:
            # the last draft token was never fed to the draft model: catch up on it now
            self.pending = [draft_ids[-1], next_token]
        else:
            self.model.rollback(gamma - 1 - num_accepted)
            self.pending = [next_token]


class NgramDrafter:
    """Prompt lookup: find the last earlier occurrence of the context's final n-gram (longest n
    first) and propose the tokens that followed it. Deterministic, so q is one-hot."""

    uses_target_features = False

    def __init__(self, max_n: int, min_n: int, vocab_size: int, device: torch.device):
        self.max_n, self.min_n = max_n, min_n
        self.vocab_size = vocab_size
        self.device = device
        self.context: list[int] = []

    def start(self, prompt_ids: list[int], max_tokens: int, target_features: torch.Tensor | None) -> None:
        self.context = list(prompt_ids)

    def lookup(self, gamma: int) -> list[int]:
        ctx = self.context
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            suffix = ctx[-n:]
            # scan right to left: the most recent match best predicts what comes next
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start:start + n] == suffix:
                    return ctx[start + n:start + n + gamma]
        return []

    def propose(self, gamma: int, params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = torch.tensor([self.lookup(gamma)], dtype=torch.long, device=self.device).view(1, -1)
        probs = None if params.greedy else F.one_hot(tokens, self.vocab_size).float()
        return tokens, probs

    def commit(self, draft_ids: list[int], num_accepted: int, next_token: int,
               target_features: torch.Tensor | None) -> None:
        self.context += draft_ids[:num_accepted] + [next_token]
