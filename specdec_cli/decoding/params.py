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


@dataclass(frozen=True)
class BatchSchedule:
    """How many tokens a block drafts at each batch size, as vLLM's
    `num_speculative_tokens_per_batch_size` reads it: ranges (first, last, tokens) of batch sizes,
    inclusive, the first from 1; a size between two ranges takes the earlier one's tokens, a size past
    the last the last one's; 0 drafts nothing (the target alone). The loop asks it once per block for
    the rows still decoding, so the choice never depends on the tokens drawn: the output stays exact."""

    ranges: tuple[tuple[int, int, int], ...]

    @classmethod
    def parse(cls, entries: object) -> BatchSchedule:
        """From [[first, last, tokens], ...] (in any order); ValueError saying what is wrong."""
        if not isinstance(entries, (list, tuple)) or not entries:
            raise ValueError("expected a non-empty list of [first batch size, last batch size, draft tokens]")
        ranges = []
        for entry in entries:
            if (
                not isinstance(entry, (list, tuple))
                or len(entry) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
            ):
                raise ValueError(f"each entry is [first batch size, last batch size, draft tokens], got {entry!r}")
            first, last, tokens = entry
            if not 1 <= first <= last or tokens < 0:
                raise ValueError(f"entry {list(entry)}: needs 1 <= first <= last and draft tokens >= 0")
            ranges.append((first, last, tokens))
        ranges.sort()
        if ranges[0][0] != 1:
            raise ValueError(f"the first range starts at batch size 1, not {ranges[0][0]}")
        for (_, last, _), (first, _, _) in zip(ranges, ranges[1:]):
            if first <= last:
                raise ValueError(f"ranges overlap at batch size {first}")
        return cls(tuple(ranges))

    def tokens(self, batch_size: int) -> int:
        return next(tokens for first, _, tokens in reversed(self.ranges) if first <= batch_size)

    @property
    def most(self) -> int:
        return max(tokens for _, _, tokens in self.ranges)

    def describe(self) -> str:
        """`1-2: 4, 3-8: 2, 9+: 0` (batch sizes: draft tokens)."""
        parts = [f"{first}-{last}" if first < last else f"{first}" for first, last, _ in self.ranges]
        parts[-1] = f"{self.ranges[-1][0]}+"
        return ", ".join(f"{part}: {tokens}" for part, (_, _, tokens) in zip(parts, self.ranges))
