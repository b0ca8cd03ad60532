"""`specdec distill` on a tiny random target: the feature draft learns, saves small, decodes exactly
(greedy output identical, sampled output distributed as the target's), and refuses a wrong target."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import DISTILL_PROMPTS as PROMPTS
from conftest import generate_json
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.commands.verify import checks, statistics
from specdec_cli.config import load_config
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.distill import DistillSettings
from specdec_cli.distill.batches import Batch
from specdec_cli.distill.corpus import (
    ANSWERS,
    add_target_features,
    build_corpus,
    label_answers,
    read_answers,
    sequence_length,
    target_states,
    write_answers,
)
from specdec_cli.distill.memory import release_freed_memory
from specdec_cli.distill.state import load_kept
from specdec_cli.distill.train import HELDOUT_MOST, draft_log_probs, sample_tokens, split_heldout
from specdec_cli.errors import EXIT_BAD_INPUT
from specdec_cli.loading.checkpoints import load_model
from specdec_cli.loading.tokens import encode_prompt, padding_id
from specdec_cli.methods.feature.draft import DRAFT_INFO, init_draft
from specdec_cli.methods.feature.parts import feature_inputs, read_target
from specdec_cli.options import EXIT_INTERRUPTED, configure
from specdec_cli.pair import load_pair

runner = CliRunner()

TARGET = {"tiny": {"seed": 0, "num_layers": 2}}


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """One tiny distillation run shared by the tests below: its folder, configs and record."""
    tmp = tmp_path_factory.mktemp("distill")
    config = tmp / "target.yaml"
    config.write_text(
        yaml.safe_dump(
            {"name": "tiny", "target": TARGET, "draft": {"ngram": {}}, "runtime": {"device": "cpu", "threads": 1}}
        )
    )
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    out = tmp / "draft"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_RUNS_DIR", str(tmp / "runs"))
        result = runner.invoke(
            app,
            [
                "distill",
                "-c",
                str(config),
                "--out",
                str(out),
                "--prompts",
                str(prompts),
                "--layers",
                "1",
                "--vocab",
                "96",
                "--training-steps",
                "80",
                "--learning-rate",
                "3e-3",
                "--answers-per-prompt",
                "4",
                "--synthetic-prompts",
                "8",
                "--answer-tokens",
                "32",
                "--eval-every",
                "80",
                "--dtype",
                "float32",
            ],
        )
    assert result.exit_code == 0, result.output
    [record] = (tmp / "runs").glob("*-distill-*/record.json")
    pair_config = tmp / "pair.yaml"
    pair_config.write_text(
        yaml.safe_dump(
            {
                "name": "pair",
                "target": TARGET,
                "draft": {"checkpoint": "draft"},
                "generation": {"max_new_tokens": 24, "ignore_eos": True},
                "runtime": {"device": "cpu", "threads": 1},
            }
        )
    )
    return SimpleNamespace(
        out=out,
        target_config=config,
        pair_config=pair_config,
        record=json.loads(record.read_text()),
        info=json.loads((out / DRAFT_INFO).read_text()),
    )


def test_every_trained_position_improves(distilled):
    # the 1st position reads the target's states, the 2nd and 3rd the draft's own
    first, last = distilled.info["log"][0], distilled.info["log"][-1]
    for position in range(3):
        assert last["expected_acceptance"][position] > first["expected_acceptance"][position] + 0.01
    # the draft scores 96 of the byte tokenizer's tokens: the rest of the target's mass is out of reach
    assert distilled.info["vocabulary_size"] == 96 and 0.5 < last["vocabulary_coverage"] < 1


def test_corpus_and_saved_folder(distilled):
    assert not (distilled.out / "distill-work").exists()
    # 5 answers to each given prompt, and one to each of the target's own 8 prompts
    assert distilled.record["corpus_answers"] == len(PROMPTS) * 5 + 8
    # only the draft's own layer and projection are stored; the embedding and head are the target's
    assert (distilled.out / "model.safetensors").stat().st_size < 200_000


def test_a_draft_trains_on_a_saved_corpus(distilled, tmp_path):
    """The corpus is saved beside the draft as text; `--answers` trains on it without writing one."""
    with gzip.open(distilled.out / ANSWERS, "rt") as file:
        saved = [json.loads(line) for line in file]
    assert len(saved) == distilled.record["corpus_answers"]
    # the given prompts answered greedily, and the one batch of synthetic prompts (greedy batches first)
    assert sum(a["greedy"] for a in saved) == len(PROMPTS) + 8 and sum(a["synthetic"] for a in saved) == 8
    out = tmp_path / "again"
    args = ["distill", "-c", str(distilled.target_config), "--out", str(out), "--vocab", "96", "--training-steps", "2"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_RUNS_DIR", str(tmp_path / "runs"))
        result = runner.invoke(app, [*args, "--answers", str(distilled.out / ANSWERS), "--answer-tokens", "32"])
    assert result.exit_code == 0, result.output
    [record] = (tmp_path / "runs").glob("*-distill-*/record.json")
    record = json.loads(record.read_text())
    assert record["corpus_answers"] == len(saved)
    assert not (out / ANSWERS).exists()  # the corpus stays where it came from


def test_answers_are_labelled_as_the_target_wrote_them(write_config, tmp_path):
    """One forward pass over prompt and answer gives the distribution the target sampled from; answers
    read back from text get the target's labels of the tokens they encode to."""
    cfg = load_config(write_config({"target": TARGET}))
    target, tokenizer = load_model(cfg.target, torch.device("cpu"), torch.float32)
    settings = DistillSettings(answers_per_prompt=1, synthetic_prompts=4, answer_tokens=16)
    torch.manual_seed(0)
    written = build_corpus(target, tokenizer, PROMPTS[:4], settings, tmp_path)
    unlabelled = [{k: v for k, v in a.items() if not k.startswith("top_")} for a in written]
    relabelled = label_answers(target, unlabelled, padding_id(tokenizer), settings.top_k, tmp_path, (-1, 1))
    assert len(relabelled) == len(written) == 4 * 2 + 4
    # the same pass kept the states the draft reads: training finds them and runs no other pass
    states = target_states(target, written, padding_id(tokenizer), (-1, 1))
    [shard] = tmp_path.glob("target-features-*.pt")
    written_at = shard.stat().st_mtime_ns
    add_target_features(target, relabelled, padding_id(tokenizer), tmp_path, (-1, 1))
    assert shard.stat().st_mtime_ns == written_at
    for answer, fresh in zip(relabelled, states, strict=True):
        torch.testing.assert_close(answer["features"], fresh, atol=1e-5, rtol=1e-5)
    for kept, again in zip(written, relabelled):
        assert torch.equal(kept["top_ids"][:, 0], again["top_ids"][:, 0])
        # stored in half precision: equal within one of its steps
        torch.testing.assert_close(kept["top_logp"].float(), again["top_logp"].float(), atol=2e-3, rtol=2e-3)
        if kept["greedy"]:
            assert kept["answer"] == again["top_ids"][:, 0].tolist()
    # the text round trip, on valid UTF-8 answers (a random model's bytes seldom are)
    readable = [
        dict(a, answer=tokenizer.encode(f"Answer {i}.</s>", add_special_tokens=False)) for i, a in enumerate(written)
    ]
    write_answers(readable, tokenizer, tmp_path / ANSWERS)
    answers = read_answers(tmp_path / ANSWERS, tokenizer, settings.answer_tokens)
    for mine, read in zip(readable, answers, strict=True):
        for key in ("prompt_text", "prompt", "answer", "greedy", "synthetic"):
            assert mine[key] == read[key]
    # the same work folder holds the labels of other answers: they are not taken for these
    labels = label_answers(target, answers, padding_id(tokenizer), settings.top_k, tmp_path, (-1,))
    assert [len(a["top_ids"]) for a in labels] == [len(a["answer"]) for a in readable]
    [kept] = tmp_path.glob("labels-*.pt")
    labelled_at = kept.stat().st_mtime_ns
    unlabelled = [{k: v for k, v in a.items() if not k.startswith("top_")} for a in answers]
    again = label_answers(target, unlabelled, padding_id(tokenizer), settings.top_k, tmp_path, (-1,))
    assert kept.stat().st_mtime_ns == labelled_at  # the same answers: the kept shard's labels are theirs
    for first, second in zip(labels, again, strict=True):
        assert torch.equal(first["top_ids"], second["top_ids"])


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "Hi", "answer": "Hello"}', "not json"], "line 2: expected"),
        (['{"prompt": "Hi"}'], "line 1: expected"),
        (['{"prompt": " ", "answer": "Hello"}'], "empty prompt or answer"),
        ([""], "holds no answers"),
    ],
)
def test_bad_answer_files_are_refused(distilled, tmp_path, lines, message):
    answers = tmp_path / "answers.jsonl"
    answers.write_text("\n".join(lines))
    args = ["distill", "-c", str(distilled.target_config), "--out", str(tmp_path / "d"), "--answers", str(answers)]
    refused = runner.invoke(app, args)
    assert refused.exit_code == EXIT_BAD_INPUT and message in refused.output, refused.output
    both = runner.invoke(app, [*args, "--prompts", str(answers)])
    assert both.exit_code == EXIT_BAD_INPUT and "exclude each other" in both.output


