"""Decoding-shaped matrix products on CPU in float32.

A decoding forward multiplies every weight matrix W [out, in] by one to a few token rows x [n, in].
torch's F.linear (x @ W.T) is slow at that shape on CPU in float32: measured on a 2-core EPYC with
torch 2.13, SmolLM2-135M forwards of 1 / 2 / 3 / 5 tokens took 55-65 / 93-108 / 112-142 / 76-83 ms,
and 33-38 / 33-45 / 43-48 / 48-55 ms taken as W @ x.T with at least two columns. So for up to
`MAX_ROWS` rows on CPU in float32 the product is taken as (W @ x.T).T, with a lone row doubled;
elsewhere (GPUs, half precision, prefill, training batches) F.linear stays. The result differs from
F.linear's in the last bits only (another summation order), and the target-only baseline goes
through the same path as speculative decoding, so benchmark ratios compare like with like.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

MAX_ROWS = 8  # beyond this F.linear was as fast or faster


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or count > MAX_ROWS:
        return F.linear(x, weight, bias)
    if count == 1:
        rows = torch.cat([rows, rows])  # one column would take the slow matrix-vector kernel
    out = torch.mm(weight, rows.T).T[:count].contiguous().view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def use_decode_matmul(model: torch.nn.Module) -> None:
    """Route a CPU model's linear layers through `linear` (elsewhere the detour would only cost time)."""
    if next(model.parameters()).device.type != "cpu":
        return
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = partial(_linear_forward, module)


def _linear_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias)
