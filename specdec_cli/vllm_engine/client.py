"""specdec's side of the vLLM worker (worker.py): find vLLM's python, start the worker, send it
requests, turn its failures into one `Error: vllm: ...` line."""

from __future__ import annotations

from pathlib import Path

from specdec_cli.config import cache_dir
from specdec_cli.workers import EngineWorker, environment_python

PYTHON_ENV = "SPECDEC_VLLM_PYTHON"  # a python that has vllm, instead of the one setup-vllm creates
WORKER = Path(__file__).with_name("worker.py")


def default_venv() -> Path:
    return cache_dir() / "vllm-venv"


def vllm_python() -> Path:
    """vLLM's python: $SPECDEC_VLLM_PYTHON, else the environment setup-vllm created."""
    return environment_python(default_venv(), PYTHON_ENV, "setup-vllm", "vLLM", "vllm")


class VllmWorker(EngineWorker):
    """One vLLM engine in a worker process; `engine`: vllm.LLM's keyword arguments."""

    def __init__(self, engine: dict):
        super().__init__("vllm", vllm_python(), WORKER, engine)
        self.version, self.device = self.ready["version"], self.ready["device"]  # the build: "cpu", "cuda", ...

    def generate(self, prompts: list[list[int]], sampling: dict) -> dict:
        return self.call({"prompts": prompts, "sampling": sampling})
