"""A feature draft (methods/feature/draft.py, EAGLE-style): beside each token it reads a hidden state,
the target's for context the target has verified and its own for the tokens it drafts. Input j is
(state at token j, token j + 1), so it runs one token behind a plain draft."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdec_cli.decoding.cache import CachedModel, Output, right_padded, right_padded_states
from specdec_cli.decoding.drafter import NOT_DRAFTED, Drafter, Drafts, Rows, States
from specdec_cli.decoding.host import to_device
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.decoding.tree import DraftTree, TreeGrowth, draft_log_probs
from specdec_cli.methods.feature.parts import feature_inputs, head_vocabulary, read_target
from specdec_cli.methods.model import confident_frontier, draft_token, stack_drafts, stops_unsure


class FeatureDrafter(Drafter):
    """What it holds, per row, between blocks: its cache has an entry for every context token but
    the first and `pending` (input j is the target's state at token j beside token j + 1); `pending`
    has the tokens whose states the target gave it but it has not read. Its drafts were computed from
    its own states, so `commit` rolls them all back and reads the accepted ones again beside the
    target's states; so does `commit_tree` with a tree's nodes (each read beside its parent's state).
    A draft whose head scores a subset of the vocabulary is run over those columns alone: its tokens
    are mapped to the target's ids, and q is spread over all `vocab_size` ids only for verification."""

    reads_target_states = stops_when_unsure = True

    def __init__(
        self, draft: PreTrainedModel, vocab_size: int, confidence_threshold: float = 0.0, graphs: bool = False
    ):
        self.vocabulary = head_vocabulary(draft)  # the token id of each column of its logits (None: all, in order)
        width = vocab_size if self.vocabulary is None else len(self.vocabulary)
        self.model = CachedModel(draft, width, graphs=graphs)
        self.vocab_size = vocab_size
        self.confidence_threshold = confidence_threshold  # see config.Speculation
        self.pending: list[list[int]] = []  # per row: context tokens not yet in the draft's cache ...
        self.pending_states: list[torch.Tensor] = []  # ... and the states beside them [n, H]
        self.root: list[int] = []  # per row, the slot of the current tree's root (its last context input)

    def start(self, prompts: Rows, max_tokens: int, target_states: States) -> None:
        self.model.reset(max_tokens, len(prompts))
        self.pending = [p[1:] for p in prompts]
        self.pending_states = [
            target_states[row, : len(p) - 1] if len(p) > 1 else None for row, p in enumerate(prompts)
        ]
        if max(map(len, self.pending)) > 1:  # read the prompts now (prefill); their last inputs draft token 1
            self._forward(
                [p[:-1] for p in self.pending], [s[:-1] if s is not None else None for s in self.pending_states], "none"
            )
            self.pending = [p[-1:] for p in self.pending]
            self.pending_states = [s[-1:] if s is not None else None for s in self.pending_states]

    def _forward(self, rows: list[list[int]], states: list[torch.Tensor | None], logits: str) -> Output:
        """Feed each row its tokens beside the target's states (rows of different lengths are padded)."""
        ids, counts = right_padded(rows, self.model.device)  # a row's tokens and states are as many
        inputs = feature_inputs(self.model.model, ids, read_target(self.model.model, right_padded_states(states)))
        return self.model.forward(inputs_embeds=inputs, counts=counts, logits=logits, hidden=True)

    def propose(self, num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None) -> Drafts:
        # a row after a one-token prompt has no state to read yet: it drafts nothing this block
        rows_without_state = [not p for p in self.pending]  # decided on the host: no device sync
        tokens, probs = [], []
        if not all(rows_without_state):
            out = self._forward(self.pending, self.pending_states, "last")
            last = to_device([max(len(p) - 1, 0) for p in self.pending], self.model.device)  # each row's last input
            logits, states = out.logits[:, -1], out.hidden[torch.arange(len(last), device=last.device), last][:, None]
            for step in range(num_draft_tokens):
                if step:
                    out = self.model.forward(
                        inputs_embeds=feature_inputs(self.model.model, tokens[-1][:, None], states),
                        logits="last",
                        hidden=True,
                    )
                    logits, states = out.logits[:, -1], out.hidden[:, -1:]
                token, q = draft_token(logits, params, generator, self.vocabulary)
                if stops_unsure(self.model, step, logits, q, self.confidence_threshold):
                    break
                tokens.append(token)
                probs.append(q)
        drafts, q = stack_drafts(tokens, probs, len(self.pending), self.vocab_size, self.model.device, self.vocabulary)
        stateless = to_device(rows_without_state, self.model.device, torch.bool)
        drafts = drafts.masked_fill(stateless[:, None], NOT_DRAFTED)
        return drafts, None if q is None else q.masked_fill(stateless[:, None, None], 0.0)

    def commit(self, draft_ids: Rows, num_accepted: list[int], next_tokens: list[int], target_states: States) -> None:
        # the drafted positions were computed from the draft's own states: redo them (and the
        # accepted ones) from the target's
        self.model.rollback(max(len(draft_ids[0]) - 1, 0))  # (a block of no drafts fed none)
        self.read_next(draft_ids, num_accepted, next_tokens, target_states)

    def read_next(self, draft_ids: Rows, num_accepted: list[int], next_tokens: list[int], target_states: States):
        """The block's accepted drafts and next token are read next time, beside the target's states."""
        self.pending = [ids[:accepted] + [token] for ids, accepted, token in zip(draft_ids, num_accepted, next_tokens)]
        self.pending_states = [target_states[row, : accepted + 1] for row, accepted in enumerate(num_accepted)]

    def propose_tree(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        """A dynamic tree (decoding/tree.py's `TreeGrowth`: EAGLE-2's when greedy, children drawn from
        q when sampling): the root's children from the context's last input, then one forward per
        depth over the frontier, each node beside its parent's state, with the tree's mask after the
        root; it stops growing at a frontier the draft is unsure of (`confident_frontier`). A row
        without a state yet drafts placeholders."""
        rows_without_state = [not p for p in self.pending]  # decided on the host: no device sync
        if all(rows_without_state):
            self.root = [length - 1 for length in self.model.lengths]
            none = torch.zeros(len(self.pending), 1, dtype=torch.long, device=self.model.device)
            return DraftTree(none, none - 1, shape.depth)
        out = self._forward(self.pending, self.pending_states, "last")
        self.root = [length - 1 for length in self.model.lengths]
        last = to_device([max(len(p) - 1, 0) for p in self.pending], self.model.device)  # each row's last input
        states = out.hidden[torch.arange(len(last), device=last.device), last][:, None]  # [B, 1, H] at the root
        growth = TreeGrowth.for_drafting(
            shape, params, len(self.pending), self.model.device, generator, self.vocabulary
        )
        growth.grow(draft_log_probs(out.logits, params))
        for _ in range(growth.shape.depth - 1):
            # each frontier node beside its parent's state; the fed slots' states, in order
            inputs = feature_inputs(
                self.model.model,
                growth.frontier_tokens,
                states.gather(1, growth.frontier_parents[..., None].expand(-1, -1, states.shape[-1])),
            )
            out = self.model.forward(inputs_embeds=inputs, region=growth.region(self.root), hidden=True)
            states = torch.cat([states, out.hidden], dim=1)
            log_probs = draft_log_probs(out.logits, params)
            if not confident_frontier(log_probs, self.confidence_threshold):
                break
            growth.grow(log_probs)
        return growth.select()[0].without(to_device(rows_without_state, self.model.device, torch.bool))

    def commit_tree(
        self,
        path: torch.Tensor,
        draft_ids: Rows,
        num_accepted: list[int],
        next_tokens: list[int],
        target_states: States,
    ) -> None:
        """As `commit`: the tree's nodes, fed beside the draft's own states, go; the accepted path
        is read next time beside the target's states (target_states [B, depth + 1, H] along the path)."""
        self.model.rollback([length - root - 1 for length, root in zip(self.model.lengths, self.root)])
        self.read_next(draft_ids, num_accepted, next_tokens, target_states)

    def follow(self, tokens: list[list[int]], target_states: torch.Tensor) -> None:
        """Lookup's block and the target's states there are read with the next block's first step."""
        for row, new in enumerate(tokens):
            self.pending[row] += new
            state = target_states[row, : len(new)]
            old = self.pending_states[row]
            self.pending_states[row] = state if old is None else torch.cat([old, state])

    def keep(self, rows: list[int]) -> None:
        self.model.keep(rows)
        self.pending = [self.pending[r] for r in rows]
        self.pending_states = [self.pending_states[r] for r in rows]
