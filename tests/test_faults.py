"""Faults a user or the machine causes, each ending as promised: exit 2 with one bounded `Error:` line
(found before the run where it can be), records written whole or not at all, nothing silently wrong."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from specdec_cli import interrupts
from specdec_cli.cli import app
from specdec_cli.config import TinyModel
from specdec_cli.distill.state import claimed
from specdec_cli.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, MESSAGE_LIMIT
from specdec_cli.loading.checkpoints import build_tiny, byte_tokenizer
from specdec_cli.methods.recycling import RecyclingDrafter, last_occurrences

runner = CliRunner()


def refused(result, *fragments: str) -> str:
    """The run ended with exit 2 and one `Error:` line holding the fragments; returns the line."""
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert lines and lines[-1].startswith("Error: "), result.stderr
    assert "internal error" not in lines[-1]
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]


def generate(config: Path, *args: str):
    return runner.invoke(app, ["generate", "-c", str(config), "--prompt", "Hi", *args])


@contextmanager
def mounted(folder: Path, *options: str):
    """A tmpfs at `folder` (a full disk, a read-only file system), or the test is skipped where this
    process may not mount one."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def fill(path: Path) -> None:
    """Write to `path` until the disk is full."""
    with open(path, "wb", buffering=0) as file:
        try:
            while True:
                file.write(b"\0" * 4096)
        except OSError:
            pass


def test_a_runs_folder_that_cannot_hold_records_is_refused_before_the_run(write_config, tmp_path):
    config = write_config()
    afile = tmp_path / "afile"
    afile.write_text("x")
    refused(generate(config, "--runs-dir", str(afile)), "cannot write run records", "is a file")
    refused(generate(config, "--runs-dir", str(afile / "below")), "cannot write run records", "Not a directory")
    refused(generate(config, "--runs-dir", ""), "--runs-dir is empty")
    result = runner.invoke(app, ["compare", "a", "b", "--runs-dir", str(afile)])
    refused(result, "is a file")  # before the records are even read
    with mounted(tmp_path / "ro", "ro") as read_only:
        started = time.monotonic()
        line = refused(generate(config, "--runs-dir", str(read_only), "--json"), "Read-only file system")
        assert time.monotonic() - started < 5, line  # found before the models load and decode


def test_the_environment_variable_is_checked_as_the_flag_and_empty_means_unset(write_config, tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setenv("SPECDEC_RUNS_DIR", str(afile))
    refused(generate(write_config()), "is a file")
    monkeypatch.setenv("SPECDEC_RUNS_DIR", "")
    monkeypatch.chdir(tmp_path)
    assert generate(write_config()).exit_code == 0
    assert len(list((tmp_path / "runs").glob("*/record.json"))) == 1


def test_a_long_config_name_still_gets_its_record(write_config, tmp_path):
    result = generate(write_config({"name": "n" * 300}))
    assert result.exit_code == 0, result.output
    (record,) = (tmp_path / "runs").glob("*/record.json")
    assert json.loads(record.read_text())["name"] == "n" * 300
    assert len(record.parent.name.encode()) < 255


def test_a_full_disk_keeps_the_printed_result_and_leaves_no_truncated_record(write_config, tmp_path):
    with mounted(tmp_path / "full", "size=64k") as full:
        fill(full / "filler")
        result = generate(write_config(), "--runs-dir", str(full), "--json")
        refused(result, "the record could not be written", "No space left on device")
        assert json.loads(result.stdout)["command"] == "generate"  # the result is not lost
        leftovers = [p for p in full.rglob("*") if p.is_file() and p.name != "filler"]
        assert not leftovers or all(json.loads(p.read_text()) for p in leftovers if p.name == "record.json")
        assert not list(full.rglob("*.tmp"))


def test_a_signal_during_a_save_waits_for_the_save_and_a_second_does_not_cut_it_short():
    """The handlers the CLI installs, in this process: a signal inside `saving()` interrupts only after
    it; after a first signal, a second neither interrupts the save nor raises."""
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    interrupts.install()
    try:
        steps = []
        with pytest.raises(KeyboardInterrupt):
            with interrupts.saving():
                os.kill(os.getpid(), signal.SIGTERM)
                steps.append("saved")
        assert steps == ["saved"]
        interrupts.install()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs between bytecodes: never reached
        with interrupts.saving():
            os.kill(os.getpid(), signal.SIGTERM)  # the second: the save goes on
            steps.append("saved after the second")
        assert steps[-1] == "saved after the second"
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def test_two_sigterms_during_benchmark_keep_a_whole_partial_record(write_config, tmp_path):
    config = write_config({"generation": {"max_new_tokens": 64, "ignore_eos": True}})
    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "specdec_cli", "benchmark", "-c", str(config), "--repeats", "200"]
    job = subprocess.Popen(
        [*command, "--runs-dir", str(runs), "--temperatures", "0,1"], stderr=subprocess.PIPE, text=True
    )
    time.sleep(12)  # loaded and measuring: a run of this size takes minutes
    assert job.poll() is None, "the benchmark ended before the signals"
    job.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    job.send_signal(signal.SIGTERM)
    stderr = job.communicate(timeout=120)[1]
    assert job.returncode == EXIT_INTERRUPTED, stderr
    (record,) = runs.glob("*-benchmark-*/record.json")
    assert json.loads(record.read_text())["partial"] is True


