"""The speculative decoding loop, and the same loop without a drafter as the target-only baseline.

One block: the drafter proposes g tokens; the target runs one forward over [last token, *drafts]
(g + 1 positions); the acceptance test keeps a prefix of the drafts and adds one recovered or bonus
token; both caches are rolled back to the accepted prefix. The target's cache always holds the whole
context except its last token, which is the first input of the next block. With a tree
(decoding/tree.py) the drafter proposes a tree of n nodes, the target verifies [last token, *nodes]
with the tree's mask, the test keeps a root path, and both caches keep that path as a chain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from specdec_cli.decoding import tree as trees
from specdec_cli.decoding.cache import CachedModel, right_padded
from specdec_cli.decoding.drafter import NOT_DRAFTED, Drafter, Rows
from specdec_cli.decoding.host import to_device, to_host
from specdec_cli.decoding.metrics import (
    StepRecord,
    acceptance_by_position,
    acceptance_rate,
    accepted_length_histogram,
    conditional_acceptance_by_position,
    draft_time_share,
    mean_accepted_length,
    vllm_counters,
    vllm_mean_acceptance_length,
)
from specdec_cli.decoding.params import BatchSchedule, SamplingParams, TreeShape
from specdec_cli.decoding.timing import Clock, Timeline
from specdec_cli.decoding.verification import ChainRule, chain_rule, tree_rule

# called after each block with the tokens it added and how many of them were accepted draft tokens
OnTokens = Callable[[list[int], int], None]


def combined(batches: list[list[GenerationResult]]) -> GenerationResult:
    """The rows of one or more batches as one result: their tokens and steps, and the batches' wall
    times (the rows of a batch share its prefill and decode at the same time)."""
    total = GenerationResult(
        prompt_ids=[],
        prefill_seconds=sum(rows[0].prefill_seconds for rows in batches),
        decode_seconds=sum(max(r.decode_seconds for r in rows) for rows in batches),
    )
    results = [r for rows in batches for r in rows]
    for r in results:
        total.token_ids += r.token_ids
        total.steps += r.steps
    total.stop_reason = "/".join(sorted({r.stop_reason for r in results}))
    return total


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = "length"  # "eos" or "length"

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: new tokens over decode time (prefill excluded)."""
        return len(self.token_ids) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def stats(self, num_draft_tokens: int) -> dict:
        return {
            "new_tokens": len(self.token_ids),
            "stop_reason": self.stop_reason,
            "tokens_per_second": self.tokens_per_second,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "target_forwards": len(self.steps),
            "mean_accepted_length": mean_accepted_length(self.steps),
            "vllm_mean_acceptance_length": vllm_mean_acceptance_length(self.steps),
            "acceptance_rate": acceptance_rate(self.steps),
            "acceptance_by_position": acceptance_by_position(self.steps, num_draft_tokens),
            "conditional_acceptance_by_position": conditional_acceptance_by_position(self.steps, num_draft_tokens),
            "accepted_length_histogram": accepted_length_histogram(self.steps),
            "vllm_counters": vllm_counters(self.steps),
            "draft_seconds": sum(s.draft_seconds for s in self.steps),
            "verify_seconds": sum(s.verify_seconds for s in self.steps),
            "draft_time_share": draft_time_share(self.steps),
        }


@dataclass
class Block:
    """One block as the device has it once verified: drafts [B, g] (-1 where a row drafted none; a
    tree's: its accepted path's tokens), num_accepted [B], next_token [B], the target's states for the
    drafter (None unless it reads them), the clock mark after drafting. `settle` keeps the accepted
    part in both caches once the loop has the outcome on the host."""

    drafts: torch.Tensor
    num_accepted: torch.Tensor
    next_token: torch.Tensor
    states: torch.Tensor | None
    drafted_at: object

    def outcome(self) -> tuple[list[int], list[int], Rows]:
        """The block's one host sync: per row, the accepted count, the next token and the draft ids."""
        batch, width = self.drafts.shape
        host = to_host(torch.cat([self.num_accepted, self.next_token, self.drafts.flatten()]))
        drafts = host[2 * batch :]
        return host[:batch], host[batch : 2 * batch], [drafts[i * width : (i + 1) * width] for i in range(batch)]

    def settle(
        self, target: CachedModel, drafter: Drafter | None, draft_ids: Rows, accepted: list[int], tokens: list[int]
    ):
        raise NotImplementedError


@dataclass
class ChainBlock(Block):
    proposed: bool = True  # whether the drafter proposed (it may still have drafted nothing)

    def settle(self, target, drafter, draft_ids, accepted, tokens):
        target.rollback([self.drafts.shape[1] - a for a in accepted])
        if drafter is not None and self.proposed:
            drafter.commit(draft_ids, accepted, tokens, self.states)
        elif drafter is not None:  # the target alone decoded this block (a schedule's 0, the last token)
            drafter.follow([[token] for token in tokens], self.states)


