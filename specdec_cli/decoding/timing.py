"""The decode loop's clock: wall-clock marks per block that are honest on CUDA (events, read after the
loop), and each row's steps and times from them."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import NamedTuple

import torch

from specdec_cli.decoding.metrics import StepRecord


class BlockMarks(NamedTuple):
    """Clock marks of one block, read only after the loop (on CUDA they are events)."""

    start: object
    drafted_at: object
    verified_at: object


class Clock:
    """Wall-clock marks that are honest on CUDA: events recorded in stream order, read at the end,
    so timing a phase adds no host sync to the loop."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the pair's device, which need not be the current one
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000


class Timeline:
    """The bookkeeping of one generate_batch: clock marks per block, each row's steps, where each row
    stopped, and time spent showing tokens (kept off the decode time). Marks are read only in
    `rows`, after the loop."""

    def __init__(self, clock: Clock, rows: int):
        self.clock = clock
        self.start = clock.mark()
        self.decode_start = None
        self.marks: list[BlockMarks] = []
        self.block_rows: list[int] = []  # rows decoding in each block, which share its time
        self.row_steps: list[list[tuple[int, int, int, int]]] = [
            [] for _ in range(rows)
        ]  # (block, drafted, accepted, emitted)
        self.finished_at = [0] * rows  # the block in which each row stopped
        self.display_seconds = 0.0

    def prefilled(self) -> None:
        self.decode_start = self.clock.mark()

    def block(self, start, drafted_at, rows: int) -> None:
        self.marks.append(BlockMarks(start, drafted_at, self.clock.mark()))
        self.block_rows.append(rows)

    def step(self, row: int, drafted: int, accepted: int, emitted: int, stopped: bool) -> None:
        self.row_steps[row].append((len(self.marks) - 1, drafted, accepted, emitted))
        if stopped:
            self.finished_at[row] = len(self.marks) - 1

    @contextmanager
    def off_clock(self):
        shown = time.perf_counter()
        yield
        self.display_seconds += time.perf_counter() - shown

    def rows(self) -> list[tuple[float, float, list[StepRecord]]]:
        """Per row: prefill seconds, decode seconds (to the block it stopped in, less display time) and
        its steps, each carrying its share of its block's time, so sums over rows are wall time."""
        clock = self.clock
        prefill_seconds = clock.seconds(self.start, self.decode_start)
        times = [
            (clock.seconds(m.start, m.drafted_at) / rows, clock.seconds(m.drafted_at, m.verified_at) / rows)
            for m, rows in zip(self.marks, self.block_rows)
        ]
        return [
            (
                prefill_seconds,
                clock.seconds(self.decode_start, self.marks[self.finished_at[row]].verified_at) - self.display_seconds,
                [
                    StepRecord(drafted=d, accepted=a, emitted=e, draft_seconds=times[b][0], verify_seconds=times[b][1])
                    for b, d, a, e in steps
                ],
            )
            for row, steps in enumerate(self.row_steps)
        ]