def test_batch_sizes_larger_than_the_prompts_are_refused(write_config):
    result = runner.invoke(
        app,
        ["benchmark", "-c", str(write_config()), "--limit", "1", "--category", "qa"]
        + [
            "--batch-sizes",
            "1000000",
        ],
    )
    refused(result, "--batch-sizes 1000000", "1 prompts selected")


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"\xff\xfe\x00garbage", "not UTF-8"),
        (b"[1, 2]", "is not a benchmark record"),
        (
            b'{"command": "benchmark", "name": "x", "timestamp": "t", "summary": [{"group": "overall"}]}',
            "summary row 0",
        ),
        (b'{"command": "benchmark", "name": "x", "timestamp": "t", "summary": [], "settings": null}', "settings"),
        (b'{"command": "benchmark"', "is not JSON"),
    ],
)
def test_compare_refuses_records_it_cannot_read(tmp_path, content, fragment):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    refused(runner.invoke(app, ["compare", str(bad), str(bad), "--no-record"]), fragment)


def test_a_prompt_on_stdin_that_is_not_utf8_is_bad_input(write_config):
    result = runner.invoke(app, ["generate", "-c", str(write_config()), "--prompt", "-"], input=b"caf\xe9\n")
    refused(result, "the prompt on stdin is not UTF-8")


def save_tiny(folder: Path, **changes) -> Path:
    model = build_tiny(TinyModel(num_layers=1))
    if changes:
        config = model.config.to_dict() | changes
        model = type(model)(type(model.config)(**config))
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_a_draft_embedding_smaller_than_the_shared_tokenizer_is_refused_at_load(write_config, tmp_path):
    draft = save_tiny(tmp_path / "draft", vocab_size=200, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    refused(generate(write_config({"draft": {"checkpoint": str(draft)}})), "draft", "200 rows", "258 tokens")


def test_a_config_that_disagrees_with_its_weights_is_refused(write_config, tmp_path):
    target = save_tiny(tmp_path / "target")
    settings = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(settings | {"vocab_size": 10**9}))
    config = write_config({"target": {"checkpoint": str(target)}, "draft": {"ngram": {}}})
    refused(generate(config), "config.json disagrees with the shapes of its weights")


def test_distill_refuses_an_out_it_cannot_use_and_a_second_run_into_one_out(write_config, tmp_path):
    config = str(write_config({"draft": {"ngram": {}}}))
    afile = tmp_path / "afile"
    afile.write_text("x")
    refused(runner.invoke(app, ["distill", "-c", config, "--out", str(afile)]), "is a file")
    out = tmp_path / "draft"
    with claimed(out):  # a run that holds `out`
        result = runner.invoke(app, ["distill", "-c", config, "--out", str(out)])
    refused(result, "another specdec distill is writing to")
    with mounted(tmp_path / "ro", "ro") as read_only:
        refused(runner.invoke(app, ["distill", "-c", config, "--out", str(read_only / "d")]), "Read-only")


def test_an_alias_bomb_gives_a_bounded_error_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"{c}: &{c} [{', '.join(['*' + p] * 10)}]" for p, c in zip("abcdefg", "bcdefgh")]
    bomb.write_text("\n".join(levels) + "\nname: *h\ntarget: {tiny: {}}\ndraft: {ngram: {}}\n")
    line = refused(runner.invoke(app, ["generate", "-c", str(bomb), "--prompt", "x"]))
    assert len(line) < MESSAGE_LIMIT + 100


def test_duplicate_yaml_keys_are_refused(tmp_path):
    config = tmp_path / "dup.yaml"
    config.write_text("name: a\nname: b\ntarget: {tiny: {}}\ndraft: {ngram: {}}\n")
    refused(runner.invoke(app, ["generate", "-c", str(config), "--prompt", "x"]), "duplicate key 'name'", "line 2")


def test_a_stdout_that_cannot_be_written_is_exit_2(write_config):
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "specdec_cli", "generate", "-c", str(write_config()), "-p", "Hi", "--json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
        )
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("Error: ") and "No space left on device" in lines[-1], done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


def test_recycling_keeps_the_last_occurrence_of_a_repeated_input():
    """A token that is the input at two positions: only its last position updates its row, the others go
    to the unused row, so no row mixes two top-k lists (index_copy_'s winner is undefined on CUDA)."""
    rows = torch.tensor([5, 7, 5, 9, 7, 5])
    sink = 100
    assert last_occurrences(rows, sink).tolist() == [sink, sink, sink, 9, 7, 5]
    vocab = 10
    drafter = RecyclingDrafter(candidates=2, vocab_size=vocab, device=torch.device("cpu"))
    logits = torch.zeros(1, 3, vocab)
    logits[0, 0, [1, 2]] = torch.tensor([2.0, 1.0])  # after the first 4: 1, then 2
    logits[0, 2, [3, 8]] = torch.tensor([1.0, 2.0])  # after the second 4: 8, then 3
    drafter.observe(torch.tensor([[4, -1, 4]]), logits)
    assert drafter.table[4].tolist() == [8, 3]
