"""A small causal LM drafting autoregressively over its own KV cache."""

from __future__ import annotations

import math

import torch

from specdec_cli.decoding import sampling  # looked up at each call, as tree.py does
from specdec_cli.decoding.cache import CachedModel, right_padded
from specdec_cli.decoding.drafter import Drafter, Drafts, Rows, States
from specdec_cli.decoding.host import to_host
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.decoding.tree import DraftTree, TreeGrowth, draft_log_probs


def draft_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    vocabulary: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next draft token per row [B] from the draft's last logits [B, S], and q [B, S] over the same
    columns (None when greedy). `vocabulary` [S]: the token ids of the columns of a head over a subset
    of the vocabulary (methods/feature/parts.py's `SubsetHead`); None: column i is token i. Warping and
    drawing over the head's columns alone gives the same q as over all V with -inf elsewhere, and is
    several times cheaper (docs/experiments/2026-12-02-feature-draft-subset-sampling.md)."""
    q = None if params.greedy else sampling.warp(logits, params)
    column = logits.argmax(dim=-1) if q is None else sampling.sample(q, generator)
    return (column if vocabulary is None else vocabulary[column]), q


def confident(logits: torch.Tensor, q: torch.Tensor | None, threshold: float) -> bool:
    """Whether some row's draft gives its most likely token at least `threshold` probability (q's, or
    the plain softmax's when greedy). It must not look at the sampled token: stopping because of the
    token drawn would bias which tokens get proposed, and the output would no longer be the target's
    (the statistical checks fail). A host sync: with a threshold of 0 it is skipped."""
    if threshold <= 0:
        return True
    probs = logits.float().softmax(-1) if q is None else q
    return to_host((probs.max(-1).values >= threshold).any())


def stops_unsure(model: CachedModel, step: int, logits: torch.Tensor, q: torch.Tensor | None, threshold: float) -> bool:
    """Whether a block ends before its draft token `step` (`confident`). Then the token before it,
    already fed to the draft's cache, is taken back out: `commit` expects a block's last draft unfed."""
    if confident(logits, q, threshold):
        return False
    if step:
        model.rollback(1)
    return True


def confident_frontier(log_probs: torch.Tensor, threshold: float) -> bool:
    """`confident` for a tree's frontier: whether some row's draft gives some frontier node's most
    likely next token at least `threshold` probability. log_probs [B, f, S]: what the tree grows by
    (`draft_log_probs`). It decides before the children are drawn, never after looking at them."""
    if threshold <= 0:
        return True
    return to_host((log_probs.amax(dim=(-2, -1)) >= math.log(threshold)).any())


def stack_drafts(
    tokens: list[torch.Tensor],
    probs: list[torch.Tensor | None],
    rows: int,
    vocab_size: int,
    device: torch.device,
    vocabulary: torch.Tensor | None = None,
) -> Drafts:
    """[B, g] drafts and [B, g, V] q (None when greedy) from per-step lists, g = 0 included; q over a
    head's `vocabulary` (see `draft_token`) is put at its token ids, once per block."""
    if not tokens:
        return torch.zeros(rows, 0, dtype=torch.long, device=device), torch.zeros(rows, 0, vocab_size, device=device)
    q = None if probs[0] is None else sampling.spread(torch.stack(probs, dim=1), vocabulary, vocab_size)
    return torch.stack(tokens, dim=1), q


class ModelDrafter(Drafter):
    """Feeds each context token once. What it holds, per row, between blocks: its cache has every
    context token but `pending`, the ones it has not read yet (the target's last token, after a
    block accepted whole also the last draft; after `follow`, lookup's block). Within a block it
    feeds its drafts but the last; `commit` rolls back the rejected ones."""

    stops_when_unsure = True

    def __init__(self, model: CachedModel, confidence_threshold: float = 0.0):
        self.model = model
        self.confidence_threshold = confidence_threshold  # see config.Speculation
        self.pending: list[list[int]] = []
        self.root: list[int] = []  # per row, the slot of the current tree's root (the last context token)
        self.fed: torch.Tensor | None = None  # [B, n + 1] per tree slot, its slot after the root (-1: not fed)

    def start(self, prompts: Rows, max_tokens: int, target_states: States) -> None:
        self.model.reset(max_tokens, len(prompts))
        if max(map(len, prompts)) > 1:
            ids, counts = right_padded([p[:-1] for p in prompts], self.model.device)
            self.model.forward(ids, counts=counts, logits="none")
        self.pending = [p[-1:] for p in prompts]

    def propose(self, num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None) -> Drafts:
        tokens, probs = [], []
        next_input, counts = right_padded(self.pending, self.model.device)
        for step in range(num_draft_tokens):
            logits = self.model.forward(next_input, counts=counts, logits="last").logits[:, -1]
            token, q = draft_token(logits, params, generator)
            if stops_unsure(self.model, step, logits, q, self.confidence_threshold):
                break
            tokens.append(token)
            probs.append(q)
            next_input, counts = token[:, None], None
        self.pending = [[] for _ in self.pending]  # all fed except the last draft token, which commit() settles
        return stack_drafts(tokens, probs, len(self.pending), self.model.vocab_size, self.model.device)

    def commit(self, draft_ids: Rows, num_accepted: list[int], next_tokens: list[int], target_states: States) -> None:
        num_draft_tokens = len(draft_ids[0])
        # the last draft token was never fed to the draft model: a row that accepted all catches up on it
        self.model.rollback([num_draft_tokens - 1 - min(accepted, num_draft_tokens - 1) for accepted in num_accepted])
        self.pending = [
            ids[-1:] + [token] if accepted == num_draft_tokens else [token]
            for ids, accepted, token in zip(draft_ids, num_accepted, next_tokens)
        ]

    def propose_tree(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        """A dynamic tree (decoding/tree.py's `TreeGrowth`: EAGLE-2's when greedy, children drawn from
        q when sampling): the root's children from the context's last logits, then one forward per
        depth over the frontier, with the tree's mask, after the root in the cache; it stops growing
        at a frontier the draft is unsure of (`confident_frontier`)."""
        next_input, counts = right_padded(self.pending, self.model.device)
        logits = self.model.forward(next_input, counts=counts, logits="last").logits  # [B, 1, V]
        self.root = [length - 1 for length in self.model.lengths]
        growth = TreeGrowth.for_drafting(shape, params, len(self.pending), self.model.device, generator)
        growth.grow(draft_log_probs(logits, params))
        for _ in range(growth.shape.depth - 1):
            logits = self.model.forward(growth.frontier_tokens, region=growth.region(self.root)).logits
            log_probs = draft_log_probs(logits, params)
            if not confident_frontier(log_probs, self.confidence_threshold):
                break
            growth.grow(log_probs)
        tree, self.fed = growth.select()
        self.pending = [[] for _ in self.pending]  # commit_tree() settles what the next block reads
        return tree

    def commit_tree(
        self,
        path: torch.Tensor,
        draft_ids: Rows,
        num_accepted: list[int],
        next_tokens: list[int],
        target_states: States,
    ) -> None:
        """The block's outcome per row: path [B, depth + 1] the accepted path's tree slots (root
        first), draft_ids its tokens, and the rest as `commit`. The path's nodes were fed up to the
        one before the last accepted (every node with an accepted child was a frontier): those stay,
        moved after the root; the last accepted node and the next token are read next block."""
        fed = self.fed.gather(1, path[:, :-1]).clamp_min(0)  # [B, depth] (-1: not fed, then past what is kept)
        self.model.compact(self.root, fed, [max(accepted, 1) for accepted in num_accepted])
        self.pending = [
            ids[accepted - 1 : accepted] + [token] for ids, accepted, token in zip(draft_ids, num_accepted, next_tokens)
        ]

    def follow(self, tokens: list[list[int]], target_states: torch.Tensor | None) -> None:
        """Lookup's block is read with the next block's first draft step."""
        for pending, new in zip(self.pending, tokens):
            pending += new

    def keep(self, rows: list[int]) -> None:
        self.model.keep(rows)
        self.pending = [self.pending[r] for r in rows]
