"""Run records: one JSON file per run under runs/ (or --runs-dir, or $SPECDEC_RUNS_DIR; none with
--no-record), and stdout JSON."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# set once per command from its --runs-dir and --record/--no-record flags
chosen_dir: Path | None = None
recording = True


def configure(runs_dir: Path | None, record: bool) -> None:
    global chosen_dir, recording
    chosen_dir, recording = runs_dir, record


def runs_dir() -> Path:
    return chosen_dir or Path(os.environ.get("SPECDEC_RUNS_DIR", "runs"))


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


def write_record(command: str, name: str, record: dict[str, Any], files: dict[str, str | bytes] | None = None) -> str:
    """Write record.json and `files` (name: text, or bytes such as a chart's) into a new run folder;
    returns what to tell the user: where they are, or that nothing was written."""
    if not recording:
        return "Not recorded (--no-record)."
    folder = run_folder(command, name)
    (folder / "record.json").write_text(dumps(record) + "\n")
    for file_name, content in (files or {}).items():
        path = folder / file_name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return "Record: " + ", ".join(str(folder / n) for n in ["record.json", *(files or {})])


def finish(
    command: str, name: str, record: dict[str, Any], as_json: bool, show: Callable[[], None], files=None
) -> None:
    """Every command's ending: write the record (and `files`), print it as JSON or `show` its tables,
    then say on stderr where it went."""
    from specdec_cli.display import stderr

    written = write_record(command, name, record, files)
    if as_json:
        print(dumps(record))
    else:
        show()
    stderr.print(written)
