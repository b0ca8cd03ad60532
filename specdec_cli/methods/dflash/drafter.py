"""A block draft (DFlash, methods/dflash/checkpoint.py) as a drafter: one forward drafts a whole block, every
position from its own q, none conditioned on another's draft.

What it holds, per row, between blocks: the K/V of every context token but the last (computed from
the target's states once per token, in a preallocated [B, kv_heads, max_tokens, D] store per layer
with a length per row), except the states in `pending`, not stored yet; `last` is the token the next
block starts with. The block itself is [last token, MASK, ...] after the context; its K/V
are never kept, so a rejected draft needs no rollback. A tree is the static top-k tree over the
block's positions, as Medusa's over its heads (`propose_tree`).
"""

from __future__ import annotations

import torch

from specdec_cli.decoding.cache import right_padded_states
from specdec_cli.decoding.drafter import Drafter, Drafts, Rows, States
from specdec_cli.decoding.host import to_device
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.decoding.tree import DraftTree, draft_log_probs, static_tree
from specdec_cli.methods.model import draft_token


class BlockDrafter(Drafter):
    reads_target_states = True  # the layers `model.state_layers`, side by side

    def __init__(self, model: torch.nn.Module, vocab_size: int):  # a DFlashDraft (methods/dflash/checkpoint.py)
        self.model = model
        self.vocab_size = vocab_size
        self.device = model.fc.weight.device
        self.store: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: K, V [B, kv, max_tokens, D]
        self.lengths: list[int] = []  # context tokens in the store per row
        self.pending: list[torch.Tensor | None] = []  # per row: the target's states not stored yet [n, taps * H]
        self.last: list[int] = []  # per row: the token the next block starts with

    def start(self, prompts: Rows, max_tokens: int, target_states: States) -> None:
        kv_heads, head_dim = self.model.kv_shape
        shape = (len(prompts), kv_heads, max_tokens, head_dim)
        dtype = self.model.fc.weight.dtype
        self.store = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in self.model.layers
        ]
        self.lengths = [0] * len(prompts)
        # the target has read every prompt token but the last, which starts the first block
        self.pending = [target_states[row, : len(p) - 1] if len(p) > 1 else None for row, p in enumerate(prompts)]
        self.last = [p[-1] for p in prompts]

    @torch.inference_mode()
    def store_context(self) -> None:
        """Compute the K/V of every row's pending context and write them after the row's stored ones."""
        counts = [0 if p is None else len(p) for p in self.pending]
        if not any(counts):
            return
        padded = right_padded_states(self.pending)
        positions = to_device(self.lengths, self.device)[:, None] + torch.arange(padded.shape[1], device=self.device)
        for (keys, values), (new_keys, new_values) in zip(self.store, self.model.context_kv(padded, positions)):
            for row, (start, count) in enumerate(zip(self.lengths, counts)):  # padding is never written
                keys[row, :, start : start + count] = new_keys[row, :, :count]
                values[row, :, start : start + count] = new_values[row, :, :count]
        self.lengths = [length + count for length, count in zip(self.lengths, counts)]
        self.pending = [None] * len(counts)

    @torch.inference_mode()
    def logits(self) -> torch.Tensor:
        """[B, block_size - 1, V]: the draft's logits for the block after each row's context."""
        self.store_context()
        size = self.model.block_size
        ids = torch.full((len(self.last), size), self.model.mask_token_id, device=self.device)
        ids[:, 0] = to_device(self.last, self.device)
        lengths = to_device(self.lengths, self.device)
        positions = lengths[:, None] + torch.arange(size, device=self.device)
        seen = max(self.lengths)
        visible = torch.arange(seen, device=self.device) < lengths[:, None]  # [B, seen]: each row its own context
        context = [(keys[:, :, :seen], values[:, :, :seen]) for keys, values in self.store]
        return self.model(ids, positions, context, visible)

    def propose(self, num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None) -> Drafts:
        # a block of fixed size is run whatever num_draft_tokens is (its positions attend to each other), and
        # the first num_draft_tokens positions drafted, each from its own q
        return draft_token(self.logits()[:, :num_draft_tokens], params, generator)

    def propose_tree(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        """The static top-k tree over the block's positions (decoding/tree.py's `static_tree`), from
        the chain's one forward: position i's top_k below every node at depth i. No position is
        conditioned on another's draft, so the tree is exact for the reason Medusa's is
        (methods/medusa/drafter.py) and costs a chain's draft step."""
        return static_tree(draft_log_probs(self.logits()[:, : shape.depth], params), shape)

    def commit(self, draft_ids: Rows, num_accepted: list[int], next_tokens: list[int], target_states: States) -> None:
        # verified now: the block's first token and the accepted drafts, with the target's states there
        self.pending = [target_states[row, : accepted + 1] for row, accepted in enumerate(num_accepted)]
        self.last = list(next_tokens)

    def follow(self, tokens: list[list[int]], target_states: torch.Tensor) -> None:
        """The target's states at lookup's block are stored before the next block is drafted."""
        for row, new in enumerate(tokens):
            states, old = target_states[row, : len(new)], self.pending[row]
            self.pending[row] = states if old is None else torch.cat([old, states])
            self.last[row] = new[-1]

    def keep(self, rows: list[int]) -> None:
        index = to_device(rows, self.device)
        self.store = [(keys[index], values[index]) for keys, values in self.store]
        self.lengths = [self.lengths[r] for r in rows]
        self.pending = [self.pending[r] for r in rows]
        self.last = [self.last[r] for r in rows]