def test_greedy_output_is_the_targets(distilled):
    pair = str(distilled.pair_config)
    outputs = [
        generate_json("-c", pair, "--num-draft-tokens", num_draft_tokens)["token_ids"]
        for num_draft_tokens in ("3", "1")
    ]
    alone = generate_json("-c", str(distilled.target_config), "--max-new-tokens", "24", "--ignore-eos")
    assert outputs[0] == outputs[1] == alone["token_ids"]


def test_sampled_output_is_the_targets(distilled):
    # drafts get accepted (the tiny target's greedy path may leave the draft's 96 tokens: sample)
    accepted = sum(
        generate_json("-c", str(distilled.pair_config), "--temperature", "0.8", "--seed", str(seed))["stats"][
            "vllm_counters"
        ]["num_accepted_tokens"]
        for seed in range(5)
    )
    assert accepted > 0
    # the first token and positions 2..4 are distributed as the target's, and a one-token prompt (no
    # target state to read yet) still decodes exactly
    pair = load_pair(load_config(str(distilled.pair_config)))
    params = SamplingParams(temperature=0.8)
    for prompt_ids in (pair.encode("Hello there"), pair.encode("H")):
        rows = checks.check_model(pair, prompt_ids, "p", params, 300, seed=0, significance=0.01)
        statistics.holm(rows, 0.01)
        assert [r.what for r in rows if r.status == statistics.FAIL] == []  # a row without draws is NOT RUN, not a pass
        assert checks.check_greedy(pair, prompt_ids, "p", 24, seed=0).passed


