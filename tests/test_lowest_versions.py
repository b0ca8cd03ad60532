"""The lowest transformers, tokenizers, huggingface-hub and safetensors that pyproject allows, installed
into a fresh venv beside this interpreter's torch, decode the tiny pair to the same tokens
(greedy and sampled) as the versions installed here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")

pytestmark = pytest.mark.install

REPO = Path(__file__).resolve().parent.parent
PINNED = ("transformers", "tokenizers", "huggingface-hub", "safetensors")
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def lowest_allowed() -> dict[str, str]:
    """Each pinned package's lower bound in pyproject, the version a resolver picking lowest takes."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    lowest = {}
    for line in dependencies:
        requirement = Requirement(line)
        if requirement.name in PINNED:
            (bound,) = [s.version for s in requirement.specifier if s.operator == ">="]
            lowest[requirement.name] = bound
    assert set(lowest) == set(PINNED), f"pyproject bounds none of {set(PINNED) - set(lowest)}"
    return lowest


def check(cmd: list) -> str:
    done = subprocess.run([str(c) for c in cmd], env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def lowest_python(tmp_path_factory) -> Path:
    """A venv whose own site-packages hold the lowest versions; everything else (torch, typer, this
    tree's specdec_cli) comes from here through a .pth file, which site-packages' own entries precede."""
    venv = tmp_path_factory.mktemp("lowest") / "venv"
    check([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(check([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip())
    paths = [str(REPO), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    (site / "dependencies.pth").write_text("".join(f"{path}\n" for path in dict.fromkeys(paths)))
    pins = [f"{name}=={version}" for name, version in lowest_allowed().items()]
    # with their own dependencies where those they need are not here (an older hub's httpx)
    check([sys.executable, "-m", "pip", "--python", python, "install", "-q", *pins])
    return python


def generate(python: Path | str, *options: str) -> dict:
    code = "import sys; from specdec_cli.cli import main; sys.argv[0] = 'specdec'; main()"
    cmd = [python, "-c", code, "generate", "-c", "tiny-random", "--prompt", "hello there", "--json", "--no-record"]
    return json.loads(check(cmd + ["--max-new-tokens", "24", *options]))


def test_the_lowest_versions_are_the_ones_imported(lowest_python):
    code = "import importlib.metadata as m; print(' '.join(m.version(p) for p in sys.argv[1:]))"
    found = check([lowest_python, "-c", "import sys; " + code, *PINNED]).split()
    assert {name: Version(v) for name, v in zip(PINNED, found)} == {
        name: Version(v) for name, v in lowest_allowed().items()
    }


def test_greedy_tokens_equal_those_of_the_installed_versions(lowest_python):
    lowest = generate(lowest_python, "--temperature", "0")
    current = generate(sys.executable, "--temperature", "0")
    assert lowest["stats"]["new_tokens"] == 24
    assert lowest["token_ids"] == current["token_ids"]


def test_sampled_tokens_equal_those_of_the_installed_versions(lowest_python):
    """Same seed, same float32 model: the draws match token for token."""
    lowest = generate(lowest_python, "--temperature", "1")
    assert lowest["token_ids"] == generate(sys.executable, "--temperature", "1")["token_ids"]
