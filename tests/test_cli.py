"""`specdec generate` driven in-process: config errors, flag precedence, --json records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer.main
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.config import TinyModel
from specdec_cli.errors import EXIT_BAD_INPUT, SpecdecError
from specdec_cli.loading.checkpoints import build_tiny, byte_tokenizer
from specdec_cli.loading.decode_matmul import PROCESS_CHOICE
from specdec_cli.pair import resolve_device

runner = CliRunner()


def run(*args: str, stdin: str | None = None):
    return runner.invoke(app, list(args), input=stdin)


def generate_json(config: Path, *args: str) -> dict:
    result = run("generate", "-c", str(config), "--prompt", "Hello there", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_record_on_stdout_and_in_runs(write_config, tmp_path):
    record = generate_json(write_config())
    assert record["command"] == "generate"
    assert len(record["token_ids"]) == record["stats"]["new_tokens"] <= 16
    assert record["stats"]["target_forwards"] == len(record["steps"])
    assert record["environment"]["dtype"] == "float32"
    assert record["environment"]["versions"]["torch"]
    matmul = record["environment"]["decode_matmul"]
    assert matmul is not None and matmul == PROCESS_CHOICE.name(torch.float32)  # the process's choice, named
    assert record["config"]["sampling"]["temperature"] == 0.0
    saved = list((tmp_path / "runs").glob("*-generate-tiny-test/record.json"))
    assert len(saved) == 1
    assert json.loads(saved[0].read_text())["token_ids"] == record["token_ids"]


def test_flags_override_yaml_including_zero_and_false(write_config):
    config = write_config(
        {
            "sampling": {"temperature": 0.9, "top_k": 5, "top_p": 0.5, "seed": 3},
            "generation": {"max_new_tokens": 16, "ignore_eos": True},
        }
    )
    record = generate_json(
        config,
        "--temperature",
        "0",
        "--top-k",
        "0",
        "--top-p",
        "1",
        "--seed",
        "0",
        "--max-new-tokens",
        "8",
        "--stop-at-eos",
        "--num-draft-tokens",
        "2",
    )
    assert record["config"]["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
    assert record["config"]["generation"] == {"max_new_tokens": 8, "ignore_eos": False}
    assert record["config"]["speculation"]["num_draft_tokens"] == 2
    assert record["stats"]["new_tokens"] <= 8


def test_greedy_cli_output_equals_target_alone(write_config):
    """An identical draft through the CLI: every draft accepted, same tokens as target-only decoding."""
    same = generate_json(
        write_config({"draft": {"tiny": {"seed": 0}}, "generation": {"ignore_eos": True}}),
        "--max-new-tokens",
        "12",
        "--num-draft-tokens",
        "3",
    )
    assert same["stats"]["mean_accepted_length"] == 4.0
    assert same["stats"]["acceptance_rate"] == 1.0
    noisy = generate_json(write_config({"generation": {"ignore_eos": True}}), "--max-new-tokens", "12")
    assert noisy["token_ids"] == same["token_ids"]


def test_the_verification_rule_comes_from_yaml_or_flag_and_is_named(write_config):
    """The record and the title name the rule; greedy decoding is the same under either."""
    block = write_config({"sampling": {"temperature": 1.0}, "speculation": {"verification": "block"}})
    assert generate_json(block)["config"]["speculation"]["verification"] == "block"
    assert generate_json(block, "--verification", "token")["config"]["speculation"]["verification"] == "token"
    shown = run("generate", "-c", str(block), "--prompt", "Hello there")
    assert shown.exit_code == 0 and "tiny-test: 3 draft tokens, block verification, sampled" in shown.stderr
    greedy = [generate_json(write_config(), "--verification", rule)["token_ids"] for rule in ("token", "block")]
    assert greedy[0] == greedy[1]


def test_prompt_from_stdin_and_file(write_config, tmp_path):
    config = write_config()
    from_stdin = run("generate", "-c", str(config), "--prompt", "-", "--json", stdin="Hello there")
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("Hello there")
    from_file = run("generate", "-c", str(config), "--prompt-file", str(prompt_file), "--json")
    assert json.loads(from_stdin.stdout)["token_ids"] == json.loads(from_file.stdout)["token_ids"]


def assert_one_line_error(result, *fragments: str, code: int = EXIT_BAD_INPUT):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "changes, fragments",
    [
        ({"sampling": {"temprature": 1.0}}, ["unknown key", "`sampling.temprature`"]),
        ({"extra": 1}, ["unknown key", "`extra`"]),
        ({"sampling": {"temperature": "hot"}}, ["`sampling.temperature` must be float"]),
        ({"sampling": {"top_k": 1.5}}, ["`sampling.top_k` must be int"]),
        ({"sampling": {"temperature": -1}}, ["temperature must be a finite number >= 0"]),
        ({"sampling": {"temperature": float("nan")}}, ["temperature must be a finite number >= 0", "nan"]),
        ({"sampling": {"temperature": float("inf")}}, ["temperature must be a finite number >= 0", "inf"]),
        ({"sampling": {"top_p": 0}}, ["top_p must be in (0, 1]"]),
        ({"sampling": {"top_p": 1.5}}, ["top_p must be in (0, 1]"]),
        ({"sampling": {"top_k": -1}}, ["top_k must be >= 0"]),
        ({"speculation": {"num_draft_tokens": 0}}, ["num_draft_tokens must be between 1 and 256"]),
        ({"speculation": {"confidence_threshold": 1}}, ["confidence_threshold must be in [0, 1)"]),
        ({"speculation": {"verification": "blocks"}}, ["verification must be token or block, got 'blocks'"]),
        (
            {"draft": {"ngram": {}}, "speculation": {"confidence_threshold": 0.3}},
            ["confidence_threshold applies to drafts that draft token by token"],
        ),
        ({"runtime": {"dtype": "float8"}}, ["dtype must be"]),
        ({"runtime": {"cuda_graphs": "yes"}}, ["cuda_graphs must be off, on or auto, got 'yes'"]),
        ({"runtime": {"cuda_graphs": "on"}}, ["cuda_graphs: on needs a CUDA device, and the device is cpu"]),
        ({"draft": {"checkpoint": "/nonexistent/model"}}, ["checkpoint not found: /nonexistent/model"]),
        ({"draft": {"checkpoint": "missing.gguf"}}, ["checkpoint not found: /", "/missing.gguf"]),
        ({"draft": {}}, ["`draft` needs exactly one of"]),
        ({"target": {"tiny": {"max_position_embeddings": 20}}}, ["exceeds the target's context of 20"]),
    ],
)
def test_config_errors(write_config, changes, fragments):
    assert_one_line_error(run("generate", "-c", str(write_config(changes)), "--prompt", "Hello there"), *fragments)


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--temperature", "-0.5"], ["temperature must be a finite number >= 0"]),
        (["--temperature", "nan"], ["temperature must be a finite number >= 0"]),
        (["--temperature", "inf"], ["temperature must be a finite number >= 0"]),
        (["--top-p", "2"], ["top_p must be in (0, 1]"]),
        (["--num-draft-tokens", "0"], ["num_draft_tokens must be between 1 and 256"]),
        (["--confidence-threshold", "-0.1"], ["confidence_threshold must be in [0, 1)"]),
        (["--verification", "Block"], ["verification must be token or block, got 'Block'"]),
        (["--cuda-graphs", "on", "--device", "cpu"], ["cuda_graphs: on needs a CUDA device"]),
        # a list is benchmark's: generate and verify-distribution run one rule
        (["--verification", "token,block"], ["verification must be token or block, got 'token,block'"]),
    ],
)
def test_flag_errors(write_config, args, fragments):
    result = run("generate", "-c", str(write_config()), "--prompt", "Hello there", *args)
    assert_one_line_error(result, *fragments)


def test_verify_distribution_runs_one_verification_rule(write_config):
    result = run("verify-distribution", "-c", str(write_config()), "--verification", "token,block")
    assert_one_line_error(result, "verification must be token or block, got 'token,block'")


def test_benchmark_refuses_nan_temperatures(write_config):
    result = run("benchmark", "-c", str(write_config()), "--temperatures", "0,nan")
    assert_one_line_error(result, "--temperatures must be finite numbers >= 0")


def test_a_cuda_device_this_machine_lacks_is_bad_input(monkeypatch):
    # as on a machine with one GPU: the hardware query answers so, nothing else is stood in for
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SpecdecError, match="cuda:7 requested but this machine has 1 CUDA device"):
        resolve_device("cuda:7")
    assert resolve_device("cuda:0") == torch.device("cuda:0")


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target:\n  tiny: {seed: 0\ndraft: [\n")
    assert_one_line_error(run("generate", "-c", str(bad), "--prompt", "x"), "malformed YAML", "line")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    assert_one_line_error(run("generate", "-c", str(scalar), "--prompt", "x"), "top level must be a mapping")


def test_missing_config_and_prompt_errors(write_config):
    assert_one_line_error(run("generate", "-c", "no-such-config", "--prompt", "x"), "config not found")
    config = str(write_config())
    assert_one_line_error(run("generate", "-c", config, "--prompt", "   "), "the prompt is empty")
    assert_one_line_error(run("generate", "-c", config), "give exactly one of --prompt")
    assert_one_line_error(run("generate", "-c", config, "--prompt-file", "/no/such/file"), "/no/such/file not found")


def test_draft_with_a_different_tokenizer_is_refused(write_config, tmp_path):
    folder = tmp_path / "draft"
    build_tiny(TinyModel(seed=1)).save_pretrained(folder)
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(folder)
    result = run("generate", "-c", str(write_config({"draft": {"checkpoint": str(folder)}})), "--prompt", "Hi")
    assert_one_line_error(result, "tokenizers disagree on token ids")


def test_help_has_examples():
    result = run("generate", "--help")
    assert result.exit_code == 0
    assert "Examples" in result.stdout and "--temperature" in result.stdout


@pytest.mark.parametrize("args", [["generate", "--temperature", "hot"], ["generate", "--bogus"]])
def test_usage_errors_are_one_line_from_the_real_entry_point(args):
    done = subprocess.run([sys.executable, "-m", "specdec_cli", *args], capture_output=True, text=True)
    assert done.returncode == EXIT_BAD_INPUT
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr


@pytest.mark.parametrize("args", [["--help"], ["benchmark", "--help"], ["compare", "--help"]])
def test_the_command_line_starts_without_torch_transformers_or_matplotlib(args):
    """--help and argument checks must not pay for loading torch, transformers or matplotlib."""
    code = (
        "import sys; from specdec_cli.cli import main\n"
        "try: main()\n"
        "except SystemExit: pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    assert "Usage:" in done.stdout and done.stdout.strip().splitlines()[-1] == "[]"


def test_each_commands_summary_is_one_paragraph():
    """The docstrings' line breaks do not reach the help: `specdec --help` wraps each summary itself."""
    for name, command in typer.main.get_command(app).commands.items():
        assert "\n" not in command.help, name
    wide = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert "Flags override the config's YAML values." in wide.stdout


def test_records_go_where_asked_or_nowhere(write_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = str(write_config())
    asked = tmp_path / "elsewhere"
    run = runner.invoke(app, ["generate", "-c", config, "-p", "hi", "--runs-dir", str(asked)])
    assert run.exit_code == 0, run.output
    assert len(list(asked.glob("*-generate-tiny-test/record.json"))) == 1
    assert f"Record: {asked}" in run.stderr
    before = sorted(tmp_path.rglob("record.json"))
    run = runner.invoke(app, ["benchmark", "-c", config, "--limit", "1", "--category", "qa", "--no-record"])
    assert run.exit_code == 0, run.output
    assert "Not recorded (--no-record)." in run.stderr
    assert sorted(tmp_path.rglob("record.json")) == before and not list(tmp_path.rglob("report.md"))
    assert not list(tmp_path.rglob("chart.*"))
