"""Batches: every row of a batch decodes exactly as its prompt alone, whatever the other rows do."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_PAIR, cached
from typer.testing import CliRunner

from specdec_cli.bench.report import compare_report
from specdec_cli.bench.summary import summarize_batches
from specdec_cli.cli import app
from specdec_cli.commands.verify import checks, statistics
from specdec_cli.config import parse_config
from specdec_cli.decoding import sampling
from specdec_cli.decoding.cache import EAGER_KEY_SLOTS_STEP, CachedModel
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.errors import EXIT_BAD_INPUT
from specdec_cli.loading.target_states import target_layers
from specdec_cli.methods.feature.draft import init_draft
from specdec_cli.methods.feature.drafter import FeatureDrafter
from specdec_cli.methods.model import ModelDrafter
from specdec_cli.methods.ngram import NgramDrafter
from specdec_cli.pair import load_pair

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "abc abc abc abc",
    "Once upon a time, in a land far away, there lived",
]
GREEDY = SamplingParams()
runner = CliRunner()


def drafter_of(kind: str, target, noisy_draft):
    if kind == "same":
        return ModelDrafter(cached(target))
    if kind == "noisy":
        return ModelDrafter(cached(noisy_draft))
    if kind.startswith("feature"):
        taps = (0, 1, 2) if kind == "feature-taps" else (-1,)  # three layers fused, or the last state
        return FeatureDrafter(
            init_draft(target, 1, torch.arange(target.config.vocab_size), taps).eval(), target.config.vocab_size
        )
    return NgramDrafter(3, 1, target.config.vocab_size, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["same", "noisy", "feature", "feature-taps", "ngram"])
@pytest.mark.parametrize("num_draft_tokens", [1, 4])
def test_each_row_is_its_prompt_alone(tiny_target, noisy_draft, tokenizer, kind, num_draft_tokens):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    alone = SpeculativeDecoder(cached(tiny_target), None, GREEDY, 1, set())
    expected = [alone.generate(p, 24, 0).token_ids for p in prompts]
    eos = expected[2][3]  # the third row's 4th token ends it early; the other rows go on past it
    expected = [e[: e.index(eos) + 1] if eos in e else e for e in expected]
    drafter = drafter_of(kind, tiny_target, noisy_draft)
    taps = target_layers(drafter.model.model) if kind.startswith("feature") else (-1,)
    target = CachedModel(tiny_target, tiny_target.config.vocab_size, taps)  # the states the draft reads
    decoder = SpeculativeDecoder(target, drafter, GREEDY, num_draft_tokens, {eos})
    rows = decoder.generate_batch(prompts, 24, 0)
    assert [r.token_ids for r in rows] == expected
    assert rows[2].stop_reason == "eos" and len(rows[2].token_ids) <= 4
    accepted = [sum(s.accepted for s in r.steps) for r in rows]
    if kind == "same":  # every row accepts every draft of its own
        assert all(sum(s.accepted for s in r.steps) == sum(s.drafted for s in r.steps) for r in rows)
    elif kind == "noisy":  # rows accept different numbers in the same blocks
        assert len({tuple(s.accepted for s in r.steps[:3]) for r in rows}) > 1, accepted


def test_preallocation_is_bounded_by_the_batch(tiny_target, tokenizer):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    target = cached(tiny_target)
    SpeculativeDecoder(target, ModelDrafter(cached(tiny_target)), GREEDY, 4, set()).generate_batch(prompts, 16, 0)
    keys = target.cache.layers[0].keys
    needed = max(map(len, prompts)) + 16 + 4 + 1  # prompt + max_new_tokens + num_draft_tokens + 1
    # in whole steps of the slots attention reads, and the scratch slot
    assert keys.shape[2] == -(-needed // EAGER_KEY_SLOTS_STEP) * EAGER_KEY_SLOTS_STEP + 1
    assert keys.shape[0] <= len(prompts)  # rows that stopped have left


@pytest.fixture(scope="module")
def batch_pair():
    return load_pair(
        parse_config(
            {
                **TINY_PAIR,
                "speculation": {"num_draft_tokens": 2},
                "runtime": {"device": "cpu", "dtype": "float32", "threads": 1},
            }
        )
    )


def row_runs(pair, prompt_ids, params, runs, seed):
    """`runs` sampled generations of one prompt as rows of batches of 4 beside other prompts."""
    others = [pair.encode(p) for p in PROMPTS[1:]]
    decoder = pair.decoder(params)
    tokens = []
    for i in range(runs):
        rows = decoder.generate_batch(
            [prompt_ids] + others, 2 * (decoder.num_draft_tokens + 1), seed + i, ignore_eos=True
        )
        tokens.append(rows[0].token_ids)
    return tokens


def test_sampled_rows_are_distributed_as_the_target(batch_pair):
    params = SamplingParams(temperature=0.8)
    ids = batch_pair.encode(PROMPTS[0])
    rows = checks.check_token_runs(
        batch_pair, ids, "batch row", params, row_runs(batch_pair, ids, params, 300, 0), 0.01
    )
    statistics.holm(rows, 0.01)
    assert [r.what for r in rows if not r.passed] == []


def test_generate_decodes_a_prompt_file_in_batches(write_config, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    config = str(write_config({"generation": {"max_new_tokens": 12}}))
    run = runner.invoke(app, ["generate", "-c", config, "--prompts", str(prompts), "--batch-size", "3", "--json"])
    assert run.exit_code == 0, run.output
    record = json.loads(run.stdout)
    assert record["batch_size"] == 3 and [r["prompt"] for r in record["rows"]] == PROMPTS
    alone = runner.invoke(app, ["generate", "-c", config, "--prompt", PROMPTS[1], "--json"])
    assert record["rows"][1]["token_ids"] == json.loads(alone.stdout)["token_ids"]  # greedy: as if alone
    assert record["stats"]["new_tokens"] == sum(r["stats"]["new_tokens"] for r in record["rows"])
    refused = runner.invoke(app, ["generate", "-c", config, "--prompt", "x", "--batch-size", "2"])
    assert refused.exit_code == EXIT_BAD_INPUT and "--batch-size needs --prompts" in refused.output


def test_benchmark_measures_each_batch_size(write_config):
    config = str(
        write_config({"draft": {"tiny": {"seed": 0}}, "generation": {"max_new_tokens": 8, "ignore_eos": True}})
    )
    run = runner.invoke(
        app, ["benchmark", "-c", config, "--batch-sizes", "2,4", "--temperatures", "0", "--warmup", "0", "--json"]
    )
    assert run.exit_code == 0, run.output
    record = json.loads(run.stdout)
    rows = record["batch_summary"]
    assert [r["batch_size"] for r in rows] == [1, 2, 4]
    for row in rows:  # the draft is the target: every draft accepted, at every batch size
        assert row["mean_accepted_length"] == 4.0 and row["acceptance_by_position"] == [1.0, 1.0, 1.0]
        assert row["greedy_identical"] == 7  # every row's tokens are its prompt's target-only tokens alone
        assert row["verification_forward_seconds"] > 0 and row["target_forward_seconds"] > 0
        assert row["speculative_tokens_per_second_per_sequence"][0] * row["batch_size"] == pytest.approx(
            row["speculative_tokens_per_second"][0]
        )
    sizes = {len(r["prompt_ids"]) for r in record["batch_runs"] if r["batch_size"] == 4}
    assert sizes == {4, 3}  # 7 built-in prompts: a batch of 4 and one of 3


def batch_run(size, num_draft_tokens, tokens, seconds):
    return {
        "batch_size": size,
        "temperature": 0.0,
        "num_draft_tokens": num_draft_tokens,
        "prompt_ids": ["a"],
        "repeats": [
            {
                "new_tokens": tokens,
                "decode_seconds": seconds,
                "steps": [[num_draft_tokens, num_draft_tokens, num_draft_tokens + 1, 0.1, 0.1]],
            }
        ],
    }


def test_the_crossover_is_the_smallest_batch_size_that_lost():
    prompt_runs = [
        {
            "engine": "specdec",
            "prompt_id": "a",
            "category": "c",
            "temperature": 0.0,
            "num_draft_tokens": g,
            "repeats": [{"new_tokens": 10, "decode_seconds": s, "steps": [[g, g, g + 1, 0.1, 0.1]]}],
        }
        for g, s in ((0, 1.0), (2, 0.5))
    ]
    batches = [
        batch_run(2, 0, 20, 1.0),
        batch_run(2, 2, 20, 0.8),
        batch_run(4, 0, 40, 1.0),
        batch_run(4, 2, 40, 1.25),
        batch_run(8, 0, 80, 1.0),
        batch_run(8, 2, 80, 0.9),
    ]
    rows = summarize_batches(prompt_runs, batches)
    assert [round(r["speedup"][0], 2) for r in rows] == [2.0, 1.25, 0.8, 1.11]
    assert {r["crossover_batch_size"] for r in rows} == {4}  # 8 won again: the crossover is where it first lost


def test_compare_matches_batch_size_rows():
    def record(name, speedup):
        row = {
            "batch_size": 4,
            "temperature": 0.0,
            "num_draft_tokens": 2,
            "baseline_tokens_per_second": [10.0] * 3,
            "speculative_tokens_per_second": [10.0 * speedup] * 3,
            "speedup": [speedup] * 3,
            "mean_accepted_length": 2.0,
        }
        return {"name": name, "timestamp": "t", "summary": [], "batch_summary": [row]}

    table = compare_report(record("a", 1.5), record("b", 0.75), ("A", "B"))
    assert ["batch 4, greedy, γ=2", "speedup", "1.500", "0.750", "0.50×"] in table.rows


def read_the_next_rows_count(monkeypatch):
    """A batch bug: each row keeps as many drafts as the next row accepted."""
    verify_sampled = sampling.verify_sampled

    def broken(*args):
        num_accepted, next_token = verify_sampled(*args)
        return num_accepted.roll(1), next_token

    monkeypatch.setattr(sampling, "verify_sampled", broken)


def test_verify_catches_a_row_reading_another_rows_acceptance(batch_pair, monkeypatch):
    params = SamplingParams(temperature=0.8)
    ids = batch_pair.encode("Hello there, how are you?")

    def failures(batch_size):
        rows = checks.check_model(batch_pair, ids, "p", params, 200, 0, 0.01, batch_size=batch_size)
        statistics.holm(rows, 0.01)
        return [r.check for r in rows if r.status == statistics.FAIL]

    assert failures(4) == []
    read_the_next_rows_count(monkeypatch)
    assert failures(1) == []  # one row: its own count is the next row's
    assert failures(4)  # rows of a batch: the checks fail


def test_the_hf_peer_at_batch_sizes_is_plain_batched_generate(write_config, tmp_path):
    config = str(write_config({"generation": {"max_new_tokens": 8, "ignore_eos": True}}))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is a river?\nName two colours.\n")
    options = f"--peer hf --batch-sizes 2 --temperatures 0 --warmup 0 --prompts {prompts} --json".split()
    run = runner.invoke(app, ["benchmark", "-c", config, *options])
    assert run.exit_code == 0, run.output
    record = json.loads(run.stdout)
    [peer_batch] = [r for r in record["batch_runs"] if r["engine"] == "hf"]
    alone = [r for r in record["runs"] if (r["engine"], r["num_draft_tokens"]) == ("specdec", 0)]
    # left-padded rows of transformers' generate() answer as each prompt alone does
    assert peer_batch["repeats"][0]["token_ids"] == [r["repeats"][0]["token_ids"] for r in alone]
    assert all(row["peer_tokens_per_second"][0] > 0 for row in record["batch_summary"])


@pytest.mark.parametrize("kind", ["noisy", "feature"])
def test_logits_are_computed_only_where_they_are_read(tiny_target, noisy_draft, tokenizer, kind):
    """Prompts of unequal length: the prefills read states only, a draft step each row's last input;
    no forward projects more than the verified block onto the vocabulary."""
    prompts = [tokenizer.encode(p * 8) for p in PROMPTS]  # 16 to 480 tokens
    drafter = drafter_of(kind, tiny_target, noisy_draft)
    taps = target_layers(drafter.model.model) if kind == "feature" else (-1,)
    projected = []  # rows each head call projects
    heads = [tiny_target.get_output_embeddings(), drafter.model.model.get_output_embeddings()]
    hooks = [h.register_forward_hook(lambda m, args, out: projected.append(args[0].shape[:-1].numel())) for h in heads]
    try:
        decoder = SpeculativeDecoder(
            CachedModel(tiny_target, tiny_target.config.vocab_size, taps), drafter, GREEDY, 3, set()
        )
        decoder.generate_batch(prompts, 8, 0)
    finally:
        for hook in hooks:
            hook.remove()
    assert projected and max(projected) <= len(prompts) * 4, projected


def test_padding_is_never_written_past_a_rows_cache(tiny_target):
    """A row far along (8 of 10 slots held) reads 1 token beside a row that reads 6: the padding of
    the first row must not land past its end, and its real token must read what it read alone."""
    target = cached(tiny_target)
    target.reset(10, batch=2)
    target.forward(torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [5, 0, 0, 0, 0, 0, 0, 0]]), counts=[8, 1])
    both = target.forward(torch.tensor([[13, 0, 0, 0, 0, 0], [6, 7, 8, 9, 10, 11]]), counts=[1, 6]).logits
    alone = cached(tiny_target)
    alone.reset(10)
    alone.forward(torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]]))
    assert torch.allclose(both[0, 0], alone.forward(torch.tensor([[13]])).logits[0, 0], atol=1e-5)
    assert target.lengths == [9, 7]


def test_lookup_runs_of_unequal_length_fit_the_draft_cache(tiny_target, noisy_draft, tokenizer):
    """Lookup blocks that one row accepts whole and another rejects leave the model draft runs of
    unequal length to read (`follow`); the rows' caches hold the longest prompt + max_new_tokens +
    num_draft_tokens + 1 tokens. Here the long-prompt row is 9 tokens in when the other reads a run of 7."""
    prompts = [tokenizer.encode(PROMPTS[3]), tokenizer.encode(PROMPTS[0])]
    max_new, num_draft_tokens = 10, 2
    drafter = ModelDrafter(cached(noisy_draft))
    drafter.start(prompts, len(prompts[0]) + max_new + num_draft_tokens + 1, None)
    drafter.follow([list(range(70, 77)), [70]], None)  # a lookup block: 6 accepted + the target's token, 0 + 1
    drafts, _ = drafter.propose(num_draft_tokens, GREEDY, None)
    drafter.commit(drafts.tolist(), [0, 0], [80, 80], None)
    drafter.follow([[81], list(range(90, 96))], None)  # row 0 rejects, row 1 accepts 5 + 1
    drafts, _ = drafter.propose(num_draft_tokens, GREEDY, None)
    assert drafts.shape == (2, num_draft_tokens)
