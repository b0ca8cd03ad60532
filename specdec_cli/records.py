"""Run records: one JSON file per run under runs/ (or $SPECDEC_RUNS_DIR), and stdout JSON."""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def runs_dir() -> Path:
    return Path(os.environ.get("SPECDEC_RUNS_DIR", "runs"))


def timestamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def run_folder(command: str, name: str) -> Path:
    """A new folder runs/<timestamp>-<command>-<name>/ (suffixed if two runs share a second)."""
    slug = re.sub(r"[^\w.-]+", "-", f"{command}-{name}").strip("-")
    base = runs_dir() / f"{timestamp()}-{slug}"
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    folder.mkdir(parents=True)
    return folder


def header(command: str, config, environment: dict | None = None) -> dict[str, Any]:
    """The fields every record starts with: what ran, under which config, where."""
    head = {"command": command, "name": config.name, "timestamp": timestamp(), "config": config.to_dict()}
    return head if environment is None else {**head, "environment": environment}


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=2, ensure_ascii=False)


def write_record(command: str, name: str, record: dict[str, Any]) -> Path:
    """Write record.json into a new run folder; returns the folder."""
    folder = run_folder(command, name)
    (folder / "record.json").write_text(dumps(record) + "\n")
    return folder
