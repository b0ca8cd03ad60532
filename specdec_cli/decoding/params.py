"""Sampling settings: torch-free, so the command line can build and check them before loading a model."""

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
