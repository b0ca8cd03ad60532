"""Weight-only quantized matrix products on a CPU, through torch's own kernels.

A batch-1 decoding forward reads every weight once per token, so its speed is the bytes it reads:
int8 weights are a quarter of float32's, int4 an eighth. Two kinds, as serving engines and gpt-fast
keep them:
- `int8`: one int8 per weight and a scale per output row (`torch._weight_int8pack_mm`);
- `int4`: 4 bits per weight, a scale and a zero per group of `GROUP` weights along the input, the
  weight being (q - 8) * scale + zero for q in 0..15 (`torch._weight_int4pack_mm_for_cpu`). Each
  group's smallest weight becomes 0 and its largest 15, as GGUF's Q4_1 quantizes, so weights
  converted from a Q4_1 file come back as its own 4-bit values (scripts/check_gguf_int4.py); from
  other types (Q4_0, Q4_K, ...) they are quantized anew.
Both kernels take bfloat16 activations (their fast path): a product converts its input to bfloat16
and its output back. The target-only baseline runs the same products, so the quantized model is the
target whose law every exactness check tests. A weight whose shape a kind cannot take (int4: an
input width not a multiple of GROUP) is taken in int8.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

GROUP = 32  # weights per int4 scale and zero: GGUF's block size
ROWS_MULTIPLE = 16  # the int4 kernel's output rows come in tiles of 16: pad to it
INNER_K_TILES = 2  # the int4 packing's inner tiles (any of 2, 4, 8 serve every GROUP multiple)
KINDS = ("int8", "int4")


class Quantized(NamedTuple):
    """A weight [rows, columns] as a kernel reads it."""

    kind: str
    data: torch.Tensor  # int8 [rows, columns], or int4 packed [rows padded to 16, columns / 2]
    scales: torch.Tensor  # int8: [rows]; int4: scales and zeros [columns / GROUP, rows padded, 2] (bfloat16)
    rows: int  # of the weight, before padding


def quantize(weight: torch.Tensor, kind: str) -> Quantized:
    """`weight` [rows, columns] as `kind`: int8 symmetric per row; int4 asymmetric per group of GROUP
    (its minimum and maximum mapped to 0 and 15, as gpt-fast and GGUF's Q4_1 do)."""
    weight = weight.detach().float()
    if kind == "int4" and weight.shape[1] % GROUP == 0:
        groups = weight.unflatten(1, (-1, GROUP))  # [rows, groups, GROUP]
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).flatten(1)
        return int4_from_groups(q.to(torch.int32), scale, low + 8 * scale)
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Quantized("int8", q, scale.to(torch.bfloat16), weight.shape[0])


def int4_from_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Quantized:
    """4-bit values `q` [rows, columns] in 0..15 and each group's `scale` and `zero` [rows, columns /
    GROUP]: the weight (q - 8) * scale + zero, packed for the kernel."""
    rows = q.shape[0]
    pad = -rows % ROWS_MULTIPLE
    if pad:  # zero rows, cut from the output
        q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (q, scale, zero))
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INNER_K_TILES)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
    return Quantized("int4", packed, scales_and_zeros, rows)


def product(x: torch.Tensor, weight: Quantized, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, the weight `weight` stands for, bias), in bfloat16 inside, in x's dtype outside."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if weight.kind == "int8":
        out = torch._weight_int8pack_mm(rows, weight.data, weight.scales)
    else:
        out = torch._weight_int4pack_mm_for_cpu(rows, weight.data, GROUP, weight.scales)[:, : weight.rows]
    out = out.to(x.dtype).view(*x.shape[:-1], weight.rows)
    return out if bias is None else out + bias
