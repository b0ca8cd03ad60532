"""Fixtures: tiny real models built in-process, config files in tmp folders, runs kept out of the repo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.commands.verify import statistics
from specdec_cli.config import TinyModel
from specdec_cli.decoding import tree
from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.loading.checkpoints import build_tiny, byte_tokenizer
from specdec_cli.methods.suffix import CachedAnswer, SuffixDrafter


@pytest.fixture(autouse=True)
def runs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_RUNS_DIR", str(tmp_path / "runs"))


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def tiny_target():
    return build_tiny(TinyModel(seed=0)).eval()


@pytest.fixture(scope="session")
def noisy_draft():
    """The tiny target with its weights perturbed: a draft that agrees with it often, not always."""
    return build_tiny(TinyModel(seed=0, noise=0.005)).eval()


def cached(model) -> CachedModel:
    return CachedModel(model, model.config.vocab_size)


def generate_json(*args: str) -> dict:
    """`specdec generate --json` on "Hello there" with `args`: its record."""
    run = CliRunner().invoke(app, ["generate", "-p", "Hello there", "--json", *args])
    assert run.exit_code == 0, run.output
    return json.loads(run.stdout)


def earlier_answers(pair, ids: list[int], params: SamplingParams) -> None:
    """Suffix decoding's shared cache as after earlier requests whose answers were the target's own
    samples after this prompt (verify's runs never draft from their own prompt's answers): drafts
    the target often accepts, so the checks see accepted drafts."""
    suffix = next((d for d in (pair.drafter, pair.lookup) if isinstance(d, SuffixDrafter)), None)
    if suffix is None:
        return
    alone = pair.decoder(params, speculative=False)
    for seed in range(40):
        answer = alone.generate(ids, 24, seed, ignore_eos=True).token_ids
        suffix.cached.append(CachedAnswer((-1 - seed,), answer, counted=True))
        suffix.shared.add(answer)


def tree_paths(drafted: tree.DraftTree, row: int = 0) -> list[tuple]:
    """Per slot, the tokens from the root to it; parents must come first."""
    paths = [()]
    for token, parent in zip(drafted.tokens[row].tolist(), drafted.parents[row].tolist()):
        assert parent < len(paths)
        paths.append(paths[parent] + (token,))
    return paths


def failing(rows) -> list[str]:
    return [f"{row.check}: {row.what}" for row in rows if row.status == statistics.FAIL]


# training prompts of the tiny distillation runs (tests/test_distill.py, tests/test_eagle3_export.py)
DISTILL_PROMPTS = [
    "Hello there",
    "The quick brown fox",
    "Once upon a time",
    "Count to ten",
    "Write a poem",
    "A list: one, two",
    "What is two plus two",
    "abc abc",
]


TINY_PAIR = {
    "name": "tiny-test",
    "target": {"tiny": {"seed": 0}},
    "draft": {"tiny": {"seed": 0, "noise": 0.005}},
    "sampling": {"temperature": 0.0, "seed": 0},
    "speculation": {"num_draft_tokens": 3},
    "generation": {"max_new_tokens": 16},
    "runtime": {"device": "cpu", "dtype": "float32"},
}


@pytest.fixture
def write_config(tmp_path):
    """Write the tiny pair's config with `changes` to a YAML file: settings sections are merged key by
    key, `target` and `draft` are replaced whole."""

    def write(changes: dict | None = None, name: str = "config.yaml") -> Path:
        data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TINY_PAIR.items()}
        for section, value in (changes or {}).items():
            if section not in ("target", "draft") and isinstance(value, dict) and section in data:
                data[section].update(value)
            else:
                data[section] = value
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data))
        return path

    return write


def pytest_collection_modifyitems(config, items):
    """Tests marked vllm start vLLM engines (minutes each on a CPU): they run only when asked for with
    `-m vllm`, so a machine that happens to have vLLM's environment keeps the default run short."""
    if "vllm" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="runs with -m vllm (after specdec setup-vllm)")
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(skip)
