"""`specdec verify-distribution`: the statistics, PASS on the real engine and FAIL on broken variants.

Every broken variant is a realistic bug injected by monkeypatching the function the engine calls; the
checks look the sampler up at call time, so they test exactly what the engine runs. All runs are
seeded, so the verdicts are deterministic.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from broken_rules import (
    block_acceptance_with_token_residual,
    residual_without_clamp,
    verify_block_stopping_at_the_first_failure,
)
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.commands.verify import checks, statistics
from specdec_cli.config import load_config
from specdec_cli.decoding import sampling
from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.decoding.verification import SampledChain
from specdec_cli.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED
from specdec_cli.methods.model import ModelDrafter
from specdec_cli.pair import load_pair

PARAMS = SamplingParams(temperature=0.6)  # not 1, so that "warped at T squared" differs from T
VOCAB = 258  # the tiny pair's byte vocabulary
SIGNIFICANCE = 0.01
RUNS = 300  # speculative runs in the model-level tests
PROMPT = "Hello there, how are you?"
# one thread: tiny models gain nothing from two, and on a busy 2-core machine two threads thrash
ONE_THREAD = {"runtime": {"threads": 1}}


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # load_pair set it process-wide


# ---------------------------------------------------------------- broken variants


def broken_verify_sampled(inverted_ratio: bool = False, bonus_from_last_draft: bool = False):
    """verify_sampled with one bug: acceptance with min(1, q/p), or the bonus drawn from the last draft
    position's distribution instead of the position after it."""

    def verify_sampled(draft_tokens, draft_probs, target_probs, generator):
        batch, num_draft_tokens = draft_tokens.shape
        p = target_probs[:, :num_draft_tokens].gather(-1, draft_tokens[..., None])[..., 0].double()
        q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0].double()
        u = torch.rand(batch, num_draft_tokens, dtype=torch.float64, generator=generator)
        passed = (u * p < q) if inverted_ratio else (u * q < p) & (q > 0)
        num_accepted = sampling.accepted_prefix_length(passed)
        bonus_at = num_draft_tokens - 1 if bonus_from_last_draft and num_draft_tokens else num_draft_tokens
        bonus = target_probs[:, bonus_at : bonus_at + 1]
        candidates = torch.cat([sampling.residual(target_probs[:, :num_draft_tokens], draft_probs), bonus], 1)
        return num_accepted, sampling.sample(candidates[torch.arange(batch), num_accepted], generator)

    return verify_sampled


def patch_verify(monkeypatch, function) -> None:
    monkeypatch.setattr(sampling, "verify_sampled", function)
    monkeypatch.setattr(sampling, "verify_sampled", function)  # the rule looks it up when called


def report_q_at_squared_temperature(monkeypatch) -> None:
    """The draft samples its tokens at T but reports q warped at T^2 to the acceptance test."""
    propose = ModelDrafter.propose

    def broken(self, num_draft_tokens, params, generator):
        tokens, q = propose(self, num_draft_tokens, params, generator)
        if q is None:  # greedy: no q to misreport
            return tokens, q
        return tokens, (q.log() / params.temperature).softmax(-1)  # softmax(logits / T^2)

    monkeypatch.setattr(ModelDrafter, "propose", broken)


def patch_rollback(monkeypatch, forget) -> None:
    """CachedModel.rollback forgets forget(n) tokens where asked for n (per row, if given a list)."""
    rollback = CachedModel.rollback
    monkeypatch.setattr(
        CachedModel,
        "rollback",
        lambda self, n: rollback(self, [forget(count) for count in n] if isinstance(n, list) else forget(n)),
    )


def rollback_one_too_many(monkeypatch) -> None:
    """A cache off by one: after a rejection, one accepted token is forgotten as well."""
    patch_rollback(monkeypatch, lambda n: n + 1 if n else 0)


def rollback_after_full_acceptance(monkeypatch) -> None:
    """A cache that, when a block accepted every draft (nothing to roll back), forgets a token anyway:
    only the blocks after it see the damage."""
    patch_rollback(monkeypatch, lambda n: n or 1)


