"""`specdec distill` on a tiny random target: the draft learns, saves small, and decodes exactly."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.checkpoints import DRAFT_INFO

runner = CliRunner()

TARGET = {"tiny": {"seed": 0, "num_layers": 2}}


def test_distilled_draft_learns_and_decodes_exactly(tmp_path):
    config = tmp_path / "target.yaml"
    config.write_text(yaml.safe_dump({"name": "tiny", "target": TARGET, "draft": {"ngram": {}},
                                      "runtime": {"device": "cpu"}}))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["Hello there", "The quick brown fox", "Once upon a time", "Count to ten",
                                  "Write a poem", "A list: one, two", "What is two plus two", "abc abc"]))
    out = tmp_path / "draft"
    result = runner.invoke(app, ["distill", "-c", str(config), "--out", str(out), "--prompts", str(prompts),
                                 "--layers", "1", "--steps", "40", "--answers-per-prompt", "4",
                                 "--answer-tokens", "32", "--eval-every", "40", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    log = json.loads((out / DRAFT_INFO).read_text())["log"]
    assert log[-1]["expected_acceptance"] > log[0]["expected_acceptance"] + 0.01
    assert not (out / "distill-work").exists()
    # only the draft's own layer is stored; the embedding and head are the target's
    assert (out / "model.safetensors").stat().st_size < 200_000

    pair = tmp_path / "pair.yaml"
    pair.write_text(yaml.safe_dump({"name": "pair", "target": TARGET, "draft": {"checkpoint": "draft"},
                                    "generation": {"max_new_tokens": 24, "ignore_eos": True},
                                    "runtime": {"device": "cpu"}}))
    outputs = []
    for gamma in ("3", "1"):
        run = runner.invoke(app, ["generate", "-c", str(pair), "-p", "Hello there", "--json", "--gamma", gamma])
        assert run.exit_code == 0, run.output
        outputs.append(json.loads(run.stdout))
    # greedy speculative output is the target's own whatever the draft proposes; compare with gamma=1
    # and with the target alone (ngram drafter that never matches is the same loop)
    alone = runner.invoke(app, ["generate", "-c", str(config), "-p", "Hello there", "--json",
                                "--max-new-tokens", "24", "--ignore-eos"])
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"] == json.loads(alone.stdout)["token_ids"]
    assert outputs[0]["stats"]["acceptance_rate"] > 0
