"""Another engine in a process of its own environment (vLLM, llama.cpp): creating that environment,
starting its worker script there, sending it requests one JSON line at a time, and turning its
failures into one `Error: NAME: ...` line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from specdec_cli.config import cache_dir
from specdec_cli.errors import SpecdecError

# a Python exception as a log or traceback line: "ValueError: ...", "pydantic_core.ValidationError: ..."
EXCEPTION_LINE = re.compile(r"(?:^|\] )((?:[\w.]+\.)?\w+(?:Error|Exception): .+)$")
# vLLM's exceptions that only point at the error above them
POINTERS = ("See stack trace", "see root cause above", "EngineCore encountered an issue")


def say(text: str) -> None:
    print(f"specdec: {text}", file=sys.stderr, flush=True)


def run_logged(command: list[str], log: Path, what: str) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise SpecdecError(f"{what} failed (exit {done.returncode}): {lines[-1] if lines else ''} (log: {log})")


def new_environment(venv: Path) -> tuple[Path, Path]:
    """A virtual environment at `venv` (kept where it exists) and a fresh setup log in it: (its python, the log)."""
    python = venv / "bin" / "python"
    venv.mkdir(parents=True, exist_ok=True)
    log = venv / "setup.log"
    log.write_text("")
    if not python.is_file():
        say(f"creating {venv}")
        run_logged([sys.executable, "-m", "venv", str(venv)], log, "creating the environment")
    return python, log


def environment_python(venv: Path, variable: str, setup: str, engine: str, module: str) -> Path:
    """The python of an engine's environment (one that imports `module`): $`variable`, else the one
    `specdec setup` created at `venv`."""
    configured = os.environ.get(variable)
    if configured:
        python = Path(configured).expanduser()
        if not python.is_file():
            raise SpecdecError(f"{variable}={configured}: no such file (it names a python that has {module})")
        return python
    python = venv / "bin" / "python"
    if not python.is_file():
        setup_line = f"run 'specdec {setup}' (or set {variable} to a python with {module})"
        raise SpecdecError(f"{engine} is not set up: {setup_line}")
    return python


def new_log(name: str) -> Path:
    """A log file of the worker's own (concurrent runs must not write into each other's); it is kept
    only where the worker failed."""
    folder = cache_dir() / f"{name}-logs"
    folder.mkdir(parents=True, exist_ok=True)
    handle, path = tempfile.mkstemp(prefix="worker-", suffix=".log", dir=folder)
    os.close(handle)
    return Path(path)


def failure_line(log: str, reported: str | None) -> str:
    """What went wrong, in one line: the worker's own report unless it only points at the engine's log,
    else the last exception line of the log that says more than that."""
    if reported and not any(p in reported for p in POINTERS):
        return reported
    found = [m[1] for line in log.splitlines() if (m := EXCEPTION_LINE.search(line.strip()))]
    useful = [line for line in found if not any(p in line for p in POINTERS)]
    return (useful or found or [reported or "the worker stopped without a message"])[-1]


class EngineWorker:
    """An engine's worker script run by `python`, named `name` in errors and logs; its first request
    is {"engine": engine} and `ready` holds the reply."""

    def __init__(self, name: str, python: Path, script: Path, engine: dict):
        self.name = name
        self.log, self.failed = new_log(name), False
        with self.log.open("w") as log:
            # a session of its own: an engine may run in the worker's child processes, and an
            # interrupted run stops them all together (`close`)
            self.process = subprocess.Popen(
                [str(python), str(script)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        self.ready = self.call({"engine": engine})

    def call(self, message: dict) -> dict:
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone: its reply below is empty
        line = self.process.stdout.readline()
        reply = json.loads(line) if line.strip() else {"error": None}
        if "error" in reply:
            self.failed = True
            self.close()
            raise SpecdecError(
                f"{self.name}: {failure_line(self.log.read_text(errors='replace'), reply['error'])} (log: {self.log})"
            )
        return reply

    def close(self, interrupted: bool = False) -> None:
        """End the worker: at the end of its input, or at once where the run was `interrupted` (the
        worker may be in the middle of a request, which it would finish first)."""
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=1 if interrupted else 60)
            except subprocess.TimeoutExpired:
                self.stop_all()
        if not self.failed:
            self.log.unlink(missing_ok=True)

    def stop_all(self) -> None:
        """The worker and the engine's processes under it."""
        for stop in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, stop)
                self.process.wait(timeout=10)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(interrupted=exc_type is not None)
