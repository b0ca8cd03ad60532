"""`specdec verify-distribution`: the statistics, PASS on the real engine and FAIL on broken variants.

Every broken variant is a realistic bug injected by monkeypatching the function the engine calls; the
checks look the sampler up at call time, so they test exactly what the engine runs. All runs are
seeded, so the verdicts are deterministic.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from specdec_cli import verify
from specdec_cli.decoding import engine, sampling
from specdec_cli.decoding.cache import CachedModel
from specdec_cli.cli import app
from specdec_cli.config import load_config
from specdec_cli.drafters.model import ModelDrafter
from specdec_cli.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED
from specdec_cli.models.pair import load_pair
from specdec_cli.decoding.params import SamplingParams

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

def residual_without_clamp(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    leftover = target_probs - draft_probs  # bug: negative mass is kept
    total = leftover.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, leftover / total.clamp_min(torch.finfo(total.dtype).tiny), target_probs)


def broken_verify_sampled(inverted_ratio: bool = False, bonus_from_last_draft: bool = False):
    """verify_sampled with one bug: acceptance with min(1, q/p), or the bonus drawn from the last draft
    position's distribution instead of the position after it."""

    def verify_sampled(draft_tokens, draft_probs, target_probs, generator):
        batch, gamma = draft_tokens.shape
        p = target_probs[:, :gamma].gather(-1, draft_tokens[..., None])[..., 0].double()
        q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0].double()
        u = torch.rand(batch, gamma, dtype=torch.float64, generator=generator)
        passed = (u * p < q) if inverted_ratio else (u * q < p) & (q > 0)
        num_accepted = sampling.accepted_prefix_length(passed)
        bonus_at = gamma - 1 if bonus_from_last_draft and gamma else gamma
        bonus = target_probs[:, bonus_at:bonus_at + 1]
        candidates = torch.cat([sampling.residual(target_probs[:, :gamma], draft_probs), bonus], 1)
        return num_accepted, sampling.sample(candidates[torch.arange(batch), num_accepted], generator)

    return verify_sampled


def patch_verify(monkeypatch, function) -> None:
    monkeypatch.setattr(sampling, "verify_sampled", function)
    monkeypatch.setattr(engine, "verify_sampled", function)  # the engine imported it by name


def report_q_at_squared_temperature(monkeypatch) -> None:
    """The draft samples its tokens at T but reports q warped at T^2 to the acceptance test."""
    propose = ModelDrafter.propose

    def broken(self, gamma, params, generator):
        tokens, q = propose(self, gamma, params, generator)
        if q is None:  # greedy: no q to misreport
            return tokens, q
        return tokens, (q.log() / params.temperature).softmax(-1)  # softmax(logits / T^2)

    monkeypatch.setattr(ModelDrafter, "propose", broken)


def rollback_one_too_many(monkeypatch) -> None:
    """A cache off by one: after a rejection, one accepted token is forgotten as well."""
    rollback = CachedModel.rollback
    monkeypatch.setattr(CachedModel, "rollback", lambda self, n: rollback(self, n + 1 if n else 0))


# ---------------------------------------------------------------- statistics

def test_pool_bins_merges_rare_categories_and_drops_impossible_ones():
    bins = verify.pool_bins(np.array([10.0, 6.0, 1.0, 1.0, 2.0, 3.0, 0.0, 0.5]))
    assert bins[6] == -1  # probability 0: no bin
    assert bins[0] != bins[1] and len({bins[0], bins[1]} & set(bins[[2, 3, 4, 5, 7]])) == 0
    pooled = np.bincount(bins[bins >= 0], weights=np.array([10.0, 6, 1, 1, 2, 3, 0, 0.5])[bins >= 0])
    assert pooled.sum() == 23.5 and pooled.min() >= verify.MIN_EXPECTED


def test_holm_step_down():
    rows = [verify.Row("x", str(p), 1, "", p_value=p) for p in (0.03, 0.001, 0.003, 0.5)]
    verify.holm(rows, 0.01)
    assert [r.passed for r in rows] == [True, False, False, True]  # 0.001 < .01/4, 0.003 < .01/3, 0.03 > .01/2
    assert rows[1].alpha == pytest.approx(0.0025)


