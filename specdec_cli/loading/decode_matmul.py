"""Decoding-shaped matrix products on CPU in float32, taken whichever way is faster on this machine.

A decoding forward multiplies every weight matrix W [out, in] by one to a few token rows x [n, in].
Which kernel is fastest at that shape depends on the CPU: on some, torch's F.linear (x @ W.T) is slow
at it and W @ x.T (a lone row doubled) is far faster; on others that detour is the slower one
(docs/experiments/2026-12-02-decode-matmul.md). No fixed choice suits every machine, so the first CPU
float32 model a process loads times both products over its own weight matrices, and the faster one
serves every product of up to `MAX_ROWS` rows in that process
(`PROCESS_CHOICE`: the target and its draft alike);
elsewhere (GPUs, half precision, prefill, training batches) F.linear stays. The results differ in the
last bits only (another summation order), and the target-only baseline goes through the same path as
speculative decoding, so benchmark ratios compare like with like.
"""

from __future__ import annotations

import math
import time
from functools import partial

import torch
import torch.nn.functional as F

MAX_ROWS = 8  # beyond this F.linear was as fast or faster
TIMED_BYTES = 256 * 2**20  # weights timed: enough to stream from memory, as in a forward
TIMED_ROWS = (1, 4)  # a target-only decoding step and a verification block of 3 draft tokens


def detour(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) taken as (W @ x.T).T, a lone row doubled (one column would take the
    matrix-vector kernel)."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count == 1:
        rows = torch.cat([rows, rows])
    out = torch.mm(weight, rows.T).T[:count].contiguous().view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def time_products(weights: list[torch.Tensor], repeats: int = 3) -> dict[str, float]:
    """Seconds to multiply `weights` by 1 and by 4 token rows, F.linear's way and the detour's (best of
    `repeats`, after one warm-up pass)."""
    inputs = {w.shape[1]: torch.randn(max(TIMED_ROWS), w.shape[1]) for w in weights}

    def seconds(product, rows: int) -> float:
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            for w in weights:
                product(inputs[w.shape[1]][:rows], w)
            best = min(best, time.perf_counter() - start)
        return best

    with torch.no_grad():
        seconds(F.linear, 1)
        return {
            name: sum(seconds(product, rows) for rows in TIMED_ROWS)
            for name, product in (("f_linear", F.linear), ("detour", detour))
        }


class MatmulChoice:
    """Which product serves a process's CPU float32 decoding matmuls: unknown until the first such
    model is loaded, then measured once over its weights and kept for every later one."""

    def __init__(self) -> None:
        self.detour_is_faster: bool | None = None

    @property
    def name(self) -> str | None:
        """The product chosen, as a record names it (None: nothing measured yet)."""
        return None if self.detour_is_faster is None else ("W @ x.T" if self.detour_is_faster else "x @ W.T")

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        decoding = x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and rows <= MAX_ROWS
        return detour(x, weight, bias) if decoding and self.detour_is_faster else F.linear(x, weight, bias)

    def route(self, model: torch.nn.Module) -> None:
        """Route a CPU float32 model's linear layers through the detour where it is the faster product."""
        parameter = next(model.parameters())
        if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
            return
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        if self.detour_is_faster is None and linears:
            weights, size = [], 0
            for module in linears:
                if size >= TIMED_BYTES:
                    break
                weights.append(module.weight)
                size += module.weight.nbytes
            seconds = time_products(weights)
            self.detour_is_faster = seconds["detour"] < seconds["f_linear"]
        if self.detour_is_faster:
            for module in linears:
                module.forward = partial(self._linear_forward, module)

    def _linear_forward(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, module.weight, module.bias)


PROCESS_CHOICE = MatmulChoice()  # the target and its draft share it
