"""Host values sent to the device without stalling it. The decode loop promises one host sync per
block (its read of the accepted counts); a copy from pageable host memory to a GPU is another, so
everything the host sends inside the loop goes through `to_device`."""

from __future__ import annotations

import torch


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (a number or nested lists) as a tensor on `device`. For a GPU they are staged in
    pinned memory and copied without blocking: the copy is queued behind the work already on the
    stream, and the caching host allocator keeps the staging memory until the copy has run."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> list:
    """`tensor`'s values on the host: the loop's one sync per block. On a GPU the copy lands in
    pinned memory and the host waits on an event recorded after it, so this wait is explicit and
    any other sync shows under `torch.cuda.set_sync_debug_mode("error")` (scripts/check_cuda.py)."""
    if tensor.device.type != "cuda":
        return tensor.tolist()
    staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    staged.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tensor.device))
    copied.synchronize()
    return staged.tolist()
