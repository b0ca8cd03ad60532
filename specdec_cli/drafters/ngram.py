"""Prompt lookup: drafts copied from earlier in the context, no model at all."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec_cli.decoding.params import SamplingParams


class NgramDrafter:
    """Find the last earlier occurrence of the context's final n-gram (longest n first) and propose
    the tokens that followed it. Deterministic, so q is one-hot."""

    reads_target_states = False

    def __init__(self, max_n: int, min_n: int, vocab_size: int, device: torch.device):
        self.max_n, self.min_n = max_n, min_n
        self.vocab_size = vocab_size
        self.device = device
        self.context: list[int] = []

    def start(self, prompt_ids: list[int], max_tokens: int, target_states: torch.Tensor | None) -> None:
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
               target_states: torch.Tensor | None) -> None:
        self.context += draft_ids[:num_accepted] + [next_token]
