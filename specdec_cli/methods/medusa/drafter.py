"""Medusa heads as a drafter: one pass of the heads over the target's last verified state drafts the
whole block, head i the block's position i (the token after the target's own next token is head
0's). A block has at most num_heads drafts; each position is drawn from its own head's q. What it
holds, per row: the target's state at the last verified token, nothing else (no cache to roll back).
A tree is the static top-k tree over the heads (`propose_tree`)."""

from __future__ import annotations

import torch

from specdec_cli.decoding.drafter import NOT_DRAFTED, Drafter, Drafts, Rows, States
from specdec_cli.decoding.host import to_device
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.decoding.tree import DraftTree, draft_log_probs, static_tree
from specdec_cli.methods.model import draft_token


class MedusaDrafter(Drafter):
    reads_target_states = True  # the target's last state (after its final norm), `state_layers` (-1,)

    def __init__(self, heads: torch.nn.Module, vocab_size: int):  # MedusaHeads (methods/medusa/checkpoint.py)
        self.heads = heads
        self.vocab_size = vocab_size
        self.device = next(heads.parameters()).device
        self.states: torch.Tensor | None = None  # [B, H] each row's state at its last verified token
        self.has_state: list[bool] = []  # a one-token prompt has none yet: the row drafts nothing

    def start(self, prompts: Rows, max_tokens: int, target_states: States) -> None:
        # the state at the prompt's next-to-last token: the target's head there says the last
        # prompt token, so head 0 says the token after it, the block's first draft
        self.has_state = [len(p) > 1 for p in prompts]
        if target_states is None:  # one-token prompts only
            self.states = torch.zeros(len(prompts), self.heads.heads[0].in_features, device=self.device)
            return
        last = to_device([max(len(p) - 2, 0) for p in prompts], self.device)
        self.states = target_states[torch.arange(len(prompts), device=self.device), last]

    def logits(self, num_heads: int) -> torch.Tensor:
        """[B, num_heads, V]: the first heads' logits from each row's state."""
        return self.heads(self.states.to(self.heads.heads[0].weight.dtype), num_heads)

    def propose(self, num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None) -> Drafts:
        batch = len(self.has_state)
        if not any(self.has_state):
            empty = torch.zeros(batch, 0, dtype=torch.long, device=self.device)
            return empty, None if params.greedy else torch.zeros(batch, 0, self.vocab_size, device=self.device)
        # every position from its own head's q, drawn and tested as it is: no position reads another
        tokens, q = draft_token(self.logits(min(num_draft_tokens, self.heads.num_heads)), params, generator)
        stateless = to_device([not s for s in self.has_state], self.device, torch.bool)
        tokens = tokens.masked_fill(stateless[:, None], NOT_DRAFTED)
        return tokens, None if q is None else q.masked_fill(stateless[:, None, None], 0.0)

    def propose_tree(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        """The static top-k tree over the heads (decoding/tree.py's `static_tree`): below every node
        at depth i, head i's top_k tokens; the max_nodes most probable nodes by the product of their
        heads' probabilities (warped as the target's when sampling). At most num_heads deep.

        A head's distribution is the same below every node: it is not conditioned on the path above,
        as a draft model's would be. The test stays exact: each node's children are a deterministic
        top-k, fixed before the target's draws, and `try_children`'s rule emits the target's p after
        the node's path for any distinct children so fixed, without reading q. The heads' q decides
        which children are tried, so only how often one is accepted."""
        tree = static_tree(draft_log_probs(self.logits(min(shape.depth, self.heads.num_heads)), params), shape)
        return tree.without(to_device([not s for s in self.has_state], self.device, torch.bool))

    def commit(self, draft_ids: Rows, num_accepted: list[int], next_tokens: list[int], target_states: States) -> None:
        # the state at the last accepted input: the target drew next_token there
        accepted = to_device(num_accepted, self.device)
        self.states = target_states[torch.arange(len(num_accepted), device=self.device), accepted]
        self.has_state = [True] * len(num_accepted)

    def follow(self, tokens: list[list[int]], target_states: torch.Tensor) -> None:
        """Keeps the target's state where it drew the last token of lookup's block."""
        last = to_device([len(new) - 1 for new in tokens], self.device)
        self.states = target_states[torch.arange(len(tokens), device=self.device), last]
        self.has_state = [True] * len(tokens)

    def keep(self, rows: list[int]) -> None:
        self.states = self.states[to_device(rows, self.device)]
        self.has_state = [self.has_state[r] for r in rows]
