"""Run records: one JSON file per run under runs/ (or --runs-dir, or $SPECDEC_RUNS_DIR; none with
--no-record), and stdout JSON."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Run:
    """How one command ends: its record in a new folder under `runs_dir` (None: $SPECDEC_RUNS_DIR,
    else runs/), or nowhere when not `recording` (--no-record); the record as JSON on stdout when
    `as_json`, else its tables."""

    runs_dir: Path | None = None
    recording: bool = True
    as_json: bool = False

    def folder(self, command: str, name: str) -> Path:
        """A new folder <runs>/<timestamp>-<command>-<name>/ (suffixed if two runs share a second)."""
        root = self.runs_dir or Path(os.environ.get("SPECDEC_RUNS_DIR", "runs"))
        slug = re.sub(r"[^\w.-]+", "-", f"{command}-{name}").strip("-")
        base = root / f"{timestamp()}-{slug}"
        folder, n = base, 1
        while folder.exists():
            n += 1
            folder = base.with_name(f"{base.name}-{n}")
        folder.mkdir(parents=True)
        return folder

    def write(
        self, command: str, name: str, record: dict[str, Any], files: dict[str, str | bytes] | None = None
    ) -> str:
        """Write record.json and `files` (name: text, or bytes such as a chart's) into a new run folder;
        returns what to tell the user: where they are, or that nothing was written."""
        if not self.recording:
            return "Not recorded (--no-record)."
        folder = self.folder(command, name)
        (folder / "record.json").write_text(dumps(record) + "\n")
        for file_name, content in (files or {}).items():
            path = folder / file_name
            path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        return "Record: " + ", ".join(str(folder / n) for n in ["record.json", *(files or {})])

    def finish(self, command: str, name: str, record: dict[str, Any], show: Callable[[], None], files=None) -> None:
        """Every command's ending: write the record (and `files`), print it as JSON or `show` its
        tables, then say on stderr where it went."""
        from specdec_cli.display import stderr

        written = self.write(command, name, record, files)
        if self.as_json:
            print(dumps(record))
        else:
            show()
        stderr.print(written)


def timestamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def header(command: str, config, environment: dict | None = None) -> dict[str, Any]:
    """The fields every record starts with: what ran, under which config, where."""
    head = {"command": command, "name": config.name, "timestamp": timestamp(), "config": config.to_dict()}
    return head if environment is None else {**head, "environment": environment}


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=2, ensure_ascii=False)
