"""Greedy divergences classed as rounding or a bug (decoding/drift.py), on real tiny models: a target
built to sit on near-ties, whose flips are rounding, and broken loops that must be classed bugs, in the
triage itself and in benchmark's records, table and exit code (verify-distribution's: test_verify.py)."""

from __future__ import annotations

import json

import pytest
import torch
from broken_rules import verify_greedy_within_top_two
from conftest import cached
from typer.testing import CliRunner

from specdec_cli.bench import run as run_module
from specdec_cli.bench.plan import make_plan
from specdec_cli.bench.prompts import Prompt
from specdec_cli.bench.run import run_benchmark
from specdec_cli.bench.summary import summarize_peers
from specdec_cli.cli import app
from specdec_cli.config import TinyModel, load_config
from specdec_cli.decoding import drift, sampling
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.errors import EXIT_CHECK_FAILED
from specdec_cli.loading.checkpoints import build_tiny
from specdec_cli.methods.model import ModelDrafter
from specdec_cli.pair import load_pair

GREEDY = SamplingParams()
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
FLOAT32 = drift.resolution(torch.float32)  # the tiny models' logits are far below where ulps decide


def decode(target, draft, prompt: list[int], tokens: int = 32, num_draft_tokens: int = 3):
    drafter = None if draft is None else ModelDrafter(cached(draft))
    return SpeculativeDecoder(cached(target), drafter, GREEDY, num_draft_tokens, set()).generate(prompt, tokens, 0)


PROMPTS = [PROMPT, "Hello there, how are you?", "Once upon a time in a land far away", "1, 2, 3, 4, 5, 6, 7"]


@pytest.fixture(scope="module")
def near_tie(tokenizer):
    """The tiny target with a twin of the token it emits most: the twin's head row is the leader's
    moved 1e-6 along a random direction, so wherever either leads the two sit about 1e-6 apart, below
    what a block's forward and a single step may round apart. Returns (model, (leader, twin))."""
    model = build_tiny(TinyModel(seed=0)).eval()
    alone = decode(model, None, tokenizer.encode(PROMPT)).token_ids
    leader = max(set(alone), key=alone.count)
    twin = (leader + 1) % model.config.vocab_size
    direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[leader] + 1e-6 * direction / direction.norm()
    return model, (leader, twin)


def test_flips_at_a_near_tie_are_rounding(near_tie, noisy_draft, tokenizer):
    model, _ = near_tie
    found = []
    for prompt in map(tokenizer.encode, PROMPTS):
        alone = decode(model, None, prompt, 64)
        for num_draft_tokens in (3, 6):
            speculative = decode(model, noisy_draft, prompt, 64, num_draft_tokens)
            runs = [(r.token_ids, r.steps) for r in (alone, speculative)]
            found += [d for d in [drift.triage(cached(model), prompt, *runs, torch.float32)] if d is not None]
    if not found:  # the unrouted tiny model's products decide; some CPUs round a block's rows as single steps
        pytest.skip("this CPU rounds every block as its single steps: no drift to class")
    assert all(d.rounding and d.reproduced and d.gap < FLOAT32 and d.difference < FLOAT32 for d in found)
    assert found[0].describe().startswith(f"token {found[0].position + 1}: rounding")


def test_a_flip_at_a_near_tie_that_the_loop_does_not_compute_is_a_bug(near_tie, tokenizer):
    """A bug may flip a near-tie too: the replays, which do not flip it, tell it from rounding."""
    model, pair = near_tie
    prompt = tokenizer.encode(PROMPT)
    alone = decode(model, None, prompt)
    position = next(i for i, t in enumerate(alone.token_ids) if t in pair)
    flipped = alone.token_ids[:position] + [pair[0] + pair[1] - alone.token_ids[position]]
    found = drift.triage(
        cached(model), prompt, (alone.token_ids, alone.steps), (flipped, alone.steps[: position + 1]), torch.float32
    )
    assert found.position == position and found.gap < FLOAT32 and found.difference < FLOAT32
    assert not found.reproduced and not found.rounding
    near_tie = f"picks token {found.alone_token} at a near-tie, the loop emitted {found.speculative_token}"
    assert found.reason == f"the replayed verification forward {near_tie}"


def test_a_loop_accepting_the_targets_second_choice_is_a_bug(tiny_target, noisy_draft, tokenizer, monkeypatch):
    prompt = tokenizer.encode(PROMPT)
    alone = decode(tiny_target, None, prompt)
    monkeypatch.setattr(sampling, "verify_greedy", verify_greedy_within_top_two)
    broken = decode(tiny_target, noisy_draft, prompt)
    runs = [(r.token_ids, r.steps) for r in (alone, broken)]
    found = drift.triage(cached(tiny_target), prompt, *runs, torch.float32)
    assert found is not None and not found.rounding and found.gap > FLOAT32
    picked, emitted = found.alone_token, found.speculative_token
    assert found.reason == f"the replayed verification forward picks token {picked}, the loop emitted {emitted}"


runner = CliRunner()


