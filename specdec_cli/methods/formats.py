"""The draft formats specdec reads, recognised from the folder itself (its config.json and tensor
names, as serving engines do). Each format is one module that recognises a folder of it, loads it
against the target and drafts with it: specdec's own (methods/feature/draft.py), DFlash
(methods/dflash/checkpoint.py), Medusa (methods/medusa/checkpoint.py), EAGLE-3 and EAGLE-1/2
(methods/feature/eagle.py). `FORMATS` only lists them: the first format whose
config.json a folder is loads it, else (a config that does not say) the first whose tensor names it
holds, read from the headers of the weight files alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

from specdec_cli.errors import SpecdecError
from specdec_cli.loading.draft_folder import DraftFolder, Format, read_folder
from specdec_cli.methods.dflash import checkpoint as dflash
from specdec_cli.methods.feature import draft as feature_draft
from specdec_cli.methods.feature import eagle
from specdec_cli.methods.medusa import checkpoint as medusa

DRAFT_FORMAT = "specdec_draft_format"  # config key set on every loaded draft: the format's name

FORMATS: dict[str, Format] = {
    "specdec": feature_draft.FORMAT,
    # block drafts (methods/dflash/drafter.py, methods/medusa/drafter.py)
    "dflash": dflash.FORMAT,
    "medusa": medusa.FORMAT,
    "eagle3": eagle.EAGLE3,
    "eagle": eagle.EAGLE,
}


def recognise(folder: DraftFolder) -> str | None:
    """The name of the folder's format: the first whose config it is, else the first whose tensor
    names it has (headers only), else None (a plain transformers checkpoint)."""
    for test in ("claims", "matches"):
        for name, fmt in FORMATS.items():
            if getattr(fmt, test)(folder):
                return name
    return None


def folder_format(path: str) -> str | None:
    """The format recognised in the draft folder `path` (None: a causal LM, or a hub id); no tensor is read."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return recognise(DraftFolder(Path(path), json.loads(config.read_text())))


def load_format(
    path: Path, target: PreTrainedModel | None, dtype: torch.dtype, remote_code: bool = False
) -> torch.nn.Module | None:
    """The draft in `path` loaded for `target` when a format recognises the folder, else None (a
    plain transformers checkpoint). Config key `DRAFT_FORMAT` says which format it is. A draft whose
    architecture neither a format nor transformers knows is refused (unless its own code is trusted)."""
    folder = read_folder(path)
    if folder is None:
        return None
    name = recognise(folder)
    if name is None and folder.speculators is not None:
        raise SpecdecError(
            f"draft {path}: a speculators {folder.speculators} draft (vllm-project/speculators' layout); "
            "specdec reads its eagle3 and dflash drafts"
        )
    if name is not None:
        if target is None:
            raise SpecdecError(f"{path} is a {name} draft: it can only be loaded as the draft of a target")
        model = FORMATS[name].load(folder, target, dtype)
        setattr(model.config, DRAFT_FORMAT, name)
        return model
    if target is not None and not remote_code:  # transformers would build it from `model_type`, half-loaded
        known = {a for fmt in FORMATS.values() for a in fmt.architectures}
        unknown = [a for a in folder.architectures if a not in known and not hasattr(transformers, a)]
        if unknown:
            raise SpecdecError(
                f"draft {path}: unknown architecture {unknown[0]} (specdec reads {', '.join(FORMATS)} drafts "
                f"and transformers' causal LMs)"
            )
    return None
