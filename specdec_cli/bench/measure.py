"""What one generation of a benchmark prompt measured, for specdec and for peers alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from specdec_cli.decoding.metrics import StepRecord, request_figures

if TYPE_CHECKING:
    from specdec_cli.decoding.engine import GenerationResult


class Turn(NamedTuple):
    """One turn's generation as the loop ran it, for replaying it (decoding/drift.py)."""

    prompt_ids: list[int]
    token_ids: list[int]
    steps: list[StepRecord]


@dataclass
class Measure:
    """One generation of a whole prompt (all turns summed)."""

    new_tokens: int = 0
    prefill_seconds: float | None = 0.0  # None: the generator cannot time prefill apart (transformers)
    decode_seconds: float = 0.0  # with prefill_seconds None: the whole call
    steps: list[StepRecord] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # all turns' answers, concatenated
    turns: list[Turn] = field(default_factory=list)  # kept out of records
    greedy_divergence: dict | None = None  # where a greedy run left the target alone's (decoding/drift.py)

    def add(self, other: Measure) -> None:
        self.new_tokens += other.new_tokens
        self.token_ids += other.token_ids
        self.turns += other.turns
        if self.prefill_seconds is None or other.prefill_seconds is None:
            self.prefill_seconds = None
        else:
            self.prefill_seconds += other.prefill_seconds
        self.decode_seconds += other.decode_seconds
        self.steps += other.steps

    def to_dict(self) -> dict:
        total = self.decode_seconds + (self.prefill_seconds or 0.0)
        return {
            "new_tokens": self.new_tokens,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "tokens_per_second": _rate(self.new_tokens, self.decode_seconds),
            "end_to_end_tokens_per_second": _rate(self.new_tokens, total),
            # compact: [drafted, accepted, emitted, draft_seconds, verify_seconds] per target forward
            "steps": [[s.drafted, s.accepted, s.emitted, s.draft_seconds, s.verify_seconds] for s in self.steps],
            "token_ids": self.token_ids,
            "request": request_figures(self.steps),  # this prompt's own acceptance figures
            "greedy_divergence": self.greedy_divergence,
        }


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


# Generates one turn: (prompt ids, seed) -> (new token ids, measure). Used for specdec and for peers.
TurnGenerator = Callable[[list[int], int], tuple[list[int], Measure]]

# Generates one turn of a batch of prompts: (prompts' ids, seed) -> a result per row. The batch's wall
# time is each result's decode_seconds (prefill_seconds 0 where the generator cannot time it apart).
BatchGenerate = Callable[[list[list[int]], int], list["GenerationResult"]]