def test_benchmark_records_a_bug_shows_it_and_exits_3(write_config, monkeypatch):
    config = str(write_config({"runtime": {"threads": 1}}))
    args = ["benchmark", "-c", config, "--category", "qa", "--limit", "2", "--temperatures", "0", "--warmup", "0"]
    args += ["--num-draft-tokens-list", "3", "--json"]
    exact = runner.invoke(app, args)
    assert exact.exit_code == 0, exact.output
    runs = json.loads(exact.stdout)["runs"]
    assert [r["repeats"][0]["greedy_divergence"] for r in runs if r["num_draft_tokens"]] == [None, None]

    monkeypatch.setattr(sampling, "verify_greedy", verify_greedy_within_top_two)
    broken = runner.invoke(app, args)
    assert broken.exit_code == EXIT_CHECK_FAILED
    assert "Error: greedy output left the target alone's by more than rounding, a bug: " in broken.stderr
    record = json.loads(broken.stdout)
    found = [r["repeats"][0]["greedy_divergence"] for r in record["runs"] if r["num_draft_tokens"]]
    assert any(d is not None and not d["rounding"] for d in found)
    overall = next(r for r in record["summary"] if r["group"] == "overall")
    assert overall["greedy_not_rounding"] == sum(d is not None and not d["rounding"] for d in found) > 0

    table = runner.invoke(app, args[:-1] + ["--no-record"])
    assert "NOT by rounding (a bug)" in table.stdout


def test_resolution_grows_with_the_logits_in_units_in_the_last_place():
    assert drift.resolution(torch.float32, "float", 20.0) == 1e-3  # 8 ulps at 20 are 1.5e-5: the floor
    assert drift.resolution(torch.bfloat16, "float", 20.0) == 8 * 2**-7 * 16  # 1.0
    assert drift.resolution(torch.bfloat16, "float", 0.5) == 0.1
    assert drift.resolution(torch.float32, "int4", 20.0) == 1.0  # int4 products round to bfloat16


def test_each_verdict_from_the_two_forwards_logits():
    """drift.verdict on logits over 4 tokens, the target alone having emitted 0 and the loop 1."""
    single = torch.tensor([5.0, 4.9995, 1.0, 0.0])

    def case(verification, trees=False):
        return drift.verdict(single, torch.tensor(verification), 0, 1, FLOAT32, trees)[2:]

    assert case([4.9995, 5.0, 1.0, 0.0]) == (True, True, "a near-tie the two forwards round apart")
    not_flipped = case([5.0, 4.9995, 1.0, 0.0])
    assert not_flipped[:2] == (False, False) and not_flipped[2].endswith(
        "picks token 0 at a near-tie, the loop emitted 1"
    )
    assert case([5.0, 4.9995, 1.0, 0.0], trees=True)[:2] == (False, True)  # trees' replays are chains
    assert case([4.9, 5.0, 1.0, 0.0])[1:] == (False, "the two forwards differ by more than rounding")
    assert case([3.0, 2.0, 6.0, 0.0])[2] == "the replayed verification forward picks token 2, the loop emitted 1"
    far = drift.verdict(torch.tensor([5.0, 4.0, 1.0, 0.0]), torch.tensor([4.5, 4.6, 1.0, 0.0]), 0, 1, 0.8, False)
    assert far[3:] == (False, "the two tokens are further apart than rounding")  # gap 1, forwards 0.6 apart
    wrong_alone = drift.verdict(single, torch.tensor([4.9995, 5.0, 1.0, 0.0]), 2, 1, FLOAT32, False)
    assert wrong_alone[3:] == (False, "the replayed single-token forward picks token 0, the target alone emitted 2")


def test_a_peers_first_difference_is_located_with_specdecs_own_gap_there(write_config):
    pair = load_pair(load_config(str(write_config({"runtime": {"threads": 1}}))))
    prompts = [Prompt("p", "c", (PROMPT,)), Prompt("two turns", "c", (PROMPT, "And then?"))]
    runs, _ = run_benchmark(pair, prompts, make_plan(pair.config, [3], [0.0], 1, 0, None))
    alone_runs = {r["prompt_id"]: r for r in runs if r["num_draft_tokens"] == 0}
    alone = alone_runs["p"]["repeats"][0]["token_ids"]
    # specdec's own next-token logits at token 5, from one fresh forward over the whole context
    ids = pair.encode(PROMPT)
    pair.target.reset(len(ids) + 8)
    logits = pair.target.forward(torch.tensor([ids + alone[:5]]), logits="last").logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    # a peer (an engine not run here) that took specdec's runner-up at token 5, and one that agreed throughout
    peer = [
        {**alone_runs[i], "engine": "llamacpp", "repeats": [{**alone_runs[i]["repeats"][0], "token_ids": tokens}]}
        for i, tokens in (("p", alone[:5] + [runner_up]), ("two turns", [0]))
    ]
    run_module.locate_peer_divergences(pair, prompts, runs + peer)
    found = peer[0]["repeats"][0]["greedy_divergence"]
    assert (found["position"], found["specdec_token"], found["peer_token"]) == (5, alone[5], runner_up)
    assert found["gap"] == pytest.approx(float(logits[alone[5]] - logits[runner_up]), abs=1e-4)
    assert found["gap"] == found["specdec_margin"] > 0
    assert peer[1]["repeats"][0]["greedy_divergence"] is None  # two turns: not located
    row = next(r for r in summarize_peers(runs + peer) if r["engine"] == "llamacpp")
    assert row["greedy_near_ties"] == int(found["gap"] < found["resolution"])
