"""A non-editable install: the wheel built from this tree, installed into a fresh venv in a temporary
folder, runs `specdec generate` from an empty folder with the configs and the draft it ships."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.install

REPO = Path(__file__).resolve().parent.parent
SHIPPED_DRAFT = REPO / "specdec_cli" / "drafts" / "smollm2-135m-instruct"
# no PYTHONPATH, so nothing but the fresh venv's site-packages can supply specdec_cli
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run(cmd: list, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=ENV, capture_output=True, text=True)


def check(cmd: list, cwd: Path | None = None) -> str:
    done = run(cmd, cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """The venv, with the wheel of this tree installed (no -e). Its dependencies come from this
    interpreter's site-packages through a .pth line: a path line does not run that folder's own .pth
    files, so an editable install of this tree there stays out of sight."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source)
    for folder in ("specdec_cli", "configs"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip"]
    # built as `pip install .` builds it: in an isolated environment with the build-system requirements
    check(pip + ["wheel", "--no-deps", "--wheel-dir", tmp / "wheels", source])
    (wheel,) = (tmp / "wheels").glob("specdec-*.whl")
    venv = (tmp / "venv").resolve()
    check([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(check([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip())
    dependencies = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(dependencies)))
    check(pip + ["--python", python, "install", "--no-deps", "--no-index", wheel])
    return venv


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder


def installed_package(venv: Path, cwd: Path) -> Path:
    code = "import specdec_cli; print(specdec_cli.__file__)"
    return Path(check([venv / "bin" / "python", "-c", code], cwd)).resolve().parent


def test_the_installed_package_is_the_one_imported(venv, elsewhere):
    package = installed_package(venv, elsewhere)
    assert package.is_relative_to(venv) and package.name == "specdec_cli"


def test_generate_with_a_built_in_config_from_another_folder(venv, elsewhere):
    cmd = [venv / "bin" / "specdec", "generate", "-c", "tiny-random", "--prompt", "abc", "--json"]
    record = json.loads(check(cmd + ["--max-new-tokens", "8"], elsewhere))
    assert record["name"] == "tiny-random"
    assert record["stats"]["new_tokens"] > 0


def test_the_default_config_finds_the_shipped_draft(venv, elsewhere):
    code = (
        "from specdec_cli.config import load_config; from specdec_cli.loading.checkpoints import resolve_checkpoint; "
        "c = load_config(None); print(c.source, resolve_checkpoint(c.draft.checkpoint))"
    )
    source, draft = (Path(p) for p in check([venv / "bin" / "python", "-c", code], elsewhere).split())
    package = installed_package(venv, elsewhere)
    assert source == package / "configs" / "smollm2-draft.yaml"
    assert draft == package / "drafts" / "smollm2-135m-instruct"
    shipped = {p.name for p in SHIPPED_DRAFT.iterdir() if p.is_file()}
    assert {p.name for p in draft.iterdir()} == shipped


def test_generate_with_the_default_pair_from_another_folder(venv, elsewhere):
    """The default pair's target is fetched into the specdec cache once (tests/test_smollm2.py)."""
    cmd = [venv / "bin" / "specdec", "generate", "--prompt", "Repeat: apples, pears, apples, pears.", "--json"]
    done = run(cmd + ["--max-new-tokens", "8"], elsewhere)
    if done.returncode != 0 and "cannot fetch" in done.stderr:
        pytest.skip(f"SmolLM2 is not available here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["name"] == "smollm2-draft"
    assert record["config"]["draft"]["checkpoint"] == "smollm2-135m-instruct-draft"  # the installed one (above)
    assert record["stats"]["new_tokens"] > 0
