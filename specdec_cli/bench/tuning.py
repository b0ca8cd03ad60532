"""`specdec tune`'s arithmetic: a speedup predicted for every draft length a schedule can give, from
the config's full drafting run on every prompt and a short probe at the same batch size, and the choice
among the lengths then run for real.

Cutting every block to g draft tokens keeps each block's first min(drafted, g) drafts and
min(accepted, g) of its accepted ones (a chain's acceptance is decided token by token, so its prefix is
accepted as it would be alone), so one run of the full drafting gives the acceptance of every shorter
length on all the prompts. A probe decodes a few prompts for a few tokens at every length, which times
a block of each as the loop runs it: its verification as wide as its rows' drafts, the drafting, and
the loop's own work."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from specdec_cli.decoding.metrics import StepRecord


@dataclass(frozen=True)
class Probe:
    """What one batch size's probes measured at one temperature: the target alone's tokens/s, and per
    draft length a block of the whole batch (drafting, verifying and the loop's own work) and the rows
    decoding in it."""

    batch_size: int
    alone_tokens_per_second: float
    block_seconds: dict[int, float]  # draft tokens -> seconds per block
    rows_per_block: dict[int, float]  # draft tokens -> rows decoding per block (rows leave at EOS)


def mean_accepted(steps: list[StepRecord], tokens: int) -> float:
    return statistics.fmean(min(s.accepted, tokens) for s in steps)


def predicted_speedup(probe: Probe, tokens: int, acceptance: list[StepRecord]) -> float:
    """Tokens/s of blocks cut to `tokens` drafts over the target alone's, at the probe's batch size.
    `acceptance`: the steps of a full-drafting run at that batch size, cut to `tokens`."""
    if tokens == 0:
        return 1.0
    tokens_per_block = probe.rows_per_block[tokens] * (1 + mean_accepted(acceptance, tokens))
    return tokens_per_block / probe.block_seconds[tokens] / probe.alone_tokens_per_second


@dataclass
class Choice:
    """One batch size and temperature: every length's prediction, the measured finalists, the pick."""

    batch_size: int
    temperature: float
    predicted: dict[int, float]  # draft tokens -> predicted speedup
    measured: dict[int, float]  # draft tokens -> measured speedup (finalists; 0 is the target alone)
    accepted_length: dict[int, float | None]  # draft tokens -> measured mean accepted length
    config_tokens: int  # what the config as it is drafts at this batch size (its schedule's, else its longest block)

    @property
    def chosen(self) -> int:
        """The measured fastest (ties: fewer draft tokens); before any finalist ran, the predicted."""
        table = self.measured or self.predicted
        return max(sorted(table), key=lambda tokens: table[tokens])


def finalists(predicted: dict[int, float], always: set[int], count: int) -> list[int]:
    """The lengths to run for real: the target alone, `always` (the config's own), and the `count`
    predicted best of the others."""
    best = sorted((t for t in predicted if t not in {0, *always}), key=lambda t: -predicted[t])[:count]
    return sorted({0, *always, *best})


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
