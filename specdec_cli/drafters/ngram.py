"""Prompt lookup: drafts copied from earlier in the context, no model at all."""

from __future__ import annotations

import torch

from specdec_cli.decoding.host import to_device
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.drafters.base import NOT_DRAFTED, Drafts, Rows, States


class NgramDrafter:
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

    def lookup(self, gamma: int, row: int = 0) -> list[int]:
        ctx = self.contexts[row]
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            suffix = ctx[-n:]
            # scan right to left: the most recent match best predicts what comes next
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start : start + n] == suffix:
                    return ctx[start + n : start + n + gamma]
        return []

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
