"""`specdec tune`'s arithmetic: a speedup predicted for every candidate setting, from the config's full
drafting run on every prompt beside the target alone, and a short probe at the same batch size, and
the choice among the settings then run for real.

Cutting every block to g draft tokens keeps each block's first min(drafted, g) drafts and
min(accepted, g) of its accepted ones (a chain's acceptance is decided token by token, so its prefix is
accepted as it would be alone), so one run of the full drafting gives the acceptance of every shorter
length on all the prompts. A drafter that copies spans of the context (`copies_context`) drafts, after
a short block accepted all it drafted, mostly the rest of the same span, whose later tokens are the
likelier to be right: there each block that accepted a tokens is replayed instead, its a + 1 tokens
emitted by ceil((a + 1) / (g + 1)) blocks of g. (A draft model is likelier right early in a block,
and its next block starts afresh: for it the cut holds.)

A probe decodes a few prompts for a few tokens with every candidate, round by round and repeated, which
times a block of each as the loop runs it: its verification as wide as its rows' drafts, the drafting,
and the loop's own work. The candidates that change more than the length (a tree, another verification
rule or confidence threshold) cannot be cut from the full run: the probe's own tokens/s predicts them.
The probe's batches are short and early: their rows all decode to the end, while in a real run rows
leave as they finish and the context grows. So every probed speedup is scaled by the
full drafting's measured speedup over its probed one."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from specdec_cli.decoding.metrics import StepRecord
from specdec_cli.decoding.params import TreeShape

TARGET_ALONE = "0"  # the target alone's label


@dataclass(frozen=True)
class Setting:
    """One candidate: draft tokens per block (0: the target alone; a tree: its depth), and what differs
    from the config's own drafting: a tree, the sampled chains' verification rule, the confidence
    threshold (None: the config's)."""

    tokens: int
    tree: TreeShape | None = None
    verification: str | None = None
    threshold: float | None = None

    @property
    def label(self) -> str:
        """ "3", "3 block", "3 threshold 0.4", "tree 3,2,6"; a style alone: "block", "threshold 0.4"."""
        if self.tree is not None:
            return f"tree {self.tree.spec}"
        rule = [self.verification] if self.verification else []
        threshold = [f"threshold {self.threshold:g}"] if self.threshold is not None else []
        tokens = [str(self.tokens)] if self.tokens or not (rule or threshold) else []
        return " ".join(tokens + rule + threshold)

    @property
    def style(self) -> Setting:
        """What a schedule cannot vary by batch size: this setting with the length taken out."""
        return Setting(0, self.tree, self.verification, self.threshold)

    @property
    def cut(self) -> bool:
        """The config's own chain at some length: predicted by cutting its full drafting's blocks."""
        return self.style == CONFIG_STYLE


CONFIG_STYLE = Setting(0)  # the config's own drafting, as a style


def runs_under(setting: Setting, style: Setting, greedy: bool) -> bool:
    """Whether a config written with `style` runs `setting` at some batch size: a chain style's schedule
    can leave a size to the target alone (a tree cannot), and greedy chains ignore the rule."""
    if setting.tokens == 0:
        return style.tree is None
    if not changes(style, greedy):
        return setting.cut
    return setting.style == style


def changes(style: Setting, greedy: bool) -> bool:
    """Whether `style` decodes differently from the config's own: a rule alone changes sampled chains only."""
    return style != CONFIG_STYLE and not (greedy and style.tree is None and style.threshold is None)


@dataclass(frozen=True)
class Probe:
    """What one batch size's probes measured at one temperature, per candidate label: a block of the
    whole batch (drafting, verifying and the loop's own work), the rows decoding in it (rows leave at
    EOS), and tokens/s; the target alone's tokens/s under TARGET_ALONE."""

    batch_size: int
    block_seconds: dict[str, float]
    rows_per_block: dict[str, float]
    tokens_per_second: dict[str, float]

    @property
    def alone_tokens_per_second(self) -> float:
        return self.tokens_per_second[TARGET_ALONE]


def mean_accepted(steps: list[StepRecord], tokens: int, replay: bool) -> float:
    """Accepted drafts per block of the full drafting's `steps` had they drafted at most `tokens`: each
    block cut, or (`replay`) replayed as blocks of `tokens` until it emitted what it did."""
    if not replay:
        return statistics.fmean(min(s.accepted, tokens) for s in steps)
    blocks = sum(math.ceil((s.accepted + 1) / (tokens + 1)) for s in steps)
    return sum(s.accepted + 1 for s in steps) / blocks - 1


def probed_speedup(probe: Probe, setting: Setting, acceptance: list[StepRecord], replay: bool) -> float:
    """Tokens/s of `setting` over the target alone's, at the probe's batch size. The config's own chain
    at fewer tokens: the probe's blocks of that length carrying the acceptance of `acceptance` (the
    steps of a full-drafting run at that batch size) cut or replayed to them; anything else: the probe's
    tokens/s."""
    if setting.tokens == 0:
        return 1.0
    label = setting.label
    if not setting.cut:
        return probe.tokens_per_second[label] / probe.alone_tokens_per_second
    tokens_per_block = probe.rows_per_block[label] * (1 + mean_accepted(acceptance, setting.tokens, replay))
    return tokens_per_block / probe.block_seconds[label] / probe.alone_tokens_per_second


def predicted_speedups(
    probe: Probe,
    settings: list[Setting],
    acceptance: list[StepRecord],
    replay: bool,
    full: Setting,
    measured_full: float,
) -> dict[str, float]:
    """Every setting's probed speedup, scaled by `measured_full` (the full drafting's speedup over the
    target alone on every prompt, in the run that gave `acceptance`) over the full drafting's probed one;
    the target alone is 1."""
    scale = measured_full / probed_speedup(probe, full, acceptance, replay)
    return {s.label: probed_speedup(probe, s, acceptance, replay) * (scale if s.tokens else 1.0) for s in settings}


@dataclass
class Choice:
    """One batch size and temperature: every candidate's prediction, the measured finalists, the pick,
    by candidate label."""

    batch_size: int
    temperature: float
    predicted: dict[str, float]  # label -> predicted speedup
    measured: dict[str, float]  # label -> measured speedup (finalists; TARGET_ALONE is the target alone)
    accepted_length: dict[str, float | None]  # label -> measured mean accepted length
    config_label: str  # what the config as it is drafts at this batch size (its schedule's, else its longest block)

    def best(self, allowed: set[str] | None = None) -> str:
        """The measured fastest of `allowed` (default: all; ties: the earlier label, so fewer draft
        tokens); before any finalist ran, the predicted."""
        table = self.measured or self.predicted
        labels = [label for label in table if allowed is None or label in allowed]
        return max(sorted(labels, key=order), key=lambda label: table[label])

    @property
    def chosen(self) -> str:
        return self.best()


def order(label: str) -> tuple:
    """Candidates in a fixed order: the config's own lengths by length first, then the others."""
    return (0, int(label), "") if label.isdigit() else (1, 0, label)


def finalists(predicted: dict[str, float], always: set[str], count: int) -> list[str]:
    """The candidates to run for real: the target alone, `always` (the config's own), and the `count`
    predicted best of the others."""
    rest = sorted((label for label in predicted if label not in {TARGET_ALONE, *always}), key=order)
    best = sorted(rest, key=lambda label: -predicted[label])[:count]
    return sorted({TARGET_ALONE, *always, *best}, key=order)


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


def written_style(choices: list[Choice], candidates: dict[str, Setting]) -> Setting:
    """The style tuned.yaml is written with: another than the config's own where, at every batch size and
    temperature it changes, the measured best runs under it (for a chain, the target alone counts) and at
    least once is its own; else the config's own, whose schedule reaches the best of its lengths."""
    for style in sorted({s.style for s in candidates.values() if not s.cut}, key=lambda s: s.label):
        best = [(candidates[c.chosen], c.temperature == 0) for c in choices if changes(style, c.temperature == 0)]
        if any(s.style == style for s, _ in best) and all(runs_under(s, style, greedy) for s, greedy in best):
            return style
    return CONFIG_STYLE


def written_setting(choice: Choice, style: Setting, candidates: dict[str, Setting]) -> str:
    """The label a config written with `style` runs at this batch size and temperature: the measured best
    of those it can run."""
    allowed = {label for label, s in candidates.items() if runs_under(s, style, choice.temperature == 0)}
    allowed &= set(choice.measured or choice.predicted)
    return choice.best(allowed) if allowed else choice.chosen
