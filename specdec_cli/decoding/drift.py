"""Where greedy speculative output leaves the target alone's, and whether rounding explains it.

Greedy speculative decoding emits the target's argmax at every position, so its output is the target
alone's unless the two runs' forwards round differently (a verification forward of several tokens is
not a single-token step on every kernel) and the top two logits sit closer than that rounding. `triage`
follows a divergence to its first differing token and replays both runs' target forwards there as
their loops should have run them: the same widths, the cache cut to each block's accepted prefix. It
is rounding when the target alone's own forward put the two tokens closer than the dtype resolves at
the logits' size and the two forwards' logits differ by less than that too; anything else (a verification forward that
does not pick the token the loop emitted, forwards further apart than rounding) is a bug.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.metrics import StepRecord

# logit differences below this are rounding whatever the logits' size (int8 and int4 products take
# bfloat16 activations and give bfloat16 outputs)
FLOOR = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.1}
ULPS = 8  # and below this many units in the last place of the largest logit: forwards that round differently


def resolution(dtype: torch.dtype, weights: str = "float", magnitude: float = 0.0) -> float:
    """What logits of `magnitude` (the largest in absolute value) resolve when the forward runs in
    `dtype` with `weights`: differences below it are rounding."""
    dtype = torch.bfloat16 if weights in ("int8", "int4") else dtype
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(magnitude)) if magnitude > 0 else 0.0
    return max(FLOOR.get(dtype, 1e-3), ULPS * ulp)


@dataclass
class Divergence:
    """The first token at which two greedy runs of one target differ, as their replays see it."""

    position: int  # index of the first differing new token
    alone_token: int  # the target alone's token there (-1: that run had stopped)
    speculative_token: int
    alone_margin: float  # top-1 minus top-2 logit in the target alone's forward
    verification_margin: float  # the same in the speculative run's verification forward
    gap: float  # the alone forward's logit of its own token minus that of the speculative token
    difference: float  # the largest difference between the two forwards' logits
    resolution: float  # what the dtype resolves at these logits' size: rounding is below it
    reproduced: bool  # whether the replays give each run its own token
    rounding: bool
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        verdict = "rounding" if self.rounding else "NOT rounding (a bug)"
        return (
            f"token {self.position + 1}: {verdict}; gap {self.gap:.2g}, forwards differ by "
            f"{self.difference:.2g} (resolution {self.resolution:g}): {self.reason}"
        )


@torch.inference_mode()
def replayed_logits(
    target: CachedModel, prompt: list[int], tokens: list[int], steps: list[StepRecord], position: int
) -> torch.Tensor:
    """The target's logits [V] for new token `position` of a run that decoded `tokens` after `prompt` in
    the blocks `steps`: each block's forward over its last token and its drafts (drafts the block
    rejected, which the record does not keep, replaced by the tokens that came next, which the
    accepted ones cannot see), then the cache cut to what the block accepted."""
    sequence = prompt + tokens
    widest = max(step.drafted for step in steps) + 1
    target.reset(len(sequence) + widest)
    if len(prompt) > 1:  # as the loop prefills: every prompt token but the last
        target.forward(torch.tensor([prompt[:-1]], device=target.device), logits="none")
    start = 0  # the block's first new token
    for step in steps:
        width = step.drafted + 1
        inputs = sequence[len(prompt) - 1 + start :][:width]
        inputs += inputs[-1:] * (width - len(inputs))  # past the run's end: fillers no kept token sees
        logits = target.forward(torch.tensor([inputs], device=target.device)).logits[0]
        if position < start + step.emitted:
            return logits[position - start]
        target.lengths = [len(prompt) + start + step.accepted]  # the last token and the accepted drafts
        start += step.emitted
    raise ValueError(f"the steps decode {start} tokens, not {position + 1}")


def verdict(
    single: torch.Tensor, verification: torch.Tensor, ours: int, theirs: int, tolerance: float, trees: bool
) -> tuple[float, float, bool, bool, str]:
    """(gap, difference, whether the replays flip it, whether it is rounding, why) from the replayed
    single-token and verification forwards' logits [V] where the target alone emitted `ours` and the
    speculative run `theirs` (the fields of Divergence)."""
    picked, alone_picked = int(verification.argmax()), int(single.argmax())
    reproduced = alone_picked == ours and picked == theirs
    gap, difference = float(single[ours] - single[theirs]), float((single - verification).abs().max())
    near = gap < tolerance and difference < tolerance
    rounding = near and (reproduced or trees)
    if rounding:
        reason = "a near-tie the two forwards round apart" + ("" if reproduced else " (trees replayed as chains)")
    elif picked != theirs:
        where = " at a near-tie" if near else ""
        reason = f"the replayed verification forward picks token {picked}{where}, the loop emitted {theirs}"
    elif alone_picked != ours:
        reason = f"the replayed single-token forward picks token {alone_picked}, the target alone emitted {ours}"
    elif difference >= tolerance:
        reason = "the two forwards differ by more than rounding"
    else:
        reason = "the two tokens are further apart than rounding"
    return gap, difference, reproduced, rounding, reason


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index at which a and b differ (one being shorter counts), None if they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def triage(
    target: CachedModel,
    prompt: list[int],
    alone: tuple[list[int], list[StepRecord]],
    speculative: tuple[list[int], list[StepRecord]],
    dtype: torch.dtype,
    weights: str = "float",
    trees: bool = False,
) -> Divergence | None:
    """The first divergence of a speculative greedy run (tokens, steps) from the target alone's, classed
    by replaying both forwards (run in `dtype` with `weights`); None if their tokens are equal. `trees`:
    the run verified trees, whose blocks are replayed as chains of their depth, so its flips need not
    come back."""
    position = first_difference(alone[0], speculative[0])
    if position is None:
        return None
    if position >= min(len(alone[0]), len(speculative[0])):
        # both decode the same tokens up to an EOS, so only a bug stops one run and not the other
        floor = resolution(dtype, weights)
        return Divergence(position, -1, -1, 0.0, 0.0, 0.0, 0.0, floor, False, False, "one run stopped early")
    ours, theirs = alone[0][position], speculative[0][position]
    single = replayed_logits(target, prompt, *alone, position)
    verification = replayed_logits(target, prompt, *speculative, position)
    margins = [float(top[0] - top[1]) for top in (single.topk(2).values, verification.topk(2).values)]
    tolerance = resolution(dtype, weights, float(torch.maximum(single.abs().max(), verification.abs().max())))
    gap, difference, reproduced, rounding, reason = verdict(single, verification, ours, theirs, tolerance, trees)
    return Divergence(position, ours, theirs, *margins, gap, difference, tolerance, reproduced, rounding, reason)
