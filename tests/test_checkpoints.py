"""Where a config's checkpoint paths point, and checkpoints or machines that fail: the CLI run
in-process on tiny real models, every failure one `Error:` line and exit 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from conftest import TINY_PAIR
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.config import TinyModel
from specdec_cli.errors import EXIT_BAD_INPUT, out_of_memory
from specdec_cli.loading.checkpoints import build_tiny, byte_tokenizer
from specdec_cli.methods.feature.draft import init_draft, save_draft

runner = CliRunner()


def write_pair(folder: Path, **changes) -> Path:
    """The tiny pair's config in `folder`, with sections replaced by `changes`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump({**TINY_PAIR, **changes}))
    return path


def plain_model(folder: Path) -> Path:
    """The tiny draft as a transformers folder (config, safetensors, tokenizer)."""
    build_tiny(TinyModel(seed=0, noise=0.005)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def the_error(result) -> str:
    """The run's one stderr line, `Error: ...`, after exit 2 and no traceback."""
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output and "internal error" not in result.output
    return lines[0]


def generate(config: Path, *args: str):
    return runner.invoke(app, ["generate", "-c", str(config), "-p", "Hi", *args])


# ---------------------------------------------------------------- paths


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """A hub cache that is empty and offline (HF_HUB_OFFLINE=1, HF_HUB_CACHE as huggingface_hub read
    them when imported): a name taken for a hub id fails as a hub error."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))


@pytest.mark.parametrize("role", ["draft", "target"])
@pytest.mark.parametrize("name", ["drafts/mine", "./mine", "../elsewhere/mine", "a/b/c", "mine.gguf"])
def test_a_missing_path_that_looks_local_is_not_found_where_the_config_points(tmp_path, no_hub, name, role):
    """Relative to the config's folder; `drafts/mine` is a path, not a hub id, as `drafts` is a folder there."""
    folder = tmp_path / "configs"
    (folder / "drafts").mkdir(parents=True)
    config = write_pair(folder, **{role: {"checkpoint": name}})
    expected = (folder / name).resolve()
    assert the_error(generate(config)) == f"Error: checkpoint not found: {expected}"


def test_relative_paths_are_relative_to_the_config_not_to_the_working_directory(tmp_path, no_hub, monkeypatch):
    plain_model(tmp_path / "work" / "drafts" / "mine")
    monkeypatch.chdir(tmp_path / "work")
    inside = write_pair(tmp_path / "configs", draft={"checkpoint": "drafts/mine"})
    assert the_error(generate(inside)) == f"Error: checkpoint not found: {tmp_path / 'configs' / 'drafts' / 'mine'}"
    beside = write_pair(tmp_path / "work", draft={"checkpoint": "drafts/mine"})
    assert generate(beside, "--json").exit_code == 0
    above = write_pair(tmp_path / "configs", draft={"checkpoint": "../work/drafts/mine"})
    assert generate(above, "--json").exit_code == 0


def test_a_hub_id_is_owner_slash_name_that_is_no_local_folder(tmp_path, no_hub):
    config = write_pair(tmp_path, draft={"checkpoint": "someone/draft"})
    assert the_error(generate(config)).startswith("Error: cannot fetch someone/draft from the Hugging Face hub: ")


def test_an_empty_folder_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    config = write_pair(tmp_path, draft={"checkpoint": "empty"})
    assert the_error(generate(config)) == f"Error: checkpoint {tmp_path / 'empty'}: not a model folder (no config.json)"


# ---------------------------------------------------------------- corrupt files, memory


def specdec_draft(folder: Path) -> Path:
    """A draft as `specdec distill` saves it (untrained), for the tiny target."""
    target = build_tiny(TinyModel(seed=0))
    draft = init_draft(target, 1, torch.arange(target.config.vocab_size))
    save_draft(draft, byte_tokenizer(), folder, {"target": "tiny"})
    return folder


@pytest.mark.parametrize("role", ["target", "draft", "specdec draft"])
def test_a_truncated_safetensors_file_is_named(tmp_path, role):
    folder = specdec_draft(tmp_path / "model") if role == "specdec draft" else plain_model(tmp_path / "model")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    config = write_pair(tmp_path, **{role.split()[-1]: {"checkpoint": "model"}})
    error = the_error(generate(config))
    assert error.startswith(f"Error: {weights}: not a readable safetensors file (truncated or corrupt?)"), error


def test_a_safetensors_header_of_garbage_is_named(tmp_path):
    folder = plain_model(tmp_path / "model")
    (folder / "model.safetensors").write_bytes(b"\xff" * 8 + b"{not json")
    config = write_pair(tmp_path, draft={"checkpoint": "model"})
    assert "model.safetensors: not a readable safetensors file" in the_error(generate(config))


def test_running_out_of_memory_on_the_cpu_is_one_line_with_what_to_try(tmp_path):
    """A context the tiny target allows but no machine holds: the KV cache allocation fails."""
    huge = 10**12
    config = write_pair(tmp_path, target={"tiny": {"seed": 0, "max_position_embeddings": 2 * huge}})
    error = the_error(generate(config, "--max-new-tokens", str(huge)))
    assert error.startswith("Error: out of memory on the CPU"), error
    assert "--max-new-tokens" in error and "--dtype" in error


def test_cuda_out_of_memory_reads_as_one_line_with_the_gpu_and_what_to_try():
    """torch's CUDA allocator message (c10/cuda/CUDACachingAllocator.cpp), as its OutOfMemoryError
    carries it; tests/test_cuda.py runs out of GPU memory for real."""
    exc = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.72 GiB of which "
        "1.20 GiB is free. Including non-PyTorch memory, this process has 138.50 GiB memory in use. Of the "
        "allocated memory 137.00 GiB is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated."
    )
    error = out_of_memory(exc)
    assert error.exit_code == EXIT_BAD_INPUT
    assert str(error).startswith("out of memory on GPU 0 (1.20 GiB free of 139.72 GiB) allocating 2.00 GiB: try ")
    assert out_of_memory(RuntimeError("shape mismatch")) is None and out_of_memory(ValueError("x")) is None


@pytest.mark.parametrize("text", ["[]", '"a string"'])
def test_a_config_json_that_is_no_mapping_is_named(tmp_path, text):
    folder = plain_model(tmp_path / "model")
    (folder / "config.json").write_text(text)
    config = write_pair(tmp_path, draft={"checkpoint": "model"})
    assert the_error(generate(config)) == f"Error: {folder / 'config.json'}: not a JSON object"
