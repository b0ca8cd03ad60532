"""The decoding settings the core takes (sampling, a draft tree's shape), built from a config by the
assembly: torch-free, so the command line can build and check them before loading a model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 selects the greedy path
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(cls, sampling, temperature: float | None = None) -> SamplingParams:
        """From a config's `sampling` section; `temperature` replaces the config's when given."""
        return cls(sampling.temperature if temperature is None else temperature, sampling.top_k, sampling.top_p)


@dataclass(frozen=True)
class TreeShape:
    """A draft tree. Greedy, EAGLE-2's dynamic tree: per depth, the top_k children of the top_k most
    probable frontier nodes are drafted; the max_nodes most probable nodes of all are verified in one
    forward. Sampled, from a draft model: top_k children drawn from q per expanded node, all kept,
    with max_nodes bounding how many nodes a depth expands (decoding/tree.py, sampled_growth)."""

    depth: int = 4
    top_k: int = 3
    max_nodes: int = 16

    @property
    def candidates(self) -> int:
        """Nodes drafted before the cut to max_nodes: top_k at depth 1, top_k * top_k at each depth after."""
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def width(self) -> int:
        """The most cache slots a block writes past the context: the target's tree, or the draft's frontiers."""
        return max(self.max_nodes, self.depth * self.top_k)

    @property
    def spec(self) -> str:
        """As --tree spells it: DEPTH,TOP_K,MAX_NODES."""
        return f"{self.depth},{self.top_k},{self.max_nodes}"

    def describe(self) -> str:
        return f"tree {self.spec} (depth, top-k, nodes)"