@dataclass
class TreeBlock(Block):
    root: list[int] = field(default_factory=list)  # per row, the slot of the tree's root
    path: torch.Tensor | None = None  # the accepted path's tree slots [B, depth + 1]

    def settle(self, target, drafter, draft_ids, accepted, tokens):
        """Both caches keep the accepted path as a chain's block would have left them."""
        target.compact(self.root, self.path, [a + 1 for a in accepted])
        states = self.states
        if states is not None:  # the target's states along the path
            states = states.gather(1, self.path[..., None].expand(-1, -1, states.shape[-1]))
        drafter.commit_tree(self.path, draft_ids, accepted, tokens, states)


class SpeculativeDecoder:
    """Generates from `target`, drafting with `drafter` (None: the target alone, one token per forward)."""

    def __init__(
        self,
        target: CachedModel,
        drafter: Drafter | None,
        params: SamplingParams,
        num_draft_tokens: int,
        eos_token_ids: set[int],
        tree: TreeShape | None = None,
        rule: ChainRule | None = None,
        schedule: BatchSchedule | None = None,
    ):
        """`tree`: draft trees of this shape instead of chains of num_draft_tokens. `rule`: how chains
        are verified (default: greedy's, or token by token when sampling); trees have their own.
        `schedule`: a chain's draft tokens by the batch's size, at most num_draft_tokens."""
        self.target = target
        self.drafter = drafter
        self.params = params
        self.tree = tree if drafter is not None else None
        # the most tokens a block can accept: a chain's length, a tree's depth
        self.num_draft_tokens = 0 if drafter is None else tree.depth if tree else num_draft_tokens
        self.width = tree.width if self.tree else self.num_draft_tokens  # slots a block writes past the context
        self.eos_token_ids = eos_token_ids
        self.schedule = schedule if drafter is not None and tree is None else None
        self.chain_rule = rule or chain_rule(params)
        self.tree_rule = tree_rule(params)
        self.clock = Clock(target.device)
        # a drafter that learns from the verifications' logits (token recycling's table) reads them here
        self.observe = drafter.observe if drafter is not None and drafter.observes else None

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        seed: int,
        ignore_eos: bool = False,
        on_tokens: OnTokens | None = None,
    ) -> GenerationResult:
        return self.generate_batch([prompt_ids], max_new_tokens, seed, ignore_eos, on_tokens)[0]

    def generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        seed: int,
        ignore_eos: bool = False,
        on_tokens: OnTokens | None = None,
    ) -> list[GenerationResult]:
        """Decode the prompts together, one row each. Every row accepts its own number of drafts per
        block and sees only its own context; a row that stops (EOS, limit) leaves the batch, so it
        costs no more target or draft work. `on_tokens` streams a single prompt's tokens."""
        if on_tokens is not None and len(prompts) > 1:
            raise ValueError("on_tokens streams one prompt's tokens: decode a batch without it")
        device = self.target.device
        generator = torch.Generator(device=device).manual_seed(seed)
        results = [GenerationResult(prompt_ids=list(p)) for p in prompts]
        max_tokens = max(map(len, prompts)) + max_new_tokens + self.width + 1
        # only a drafter that reads the target's hidden states makes the target return them
        wants_states = self.drafter is not None and self.drafter.reads_target_states

        timeline = Timeline(self.clock, len(prompts))
        self._prefill(prompts, max_tokens, wants_states)
        timeline.prefilled()

        active = list(range(len(prompts)))  # rows still decoding, in the caches' order
        last_token = to_device([p[-1:] for p in prompts], device)  # [B, 1]
        while active:
            remaining = max(max_new_tokens - len(results[row].token_ids) for row in active)
            num_draft_tokens = self._block_length(len(active), remaining)
            block_start = self.clock.mark()
            as_tree = self.tree is not None and num_draft_tokens
            block = (self._tree_block if as_tree else self._chain_block)(
                last_token, num_draft_tokens, generator, wants_states
            )
            accepted, tokens, draft_ids = block.outcome()
            batch = len(active)
            timeline.block(block_start, block.drafted_at, batch)
            block.settle(self.target, self.drafter, draft_ids, accepted, tokens)
            staying = []
            for i, row in enumerate(active):
                emitted, stopped = self._emit(
                    results[row], draft_ids[i][: accepted[i]] + [tokens[i]], ignore_eos, max_new_tokens
                )
                timeline.step(row, sum(t >= 0 for t in draft_ids[i]), accepted[i], emitted, stopped)
                if not stopped:
                    staying.append(i)
            if on_tokens is not None:  # showing tokens is not decoding: keep it off the clock
                with timeline.off_clock():
                    on_tokens(results[0].token_ids[-emitted:], min(accepted[0], emitted))  # the one row's block
            active = [active[i] for i in staying]
            last_token = self._keep_rows(staying, block.next_token)
        for result, (prefill, decode, steps) in zip(results, timeline.rows()):
            result.prefill_seconds, result.decode_seconds, result.steps = prefill, decode, steps
        return results

    def _prefill(self, prompts: list[list[int]], max_tokens: int, wants_states: bool) -> None:
        """Fresh caches of `max_tokens` per row, holding every prompt token but the last (the first
        block's input); the drafter starts from the same prompts."""
        self.target.reset(max_tokens, len(prompts))
        prompt_states = None
        if max(map(len, prompts)) > 1:
            ids, counts = right_padded([p[:-1] for p in prompts], self.target.device)
            prompt_states = self.target.forward(ids, counts=counts, logits="none", hidden=wants_states).hidden
        if self.drafter is not None:
            self.drafter.start(prompts, max_tokens, prompt_states)

    def _block_length(self, rows: int, remaining: int) -> int:
        """Draft tokens for a block of `rows` rows: the schedule's for that many, and never past the
        token limit (`remaining` for the row furthest from it; the block's own token takes one)."""
        scheduled = self.num_draft_tokens if self.schedule is None else self.schedule.tokens(rows)
        return min(self.num_draft_tokens, scheduled, remaining - 1)

    def _keep_rows(self, staying: list[int], next_token: torch.Tensor) -> torch.Tensor:
        """Rows that stopped leave both caches; the staying rows' next tokens [B', 1]."""
        if len(staying) == next_token.shape[0]:
            return next_token[:, None]
        if staying:
            self.target.keep(staying)
            if self.drafter is not None:
                self.drafter.keep(staying)
        return next_token[to_device(staying, self.target.device)][:, None]

    def _chain_block(
        self, last_token: torch.Tensor, num_draft_tokens: int, generator: torch.Generator, wants_states: bool
    ) -> ChainBlock:
        """Draft a chain of `num_draft_tokens` (none: the target alone), verify it in one target forward."""
        drafts, draft_probs = (
            self.drafter.propose(num_draft_tokens, self.params, generator)
            if num_draft_tokens
            else (last_token[:, :0], None)
        )
        draft_end = self.clock.mark()
        verified = self.target.forward(torch.cat([last_token, drafts.clamp_min(0)], dim=1), hidden=wants_states)
        if self.observe is not None:  # after the block's drafts are fixed: it shapes only later blocks
            self.observe(torch.cat([last_token, drafts], dim=1), verified.logits)
        num_accepted, next_token = self.chain_rule.verify(drafts, draft_probs, verified.logits, self.params, generator)
        states = verified.hidden if wants_states else None
        return ChainBlock(drafts, num_accepted, next_token, states, draft_end, proposed=num_draft_tokens > 0)

    def _tree_block(
        self, last_token: torch.Tensor, depth: int, generator: torch.Generator, wants_states: bool
    ) -> TreeBlock:
        """Draft a tree of at most `depth` (near the token limit a shallower one), verify it in one
        target forward with its root after each row's context. The block's drafts are the accepted
        path's tokens [B, depth] (valid up to num_accepted; -1 past a row's deepest node)."""
        start = list(self.target.lengths)  # the slot of each row's root
        tree = self.drafter.propose_tree(replace(self.tree, depth=depth), self.params, generator)
        draft_end = self.clock.mark()
        region = trees.target_region(tree, start)
        verified = self.target.forward(torch.cat([last_token, tree.tokens], dim=1), region=region, hidden=wants_states)
        if self.observe is not None:
            self.observe(torch.cat([last_token, tree.tokens.masked_fill(tree.parents < 0, -1)], dim=1), verified.logits)
        num_accepted, next_token, path = self.tree_rule.verify(tree, verified.logits, self.params, generator)
        path_tokens = tree.tokens.gather(1, (path[:, 1:] - 1).clamp_min(0))
        # past the row's deepest node it drafted nothing (a row lookup found less for, placeholders)
        drafted = torch.arange(path_tokens.shape[1], device=path.device) < region.depths.max(dim=1, keepdim=True).values
        states = verified.hidden if wants_states else None
        drafts = path_tokens.masked_fill(~drafted, NOT_DRAFTED)
        return TreeBlock(drafts, num_accepted, next_token, states, draft_end, root=start, path=path)

    def _emit(
        self, result: GenerationResult, new_tokens: list[int], ignore_eos: bool, max_new_tokens: int
    ) -> tuple[int, bool]:
        """Append the block's tokens up to an EOS (included) or the limit; returns (count, row stopped)."""
        new_tokens = new_tokens[: max_new_tokens - len(result.token_ids)]
        if not ignore_eos:
            for i, token in enumerate(new_tokens):
                if token in self.eos_token_ids:
                    result.token_ids += new_tokens[: i + 1]
                    result.stop_reason = "eos"
                    return i + 1, True
        result.token_ids += new_tokens
        return len(new_tokens), len(result.token_ids) >= max_new_tokens
