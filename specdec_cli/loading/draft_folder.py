"""A draft checkpoint folder as every format reads it (its config.json and, read when first asked
for, its tensors), and what a draft format is. Format modules (methods/feature/draft.py and eagle.py,
methods/dflash/checkpoint.py, methods/medusa/checkpoint.py) import this, never the registry
(methods/formats.py) that lists them.

Weights load from safetensors; a pickle (`WEIGHTS`) only with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from transformers import PreTrainedModel

from specdec_cli.decoding.drafter import Drafter
from specdec_cli.errors import SpecdecError

# Where a checkpoint's tensors are, tier by tier as transformers looks: the shards an index lists, else
# every top-level file of the tier. Pickles: transformers' (SafeAILab's EAGLE drafts use its name too)
# and FasterDecoding Medusa's; any other pickle beside them (training_args.bin, optimizer.pt) is never
# opened, as unpickling it may be slow, refused, or both.
WEIGHTS = (
    ("model.safetensors.index.json", ("*.safetensors",)),
    ("pytorch_model.bin.index.json", ("pytorch_model*.bin", "medusa_lm_head.pt")),
)


def index_files(index: Path) -> list[str] | None:
    """The shard files a sharded checkpoint's index lists (None: no index)."""
    if not index.is_file():
        return None
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise SpecdecError(f"{index}: cannot read: {exc}") from None
    shards = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(shards, dict) or not all(isinstance(f, str) and "/" not in f for f in shards.values()):
        raise SpecdecError(f"{index}: no weight_map of tensor names to files in its folder")
    return sorted(set(shards.values()))


def tier_files(path: Path, index: str, patterns: tuple[str, ...]) -> list[Path]:
    listed = index_files(path / index)
    if listed is None:
        return sorted({p for pattern in patterns for p in path.glob(pattern)})
    missing = [name for name in listed if not (path / name).is_file()]
    if missing:
        raise SpecdecError(f"{path}: {index} lists {missing[0]}, which is not there")
    return [path / name for name in listed]


def weight_files(path: Path) -> list[Path]:
    return next((files for tier in WEIGHTS if (files := tier_files(path, *tier))), [])


@dataclass
class DraftFolder:
    """A checkpoint folder: its config.json and, read when first asked for, its tensors."""

    path: Path
    config: dict

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])

    @property
    def speculators(self) -> str | None:
        """The algorithm of a draft in vllm-project/speculators' layout (eagle3, dflash, ...), else None."""
        config = self.config
        return config.get("speculators_model_type") or (config.get("speculators_config") or {}).get("algorithm")

    @cached_property
    def files(self) -> list[Path]:
        return weight_files(self.path)

    @cached_property
    def names(self) -> dict[str, str]:
        """Each tensor's name and the file holding it, from safetensors headers and memory-mapped
        pickles (no tensor is read). A name in two files is refused: which copy would be meant?"""
        where = {}
        for file in self.files:
            for name in tensor_names(file):
                if name in where:
                    raise SpecdecError(f"{self.path}: tensor {name} is in both {where[name]} and {file.name}")
                where[name] = file.name
        return where

    @cached_property
    def weights(self) -> dict[str, torch.Tensor]:
        if not self.names:
            patterns = ", ".join(p for _, tier in WEIGHTS for p in tier)
            raise SpecdecError(f"draft {self.path}: no weights (no tensors in {patterns})")
        return {k: v for file in self.files for k, v in read_tensors(file).items()}


@contextmanager
def unreadable(file: Path):
    """A truncated or corrupt safetensors file: one line, not a traceback."""
    try:
        yield
    except SafetensorError as exc:
        raise SpecdecError(f"{file}: not a readable safetensors file (truncated or corrupt?): {exc}") from None


def tensor_names(file: Path) -> list[str]:
    if file.suffix == ".safetensors":
        with unreadable(file), safe_open(file, framework="pt") as f:
            return list(f.keys())
    return list(load_pickle(file))


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        with unreadable(file):
            return load_file(file)
    return load_pickle(file)


def load_pickle(file: Path) -> dict[str, torch.Tensor]:
    """Plain tensors only: `weights_only=True` refuses pickles that would run code or build objects.
    Memory-mapped (a zip archive, as torch.save writes since 1.6): only the tensors used are read."""
    try:
        data = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except pickle.UnpicklingError as exc:
        why = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(exc))
        raise SpecdecError(
            f"{file}: refused, it is not a pickle of plain tensors (specdec loads .bin/.pt files only "
            f"with torch.load(weights_only=True); convert it to safetensors)" + (f": {why[1]}" if why else "")
        ) from None
    except (RuntimeError, OSError, EOFError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SpecdecError(f"{file}: not a readable pickle (truncated or corrupt?): {reason}") from None
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise SpecdecError(f"{file}: not a mapping of tensor names to tensors")
    return data


def read_folder(path: Path) -> DraftFolder | None:
    """The folder with its config.json read (None: it has none, so no format can claim it)."""
    if not (path / "config.json").is_file():
        return None
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SpecdecError(f"{path / 'config.json'}: cannot read: {exc}") from None
    if not isinstance(config, dict):
        raise SpecdecError(f"{path / 'config.json'}: not a JSON object")
    return DraftFolder(path, config)


class Wiring(NamedTuple):
    """A loaded draft made ready to draft: its drafter, the target hidden states the target hands it
    (loading/target_states.py's convention), and what it reads, said in words."""

    drafter: Drafter
    state_layers: tuple[int, ...]
    reads: str


@dataclass(frozen=True)
class Format:
    """A draft format: how to recognise a folder of it, load one against the target, and draft with it."""

    claims: Callable[[DraftFolder], bool]  # from config.json (or a file of its own): no tensor is read
    load: Callable[[DraftFolder, PreTrainedModel, torch.dtype], torch.nn.Module]
    # the loaded draft, the target's vocabulary size, the confidence threshold and whether decoding
    # forwards replay CUDA graphs -> its wiring
    wire: Callable[[torch.nn.Module, int, float, bool], Wiring]
    architectures: tuple[str, ...] = ()  # the `architectures` names of its configs that transformers lacks
    # from the tensor names, for a config that does not say (EAGLE-1's is a plain Llama config)
    matches: Callable[[DraftFolder], bool] = lambda folder: False
