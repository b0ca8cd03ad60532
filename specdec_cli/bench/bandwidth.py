"""The machine's memory read bandwidth, the limit of a batch-1 decoding forward: such a forward reads
every weight once per token, so weight bytes / forward seconds against this figure says how close to
the limit it runs."""

from __future__ import annotations

import functools
import time

import torch

READ_BYTES = 512 * 2**20  # well beyond any cache
REPEATS = 7


@functools.cache
def read_bandwidth(device: torch.device) -> float:
    """Bytes a second that torch's sum reads from a float32 tensor of READ_BYTES on `device`, the best of
    REPEATS, with the threads torch has now; measured once per process and device."""
    data = torch.ones(READ_BYTES // 4, device=device)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        data.sum().item()  # .item(): the sum has finished when the clock is read (CUDA too)
        best = min(best, time.perf_counter() - start)
    return READ_BYTES / best
