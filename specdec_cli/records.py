"""Run records: one JSON file per run under runs/ (or --runs-dir, or $SPECDEC_RUNS_DIR; none with
--no-record), and stdout JSON."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specdec_cli import interrupts
from specdec_cli.errors import SpecdecError

NAME_BYTES = 120  # of a run folder's name after its timestamp: file systems allow 255


@dataclass(frozen=True)
class Run:
    """How one command ends: its record in a new folder under `runs_dir` (None: $SPECDEC_RUNS_DIR,
    else runs/), or nowhere when not `recording` (--no-record); the record as JSON on stdout when
    `as_json`, else its tables. Made before the run, it refuses a runs folder it cannot write to."""

    runs_dir: str | Path | None = None
    recording: bool = True
    as_json: bool = False

    def __post_init__(self) -> None:
        if self.recording:
            check_writable(self.root())

    def root(self) -> Path:
        if self.runs_dir is None:  # an empty $SPECDEC_RUNS_DIR counts as unset, as shells mean it
            return Path(os.environ.get("SPECDEC_RUNS_DIR") or "runs").expanduser()
        if str(self.runs_dir) == "":
            raise SpecdecError("--runs-dir is empty: name a folder, or use --no-record")
        return Path(self.runs_dir).expanduser()

    def folder(self, command: str, name: str) -> Path:
        """A new folder <runs>/<timestamp>-<command>-<name>/ (suffixed if two runs share a second)."""
        slug = re.sub(r"[^\w.-]+", "-", f"{command}-{name}").strip("-")
        slug = slug.encode()[:NAME_BYTES].decode(errors="ignore")  # a long config name still fits
        base = self.root() / f"{timestamp()}-{slug}"
        folder, n = base, 1
        while True:
            try:
                folder.mkdir(parents=True)
                return folder
            except FileExistsError:  # another run took this second's name, here or in another process
                n += 1
                folder = base.with_name(f"{base.name}-{n}")

    def write(
        self, command: str, name: str, record: dict[str, Any], files: dict[str, str | bytes] | None = None
    ) -> str:
        """Write record.json and `files` (name: text, or bytes such as a chart's) into a new run folder,
        each whole or not at all; returns what to tell the user: where they are, or that nothing was
        written. Ctrl-C and SIGTERM wait for the writing to end."""
        if not self.recording:
            return "Not recorded (--no-record)."
        with interrupts.saving():
            folder = self.folder(command, name)
            try:
                for file_name, content in {"record.json": dumps(record) + "\n", **(files or {})}.items():
                    write_whole(folder / file_name, content)
            except OSError:
                if not any(folder.iterdir()):
                    folder.rmdir()
                raise
        return "Record: " + ", ".join(str(folder / n) for n in ["record.json", *(files or {})])

    def finish(self, command: str, name: str, record: dict[str, Any], show: Callable[[], None], files=None) -> None:
        """Every command's ending: write the record (and `files`), print it as JSON or `show` its
        tables, then say on stderr where it went. A record that cannot be written is still printed,
        then reported as an error."""
        from specdec_cli.display import stderr

        try:
            written, failure = self.write(command, name, record, files), None
        except OSError as exc:
            written = None
            failure = SpecdecError(f"the record could not be written: {exc.strerror or exc}: {exc.filename or ''}")
        if self.as_json:
            print(dumps(record))
        else:
            show()
        if failure:
            raise failure
        stderr.print(written)


def check_writable(root: Path) -> None:
    """Before any work: records can be written under `root` (created if missing)."""
    where = f"cannot write run records to {root}"
    if root.exists() and not root.is_dir():
        raise SpecdecError(f"{where}: it is a file, not a folder (--runs-dir, $SPECDEC_RUNS_DIR, or --no-record)")
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        raise SpecdecError(f"{where}: {exc.strerror or exc} (--runs-dir, $SPECDEC_RUNS_DIR, or --no-record)") from None


def write_whole(path: Path, content: str | bytes) -> None:
    """Write a file whole or not at all: into a temporary file beside it, then renamed over it."""
    data = content.encode() if isinstance(content, str) else content
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "xb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def timestamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def header(command: str, config, environment: dict | None = None) -> dict[str, Any]:
    """The fields every record starts with: what ran, under which config, where."""
    head = {"command": command, "name": config.name, "timestamp": timestamp(), "config": config.to_dict()}
    return head if environment is None else {**head, "environment": environment}


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=2, ensure_ascii=False)