def test_hf_peer_runs_what_transformers_has_beside_a_feature_draft(distilled):
    # transformers cannot run a feature draft: plain generate() and its prompt lookup stand beside specdec
    options = "--peer hf --category qa --temperatures 0 --warmup 0 --json".split()
    peer = runner.invoke(app, ["benchmark", "-c", str(distilled.pair_config), *options])
    assert peer.exit_code == 0, peer.output
    record = json.loads(peer.stdout)
    [num_draft_tokens] = record["settings"]["num_draft_tokens_list"]
    assert [(p["engine"], p["num_draft_tokens"], p["specdec_num_draft_tokens"]) for p in record["peers"]] == [
        ("hf", 0, num_draft_tokens),
        ("hf prompt lookup", num_draft_tokens, num_draft_tokens),
    ]
    for row in record["peers"]:
        assert row["peer_tokens_per_second"][0] > 0 and row["specdec_tokens_per_second"][0] > 0
        assert row["greedy_identical"] == 1
    assert "the draft reads the target's hidden states" in record["peer_fairness"]


def test_a_draft_for_another_target_is_refused(distilled, tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text(
        yaml.safe_dump(
            {
                "name": "other",
                "target": {"tiny": {"seed": 0, "hidden_size": 32}},
                "draft": {"checkpoint": str(distilled.out)},
                "runtime": {"device": "cpu"},
            }
        )
    )
    refused = runner.invoke(app, ["generate", "-c", str(other), "-p", "Hello"])
    assert refused.exit_code == EXIT_BAD_INPUT and "was distilled for" in refused.output


def test_a_draft_reading_layers_the_target_lacks_is_refused(distilled, tmp_path):
    # the tiny target has 2 layers: its hidden states are 0 .. 2
    assert distilled.info["reads_target_layers"] == [0, 1, 2]
    broken = tmp_path / "draft"
    shutil.copytree(distilled.out, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "specdec_target_layers": [0, 1, 7]}))
    pair = yaml.safe_load(distilled.pair_config.read_text())
    (tmp_path / "pair.yaml").write_text(yaml.safe_dump({**pair, "draft": {"checkpoint": str(broken)}}))
    refused = runner.invoke(app, ["generate", "-c", str(tmp_path / "pair.yaml"), "-p", "Hello"])
    assert refused.exit_code == EXIT_BAD_INPUT
    assert "target layer ids [0, 1, 7] do not fit a target of 2 layers" in refused.output