def test_fit_passes_exact_draws_and_fails_shifted_or_impossible_ones():
    rng = np.random.default_rng(0)
    probs = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
    fit = verify.Fit()
    fit.add(np.bincount(rng.choice(5, 2000, p=probs), minlength=5), probs)
    row = fit.row("t", "exact", SIGNIFICANCE)
    assert row.p_value > SIGNIFICANCE and row.tv < row.tv_bound < 0.1
    shifted = verify.Fit()
    shifted.add(np.bincount(rng.choice(5, 2000, p=[0.4, 0.4, 0.15, 0.05, 0.0]), minlength=5), probs)
    assert shifted.row("t", "shifted", SIGNIFICANCE).p_value < 1e-6
    impossible = verify.Fit()
    impossible.add(np.array([5, 3, 1, 1, 1]), probs)
    assert impossible.row("t", "impossible", SIGNIFICANCE).p_value == 0.0


# ---------------------------------------------------------------- 1. the sampler

def sampler_rows() -> dict[str, verify.Row]:
    rows = verify.check_sampler(VOCAB, PARAMS, 4000, seed=0, significance=SIGNIFICANCE)
    verify.holm(rows, SIGNIFICANCE)
    return {row.what: row for row in rows}


def failing(rows) -> list[str]:
    return [row.what for row in (rows.values() if isinstance(rows, dict) else rows) if not row.passed]


def test_sampler_check_passes_on_the_real_sampler():
    rows = sampler_rows()
    assert failing(rows) == []
    assert len(rows) == 11  # exact formula, 9 shapes, bonus


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


def model_rows(pair) -> list[verify.Row]:
    rows = verify.check_model(pair, pair.encode(PROMPT), "p", PARAMS, RUNS, seed=0, significance=SIGNIFICANCE)
    verify.holm(rows, SIGNIFICANCE)
    return rows


def test_model_checks_pass_on_the_real_engine(pair):
    rows = model_rows(pair)
    assert [r.check for r in rows] == ["2 first token", "3 position 2", "3 position 3", "3 position 4"]
    assert failing(rows) == []
    assert rows[0].samples == RUNS and all(r.p_value is not None for r in rows)


@pytest.mark.parametrize("inject", [
    pytest.param(report_q_at_squared_temperature, id="draft-warped-differently"),
    pytest.param(lambda mp: patch_verify(mp, broken_verify_sampled(inverted_ratio=True)), id="min(1,q/p)"),
    pytest.param(lambda mp: patch_verify(mp, broken_verify_sampled(bonus_from_last_draft=True)), id="bonus-position"),
])
def test_model_checks_fail_on_broken_engines(pair, monkeypatch, inject):
    inject(monkeypatch)
    assert failing(model_rows(pair))


def test_greedy_identity_passes_and_catches_a_cache_off_by_one(pair, monkeypatch):
    ids = pair.encode(PROMPT)
    assert verify.check_greedy(pair, ids, "p", 32, seed=0).passed
    rollback_one_too_many(monkeypatch)
    row = verify.check_greedy(pair, ids, "p", 32, seed=0)
    assert not row.passed and row.note == "not a tie: a bug"


# ---------------------------------------------------------------- the command

runner = CliRunner()


def test_command_json_record_and_exit_codes(write_config, tmp_path, monkeypatch):
    config = str(write_config({"sampling": {"temperature": 0.0}, **ONE_THREAD}))
    args = ["verify-distribution", "-c", config, "--samples", "40", "--json", "-p", PROMPT]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["verdict"] == "pass" and record["settings"]["params"]["temperature"] == 1.0  # greedy config
    assert {row["check"] for row in record["checks"]} >= {"1 sampler", "2 first token", "4 greedy"}
    assert list((tmp_path / "runs").glob("*-verify-distribution-tiny-test/record.json"))

    assert runner.invoke(app, args + ["--temperature", "0"]).exit_code == EXIT_BAD_INPUT
    assert runner.invoke(app, args + ["--significance", "2"]).exit_code == EXIT_BAD_INPUT
    assert runner.invoke(app, args + ["--samples", "1"]).exit_code == EXIT_BAD_INPUT  # the last flag wins

    monkeypatch.setattr(sampling, "residual", residual_without_clamp)
    failed = runner.invoke(app, args)
    assert failed.exit_code == EXIT_CHECK_FAILED
    assert json.loads(failed.stdout)["verdict"] == "fail"
