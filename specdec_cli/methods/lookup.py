"""Prompt lookup where the context repeats itself, a draft model elsewhere.

Where the answer copies its context (extraction, summaries, code edits), lookup drafts long runs for
free that a small model misses; elsewhere it has nothing to say and the model drafts. The model
reads every verified token either way: after a block it did not draft it `follow`s the context.
A block is drafted by lookup when it found a continuation in every row, else by the model. Each
side drafts up to its own length: a lookup draft costs only the wider verification, a model draft
also a draft step, so lookup blocks may pay off longer. Greedy, a lookup token is kept whenever it
is the target's argmax, and lookup blocks are drafted at their full length. Sampled, it is kept only
with the target's probability of it, so lookup blocks start at the model's length and double after
one is accepted whole (back to the start after one that is not): long blocks while the answer copies
its context, short ones elsewhere, as verification width is not free: on CPU a forward's cost jumps
past a few tokens (docs/experiments/2026-12-02-sampled-lookup-blocks.md).
"""

from __future__ import annotations

import torch

from specdec_cli.decoding.drafter import Drafter, Drafts, Rows, States
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.decoding.tree import DraftTree
from specdec_cli.methods.context import ContextDrafter


class LookupFirstDrafter(Drafter):
    def __init__(
        self,
        lookup: ContextDrafter,  # prompt lookup (ngram.py) or suffix decoding (suffix.py)
        model: Drafter,  # it `follow`s lookup's blocks
        lookup_tokens: int | None = None,
        model_tokens: int | None = None,
    ):
        """`lookup_tokens`, `model_tokens`: each side's longest block (None: as long as the decoder's)."""
        self.lookup, self.model = lookup, model
        self.lookup_tokens, self.model_tokens = lookup_tokens, model_tokens
        # a sampled run's first lookup block length (None: the decoder's, and it never changes)
        self.shortest = None if lookup_tokens is None else min(lookup_tokens, model_tokens or lookup_tokens)
        self.lookup_length = self.shortest
        self.reads_target_states = model.reads_target_states
        self.model_drafted = False  # who drafted the current block

    def start(self, prompts: Rows, max_tokens: int, target_states: States) -> None:
        self.lookup_length = self.shortest
        self.lookup.start(prompts, max_tokens, target_states)
        self.model.start(prompts, max_tokens, target_states)

    def propose(self, num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None) -> Drafts:
        length = self.lookup_tokens if params.greedy else self.lookup_length
        found = self.lookup.find(num_draft_tokens if length is None else min(num_draft_tokens, length))
        self.model_drafted = not all(found)
        if self.model_drafted:
            model_num_draft_tokens = (
                num_draft_tokens if self.model_tokens is None else min(num_draft_tokens, self.model_tokens)
            )
            return self.model.propose(model_num_draft_tokens, params, generator)
        return self.lookup.drafts(found, params)

    def propose_tree(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        """Lookup's trie (several matches as branches) where it found a match in every row, else the
        model's tree; either is as deep as the shape (lookup's own length applies to chains)."""
        found = self.lookup.find_trees(shape)
        self.model_drafted = not all(tokens for tokens, _ in found)
        if self.model_drafted:
            return self.model.propose_tree(shape, params, generator)
        return self.lookup.tree(found, shape.depth)

    def commit_tree(self, path: torch.Tensor, *block) -> None:
        """path [B, depth + 1] the accepted path's tree slots, then `commit`'s arguments, along the path."""
        if self.model_drafted:  # the model keeps its tree's accepted path as its own commit_tree does
            self.lookup.commit(*block)
            self.model.commit_tree(path, *block)
        else:  # lookup keeps nothing of a tree but the path: as after a lookup chain
            self.commit(*block)

    def commit(self, draft_ids: Rows, num_accepted: list[int], next_tokens: list[int], target_states: States) -> None:
        self.lookup.commit(draft_ids, num_accepted, next_tokens, target_states)
        if self.model_drafted:
            self.model.commit(draft_ids, num_accepted, next_tokens, target_states)
        else:
            self.model.follow(
                [ids[:accepted] + [token] for ids, accepted, token in zip(draft_ids, num_accepted, next_tokens)],
                target_states,
            )
            if self.lookup_length is not None:
                whole = all(accepted == sum(t >= 0 for t in ids) for ids, accepted in zip(draft_ids, num_accepted))
                self.lookup_length = min(2 * self.lookup_length, self.lookup_tokens) if whole else self.shortest

    def follow(self, tokens: Rows, target_states: States) -> None:
        self.lookup.follow(tokens, target_states)
        self.model.follow(tokens, target_states)

    def keep(self, rows: list[int]) -> None:
        self.lookup.keep(rows)
        self.model.keep(rows)