@pytest.mark.parametrize("taps", [(-1,), (0, 1, 2)], ids=["last state", "three layers fused"])
@torch.no_grad()
def test_training_sees_what_drafting_sees(tiny_target, taps):
    """Each training step's prediction equals the one drafting makes from the same verified text:
    the target's states up to input t, then the draft's own outputs for the tokens it drafted."""
    torch.manual_seed(0)
    vocab, width, length, draft_steps = tiny_target.config.vocab_size, tiny_target.config.hidden_size, 12, 3
    draft = init_draft(tiny_target, 1, torch.arange(vocab), taps).eval()
    for weight in draft.parameters():  # away from the target's layer, so each step's input matters
        weight.add_(0.05 * torch.randn_like(weight))
    ids, states = torch.randint(0, vocab, (1, length)), torch.randn(1, length, len(taps) * width)
    unused = torch.zeros(length, dtype=torch.long)
    batch = Batch(
        ids,
        states,
        torch.ones(1, length),
        rows=unused,
        cols=torch.arange(length),
        targets=unused[:, None],
        weights=torch.ones(length, 1),
        top1=unused,
        greedy=unused.bool(),
    )
    trained = draft_log_probs(draft, batch, None, draft_steps)
    for t in range(length - draft_steps + 1):  # verified text ends at input t
        features = read_target(draft, states[:, : t + 1])
        for step in range(draft_steps):
            hidden = draft.model(
                inputs_embeds=feature_inputs(draft, ids[:, : t + step + 1], features)
            ).last_hidden_state
            drafting = draft.lm_head(hidden[0, t + step]).log_softmax(-1)
            torch.testing.assert_close(trained[step][t + step], drafting, atol=1e-4, rtol=1e-4)
            features = torch.cat([read_target(draft, states[:, : t + 1]), hidden[:, t : t + step + 1]], dim=1)


def test_flags_override_the_yaml_only_when_given(write_config):
    config = str(write_config({"runtime": {"device": "cpu", "dtype": "float32"}}))
    assert configure(config, runtime__dtype=None).runtime.dtype == "float32"  # no flag: the YAML's
    assert configure(config, runtime__dtype="bfloat16").runtime.dtype == "bfloat16"
    pair = load_pair(load_config(config))
    assert pair.decoder(SamplingParams(), num_draft_tokens=0).num_draft_tokens == 0  # an explicit 0 is not "not given"
    assert pair.decoder(SamplingParams()).num_draft_tokens == 3


