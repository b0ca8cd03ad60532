"""specdec's side of llama.cpp: its environment, built once per CPU, and its worker (worker.py)."""

from __future__ import annotations

import hashlib
import platform
import subprocess
import time
from pathlib import Path

from specdec_cli import display
from specdec_cli.config import cache_dir
from specdec_cli.errors import SpecdecError
from specdec_cli.workers import EngineWorker, environment_python, new_environment, run_logged, say

PYTHON_ENV = "SPECDEC_LLAMACPP_PYTHON"  # a python that has llama_cpp, instead of the one setup-llamacpp creates
WORKER = Path(__file__).with_name("worker.py")
PACKAGE, VERSION = "llama-cpp-python", "0.3.36"


def default_venv() -> Path:
    return cache_dir() / "llamacpp-venv"


def llamacpp_python() -> Path:
    return environment_python(default_venv(), PYTHON_ENV, "setup-llamacpp", "llama.cpp", "llama_cpp")


def wheel_folder() -> Path:
    """Where the wheel built on this kind of CPU is kept: PyPI ships llama-cpp-python as source, and the
    build targets the CPU it runs on (its instructions), so a wheel serves only CPUs with the same flags."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text(errors="replace") if cpuinfo.is_file() else platform.processor()
    lines = sorted({line for line in flags.splitlines() if line.startswith(("flags", "model name"))})
    return cache_dir() / "wheels" / hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def build_wheel(python: Path, log: Path) -> None:
    """Compile llama-cpp-python into a wheel (many minutes on a few cores), showing how long so far."""
    folder = wheel_folder()
    command = [str(python), "-m", "pip", "wheel", "--no-deps", f"{PACKAGE}=={VERSION}", "-w", str(folder)]
    start = time.monotonic()
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        what = f"building {PACKAGE} {VERSION} (compiles llama.cpp for this CPU, 5-15 minutes; log: {log})"
        with display.stderr.status(what) as status:
            while process.poll() is None:
                time.sleep(1)
                status.update(
                    f"{what}: {int(time.monotonic() - start) // 60} min {int(time.monotonic() - start) % 60} s"
                )
    if process.returncode != 0:
        raise SpecdecError(f"building {PACKAGE} failed (exit {process.returncode}; log: {log})")
    minutes = (time.monotonic() - start) / 60
    say(f"{PACKAGE} wheel ready after {minutes:.1f} min (pip may have had it built), kept in {folder}")


def setup_llamacpp() -> Path:
    """Create the environment (default_venv()) and install llama-cpp-python there, from the wheel built
    on this kind of CPU before, or built now. Returns its python."""
    python, log = new_environment(default_venv())
    folder = wheel_folder()
    if not list(folder.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl")):
        run_logged([str(python), "-m", "pip", "install", "--upgrade", "pip"], log, "pip install --upgrade pip")
        build_wheel(python, log)
    say(f"installing {PACKAGE} {VERSION} (log: {log})")
    install = [str(python), "-m", "pip", "install", "--find-links", str(folder), f"{PACKAGE}=={VERSION}"]
    run_logged(install, log, "pip install")
    say("checking that llama_cpp imports")
    run_logged(
        [str(python), "-c", "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"], log, "import llama_cpp"
    )
    return python


class LlamacppWorker(EngineWorker):
    """One llama.cpp model in a worker process (worker.py says what `engine` holds)."""

    def __init__(self, engine: dict):
        super().__init__("llamacpp", llamacpp_python(), WORKER, engine)
        self.version, self.buffers = self.ready["version"], self.ready["buffers"]

    def generate(self, prompt: list[int], request: dict) -> dict:
        return self.call({"prompt": prompt, **request})
