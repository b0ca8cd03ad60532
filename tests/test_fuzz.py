"""Property-based: whatever the config, flags, prompt and checkpoint paths, `specdec generate` either
runs (exit 0) or exits 2 with one `Error:` line, never a traceback or an internal error.

Configs start as the tiny pair and get random edits: any key of the schema (taken from the config
dataclasses) or an unknown one set to a value of any type (huge, negative, non-finite, unicode, a
list or a mapping), sections deleted or replaced; now and then the file is not YAML or not UTF-8.
Checkpoints are broken folders and files (empty, truncated, garbage) or names. Prompts come inline,
from stdin, from files of random bytes, or from a `--prompts` file. Valid sizes stay small (up to
40 tokens, 40-wide models) so a case that runs is fast; invalid ones are large. The CLI runs
in-process through `main()`, as the command line does. SPECDEC_FUZZ_EXAMPLES sets the number of
cases (a longer local hunt: SPECDEC_FUZZ_EXAMPLES=2000)."""

from __future__ import annotations

import copy
import dataclasses
import faulthandler
import os
import re
import sys
import tempfile
import types
import typing
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from conftest import TINY_PAIR
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from specdec_cli.cli import main
from specdec_cli.config import Config, TinyModel
from specdec_cli.loading.checkpoints import build_tiny, byte_tokenizer

EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "60"))
CASE_SECONDS = 120  # a case that runs longer is a hang: it ends the run instead of stalling it


def key_types(cls: type, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], type]:
    """Every key of the config schema, nested ones as paths (("target", "tiny", "hidden_size")), and
    its type."""
    keys = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name == "source":
            continue
        path, tp = (*prefix, f.name), hints[f.name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(t for t in typing.get_args(tp) if t is not type(None))
        keys[path] = tp
        if dataclasses.is_dataclass(tp):
            keys |= key_types(tp, path)
    return keys


KEYS = key_types(Config)
HUGE = [10**12, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400]
INTS = st.one_of(st.integers(-2, 40), st.sampled_from(HUGE))
FLOATS = st.one_of(st.floats(-0.5, 1.5), st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=12))
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.dictionaries(st.one_of(st.text(max_size=6), st.integers(), st.none()), SCALARS, max_size=3),
)
OF_TYPE = {int: INTS, float: FLOATS, bool: st.booleans(), str: st.text(max_size=12)}
DEVICES = st.sampled_from(["cpu", "cpu", "auto", "cuda", "cuda:0", "cuda:x", "cuda:-1", "mps", " cpu", "CPU", "é"])
DTYPES = st.sampled_from(["float32", "bfloat16", "float16", "auto", "float8", "int8", "", "ü"])
NUMBERS = st.one_of(INTS.map(str), FLOATS.map(repr), st.text(max_size=6))
FLAGS = {
    "--temperature": FLOATS.map(repr),
    "--top-k": INTS.map(str),
    "--top-p": FLOATS.map(repr),
    "--seed": INTS.map(str),
    "--num-draft-tokens": INTS.map(str),
    "--max-new-tokens": INTS.map(str),
    "--confidence-threshold": FLOATS.map(repr),
    "--threads": st.sampled_from(["1", "2", "0", "-1", str(2**31), str(10**12)]),
    "--batch-size": INTS.map(str),
    "--device": DEVICES,
    "--dtype": DTYPES,
    "--any": NUMBERS,  # a value of the wrong kind for a random flag, or a flag that does not exist
}
SWITCHES = ["--json", "--raw", "--ignore-eos", "--stop-at-eos"]


