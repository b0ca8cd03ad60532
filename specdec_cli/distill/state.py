"""What distill keeps on disk: the work folder's files (written whole, read as data only), the
training state a stopped run resumes from (with the settings that shaped it), and the saved draft."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec_cli.distill.settings import DistillSettings, read_layers
from specdec_cli.errors import SpecdecError
from specdec_cli.loading.checkpoints import first_lines
from specdec_cli.loading.target_states import target_layers
from specdec_cli.methods.feature import eagle3_export
from specdec_cli.methods.feature.draft import EMBEDDING, own_weights, save_draft, starting_layers
from specdec_cli.pair import dtype_name

WORK = "distill-work"  # subfolder of the output: corpus and training state until training ends
STATE = "train-state.pt"  # (train-state-eagle3.pt for an EAGLE-3 draft)
LOCK = ".distill.lock"  # held by the run writing to the output folder


@contextmanager
def claimed(out: Path) -> Iterator[None]:
    """The output folder, created if missing and held by this run alone: a second distill into it is
    refused at once (the two would overwrite each other's corpus, state and draft). The lock ends
    with the process, however it ends."""
    if out.exists() and not out.is_dir():
        raise SpecdecError(f"--out {out} is a file: name a folder for the draft")
    try:
        out.mkdir(parents=True, exist_ok=True)
        handle = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise SpecdecError(f"cannot write the draft to --out {out}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        raise SpecdecError(f"another specdec distill is writing to {out}: wait for it, or use another --out") from None
    try:
        yield
    finally:
        os.close(handle)


def save_whole(obj, path: Path) -> None:
    """torch.save through a temporary file: a run stopped mid-write leaves the previous file (or none),
    never a truncated one that the resumed run would fail to read."""
    partial = path.with_suffix(".partial")
    torch.save(obj, partial)
    partial.replace(path)


def load_kept(path: Path, mapped: bool = False):
    """A file of the work folder, read as data only: the folder may come from someone else, and a
    pickle can run code as it loads. What specdec saves there is tensors and plain containers (on the
    CPU, so a run stopped on a GPU resumes anywhere). `mapped`: the tensors stay in the file, mapped
    into memory, read as they are used (the target states of a large corpus outgrow the memory)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except pickle.UnpicklingError:
        problem = "it holds objects other than tensors and plain data, which could run code as they load"
    except (RuntimeError, EOFError) as exc:
        problem = f"it is damaged ({first_lines(exc).split('. ')[0]})"
    raise SpecdecError(f"{path}: refused, {problem}: delete it, or use another --out")


def state_path(work: Path, draft_format: str) -> Path:
    return work / (STATE if draft_format == "specdec" else f"train-state-{draft_format}.pt")


def save_state(
    path: Path,
    shaped_by: dict,
    draft: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    log: list[dict],
) -> None:
    """The training state `resume` loads: the draft's own weights, optimizer, schedule, the step and
    log reached, and `trained_with`'s record of what shaped them."""
    save_whole(
        {
            "draft": own_weights(draft),
            "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict(),
            "step": step,
            "log": log,
            "trained_with": shaped_by,
        },
        path,
    )


def trained_with(settings: DistillSettings, target: PreTrainedModel, target_name: str, corpus: list[dict]) -> dict:
    """What shapes a training state (the draft's weights, the optimizer, the answers and their order):
    a run resumes it only with the same. `training_steps` may change (the schedule goes on from the step
    reached towards the new end), and so may `eval_every`."""
    answers = json.dumps([(a["prompt"], a["answer"]) for a in corpus]).encode()
    return {
        **{key: value for key, value in vars(settings).items() if key not in ("training_steps", "eval_every")},
        # as resolved: by default they depend on the target
        "target_layers": list(read_layers(settings, target)),
        "init_layers": starting_layers(target.config, settings.num_layers, settings.init_layers),
        "target": target_name,
        "dtype": dtype_name(target.dtype),
        "corpus": hashlib.sha256(answers).hexdigest()[:12],
    }


def resume(
    path: Path,
    shaped_by: dict,
    draft: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[int, list[dict]]:
    """Loads a saved training state into the draft, optimizer and schedule: the step and log it reached."""
    state = load_kept(path)
    saved = state.get("trained_with", {}) if isinstance(state, dict) else {}
    # a setting added since the state was saved shaped it as its default does (what the run had then)
    defaults = vars(DistillSettings())
    for key, value in shaped_by.items():
        was = saved.get(key, defaults.get(key, "(not recorded)"))
        if was != value:
            raise SpecdecError(
                f"{path} holds training with {key} {was}, this run {key} {value}: "
                "run with the same settings, use another --out, or delete that file to train anew on the kept corpus"
            )
    try:
        # strictly: every tensor of the draft but the target's embedding, which is never saved
        missing, unexpected = draft.load_state_dict(state["draft"], strict=False)
        if missing != [EMBEDDING] or unexpected:
            raise ValueError(f"missing {[m for m in missing if m != EMBEDDING]}, unexpected {unexpected}")
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        return state["step"], state["log"]
    except (KeyError, TypeError, RuntimeError, ValueError) as exc:
        raise SpecdecError(
            f"{path} does not fit this draft ({first_lines(exc)}): delete it, or use another --out"
        ) from None


def save(
    draft: PreTrainedModel,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    target_name: str,
    log: list[dict],
    settings: DistillSettings,
) -> None:
    eagle3 = settings.format == "eagle3"
    info = {
        "target": target_name,
        "format": settings.format,
        "borrowed_from_target": ["input embedding"] + ([] if eagle3 else ["LM head rows of its vocabulary"]),
        "initialised_from_target_layers": starting_layers(
            target.config, draft.config.num_hidden_layers, settings.init_layers
        ),
        "reads_target_layers": list(target_layers(draft)),
        "vocabulary_size": len(draft.lm_head.token_ids),
        "settings": vars(settings),
        "log": log,
    }
    if eagle3:
        eagle3_export.save_eagle3(draft, target, out, info, settings.layout)
    else:
        save_draft(draft, tokenizer, out, info)
