"""Prompt lookup where the context repeats itself, a draft model elsewhere.

Where the answer copies its context (extraction, summaries, code edits), lookup drafts long runs for
free that a small model misses; elsewhere it has nothing to say and the model drafts. The model
reads every verified token either way: after a block it did not draft it `follow`s the context.
"""

from __future__ import annotations

import torch

from specdec_cli.decoding.params import SamplingParams
from specdec_cli.drafters.feature import FeatureDrafter
from specdec_cli.drafters.model import ModelDrafter
from specdec_cli.drafters.ngram import NgramDrafter


class LookupFirstDrafter:
    def __init__(self, lookup: NgramDrafter, model: ModelDrafter | FeatureDrafter):
        self.lookup, self.model = lookup, model
        self.reads_target_states = model.reads_target_states
        self.model_drafted = False  # who drafted the current block

    def start(self, prompt_ids: list[int], max_tokens: int, target_states: torch.Tensor | None) -> None:
        self.lookup.start(prompt_ids, max_tokens, target_states)
        self.model.start(prompt_ids, max_tokens, target_states)

    def propose(self, gamma: int, params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        drafts, probs = self.lookup.propose(gamma, params, generator)
        self.model_drafted = drafts.shape[1] == 0
        return self.model.propose(gamma, params, generator) if self.model_drafted else (drafts, probs)

    def commit(self, draft_ids: list[int], num_accepted: int, next_token: int,
               target_states: torch.Tensor | None) -> None:
        self.lookup.commit(draft_ids, num_accepted, next_token, target_states)
        if self.model_drafted:
            self.model.commit(draft_ids, num_accepted, next_token, target_states)
        else:
            self.model.follow(draft_ids[:num_accepted] + [next_token], target_states)
