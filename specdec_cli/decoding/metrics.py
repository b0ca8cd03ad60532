"""Per-step records of a speculative decode loop and the numbers a benchmark reports.

Glossary:
  drafted   -- tokens the draft model proposed in one block (num_draft_tokens, or fewer near the end).
  accepted  -- the longest prefix of the drafted tokens that the verifier kept.
  recovered -- when a draft token is rejected, the verifier samples a replacement from the
               residual distribution max(0, p_target - p_draft), normalised; that token is
               emitted in place of the rejected one (also called the residual token).
  bonus     -- when every drafted token is accepted, the target's forward already gives the
               distribution for the next position, so one more token is sampled for free.
  So a block normally emits accepted + 1 tokens (the +1 is the recovered or bonus token), and
  the *mean accepted length* counts that +1: it is tokens emitted per target forward, and a
  target-only decoder scores exactly 1.0.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """One target forward (one speculative block) of the decode loop."""

    drafted: int  # draft tokens proposed in this block (a tree: its depth); 0 for target-only decoding
    accepted: int  # drafted tokens the verifier accepted, before EOS/length truncation
    emitted: int  # tokens appended to the output: accepted + 1, fewer if EOS/max-new-tokens cut it
    draft_seconds: float
    verify_seconds: float  # target forward + acceptance test


def mean_accepted_length(steps: list[StepRecord]) -> float | None:
    """Tokens emitted per target forward: sum(emitted) / len(steps).

    This includes the recovered or bonus token of each block, so it is >= 1 for any block
    that was not truncated, and target-only decoding gives 1.0. None when there are no steps.
    """
    if not steps:
        return None
    return sum(s.emitted for s in steps) / len(steps)


def vllm_mean_acceptance_length(steps: list[StepRecord]) -> float | None:
    """vLLM's and SGLang's "mean acceptance length": 1 + accepted draft tokens / blocks that drafted.

    It counts what the verifier accepted, not what was emitted, so blocks cut short by EOS or the
    token limit do not lower it, and blocks that drafted nothing (an n-gram miss) are left out;
    mean_accepted_length counts both. None when nothing was drafted.
    """
    drafting = [s for s in steps if s.drafted]
    if not drafting:
        return None
    return 1 + sum(s.accepted for s in drafting) / len(drafting)


def acceptance_rate(steps: list[StepRecord]) -> float | None:
    """Fraction of drafted tokens accepted: sum(accepted) / sum(drafted).

    None when nothing was drafted (target-only runs), so that reports print "n/a" and JSON
    gets null rather than NaN, which is not valid JSON.
    """
    drafted = sum(s.drafted for s in steps)
    if drafted == 0:
        return None
    return sum(s.accepted for s in steps) / drafted


def acceptance_by_position(steps: list[StepRecord], num_draft_tokens: int) -> list[float | None]:
    """Acceptance rate of draft positions 1..num_draft_tokens, and beyond where a step drafted more (prompt
    lookup ahead of a draft model may draft longer blocks than the model's num_draft_tokens).

    Position i counts as accepted in a step when accepted >= i, among the steps that drafted
    at least i tokens; acceptance is a prefix, so this is P(position i kept | it was drafted).
    An entry is None when no step drafted that far.
    """
    rates: list[float | None] = []
    for i in range(1, max([num_draft_tokens] + [s.drafted for s in steps]) + 1):
        reached = [s for s in steps if s.drafted >= i]
        rates.append(sum(s.accepted >= i for s in reached) / len(reached) if reached else None)
    return rates


def conditional_acceptance_by_position(steps: list[StepRecord], num_draft_tokens: int) -> list[float | None]:
    """Acceptance of draft position i given that positions 1..i-1 were kept (SPEED-Bench's per-position
    figure): among the steps that drafted at least i tokens and accepted at least i - 1, the share
    that accepted i. Position 1 equals acceptance_by_position's; later ones are its ratios, so a weak
    deep position shows here even when few blocks reach it. None where no step reached a position."""
    rates: list[float | None] = []
    for i in range(1, max([num_draft_tokens] + [s.drafted for s in steps]) + 1):
        reached = [s for s in steps if s.drafted >= i and s.accepted >= i - 1]
        rates.append(sum(s.accepted >= i for s in reached) / len(reached) if reached else None)
    return rates


def accepted_length_histogram(steps: list[StepRecord]) -> list[int]:
    """How many drafting blocks accepted 0, 1, 2, ... draft tokens (blocks that drafted nothing left out)."""
    drafting = [s.accepted for s in steps if s.drafted]
    return [drafting.count(k) for k in range(max(drafting) + 1)] if drafting else []


def request_figures(steps: list[StepRecord]) -> dict:
    """One request's own figures, as vLLM's per-request metrics report them: its mean accepted length
    both ways, acceptance rate, histogram of accepted drafts, and target forwards."""
    return {
        "mean_accepted_length": mean_accepted_length(steps),
        "vllm_mean_acceptance_length": vllm_mean_acceptance_length(steps),
        "acceptance_rate": acceptance_rate(steps),
        "accepted_length_histogram": accepted_length_histogram(steps),
        "forwards": len(steps),
    }


def per_request_mean(requests: list[list[StepRecord]], figure) -> float | None:
    """The mean over requests of each request's `figure` (SpecForge's way), beside the figure of all
    their steps pooled (vLLM's and SGLang's): requests where it is undefined are left out."""
    values = [v for v in (figure(steps) for steps in requests) if v is not None]
    return sum(values) / len(values) if values else None


def vllm_counters(steps: list[StepRecord]) -> dict[str, int | list[int]]:
    """The acceptance counters under the names vLLM's speculative-decoding metrics give them: drafting
    blocks, draft tokens, accepted draft tokens, and per position how many blocks kept it. vLLM's
    acceptance rate at position i is num_accepted_tokens_per_pos[i] / num_drafts."""
    drafting = [s for s in steps if s.drafted]
    depth = max((s.drafted for s in drafting), default=0)
    return {
        "num_drafts": len(drafting),
        "num_draft_tokens": sum(s.drafted for s in drafting),
        "num_accepted_tokens": sum(s.accepted for s in drafting),
        "num_accepted_tokens_per_pos": [sum(s.accepted > i for s in drafting) for i in range(depth)],
    }


def draft_time_share(steps: list[StepRecord]) -> float | None:
    """Fraction of decode-loop time spent drafting; None when no time was recorded."""
    draft = sum(s.draft_seconds for s in steps)
    total = draft + sum(s.verify_seconds for s in steps)
    if total <= 0:
        return None
    return draft / total


def cost_ratio(draft_seconds_per_token: float, target_seconds_per_forward: float) -> float:
    """c in Leviathan et al. 2023: time of one draft step over time of one target forward."""
    if target_seconds_per_forward <= 0:
        raise ValueError("target_seconds_per_forward must be positive")
    return draft_seconds_per_token / target_seconds_per_forward


def predicted_speedup(alpha: float, num_draft_tokens: int, c: float) -> float:
    """Expected wall-time speedup over target-only decoding (Leviathan et al. 2023, Thm 3.8).

        (1 - alpha^(g+1)) / ((1 - alpha) * (g*c + 1))

    alpha is the per-token acceptance rate, g = num_draft_tokens (the paper's gamma), c the cost ratio.
    The numerator over (1 - alpha) is summed as the geometric series 1 + alpha + ... + alpha^g,
    which equals the formula for alpha < 1 and gives the alpha -> 1 limit (g+1) exactly,
    without dividing by a tiny (1 - alpha).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if num_draft_tokens < 0 or c < 0:
        raise ValueError("num_draft_tokens and c must be non-negative")
    expected_tokens = sum(alpha**k for k in range(num_draft_tokens + 1))
    return expected_tokens / (num_draft_tokens * c + 1)


def block_costs(spec_steps: list[StepRecord], base_steps: list[StepRecord]) -> tuple[float, float] | None:
    """A speculative block's measured cost in target-only forwards: (its verification, as wide as its
    chain or tree, over one 1-token forward; its drafting over one 1-token forward). None without steps."""
    if not spec_steps or not base_steps:
        return None
    forward = statistics.fmean(s.verify_seconds for s in base_steps)
    if forward <= 0:
        return None
    verify = statistics.fmean(s.verify_seconds for s in spec_steps)
    draft = statistics.fmean(s.draft_seconds for s in spec_steps)
    return verify / forward, draft / forward


def predicted_speedup_from_parts(spec_steps: list[StepRecord], costs: tuple[float, float]) -> float:
    """Leviathan's prediction generalised to trees and to verification that is not free: expected
    tokens per target forward from the measured acceptance by depth, 1 + sum over depths d of
    P(a block accepts >= d tokens) (= 1 + mean accepted), over a block's measured cost `costs`
    (block_costs) in target-only forwards. What it leaves out (the loop's overhead, blocks cut
    short by EOS or the token limit) is the gap to the measured speedup."""
    verify, draft = costs
    return (1 + statistics.fmean(s.accepted for s in spec_steps)) / (verify + draft)


def speedup(baseline_tps: list[float], speculative_tps: list[float]) -> float:
    """Spec-Bench's speedup: mean(speculative_tps) / mean(baseline_tps).

    Each list holds one tokens/s figure per prompt, same prompts in both. This is a ratio of
    means, not the mean of per-prompt ratios, so long fast prompts and short slow ones are
    weighed as Spec-Bench does.
    """
    if not baseline_tps or len(baseline_tps) != len(speculative_tps):
        raise ValueError("need the same, non-zero number of baseline and speculative figures")
    return statistics.fmean(speculative_tps) / statistics.fmean(baseline_tps)


def median_and_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) over --repeats runs.

    Min/max rather than an IQR: with the handful of repeats a benchmark affords, quartiles
    are barely defined, while the full range shows the worst and best run honestly.
    """
    if not values:
        raise ValueError("need at least one value")
    return statistics.median(values), min(values), max(values)


def per_token_acceptance(steps: list[StepRecord]) -> float | None:
    """Leviathan's alpha, estimated as accepted / (accepted + rejections).

    Acceptance stops at the first rejection, so positions after it are never tested; accepted/drafted
    counts them as failures and underestimates alpha (num_draft_tokens 4, alpha 0.5 gives 0.23). Each block is
    a run of successes ended by one failure unless all drafts passed: this is the maximum-likelihood
    alpha of that geometric model."""
    accepted = sum(s.accepted for s in steps)
    rejections = sum(s.accepted < s.drafted for s in steps)
    return accepted / (accepted + rejections) if accepted + rejections else None
