"""specdec's side of the vLLM worker (worker.py): find vLLM's python, start the worker, send it
requests, turn its failures into one `Error: vllm: ...` line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path

from specdec_cli.config import cache_dir
from specdec_cli.errors import SpecdecError

PYTHON_ENV = "SPECDEC_VLLM_PYTHON"  # a python that has vllm, instead of the one setup-vllm creates
WORKER = Path(__file__).with_name("worker.py")
# a Python exception as a log or traceback line: "ValueError: ...", "pydantic_core.ValidationError: ..."
EXCEPTION_LINE = re.compile(r"(?:^|\] )((?:[\w.]+\.)?\w+(?:Error|Exception): .+)$")
# vLLM's exceptions that only point at the error above them
POINTERS = ("See stack trace", "see root cause above", "EngineCore encountered an issue")


def default_venv() -> Path:
    return cache_dir() / "vllm-venv"


def vllm_python() -> Path:
    """vLLM's python: $SPECDEC_VLLM_PYTHON, else the environment setup-vllm created."""
    configured = os.environ.get(PYTHON_ENV)
    if configured:
        python = Path(configured).expanduser()
        if not python.is_file():
            raise SpecdecError(f"{PYTHON_ENV}={configured}: no such file (it names a python that has vllm)")
        return python
    python = default_venv() / "bin" / "python"
    if not python.is_file():
        raise SpecdecError(f"vLLM is not set up: run 'specdec setup-vllm' (or set {PYTHON_ENV} to a python with vllm)")
    return python


def new_log() -> Path:
    """A log file of the worker's own (concurrent runs must not write into each other's); it is kept
    only where the worker failed."""
    folder = cache_dir() / "vllm-logs"
    folder.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix="worker-", suffix=".log", dir=folder)
    os.close(handle)
    return Path(name)


def failure_line(log: str, reported: str | None) -> str:
    """What went wrong, in one line: the worker's own report unless it only points at vLLM's log, else
    the last exception line of the log that says more than that."""
    if reported and not any(p in reported for p in POINTERS):
        return reported
    found = [m[1] for line in log.splitlines() if (m := EXCEPTION_LINE.search(line.strip()))]
    useful = [line for line in found if not any(p in line for p in POINTERS)]
    return (useful or found or [reported or "the worker stopped without a message"])[-1]


class VllmWorker:
    """One vLLM engine in a worker process; `engine`: vllm.LLM's keyword arguments."""

    def __init__(self, engine: dict):
        python = vllm_python()
        self.log, self.failed = new_log(), False
        with self.log.open("w") as log:
            # a session of its own: vLLM's engine runs in the worker's child processes, and an
            # interrupted run stops them all together (`close`)
            self.process = subprocess.Popen(
                [str(python), str(WORKER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        ready = self.call({"engine": engine})
        self.version, self.device = ready["version"], ready["device"]  # the build: "cpu", "cuda", ...

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
                f"vllm: {failure_line(self.log.read_text(errors='replace'), reply['error'])} (log: {self.log})"
            )
        return reply

    def generate(self, prompts: list[list[int]], sampling: dict) -> dict:
        return self.call({"prompts": prompts, "sampling": sampling})

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
        """The worker and vLLM's engine processes under it."""
        for stop in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, stop)
                self.process.wait(timeout=10)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(interrupted=exc_type is not None)
