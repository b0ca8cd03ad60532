"""`specdec tune`'s arithmetic: a speedup predicted for every draft length a schedule can give, from
short measured probes at each batch size, and the choice among the lengths then run for real.

A probe decodes a batch of the sample prompts twice, target alone and with the config's full drafting,
and times a target forward of every verification width on a batch as large. Shortening every block
to g draft tokens keeps each block's first min(drafted, g) drafts and min(accepted, g) of its accepted
ones (a chain's acceptance is decided token by token, so its prefix is accepted as it would be alone),
so one speculative probe gives the acceptance of every shorter length. A block of g costs the forward
of its width, the loop's own work per block (what the probe's verification took beyond that forward),
and its share of the probe's drafting time."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from specdec_cli.decoding.metrics import StepRecord


@dataclass(frozen=True)
class Probe:
    """What one batch size's probes measured at one temperature: per block, target alone and
    speculative (drafting its config's full length); the target's forward by verification width."""

    batch_size: int
    alone_tokens_per_second: float  # the target alone's, the whole batch's
    steps: list[StepRecord]  # the speculative probe's, one per row and block
    blocks: int  # the speculative probe's blocks (target forwards of the batch)
    forward_seconds: dict[int, float]  # verification width -> one target forward of the batch at that width


def mean_drafted(steps: list[StepRecord], tokens: int) -> float:
    return statistics.fmean(min(s.drafted, tokens) for s in steps)


def mean_accepted(steps: list[StepRecord], tokens: int) -> float:
    return statistics.fmean(min(s.accepted, tokens) for s in steps)


def forward_at(forward_seconds: dict[int, float], width: float) -> float:
    """A forward's time at a mean width between two timed ones: linear between them."""
    low = min(int(width), max(forward_seconds))
    if low == width or low + 1 not in forward_seconds:
        return forward_seconds[low]
    share = width - low
    return (1 - share) * forward_seconds[low] + share * forward_seconds[low + 1]


def predicted_speedup(probe: Probe, tokens: int, acceptance: list[StepRecord]) -> float:
    """Tokens/s of blocks shortened to `tokens` drafts over the target alone's, at the probe's batch
    size. `acceptance`: the steps that say how many drafts are kept (every probe's at this temperature:
    acceptance does not depend on the batch)."""
    if tokens == 0:
        return 1.0
    full = max(s.drafted for s in probe.steps)
    rows_per_block = len(probe.steps) / probe.blocks
    drafting = sum(s.draft_seconds for s in probe.steps) / probe.blocks  # the batch's, per block
    verifying = sum(s.verify_seconds for s in probe.steps) / probe.blocks
    # the loop's work per block beyond the forward: sampling, acceptance, cache and drafter bookkeeping
    own = max(0.0, verifying - forward_at(probe.forward_seconds, 1 + mean_drafted(probe.steps, full)))
    drafted, drafted_full = mean_drafted(probe.steps, tokens), mean_drafted(probe.steps, full)
    block = forward_at(probe.forward_seconds, 1 + drafted) + own + drafting * drafted / drafted_full
    tokens_per_block = rows_per_block * (1 + mean_accepted(acceptance, tokens))
    return tokens_per_block / block / probe.alone_tokens_per_second


@dataclass
class Choice:
    """One batch size and temperature: every length's prediction, the measured finalists, the pick."""

    batch_size: int
    temperature: float
    predicted: dict[int, float]  # draft tokens -> predicted speedup
    measured: dict[int, float]  # draft tokens -> measured speedup (finalists; 0 is the target alone)
    accepted_length: dict[int, float | None]  # draft tokens -> measured mean accepted length
    config_tokens: int  # the config's own drafting (its longest block)

    @property
    def chosen(self) -> int:
        """The measured fastest (ties: fewer draft tokens); before any finalist ran, the predicted."""
        table = self.measured or self.predicted
        return max(sorted(table), key=lambda tokens: table[tokens])


def finalists(predicted: dict[int, float], config_tokens: int, count: int) -> list[int]:
    """The lengths to run for real: the target alone, the config's own, and the `count` predicted best."""
    best = sorted((t for t in predicted if t not in (0, config_tokens)), key=lambda t: -predicted[t])[:count]
    return sorted({0, config_tokens, *best})


def schedule_ranges(chosen: dict[int, int]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` from the tokens chosen at measured batch sizes: a
    measured size's choice holds from it up to the next measured size; equal neighbours merge."""
    sizes = sorted(chosen)
    ranges: list[list[int]] = []
    for size, after in zip(sizes, sizes[1:] + [None]):
        first = 1 if not ranges else size
        last = after - 1 if after is not None else size
        if ranges and ranges[-1][2] == chosen[size]:
            ranges[-1][1] = last
        else:
            ranges.append([first, last, chosen[size]])
    return ranges