def misreport_q_after_the_first_block(monkeypatch) -> None:
    """The draft reports q warped at T^2 from its second proposal of a sequence on: the first block,
    all that one block of tokens shows, is exact."""
    start, propose = ModelDrafter.start, ModelDrafter.propose

    def counting_start(self, *args):
        self.proposals = 0
        start(self, *args)

    def broken(self, num_draft_tokens, params, generator):
        tokens, q = propose(self, num_draft_tokens, params, generator)
        self.proposals += 1
        return tokens, q if self.proposals == 1 else (q.log() / params.temperature).softmax(-1)

    monkeypatch.setattr(ModelDrafter, "start", counting_start)
    monkeypatch.setattr(ModelDrafter, "propose", broken)


def warp_without_top_k(monkeypatch) -> None:
    """The engine warps the target's logits without top-k: it emits tokens the target never would."""
    warp = sampling.warp
    monkeypatch.setattr(
        SampledChain, "warp", staticmethod(lambda logits, params: warp(logits, replace(params, top_k=0)))
    )


# ---------------------------------------------------------------- statistics


def test_pool_bins_merges_rare_categories_and_drops_impossible_ones():
    bins = statistics.pool_bins(np.array([10.0, 6.0, 1.0, 1.0, 2.0, 3.0, 0.0, 0.5]))
    assert bins[6] == -1  # probability 0: no bin
    assert bins[0] != bins[1] and len({bins[0], bins[1]} & set(bins[[2, 3, 4, 5, 7]])) == 0
    pooled = np.bincount(bins[bins >= 0], weights=np.array([10.0, 6, 1, 1, 2, 3, 0, 0.5])[bins >= 0])
    assert pooled.sum() == 23.5 and pooled.min() >= statistics.MIN_EXPECTED


def test_holm_step_down():
    rows = [statistics.Row("x", str(p), 1, "", p_value=p) for p in (0.03, 0.001, 0.003, 0.5)]
    statistics.holm(rows, 0.01)
    assert [r.passed for r in rows] == [True, False, False, True]  # 0.001 < .01/4, 0.003 < .01/3, 0.03 > .01/2
    assert rows[1].alpha == pytest.approx(0.0025)


def test_fit_passes_exact_draws_and_fails_shifted_or_impossible_ones():
    rng = np.random.default_rng(0)
    probs = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
    fit = statistics.Fit()
    fit.add(np.bincount(rng.choice(5, 2000, p=probs), minlength=5), probs)
    row = fit.row("t", "exact", SIGNIFICANCE)
    assert row.p_value > SIGNIFICANCE and row.tv < row.tv_bound < 0.1
    shifted = statistics.Fit()
    shifted.add(np.bincount(rng.choice(5, 2000, p=[0.4, 0.4, 0.15, 0.05, 0.0]), minlength=5), probs)
    assert shifted.row("t", "shifted", SIGNIFICANCE).p_value < 1e-6
    impossible = statistics.Fit()
    impossible.add(np.array([5, 3, 1, 1, 1]), probs)
    assert impossible.row("t", "impossible", SIGNIFICANCE).p_value == 0.0


def test_a_fit_without_a_degree_of_freedom_is_not_run_not_passed():
    fit = statistics.Fit()
    fit.add(np.array([2, 1, 0]), np.array([0.5, 0.3, 0.2]))  # 3 draws: a single pooled bin
    rows = [fit.row("t", "few", SIGNIFICANCE)]
    statistics.holm(rows, SIGNIFICANCE)
    assert rows[0].status == statistics.NOT_RUN and not rows[0].passed and rows[0].p_value is None


def test_tv_bound_mixes_the_groups_own_bounds():
    # 1000 draws on 2 bins and 20 on 4: the sampling term is sum_g sqrt(df_g n_g) / 2n, not sqrt(df / n) / 2
    fit = statistics.Fit()
    fit.add(np.array([480.0, 520.0]), np.array([0.5, 0.5]))
    fit.add(np.array([5.0, 5, 5, 5]), np.full(4, 0.25))
    row = fit.row("t", "two groups", SIGNIFICANCE)
    n = 1020
    assert row.tv == pytest.approx(40 / (2 * n))
    expected = row.tv + (math.sqrt(1 * 1000) + math.sqrt(3 * 20)) / (2 * n) + math.sqrt(math.log(100) / (2 * n))
    assert row.tv_bound == pytest.approx(expected)


