"""The speculative decoding loop, and the same loop without a drafter as the target-only baseline.

One block: the drafter proposes g tokens; the target runs one forward over [last token, *drafts]
(g + 1 positions); the acceptance test keeps a prefix of the drafts and adds one recovered or bonus
token; both caches are rolled back to the accepted prefix. The target's cache always holds the whole
context except its last token, which is the first input of the next block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.metrics import (StepRecord, acceptance_by_position, acceptance_rate, draft_time_share,
                                          mean_accepted_length, vllm_mean_acceptance_length)
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.decoding.sampling import verify_greedy, verify_sampled, warp
from specdec_cli.drafters.base import Drafter


# called after each block with the tokens it added and how many of them were accepted draft tokens
OnTokens = Callable[[list[int], int], None]


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

    def stats(self, gamma: int) -> dict:
        return {
            "new_tokens": len(self.token_ids),
            "stop_reason": self.stop_reason,
            "tokens_per_second": self.tokens_per_second,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "target_forwards": len(self.steps),
            "mean_accepted_length": mean_accepted_length(self.steps),
            "vllm_mean_acceptance_length": vllm_mean_acceptance_length(self.steps),
            "draft_tokens": sum(s.drafted for s in self.steps),
            "accepted_draft_tokens": sum(s.accepted for s in self.steps),
            "acceptance_rate": acceptance_rate(self.steps),
            "acceptance_by_position": acceptance_by_position(self.steps, gamma),
            "draft_seconds": sum(s.draft_seconds for s in self.steps),
            "verify_seconds": sum(s.verify_seconds for s in self.steps),
            "draft_time_share": draft_time_share(self.steps),
        }


class BlockMarks(NamedTuple):
    """Clock marks of one block, read only after the loop (on CUDA they are events)."""

    start: object
    drafted_at: object
    verified_at: object
    drafted: int
    accepted: int
    emitted: int


class Clock:
    """Wall-clock marks that are honest on CUDA: events recorded in stream order, read at the end,
    so timing a phase adds no host sync to the loop."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000


class SpeculativeDecoder:
    """Generates from `target`, drafting with `drafter` (None: the target alone, one token per forward)."""

    def __init__(self, target: CachedModel, drafter: Drafter | None, params: SamplingParams,
                 num_draft_tokens: int, eos_token_ids: set[int]):
        self.target = target
        self.drafter = drafter
        self.params = params
        self.gamma = num_draft_tokens if drafter is not None else 0
        self.eos_token_ids = eos_token_ids
        self.clock = Clock(target.device)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int,
                 ignore_eos: bool = False, on_tokens: OnTokens | None = None) -> GenerationResult:
        device = self.target.device
        generator = torch.Generator(device=device).manual_seed(seed)
        result = GenerationResult(prompt_ids=list(prompt_ids))
        max_tokens = len(prompt_ids) + max_new_tokens + self.gamma + 1
        clock = self.clock
        # only a drafter that reads the target's hidden states makes the target return them
        wants_states = self.drafter is not None and self.drafter.reads_target_states

        start = clock.mark()
        self.target.reset(max_tokens)
        prompt_states = None
        if len(prompt_ids) > 1:
            prompt_states = self.target.forward(torch.tensor([prompt_ids[:-1]], device=device),
                                                last_only=True, hidden=wants_states).hidden
        if self.drafter is not None:
            self.drafter.start(prompt_ids, max_tokens, prompt_states)
        decode_start = clock.mark()
        result.prefill_seconds = clock.seconds(start, decode_start)

        last_token = torch.tensor([prompt_ids[-1:]], device=device)  # [1, 1]
        marks = []
        display_seconds = 0.0
        while len(result.token_ids) < max_new_tokens:
            # never draft past the limit: the block's own token needs one of the remaining slots
            gamma = min(self.gamma, max_new_tokens - len(result.token_ids) - 1)
            block_start = clock.mark()
            drafts, draft_probs = (self.drafter.propose(gamma, self.params, generator) if gamma
                                   else (last_token[:, :0], None))
            drafted = drafts.shape[1]
            draft_end = clock.mark()
            verified = self.target.forward(torch.cat([last_token, drafts], dim=1), hidden=wants_states)
            logits = verified.logits  # [1, g + 1, V]
            if self.params.greedy:
                num_accepted, next_token = verify_greedy(drafts, logits)
            else:
                target_probs = warp(logits, self.params)
                if draft_probs is None:  # target-only: nothing to test, sample from p
                    draft_probs = target_probs[:, :0]
                num_accepted, next_token = verify_sampled(drafts, draft_probs, target_probs, generator)
            # the one host sync of the block: accepted count, next token and the draft ids together
            accepted, token, *draft_ids = torch.cat([num_accepted, next_token, drafts[0]]).tolist()
            verify_end = clock.mark()

            self.target.rollback(drafted - accepted)
            if self.drafter is not None and gamma:
                self.drafter.commit(draft_ids, accepted, token,
                                    verified.hidden[:, :accepted + 1] if wants_states else None)
            new_tokens = draft_ids[:accepted] + [token]
            last_token = next_token[:, None]
            emitted, hit_eos = self._emit(result, new_tokens, ignore_eos)
            marks.append(BlockMarks(block_start, draft_end, verify_end, drafted, accepted, emitted))
            if on_tokens is not None:  # showing tokens is not decoding: keep it off the clock
                shown = time.perf_counter()
                on_tokens(result.token_ids[-emitted:], min(accepted, emitted))
                display_seconds += time.perf_counter() - shown
            if hit_eos:
                result.stop_reason = "eos"
                break

        end = clock.mark()
        result.decode_seconds = clock.seconds(decode_start, end) - display_seconds
        result.steps = [StepRecord(drafted=m.drafted, accepted=m.accepted, emitted=m.emitted,
                                   draft_seconds=clock.seconds(m.start, m.drafted_at),
                                   verify_seconds=clock.seconds(m.drafted_at, m.verified_at)) for m in marks]
        return result

    def _emit(self, result: GenerationResult, new_tokens: list[int], ignore_eos: bool) -> tuple[int, bool]:
        """Append the block's tokens up to and including an EOS; returns (count, EOS seen)."""
        if not ignore_eos:
            for i, token in enumerate(new_tokens):
                if token in self.eos_token_ids:
                    result.token_ids += new_tokens[: i + 1]
                    return i + 1, True
        result.token_ids += new_tokens
        return len(new_tokens), False