def test_kept_target_states_extend_with_the_corpus(tiny_target, tmp_path, monkeypatch):
    """A retrain with more synthetic prompts keeps the states of the answers it has and runs the
    target only on the shards that changed; each answer gets the states of its own tokens."""
    monkeypatch.setattr("specdec_cli.distill.corpus.SHARD", 2)  # 5 answers: shards of 2, 2 and 1
    torch.manual_seed(0)
    vocab = tiny_target.config.vocab_size
    corpus = [
        {"prompt": torch.randint(1, vocab, (3,)).tolist(), "answer": torch.randint(1, vocab, (n,)).tolist()}
        for n in (4, 7, 2, 5, 6)
    ]
    fresh = target_states(tiny_target, corpus, 0, (-1,))
    add_target_features(tiny_target, corpus[:3], 0, tmp_path, (-1,))
    shards = sorted(tmp_path.glob("target-features-*.pt"))
    assert len(shards) == 2
    first = [path.stat().st_mtime_ns for path in shards]
    add_target_features(tiny_target, corpus, 0, tmp_path, (-1,))
    shards = sorted(tmp_path.glob("target-features-*.pt"))
    assert [len(torch.load(path)) for path in shards] == [2, 2, 1]
    # the full first shard is kept, the one that grew is run again
    assert shards[0].stat().st_mtime_ns == first[0] and shards[1].stat().st_mtime_ns > first[1]
    for answer, states in zip(corpus, fresh):
        assert answer["features"].shape == (sequence_length(answer), states.shape[-1])
        torch.testing.assert_close(answer["features"], states, atol=1e-5, rtol=1e-5)
    smaller = [dict(a) for a in corpus[:3]]  # fewer synthetic prompts than the kept shards cover
    add_target_features(tiny_target, smaller, 0, tmp_path, (-1,))
    torch.testing.assert_close(smaller[1]["features"], fresh[1])
    torch.testing.assert_close(smaller[2]["features"], fresh[2], atol=1e-5, rtol=1e-5)
    # kept states are reused, not recomputed: marked ones come back as they were
    torch.save([torch.zeros_like(f) for f in fresh[2:4]], shards[1])
    add_target_features(tiny_target, corpus, 0, tmp_path, (-1,))
    assert not corpus[2]["features"].any() and corpus[1]["features"].any() and corpus[4]["features"].any()
    # a corpus whose answers changed (other settings on the same folder) is not given stale states
    changed = corpus[:2] + [dict(corpus[2], answer=corpus[2]["answer"] + [1])] + corpus[3:]
    add_target_features(tiny_target, changed, 0, tmp_path, (-1,))
    assert changed[2]["features"].shape[0] == sequence_length(changed[2]) and changed[2]["features"].any()
    assert changed[3]["features"].any()  # its shard was run again