def test_at_cut_tells_float_ties_from_tokens_outside_the_support():
    margin = 1e-3
    logits = torch.tensor([5.0, 4.0, 3.0, 3.0 - 1e-4, 1.0, 0.0])
    top_k = SamplingParams(1.0, top_k=3)
    assert checks.at_cut(logits, top_k, 3, margin)  # level with the 3rd largest: either could be kept
    assert not checks.at_cut(logits, top_k, 4, margin)
    # nucleus: tokens 0 and 1 hold 0.8 >= top_p, so token 2 is out, but by less than float noise
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    top_p = SamplingParams(1.0, top_p=0.7999)
    assert sampling.warp(logits, top_p)[2] == 0
    assert checks.at_cut(logits, top_p, 2, margin)
    assert not checks.at_cut(logits, top_p, 3, margin)
    assert not checks.at_cut(logits, SamplingParams(1.0, top_p=0.7), 2, margin)  # out by 0.1 of mass


def test_tokens_tied_at_the_top_k_cut_are_ties_whichever_the_generating_forward_kept():
    """bfloat16 rounds logits level: warp keeps every token level with the k-th largest, and the
    generating forward, its logits off by float noise, keeps k of them. Its draws then never show the
    token it dropped, which a test against warp's distribution reads as a failure; left out as ties,
    the same draws pass."""
    logits = torch.tensor([2.0, 1.5, 1.0, 1.0, -1.0])  # the 3rd and 4th level
    params, margin = SamplingParams(1.0, top_k=3), 1e-3
    assert int((sampling.warp(logits, params) > 0).sum()) == 4
    generating = sampling.warp(logits + torch.tensor([0.0, 0.0, margin / 2, 0.0, 0.0]), params)  # it keeps the 3rd
    drawn = sampling.sample(generating.expand(20_000, -1), torch.Generator().manual_seed(0))
    counts = np.bincount(drawn.numpy(), minlength=5).astype(float)
    against_warp = statistics.Fit()
    against_warp.add(counts.copy(), sampling.warp(logits, params).double().numpy())
    assert against_warp.row("2", "warp's", SIGNIFICANCE).p_value < 1e-6  # the false failure
    fit = statistics.Fit()
    checks.add_draws(fit, logits, params, counts, margin)
    row = fit.row("2", "tied tokens left out", SIGNIFICANCE)
    assert fit.ties == int((drawn == 2).sum()) > 0 and row.p_value > SIGNIFICANCE
    assert not checks.tied_at_top_k(torch.tensor([2.0, 1.5, 1.0, 0.9, -1.0]), params, margin).any()  # a clear cut


# ---------------------------------------------------------------- 1. the sampler


def sampler_rows(verification: str = "token") -> dict[str, statistics.Row]:
    rows = checks.check_sampler(VOCAB, PARAMS, 4000, seed=0, significance=SIGNIFICANCE, verification=verification)
    statistics.holm(rows, SIGNIFICANCE)
    return {row.what: row for row in rows}


def failing(rows) -> list[str]:
    return [row.what for row in (rows.values() if isinstance(rows, dict) else rows) if not row.passed]


@pytest.mark.parametrize("verification", ["token", "block"])
def test_sampler_check_passes_on_the_real_sampler(verification):
    rows = sampler_rows(verification)
    assert failing(rows) == []
    assert len(rows) == 11  # exact formula, 9 shapes, bonus
    assert sum(what.startswith(f"{verification} verification draws") for what in rows) == 9


