"""A model's decoding forwards replayed from CUDA graphs: one graph per input shape, over inputs that
live in fixed tensors. The host launches one graph instead of every kernel of every layer, which is
most of an eager forward's time on a GPU for the models people deploy
(docs/experiments/2026-12-04-h200-random-weights.md).

A graph records the kernels and the memory they touch, so everything a forward reads is copied into
that graph's own input tensors before each replay, on the device (no host sync), and what it writes
is read from its output tensors and copied out before the next replay can overwrite them. The KV
cache is captured in place: a graph is only valid for the cache tensors it was captured on, so the
owner drops its graphs whenever those are replaced (a new batch, rows leaving).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# key: input shapes and settings that change the kernels; value: (input tensors, replay, outputs)
Step = tuple[dict[str, torch.Tensor], Callable[[], None], Sequence[torch.Tensor]]


class GraphedForward:
    """`forward(**inputs, **settings)` (inputs: tensors; returns a tuple of tensors) run through a
    graph captured for each new key, which must tell apart every input shape and setting. On CUDA
    a torch.cuda.CUDAGraph; elsewhere the same fixed input and output tensors with the forward run
    eagerly, which is how a CPU test checks everything but the capture."""

    def __init__(self, forward: Callable[..., tuple[torch.Tensor, ...]], device: torch.device):
        self.forward = forward
        self.capture = device.type == "cuda"
        self.steps: dict[tuple, Step] = {}
        self.captures = 0  # graphs recorded since the start, those dropped with their cache included

    def clear(self) -> None:
        self.steps.clear()

    def __call__(self, key: tuple, inputs: dict[str, torch.Tensor], **settings) -> tuple[torch.Tensor, ...]:
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = self.record(inputs, settings)
        fixed, replay, outputs = step
        for name, tensor in inputs.items():
            fixed[name].copy_(tensor)
        replay()
        return tuple(out.clone() for out in outputs)

    def record(self, inputs: dict[str, torch.Tensor], settings: dict) -> Step:
        self.captures += 1
        fixed = {name: tensor.clone() for name, tensor in inputs.items()}
        if not self.capture:  # outputs in fixed tensors too, overwritten by each run as by a replay
            outputs = self.forward(**fixed, **settings)

            def run():
                for out, new in zip(outputs, self.forward(**fixed, **settings)):
                    out.copy_(new)

            return fixed, run, outputs
        # warm-up on a side stream, as capture requires (lazy initialisation, the allocator's pools);
        # it computes what the replay will, so what it writes into the cache is what belongs there
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(**fixed, **settings)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.forward(**fixed, **settings)
        return fixed, graph.replay, outputs