def test_sigterm_keeps_the_training_state_and_the_run_resumes(tmp_path):
    """`timeout` and CI runners stop a job with SIGTERM: distill saves its state as on Ctrl-C (exit 130),
    and the same command then goes on from that step."""
    config = tmp_path / "target.yaml"
    config.write_text(
        yaml.safe_dump({"name": "tiny", "target": TARGET, "draft": {"ngram": {}}, "runtime": {"threads": 1}})
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    out = tmp_path / "draft"
    settings = ["--vocab", "96", "--answers-per-prompt", "1", "--synthetic-prompts", "4", "--answer-tokens", "16"]
    command = [sys.executable, "-m", "specdec_cli", "distill", "-c", str(config), "--out", str(out)]
    command += ["--prompts", str(prompts), "--dtype", "float32", *settings]
    env = {**os.environ, "SPECDEC_RUNS_DIR": str(tmp_path / "runs")}
    work = out / "distill-work"
    job = subprocess.Popen([*command, "--training-steps", "100000"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(work.glob("target-features-*.pt")) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # training is under way
    job.send_signal(signal.SIGTERM)
    stderr = job.communicate(timeout=60)[1]
    assert job.returncode == EXIT_INTERRUPTED, stderr
    assert "Interrupted at step" in stderr
    saved = torch.load(work / "train-state.pt", weights_only=True)["step"]
    assert saved > 0 and not list(work.glob("*.partial"))
    resumed = subprocess.run([*command, "--training-steps", str(saved + 2)], env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / DRAFT_INFO).read_text())["log"][-1]["step"] == saved + 2


def quick_run(tmp_path, *more: str) -> list[str]:
    """`specdec distill` arguments for a run of seconds in tmp_path/draft: the target labels an answer
    file (one greedy and one sampled answer per prompt), keeping its work folder."""
    config = tmp_path / "target.yaml"
    config.write_text(yaml.safe_dump({"name": "tiny", "target": TARGET, "draft": {"ngram": {}}}))
    answers = tmp_path / "answers.jsonl"
    lines = [
        json.dumps({"prompt": p, "answer": f"{p}, said {who}.", "greedy": who == "one"})
        for p in PROMPTS
        for who in ("one", "two")
    ]
    answers.write_text("\n".join(lines))
    out = tmp_path / "draft"
    options = "--vocab 96 --training-steps 2 --answer-tokens 16 --dtype float32 --device cpu --keep-work".split()
    return ["distill", "-c", str(config), "--out", str(out), "--answers", str(answers), *options, *more]


def refusal(run) -> str:
    """The one `Error:` line of a run refused as bad input."""
    assert run.exit_code == EXIT_BAD_INPUT, run.output
    [error] = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    return error


class RunsCode:
    """Unpickling it creates the file `marker`: what a work folder someone else wrote could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.parametrize("name", ["train-state.pt", "labels-00000.pt"])
def test_work_files_that_would_run_code_are_refused(tmp_path, name):
    args = quick_run(tmp_path)
    work = tmp_path / "draft" / "distill-work"
    work.mkdir(parents=True)
    marker = tmp_path / "ran"
    torch.save({"draft": RunsCode(marker), "step": 1}, work / name)
    error = refusal(runner.invoke(app, args))
    assert name in error and "another --out" in error
    assert not marker.exists()


def test_a_resume_with_other_settings_is_refused(tmp_path):
    """The training state records what shaped it: resumed with other settings (another learning rate,
    which the saved optimizer would override, or more layers, which would stay as they started) the
    run stops and says which setting differs; the same settings resume."""
    args = quick_run(tmp_path)
    assert runner.invoke(app, args).exit_code == 0
    state_path = tmp_path / "draft" / "distill-work" / "train-state.pt"
    for change, setting, saved, new in [
        (["--layers", "2"], "num_layers", 1, 2),
        (["--learning-rate", "0.01"], "learning_rate", 0.001, 0.01),
        (["--loss", "tv"], "loss", "kl", "tv"),
    ]:
        error = refusal(runner.invoke(app, [*args, *change]))
        assert f"with {setting} {saved}, this run {setting} {new}" in error and "another --out" in error, error
    # other answers are another corpus
    answers = tmp_path / "answers.jsonl"
    answers.write_text(answers.read_text().replace("said one", "said three"))
    assert "corpus" in refusal(runner.invoke(app, args))
    answers.write_text(answers.read_text().replace("said three", "said one"))
    resumed = runner.invoke(app, [*args, "--training-steps", "3"])  # a longer schedule is the same training
    assert resumed.exit_code == 0, resumed.output
    assert torch.load(state_path, weights_only=True)["step"] == 3
    # a state saved before a setting existed was shaped as its default shapes it: it resumes with that
    state = torch.load(state_path, weights_only=True)
    del state["trained_with"]["trained_answers"], state["trained_with"]["loss"]
    torch.save(state, state_path)
    error = refusal(runner.invoke(app, [*args, "--training-steps", "4", "--loss", "tv"]))
    assert "with loss kl, this run loss tv" in error, error
    resumed = runner.invoke(app, [*args, "--training-steps", "4"])
    assert resumed.exit_code == 0, resumed.output
    assert torch.load(state_path, weights_only=True)["step"] == 4
    # weights are loaded strictly: a state missing one of the draft's tensors is refused
    state = torch.load(state_path, weights_only=True)
    state["draft"].pop(next(iter(state["draft"])))
    torch.save(state, state_path)
    assert "does not fit" in refusal(runner.invoke(app, [*args, "--training-steps", "5"]))


def test_training_on_total_variation_raises_the_acceptance_it_measures(tmp_path):
    """--loss tv minimises 1 - sum min(p, q) over the target's top-k: one minus the expected acceptance
    at temperature 1 that the held-out evaluation reports. Training on it raises that at every draft
    position."""
    more = "--loss tv --training-steps 60 --eval-every 60 --learning-rate 3e-3".split()
    result = runner.invoke(app, quick_run(tmp_path, *more))
    assert result.exit_code == 0, result.output
    log = json.loads((tmp_path / "draft" / DRAFT_INFO).read_text())["log"]
    first, last = log[0], log[-1]
    for position in range(3):
        assert last["expected_acceptance"][position] > first["expected_acceptance"][position] + 0.01


def test_only_answers_to_given_prompts_are_held_out():
    """The held-out answers measure the draft on prompts it never trained on: a share of the given
    prompts, evenly spaced, wherever their answers stand in the corpus; the target's own prompts are
    never held out."""
    own = [{"prompt": [1, 100 + i], "answer": [5], "synthetic": True, "greedy": i % 2 == 0} for i in range(10)]
    given = [
        {"prompt": [1, 200 + i], "answer": [5], "synthetic": False, "greedy": greedy}
        for i in range(20)
        for greedy in (True, False)
    ]
    for corpus in (own + given, given + own):  # an answer file may list the target's own prompts first
        training, heldout = split_heldout(corpus, 0.1)
        assert [a["prompt"][1] for a in heldout] == [200, 200, 210, 210]  # both answers of 2 of the 20
        assert len(training) == len(corpus) - 4 and not any(a in heldout for a in training)
    training, heldout = split_heldout(own, 0.1)
    assert heldout == [] and training == own
    # a large corpus holds out at most HELDOUT_MOST prompts, spread over all of it
    many = [{"prompt": [1, i], "answer": [5], "synthetic": False, "greedy": i < 5000} for i in range(10_000)]
    training, heldout = split_heldout(many, 0.1)
    assert len(heldout) == HELDOUT_MOST and len(training) == len(many) - HELDOUT_MOST
    assert 0 < sum(a["greedy"] for a in heldout) < HELDOUT_MOST  # from both halves


def test_training_token_samples_are_nested_and_sized():
    """A learning curve's points: each sample holds about the asked answer tokens, the same seed
    gives nested samples, and a sample larger than the corpus is all of it."""
    corpus = [{"prompt": [1, i], "answer": [5] * (1 + i % 7), "synthetic": False, "greedy": True} for i in range(500)]
    small, large = sample_tokens(corpus, 300, seed=3), sample_tokens(corpus, 900, seed=3)
    assert 300 <= sum(len(a["answer"]) for a in small) < 307
    assert 900 <= sum(len(a["answer"]) for a in large) < 907
    assert large[: len(small)] == small
    assert sample_tokens(corpus, 300, seed=4) != small
    assert sorted(map(id, sample_tokens(corpus, 10**9, seed=3))) == sorted(map(id, corpus))


def test_a_corpus_with_nothing_to_train_on_is_refused(tmp_path):
    args = quick_run(tmp_path)
    (tmp_path / "answers.jsonl").write_text(json.dumps({"prompt": "Hello", "answer": "Hi there."}))
    error = refusal(runner.invoke(app, args))
    assert "no answers to train on" in error, error


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_training_on_one_kind_of_answer_keeps_the_held_out_ones(tmp_path, kind):
    """--trained-answers greedy|sampled: the draft trains on the target's answers of that kind only,
    measured on the held-out answers a run on all of them has (chosen first), so that the two compare."""
    for name in ("all", kind, "other"):
        (tmp_path / name).mkdir()
    everything = quick_run(tmp_path / "all")
    assert runner.invoke(app, everything).exit_code == 0
    run = runner.invoke(app, quick_run(tmp_path / kind, "--trained-answers", kind))
    assert run.exit_code == 0, run.output
    [all_labelled, labelled] = [
        load_kept(tmp_path / name / "draft" / "distill-work" / "labels-00000.pt") for name in ("all", kind)
    ]
    # answers to each prompt: one greedy, one sampled; half the training answers remain
    heldout = 2 * len(labelled) - len(all_labelled)
    assert 0 < heldout < len(labelled)
    assert [a["answer"] for a in labelled[:heldout]] == [a["answer"] for a in all_labelled[:heldout]]
    assert {a["greedy"] for a in labelled[:heldout]} == {True, False}
    assert {a["greedy"] for a in labelled[heldout:]} == {kind == "greedy"}
    # none of that kind: nothing to train on
    args = quick_run(tmp_path / "other", "--trained-answers", kind)
    answers = tmp_path / "other" / "answers.jsonl"
    records = [json.loads(line) | {"greedy": kind != "greedy"} for line in answers.read_text().splitlines()]
    answers.write_text("\n".join(map(json.dumps, records)))
    error = refusal(runner.invoke(app, args))
    assert f"none of the {len(all_labelled) - heldout} training answers is {kind}" in error, error


def test_figures_without_held_out_answers_are_not_shown_as_zero(tmp_path):
    """Expected acceptance at T=1 is measured on sampled held-out answers: with none (every answer
    greedy here) it is not measured, and says so, rather than showing 0 while the draft learns."""
    args = quick_run(tmp_path)
    answers = tmp_path / "answers.jsonl"
    answers.write_text(answers.read_text().replace('"greedy": false', '"greedy": true'))
    run = runner.invoke(app, args)
    assert run.exit_code == 0, run.output
    log = json.loads((tmp_path / "draft" / DRAFT_INFO).read_text())["log"]
    assert len(log) == 2 and all(e["expected_acceptance"] is None and len(e["greedy_agreement"]) == 3 for e in log)
    assert "expected acceptance (T=1) not measured (no sampled answers held out)" in " ".join(run.stderr.split())


def test_answers_held_out_from_another_file_are_measured_and_never_trained_on(tmp_path):
    """--heldout-answers: the draft is measured on those answers, labelled in the same pass, and no
    answer to one of their prompts is trained on; without --answers it is refused."""
    other = tmp_path / "other.jsonl"
    held = [("Name a colour", "Blue.", True), ("Name a fruit", "A pear.", False), (PROMPTS[0], "Hello.", True)]
    other.write_text("\n".join(json.dumps({"prompt": p, "answer": a, "greedy": g}) for p, a, g in held))
    args = quick_run(tmp_path, "--heldout-answers", str(other))
    run = runner.invoke(app, args)
    assert run.exit_code == 0, run.output
    assert "3 held out (2 greedy, 1 sampled)" in " ".join(run.stderr.split())
    labelled = load_kept(tmp_path / "draft" / "distill-work" / "labels-00000.pt")
    tokenizer = load_pair(load_config(str(tmp_path / "target.yaml"))).tokenizer
    heldout_prompts = {tuple(encode_prompt(tokenizer, p)) for p, _, _ in held}
    assert {tuple(a["prompt"]) for a in labelled[:3]} == heldout_prompts
    trained = labelled[3:]
    assert len(trained) == 2 * (len(PROMPTS) - 1) and not any(tuple(a["prompt"]) in heldout_prompts for a in trained)
    without = [a for a in args if a != "--answers" and not a.endswith("/answers.jsonl")]
    assert "--heldout-answers needs --answers" in refusal(runner.invoke(app, without))


def test_answers_from_several_sources_are_trained_on_together(tmp_path):
    """--answers given twice: the target labels both files' answers in one pass, and the draft trains
    on them together (the held-out ones measured from another file, so every given answer trains)."""
    second = tmp_path / "second.jsonl"
    more = [("Name a colour", "Blue."), ("Name a fruit", "A pear.")]
    second.write_text("\n".join(json.dumps({"prompt": p, "answer": a, "greedy": True}) for p, a in more))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt": "Name a river", "answer": "The Nile.", "greedy": True}))
    run = runner.invoke(app, quick_run(tmp_path, "--answers", str(second), "--heldout-answers", str(other)))
    assert run.exit_code == 0, run.output
    assert f"Corpus: {2 * len(PROMPTS) + len(more)} training answers" in " ".join(run.stderr.split())
    tokenizer = load_pair(load_config(str(tmp_path / "target.yaml"))).tokenizer
    trained = {tuple(a["prompt"]) for a in load_kept(tmp_path / "draft" / "distill-work" / "labels-00000.pt")[1:]}
    assert trained == {tuple(encode_prompt(tokenizer, p)) for p in [*PROMPTS, *(p for p, _ in more)]}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc's heap")
def test_release_freed_memory_hands_the_heaps_free_pages_back():
    def resident() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon"))

    # 64 KiB blocks sit on the heap (below glibc's mmap threshold); the live 1 in 16 keeps the freed
    # ones from coalescing into the heap's top, which glibc would return by itself
    blocks = [torch.ones(16 * 1024) for _ in range(4000)]
    held = blocks[15::16]
    del blocks
    before = resident()
    release_freed_memory()
    assert before - resident() > 150 * 2**20  # of the 234 MiB freed
    assert all(block.sum() == block.numel() for block in held)
