"""llama.cpp as a benchmark peer (`--peer llamacpp`): its refusals without a GGUF target or its
environment, and, where `specdec setup-llamacpp` has run and the built-in SmolLM2 is cached, a run
of the default pair beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.config import BUILTIN_CONFIGS, cache_dir
from specdec_cli.llamacpp_engine.client import PYTHON_ENV, default_venv

runner = CliRunner()

TINY = {
    "name": "tiny-llamacpp",
    "target": {"tiny": {"seed": 0}},
    "draft": {"ngram": {"max_n": 3, "min_n": 1}},
    "generation": {"max_new_tokens": 8},
    "runtime": {"device": "cpu", "dtype": "float32"},
}


def benchmark(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["benchmark", "--temperatures", "0", "--peer", "llamacpp", *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def tiny(tmp_path) -> tuple[str, str]:
    config, prompts = tmp_path / "tiny.yaml", tmp_path / "prompts.txt"
    config.write_text(yaml.safe_dump(TINY))
    prompts.write_text("abc abc abc\n")
    return str(config), str(prompts)


def test_without_its_environment_the_peer_is_one_error_line_before_any_work(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    code, out, err = benchmark("-c", tiny[0], "--prompts", tiny[1])
    assert code == 2 and out == ""
    assert (
        err.strip()
        == f"Error: {PYTHON_ENV}={tmp_path / 'nowhere' / 'python'}: no such file (it names a python that has llama_cpp)"
    )
    monkeypatch.delenv(PYTHON_ENV)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    code, out, err = benchmark("-c", tiny[0], "--prompts", tiny[1])
    assert code == 2 and err.startswith("Error: llama.cpp is not set up: run 'specdec setup-llamacpp'")


def test_a_target_that_is_not_a_gguf_file_is_refused(tiny, monkeypatch):
    monkeypatch.setenv(PYTHON_ENV, "/bin/sh")  # any file: the GGUF is checked next, before any work
    code, out, err = benchmark("-c", tiny[0], "--prompts", tiny[1])
    assert code == 2 and out == ""
    assert err.startswith("Error: llama.cpp runs GGUF files, and the target tiny") and "smollm2-135m-instruct" in err


def test_batches_are_refused(tiny):
    code, _, err = benchmark("-c", tiny[0], "--prompts", tiny[1], "--batch-sizes", "2")
    assert code == 2 and "--peer llamacpp decodes one prompt at a time" in err


def set_up() -> bool:
    builtin = cache_dir() / "smollm2-135m-instruct" / "config.json"
    return (default_venv() / "bin" / "python").is_file() and builtin.is_file()


@pytest.mark.skipif(not set_up(), reason="needs specdec setup-llamacpp and the built-in SmolLM2 fetched")
def test_the_default_pair_beside_llamacpp(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": "q", "category": "qa", "turns": ["Count from 1 to 20."]}) + "\n")
    config = BUILTIN_CONFIGS / "smollm2-draft.yaml"
    code, out, err = benchmark("-c", str(config), "--prompts", str(prompts), "--max-new-tokens", "24", "--json")
    assert code == 0, err
    record = json.loads(out)
    peers = {row["engine"]: row for row in record["peers"]}
    assert set(peers) == {"llamacpp", "llamacpp prompt lookup"}
    for row in peers.values():
        assert row["peer_decode_tokens_per_second"][0] > 0 and row["specdec_decode_tokens_per_second"][0] > 0
    assert peers["llamacpp prompt lookup"]["peer_mean_accepted_length"] >= 1.0
    runs = [r for r in record["runs"] if r["engine"].startswith("llamacpp")]
    for run in runs:
        [repeat] = run["repeats"]
        assert repeat["new_tokens"] == 24 and repeat["prefill_seconds"] > 0
        # each forward emits its accepted drafts and one token; the steps add up to the tokens
        assert sum(step[2] for step in repeat["steps"]) == 24
        assert all(step[2] == step[1] + 1 and step[1] <= step[0] for step in repeat["steps"][:-1])
    assert "llama-cpp-python 0.3.36" in record["peer_fairness"] and ".gguf" in record["peer_fairness"]
    assert record["peer_versions"] == {"llamacpp": "0.3.36"}
    assert Path(record["peer_fairness"].split("as it ships (")[1].split(")")[0]).is_file()