def test_sampler_check_fails_on_broken_block_verification(monkeypatch):
    monkeypatch.setattr(sampling, "block_acceptance", block_acceptance_with_token_residual)
    assert failing(sampler_rows("block")) == [
        "exact law of 2 block-verified drafts from block_acceptance, 9 shapes on their 12 likeliest tokens"
    ]
    monkeypatch.undo()
    monkeypatch.setattr(sampling, "verify_block", verify_block_stopping_at_the_first_failure)
    assert failing(sampler_rows("block")) == ["block verification draws of 2 drafts, tokens 1 and 2: flat p, flat q"]


def test_sampler_check_fails_without_the_clamp(monkeypatch):
    monkeypatch.setattr(sampling, "residual", residual_without_clamp)
    # the exact formula sees it at once; the draws may be too few to resolve a small distortion
    assert failing(sampler_rows())[0].startswith("exact output distribution")


def test_sampler_check_fails_with_inverted_acceptance_ratio(monkeypatch):
    patch_verify(monkeypatch, broken_verify_sampled(inverted_ratio=True))
    assert any("disjoint" in what or "peaked" in what for what in failing(sampler_rows()))


def test_sampler_check_fails_with_bonus_from_the_wrong_position(monkeypatch):
    patch_verify(monkeypatch, broken_verify_sampled(bonus_from_last_draft=True))
    assert failing(sampler_rows()) == ["bonus token after full acceptance, all shapes"]


# ---------------------------------------------------------------- 2-4. the model pair


@pytest.fixture
def pair(write_config):
    return load_pair(load_config(str(write_config(ONE_THREAD))))


def model_rows(pair, params: SamplingParams = PARAMS, **blocks) -> list[statistics.Row]:
    rows = checks.check_model(pair, pair.encode(PROMPT), "p", params, RUNS, seed=0, significance=SIGNIFICANCE, **blocks)
    statistics.holm(rows, SIGNIFICANCE)
    return rows


@pytest.fixture
def block_pair(write_config):
    return load_pair(load_config(str(write_config({"speculation": {"verification": "block"}, **ONE_THREAD}))))


def test_model_checks_pass_on_block_verification_and_catch_a_broken_one(block_pair, monkeypatch):
    assert failing(model_rows(block_pair, SamplingParams(temperature=0.6, top_k=20, top_p=0.9), batch_size=4)) == []
    monkeypatch.setattr(sampling, "verify_block", verify_block_stopping_at_the_first_failure)
    assert failing(model_rows(block_pair))


def test_model_checks_pass_on_the_real_engine(pair):
    rows = model_rows(pair)
    assert [r.check for r in rows] == [
        "2 first token",
        "3 position 2",
        "3 position 3",
        "3 position 4",
        "4 tokens 1-4",
        "4 tokens 5-8",
    ]
    assert failing(rows) == []
    assert rows[0].samples == RUNS and rows[-1].samples == 4 * RUNS and all(r.p_value is not None for r in rows)


@pytest.mark.parametrize(
    "inject",
    [
        pytest.param(report_q_at_squared_temperature, id="draft-warped-differently"),
        pytest.param(lambda mp: patch_verify(mp, broken_verify_sampled(inverted_ratio=True)), id="min(1,q/p)"),
        pytest.param(
            lambda mp: patch_verify(mp, broken_verify_sampled(bonus_from_last_draft=True)), id="bonus-position"
        ),
    ],
)
def test_model_checks_fail_on_broken_engines(pair, monkeypatch, inject):
    inject(monkeypatch)
    assert failing(model_rows(pair))


@pytest.mark.parametrize("inject", [rollback_after_full_acceptance, misreport_q_after_the_first_block])
def test_model_checks_catch_a_bug_after_the_first_block(pair, monkeypatch, inject):
    inject(monkeypatch)
    assert failing(model_rows(pair, blocks=1)) == []  # the first num_draft_tokens + 1 tokens are still exact
    assert failing(model_rows(pair)) == [
        "p: every run's tokens 5-8, ranked in the target's distribution after the run's own prefix (uniform if exact)"
    ]


