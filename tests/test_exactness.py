"""The exactness table: every drafting method, drafting chains and trees, greedy and sampled, at batch
1 and 4, loaded from a YAML config as a user's pair is.

- Greedy: each prompt's tokens are the target alone's, decoded alone and in a batch where one row
  stops early at an EOS; drafts were accepted (but for untrained drafts), so rollback after a partly
  accepted block ran.
- Sampled: verify-distribution's checks of the model pass (test_verify.py, test_sampling.py and
  test_tree.py show them catching broken rules), and drafts were accepted, so they saw speculative
  blocks (at batch 1, for untrained drafts). Batch 1 samples at T=1, batch 4 at T=0.6 with top-k and top-p.

What is particular to a method (its cache's contents, its format's forward, a broken variant of its
drafts) is tested in its own module."""

from __future__ import annotations

import pytest
import torch
from block_checkpoints import write_dflash, write_medusa_vllm
from conftest import earlier_answers

from specdec_cli.commands.verify import checks, statistics
from specdec_cli.config import TinyModel, load_config
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.loading.checkpoints import build_tiny, byte_tokenizer
from specdec_cli.methods.feature.draft import init_draft, save_draft
from specdec_cli.pair import load_pair

PROMPTS = ["abc abc abc abc abc", "Hello there, hello there, hello", "one two one two one two", "H"]
TREE = {"depth": 3, "top_k": 2, "max_nodes": 6}
NOISY_MODEL = {"tiny": {"seed": 0, "noise": 0.005}}
SAMPLED = {1: SamplingParams(temperature=1.0), 4: SamplingParams(0.6, top_k=20, top_p=0.9)}
# each case's checks at 0.001 (Holm within the case): over the table's 36 sampled cases a false FAIL
# stays unlikely (at most 4%), where 0.01 would fail one case in three by chance
RUNS, SIGNIFICANCE = 200, 0.001
# untrained weights: greedy, their chains rarely draft the target's argmax; under batch 4's top-k and
# top-p their drafts rarely land in the target's few kept tokens
UNTRAINED = {"feature", "medusa", "dflash"}


def write_feature(folder) -> None:
    """specdec's own feature draft for the tiny target, reading its input, middle and last states."""
    target = build_tiny(TinyModel(seed=0)).eval()
    draft = init_draft(target, 1, torch.arange(target.config.vocab_size), (0, 1, -1))
    save_draft(draft, byte_tokenizer(), folder, {"target": "tiny"})


def checkpoint(write):
    def draft(folder) -> dict:
        write(folder)
        return {"checkpoint": str(folder)}

    return draft


METHODS = {  # each method's draft section, given a folder for its checkpoint
    "model": lambda _: NOISY_MODEL,
    "feature": checkpoint(write_feature),
    "medusa": checkpoint(write_medusa_vllm),
    "dflash": checkpoint(write_dflash),
    "ngram": lambda _: {"ngram": {"max_n": 3, "min_n": 1}},
    "suffix": lambda _: {"suffix": {"max_spec_factor": 2.0}},
    "recycling": lambda _: {"recycling": {"candidates": 4}},
    "model+lookup": lambda _: NOISY_MODEL | {"lookup": {"min_n": 2}},
    "model+suffix": lambda _: NOISY_MODEL | {"suffix": {"num_draft_tokens": 5}},
}


def pair_of(draft: dict, drafting: str, write_config):
    speculation = {"num_draft_tokens": 3, "tree": TREE if drafting == "tree" else None}
    return load_pair(load_config(str(write_config({"draft": draft, "speculation": speculation}))))


@pytest.mark.parametrize("drafting", ["chain", "tree"])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_is_the_targets(method, drafting, tmp_path, write_config):
    pair = pair_of(METHODS[method](tmp_path / method), drafting, write_config)
    prompts = [pair.encode(p, raw=True) for p in PROMPTS]
    alone = pair.decoder(SamplingParams(), speculative=False)
    alone.eos_token_ids = set()
    expected = [alone.generate(ids, 24, 0).token_ids for ids in prompts]
    decoder = pair.decoder(SamplingParams())
    decoder.eos_token_ids = set()
    one_by_one = [decoder.generate(ids, 24, 0) for ids in prompts]
    assert [r.token_ids for r in one_by_one] == expected  # batch 1
    eos = expected[1][3]  # a batch where that row stops at its 4th token, and others may stop too
    expected = [e[: e.index(eos) + 1] if eos in e else e for e in expected]
    decoder.eos_token_ids = {eos}
    batch = decoder.generate_batch(prompts, 24, 0)
    assert [r.token_ids for r in batch] == expected  # batch 4
    steps = [s for r in one_by_one + batch for s in r.steps]
    assert sum(s.drafted for s in steps) > 0
    if method not in UNTRAINED:
        assert sum(s.accepted for s in steps) > 0


@pytest.mark.parametrize("batch_size", SAMPLED)
@pytest.mark.parametrize("drafting", ["chain", "tree"])
@pytest.mark.parametrize("method", METHODS)
def test_sampled_output_is_the_targets(method, drafting, batch_size, tmp_path, write_config):
    pair = pair_of(METHODS[method](tmp_path / method), drafting, write_config)
    params, ids = SAMPLED[batch_size], pair.encode(PROMPTS[0], raw=True)
    earlier_answers(pair, ids, params)
    rows = checks.check_model(pair, ids, "p", params, RUNS, 0, SIGNIFICANCE, batch_size=batch_size)
    statistics.holm(rows, SIGNIFICANCE)
    assert [r.what for r in rows if r.status == statistics.FAIL] == [], [(r.check, r.p_value) for r in rows]
    assert sum(r.p_value is not None for r in rows) >= 5  # the checks tested, not only skipped
    accepted = int(rows[0].note.split("/")[0])
    if method not in UNTRAINED or batch_size == 1:
        assert accepted > 0


@pytest.mark.parametrize("drafting", ["chain", "tree"])
def test_the_tables_checks_catch_a_wrong_q(drafting, write_config, monkeypatch):
    """At the table's runs and significance: a draft model's q reported flatter than the one it drew
    its drafts from, so acceptance is wrong. The draft is another seed's model: the table's noisy one
    is so close to the target that the error hides."""
    pair = pair_of({"tiny": {"seed": 1}}, drafting, write_config)
    drafter = pair.drafter
    name = "propose_tree" if drafting == "tree" else "propose"
    honest = getattr(drafter, name)

    def flattened(*args):
        drafts = honest(*args)
        if drafting == "tree":
            probs = drafts.sampled.probs
            return drafts._replace(sampled=drafts.sampled._replace(probs=0.5 * probs + 0.5 / probs.shape[-1]))
        tokens, q = drafts
        return tokens, 0.5 * q + 0.5 / q.shape[-1]

    monkeypatch.setattr(drafter, name, flattened)
    rows = checks.check_model(pair, pair.encode(PROMPTS[0], raw=True), "p", SAMPLED[1], RUNS, 0, SIGNIFICANCE)
    statistics.holm(rows, SIGNIFICANCE)
    assert [r.check for r in rows if r.status == statistics.FAIL]