def broken_checkpoints(root: Path) -> list[str]:
    """Checkpoints in `root` that are not what a config says (folders and files, as absolute paths),
    one that is, and names that are no checkpoint."""

    def plain(name: str) -> Path:
        folder = root / name
        build_tiny(TinyModel(seed=0, noise=0.005)).save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
        return folder

    plain("plain")
    (root / "empty").mkdir()
    (root / "config only").mkdir()
    (root / "config only" / "config.json").write_text((root / "plain" / "config.json").read_text())
    for name, text in {"config not json": b"\xff{", "config a list": b"[]", "config empty": b""}.items():
        plain(name)
        (root / name / "config.json").write_bytes(text)
    truncated = plain("truncated") / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    garbage = plain("garbage header") / "model.safetensors"
    garbage.write_bytes(b"\xff" * 8 + b"{not json")
    pickled = plain("truncated pickle")
    torch.save(build_tiny(TinyModel(seed=0)).state_dict(), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes((pickled / "pytorch_model.bin").read_bytes()[:5000])
    (root / "a file").write_bytes(os.urandom(100))
    (root / "truncated.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + os.urandom(40))
    (root / "empty.gguf").write_bytes(b"")
    return [str(path) for path in root.iterdir()] + ["someone/draft", "", " ", "missing/one", "./missing", "smollm2"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    return broken_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module", autouse=True)
def no_hub(tmp_path_factory):
    """An empty, offline hub cache: a name taken for a hub id fails without a network."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf")))
        yield


def set_key(data: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        if not isinstance(data.get(key), dict):
            data[key] = {}
        data = data[key]
    data[path[-1]] = value


def delete_key(data: dict, path: tuple) -> None:
    for key in path[:-1]:
        data = data.get(key)
        if not isinstance(data, dict):
            return
    data.pop(path[-1], None)


@st.composite
def config_files(draw, checkpoints: list[str]) -> bytes:
    """The bytes of a config file: the tiny pair with random edits, or text that is no such config."""
    kind = draw(st.sampled_from(["edited"] * 18 + ["text", "bytes"]))
    if kind == "text":
        return draw(st.text(max_size=60)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=60))
    data = copy.deepcopy(TINY_PAIR)
    special = {
        ("target", "checkpoint"): st.sampled_from(checkpoints),
        ("draft", "checkpoint"): st.sampled_from(checkpoints),
        ("runtime", "device"): DEVICES,
        ("runtime", "dtype"): DTYPES,
    }
    unknown = st.lists(st.text(max_size=6), min_size=1, max_size=2).map(tuple)
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))):
        path = draw(unknown if draw(st.integers(0, 9)) == 9 else st.sampled_from(sorted(KEYS)))
        edit = draw(st.sampled_from(["of its type"] * 6 + ["checkpoint", "checkpoint", "any", "delete", "empty"]))
        if edit == "checkpoint":  # the target or draft read from a checkpoint instead
            path = (draw(st.sampled_from(["target", "draft"])), "checkpoint")
            data[path[0]] = {}
        if path[0] == "generation" and edit in ("delete", "empty"):
            continue  # the default, 128 tokens, is valid but slow: runs stay at 40 tokens or fewer
        if edit == "delete":
            delete_key(data, path)
        elif edit == "empty":
            set_key(data, path, draw(st.sampled_from([{}, None, []])))
        else:
            typed = special.get(path, OF_TYPE.get(KEYS.get(path), VALUES))
            set_key(data, path, draw(VALUES if edit == "any" else typed))
    return yaml.safe_dump(data, allow_unicode=True).encode()


@st.composite
def prompts(draw, folder: Path) -> tuple[list[str], str | None]:
    """Prompt arguments (files written into `folder`) and stdin."""
    kind = draw(st.sampled_from(["inline"] * 6 + ["stdin", "file", "file", "prompts", "prompts", "none", "two"]))
    nice = st.sampled_from(["Hello there", "Once upon a time", "abc abc abc"])
    odd = st.sampled_from(["", "   ", "\n\t ", "a" * 5000, "Hi\x00there"])
    texts = st.one_of(nice, nice, st.text(min_size=1, max_size=80), odd)
    files = st.one_of(st.binary(max_size=80), st.sampled_from([b"\xff\xfeH\x00i\x00", b"", b"\x00\x00", b"a\nb\n"]))
    if kind == "inline":
        return ["--prompt", draw(texts)], None
    if kind == "stdin":
        return ["--prompt", "-"], draw(texts)
    if kind == "none":
        return [], None
    path = folder / draw(st.sampled_from(["prompt.txt", "prompt.jsonl", "prompt"]))
    path.write_bytes(draw(files) if draw(st.booleans()) else draw(texts).encode())
    if kind == "file":
        return ["--prompt-file", str(path)], None
    if kind == "prompts":
        return ["--prompts", str(path)], None
    return ["--prompt", "Hi", "--prompt-file", str(path)], None


@st.composite
def flags(draw) -> list[str]:
    args = []
    for flag in draw(st.lists(st.sampled_from(sorted(FLAGS)), unique=True, max_size=3)):
        name = draw(st.sampled_from([*sorted(set(FLAGS) - {"--any"}), "--bogus"])) if flag == "--any" else flag
        args += [name, draw(FLAGS[flag])]
    return args + draw(st.lists(st.sampled_from(SWITCHES), unique=True, max_size=2))


def run_main(args: list[str], stdin: str | None) -> tuple[int, str]:
    """`specdec ARGS` as the command line runs it: the exit code and stderr. A case that hangs ends
    the test run with the stacks of its threads (a timer thread: no signal handler to swallow it)."""
    threads, argv = torch.get_num_threads(), sys.argv
    faulthandler.dump_traceback_later(CASE_SECONDS, exit=True)
    try:
        with CliRunner().isolation(input=stdin) as (_, err, _):
            sys.argv = ["specdec", *args]
            with pytest.raises(SystemExit) as done:
                main()
            sys.stderr.flush()
            return done.value.code, err.getvalue().decode()
    finally:
        faulthandler.cancel_dump_traceback_later()
        torch.set_num_threads(threads)  # --threads is process-wide
        sys.argv = argv


def run_case(data: st.DataObject, checkpoints: list[str]) -> tuple[int, str]:
    """One drawn command line, run: its exit code and stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.yaml").write_bytes(data.draw(config_files(checkpoints), label="config"))
        prompt_args, stdin = data.draw(prompts(folder), label="prompt")
        args = ["generate", "-c", str(folder / "config.yaml"), *prompt_args, *data.draw(flags(), label="flags")]
        return run_main(args, stdin)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(data=st.data())
def test_any_input_runs_or_is_one_error_line(checkpoints, data):
    code, stderr = run_case(data, checkpoints)
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    event(re.sub(r"/\S+", "PATH", errors[0])[:40] if errors else f"exit {code}")  # --hypothesis-show-statistics
    assert code in (0, 2), stderr
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    assert len(errors) == (code == 2), stderr


# What the fuzzing found: each an internal error (or a hang) before its fix. A config is the tiny pair
# with sections replaced, or the bytes of the file; the error line must name the problem.
FOUND = {
    "config not UTF-8": (b"\x80name: x\n", ["-p", "Hi"], "config {folder}/config.yaml is not UTF-8 text (byte 0x80"),
    "prompt file in UTF-16": (
        {},
        ["--prompt-file", "{folder}/prompt.txt"],
        "prompt file {folder}/prompt.txt is not UTF-8 text (byte 0xff at offset 0, it looks like UTF-16)",
    ),
    "no attention heads' width": (
        {"target": {"tiny": {"hidden_size": 0}}},
        ["-p", "Hi"],
        "config: `target.tiny.hidden_size` must be >= 1, got 0",
    ),
    "heads that do not divide the width": (
        {"draft": {"tiny": {"hidden_size": 60, "num_heads": 8}}},
        ["-p", "Hi"],
        "config: `draft.tiny.hidden_size` (60) must be a multiple of `num_heads` (8)",
    ),
    "key/value heads that do not divide the heads": (
        {"draft": {"tiny": {"num_heads": 4, "num_kv_heads": 3}}},
        ["-p", "Hi"],
        "config: `draft.tiny.num_heads` (4) must be a multiple of `num_kv_heads` (3)",
    ),
    "heads of an odd width": (
        {"draft": {"tiny": {"hidden_size": 12, "num_heads": 4}}},
        ["-p", "Hi"],
        "config: `draft.tiny` heads are 3 wide (hidden_size / num_heads): rotary embeddings need an even width",
    ),
    "unknown keys that are not all strings": (
        b"target: {tiny: {}}\ndraft: {tiny: {}}\nsampling: {null: 1, 7: 2, x: 3}\n",
        ["-p", "Hi"],
        "config: unknown key `sampling.7`, `sampling.None`, `sampling.x`",
    ),
    "a tiny model of 2**31 layers (building it never ended)": (
        {"target": {"tiny": {"num_layers": 2**31}}},
        ["-p", "Hi"],
        "config: `target.tiny` is no tiny model: 8.8e+13 parameters (at most 2**30)",
    ),
    "a negative init std": (
        {"draft": {"tiny": {"init_std": -0.3}}},
        ["-p", "Hi"],
        "config: `draft.tiny.init_std` must be in [0, 1], got -0.3",
    ),
    "noise that is not a number": (
        {"draft": {"tiny": {"noise": float("nan")}}},
        ["-p", "Hi"],
        "config: `draft.tiny.noise` must be a finite number >= 0, got nan",
    ),
    "a seed beyond 64 bits": (
        {},
        ["-p", "Hi", "--seed", str(10**20)],
        f"`sampling.seed` must be between -2**62 and 2**62, got {10**20}",
    ),
    "a tiny seed beyond 64 bits": (
        {"draft": {"tiny": {"seed": -(2**64)}}},
        ["-p", "Hi"],
        f"`draft.tiny.seed` must be between -2**62 and 2**62, got {-(2**64)}",
    ),
    "more threads than the machine has CPUs": (
        {},
        ["-p", "Hi", "--threads", "100000"],
        f"threads must be between 1 and {os.cpu_count()} (the CPUs of this machine), got 100000",
    ),
    "a draft length no forward verifies": (
        {},
        ["-p", "Hi", "--num-draft-tokens", str(2**70)],
        f"num_draft_tokens must be between 1 and 256, got {2**70}",
    ),
    "a CUDA device that is no number": (
        {},
        ["-p", "Hi", "--device", "cuda:x"],
        "device must be auto, cpu, cuda or cuda:N, got 'cuda:x'",
    ),
    "a cache larger than 64 bits count": (
        {"target": {"tiny": {"max_position_embeddings": 2**61}}},
        ["-p", "Hi", "--max-new-tokens", str(2**60)],
        "out of memory on any device allocating more than 2**63 bytes: try ",
    ),
    "an empty checkpoint name": ({"draft": {"checkpoint": ""}}, ["-p", "Hi"], "config: `draft.checkpoint` is empty"),
}


@pytest.mark.parametrize("case", FOUND)
def test_what_the_fuzzing_found_is_one_error_line_naming_it(tmp_path, case):
    config, args, message = FOUND[case]
    data = yaml.safe_dump({**TINY_PAIR, **config}).encode() if isinstance(config, dict) else config
    (tmp_path / "config.yaml").write_bytes(data)
    (tmp_path / "prompt.txt").write_bytes("\ufeffHi".encode("utf-16-le"))
    code, stderr = run_main(
        ["generate", "-c", str(tmp_path / "config.yaml"), *(a.format(folder=tmp_path) for a in args)], None
    )
    assert code == 2 and stderr.startswith(f"Error: {message.format(folder=tmp_path)}"), stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