def test_model_checks_tell_float_ties_at_the_top_k_cut_from_a_broken_warp(write_config, monkeypatch):
    # in bfloat16 the cached forward and the fresh reference differ by rounding, so a token level with
    # the 5th largest logit can be in one top-5 and not the other: a tie, not a failure
    pair = load_pair(load_config(str(write_config({"runtime": {"dtype": "bfloat16", "threads": 1}}))))
    top_k = SamplingParams(temperature=0.6, top_k=5)
    rows = model_rows(pair, top_k)
    assert failing(rows) == [] and any("ties, left out" in r.note for r in rows)
    warp_without_top_k(monkeypatch)  # tokens far below the cut: still failures
    broken = [r for r in model_rows(pair, top_k, blocks=1) if not r.passed]
    assert any(r.statistic.endswith("draws of zero-probability tokens") for r in broken)


def test_greedy_identity_passes_and_catches_a_cache_off_by_one(pair, monkeypatch):
    ids = pair.encode(PROMPT)
    assert checks.check_greedy(pair, ids, "p", 32, seed=0).passed
    rollback_one_too_many(monkeypatch)
    row = checks.check_greedy(pair, ids, "p", 32, seed=0)
    assert not row.passed and row.note == "not rounding: a bug"


# ---------------------------------------------------------------- the command

runner = CliRunner()


def test_command_json_record_and_exit_codes(write_config, tmp_path, monkeypatch):
    config = str(write_config({"sampling": {"temperature": 0.0}, **ONE_THREAD}))
    args = ["verify-distribution", "-c", config, "--samples", "40", "--json", "-p", PROMPT]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["verdict"] == "pass" and record["settings"]["params"]["temperature"] == 1.0  # greedy config
    assert {row["check"] for row in record["checks"]} >= {"1 sampler", "2 first token", "4 tokens 5-8", "5 greedy"}
    assert record["summary"]["failed"] == 0 and record["summary"]["passed"] >= len(record["checks"]) // 2
    assert list((tmp_path / "runs").glob("*-verify-distribution-tiny-test/record.json"))

    assert runner.invoke(app, args + ["--temperature", "0"]).exit_code == EXIT_BAD_INPUT
    assert runner.invoke(app, args + ["--significance", "2"]).exit_code == EXIT_BAD_INPUT
    assert runner.invoke(app, args + ["--samples", "1"]).exit_code == EXIT_BAD_INPUT  # the last flag wins

    monkeypatch.setattr(sampling, "residual", residual_without_clamp)
    failed = runner.invoke(app, args)
    assert failed.exit_code == EXIT_CHECK_FAILED
    assert json.loads(failed.stdout)["verdict"] == "fail"


def test_command_with_too_few_draws_is_bad_input_not_a_pass(write_config):
    # 2 runs give no test on the model pair a degree of freedom: those rows are NOT RUN, and the run says nothing
    config = str(write_config({"sampling": {"temperature": 1.0}, **ONE_THREAD}))
    args = ["verify-distribution", "-c", config, "--samples", "2", "-p", PROMPT]
    table = runner.invoke(app, args)
    assert table.exit_code == EXIT_BAD_INPUT
    assert "NOT RUN" in table.output and " passed, 0 failed, 6 not run in " in table.output
    assert table.output.strip().splitlines()[-1].startswith("Error: too few draws to test: ")
    assert "raise --samples" in table.output
    record = json.loads(runner.invoke(app, args + ["--json"]).stdout)
    assert record["verdict"] == "inconclusive" and record["summary"]["not_run"] == 6
    assert {row["status"] for row in record["checks"] if row["check"].startswith(("2", "3", "4"))} == {"not run"}


def test_command_checks_block_verification(write_config):
    config = str(write_config({"sampling": {"temperature": 1.0, "top_k": 20, "top_p": 0.9}, **ONE_THREAD}))
    args = ["verify-distribution", "-c", config, "--verification", "block", "--batch-size", "4", "--samples", "40"]
    result = runner.invoke(app, [*args, "--json", "-p", PROMPT])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["verdict"] == "pass" and record["config"]["speculation"]["verification"] == "block"
    assert any(row["what"].startswith("block verification draws") for row in record["checks"])
