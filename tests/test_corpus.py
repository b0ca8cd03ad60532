"""`specdec corpus`: prompts of many kinds from a seed, shards of token ids that a rerun continues, and
`distill --answers FOLDER` training on them."""

from __future__ import annotations

import json
import random

import numpy as np
import yaml
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.distill.prompt_mix import PromptMaker, ngrams
from specdec_cli.distill.writing import MANIFEST, ids_dtype, read_corpus, read_shard

runner = CliRunner()
TARGET = {"tiny": {"seed": 0, "num_layers": 2}}


def corpus_args(tmp_path, tokens: str, *more: str) -> list[str]:
    config = tmp_path / "target.yaml"
    config.write_text(yaml.safe_dump({"name": "tiny", "target": TARGET, "draft": {"ngram": {}}}))
    options = "--prompts-per-shard 8 --answer-tokens 16 --batch-size 4 --temperatures 0,1 --dtype float32"
    return ["corpus", "-c", str(config), "--out", str(tmp_path / "corpus"), "--tokens", tokens, *options.split(), *more]


def test_a_corpus_is_written_in_shards_continued_by_the_same_command_and_trained_on(tmp_path):
    result = runner.invoke(app, [*corpus_args(tmp_path, "200"), "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    folder = tmp_path / "corpus"
    manifest = json.loads((folder / MANIFEST).read_text())
    shards = manifest["shards"]
    assert record["answer_tokens"] == sum(s["answer_tokens"] for s in shards) >= 200
    assert record["answers"] == 8 * len(shards)
    assert [s["temperature"] for s in shards] == [0.0, 1.0] * (len(shards) // 2) + [0.0] * (len(shards) % 2)
    first = read_shard(folder / "shard-00000.npz")
    assert len(first.prompts) == len(first.answers) == len(first.texts) == 8
    assert all(0 <= t < 258 for a in first.answers for t in a) and all(0 < len(a) <= 16 for a in first.answers)
    assert len(set(first.texts)) == 8
    kept = (folder / "shard-00000.npz").read_bytes()

    result = runner.invoke(app, corpus_args(tmp_path, "400"))  # more: the shards written stay as they are
    assert result.exit_code == 0, result.output
    more = json.loads((folder / MANIFEST).read_text())["shards"]
    assert more[: len(shards)] == shards and len(more) > len(shards)
    assert (folder / "shard-00000.npz").read_bytes() == kept
    texts = [t for s in more for t in read_shard(folder / s["file"]).texts]
    assert len(set(texts)) == len(texts)  # no prompt twice across shards

    answers = read_corpus(folder, 16)
    assert len(answers) == 8 * len(more)
    assert sum(a["greedy"] for a in answers) == 8 * sum(s["temperature"] == 0 for s in more)

    result = runner.invoke(app, corpus_args(tmp_path, "400", "--seed", "1"))
    assert result.exit_code == 2 and "Error:" in result.output and "seed=0" in result.output

    config = tmp_path / "target.yaml"
    args = ["distill", "-c", str(config), "--out", str(tmp_path / "draft"), "--answers", str(folder)]
    full = runner.invoke(app, [*args, *"--vocab 96 --training-steps 2 --answer-tokens 16 --dtype float32".split()])
    assert full.exit_code == 0, full.output
    [distilled] = (tmp_path / "runs").glob("*-distill-*/record.json")
    assert json.loads(distilled.read_text())["corpus_answers"] == len(answers)

    # a learning curve's point: the held-out answers as before, and about 100 answer tokens trained on
    small = [*args[:4], str(tmp_path / "small"), *args[5:], "--training-tokens", "100"]
    result = runner.invoke(app, [*small, *"--vocab 96 --training-steps 2 --answer-tokens 16 --dtype float32".split()])
    assert result.exit_code == 0, result.output

    def corpus_line(output: str) -> tuple[int, str]:
        """(answer tokens trained on, the held-out part) of distill's Corpus line"""
        line = output.split("Corpus: ")[1].split("\n")[0]
        return int(line.split("training answers (")[1].split(" answer tokens")[0]), line.split("), ")[1]

    trained, heldout = corpus_line(result.output)
    assert 100 <= trained < 100 + 16 and trained < corpus_line(full.output)[0]
    assert heldout == corpus_line(full.output)[1]


def test_a_folder_that_is_no_corpus_is_one_error_line(tmp_path):
    config = tmp_path / "target.yaml"
    config.write_text(yaml.safe_dump({"name": "tiny", "target": TARGET, "draft": {"ngram": {}}}))
    (tmp_path / "empty").mkdir()
    result = runner.invoke(
        app, ["distill", "-c", str(config), "--out", str(tmp_path / "d"), "--answers", str(tmp_path / "empty")]
    )
    assert result.exit_code == 2 and result.output.count("Error:") == 1 and "not a corpus folder" in result.output


def test_bad_counts_are_refused(tmp_path):
    for tokens in ("0", "lots", "-5k"):
        result = runner.invoke(app, corpus_args(tmp_path, tokens))
        assert result.exit_code == 2 and "--tokens" in result.output


def earlier_answers(count: int) -> list[tuple[str, str]]:
    words = "the river rose after three days of rain and the farmers moved their animals".split()
    rng = random.Random(0)
    return [(f"Prompt {i}?", " ".join(rng.choice(words) for _ in range(60)) + ".") for i in range(count)]


def test_prompts_come_from_the_seed_alone_and_passages_only_from_earlier_answers():
    made = [PromptMaker([]).shard(random.Random("0-0"), 300, [], set()) for _ in range(2)]
    assert [p.text for p in made[0]] == [p.text for p in made[1]]
    maker = PromptMaker([])
    passage_kinds = {k.name for k in maker.kinds if k.passage}
    assert not passage_kinds & {p.kind for p in made[0]}  # nothing written yet: no passages
    assert len({p.kind for p in made[0]}) == len(maker.kinds) - len(passage_kinds)

    earlier = earlier_answers(20)
    later = maker.shard(random.Random("0-1"), 600, earlier, set())
    assert {p.kind for p in later} == {k.name for k in maker.kinds}
    answers = {a for _, a in earlier}
    follow_ups = [p for p in later if p.history]
    assert follow_ups and all(p.kind == "multi_turn" and p.history[1]["content"] in answers for p in follow_ups)
    assert all(any(a in p.text for a in answers) for p in later if p.kind == "summarisation")
    assert len({p.key for p in later}) == len(later)


def test_prompts_sharing_eight_words_with_an_evaluation_prompt_are_dropped():
    drawn = PromptMaker([]).shard(random.Random("0-0"), 200, [], set())
    evaluation = [f"Please answer this: {p.text} Thank you." for p in drawn[:20]]
    maker = PromptMaker(evaluation)
    kept = maker.shard(random.Random("0-0"), 200, [], set())
    excluded = set().union(*(ngrams(t) for t in evaluation))
    assert maker.dropped >= 1
    assert all(ngrams(p.text).isdisjoint(excluded) for p in kept)
    assert not {p.text for p in kept} & {p.text for p in drawn[:20] if len(p.text.split()) >= 8}


def test_token_ids_are_stored_in_the_smallest_type_that_holds_the_vocabulary():
    assert ids_dtype(49152) is np.uint16 and ids_dtype(128256) is np.uint32
