"""`specdec verify-distribution`: statistical evidence that speculative output is the target's own.

Five checks, all through the code `generate` uses (the sampler functions are looked up on the
`sampling` module at call time, so a patched or broken sampler is the one under test):
1. sampler: for many (p, q) shapes, the exact output distribution of the configured verification rule
   equals p (token: accept-or-resample from the formula; block: every chain of 2 drafts summed from the
   engine's acceptance chances and corrections), and N chains of 2 drafts through its function
   (`verify_sampled` or `verify_block`) emit tokens 1 and 2 as p does: token 1, and token 2 given each
   frequent token 1 (and the bonus token against the distribution after the last position);
   with a draft tree, N draws of the tree's rules at a node too: children q's top-k tokens (deterministic
   candidates), and children drawn from q without replacement (recursive rejection sampling);
2. first token: N speculative runs (seeds s, s+1, ...) of BLOCKS * (num_draft_tokens + 1) tokens each, token 1
   against the exact warped target distribution;
3. positions 2..num_draft_tokens+1: the same runs, conditional on their most frequent prefixes, against the
   target's exact conditional distribution, one pooled test per position;
4. every token: each token of every run ranked in the target's exact distribution after that run's own
   prefix (a randomized probability integral transform, uniform under exactness), one test per block
   of num_draft_tokens + 1 positions; this reaches past the first block, where rare prefixes leave check 3 no data;
5. greedy identity: speculative greedy output equals target-only greedy output.

The goodness-of-fit tests are Pearson chi-square tests on bins that pool rare tokens; all of them form
one family, corrected for multiplicity with Holm's step-down method at the chosen significance. A test
with too few draws for a single degree of freedom is reported as not run, neither passed nor failed.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict

from specdec_cli import display, records
from specdec_cli.commands.verify.checks import MODEL_CHECKS, Settings, run_checks
from specdec_cli.commands.verify.laws import describe_params
from specdec_cli.commands.verify.statistics import FAIL, MIN_EXPECTED, NOT_RUN, PASS, Row
from specdec_cli.config import Config
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, SpecdecError
from specdec_cli.pair import Pair, load_pair_showing

# Default prompts: a chat turn whose template repeats tokens, so an n-gram drafter finds matches too.
DEFAULT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "List three facts about the moon, one per line.",
]
SMALL_MODEL_PARAMETERS = 50_000_000
# speculative runs per prompt: the tiny pair affords many; for a 100M+ model on a small CPU, 150 runs
# already take minutes (docs/experiments/2026-11-29-shipped-draft.md, "verify-distribution")
DEFAULT_SAMPLES = {"small": 1000, "large": 150}
SAMPLER_DRAWS_PER_RUN = 10  # the sampler alone is cheap: test it with more draws than model runs
MIN_SAMPLER_DRAWS = 3000


def default_samples(pair: Pair) -> int:
    size = sum(p.numel() for p in pair.target.model.parameters())
    return DEFAULT_SAMPLES["small" if size < SMALL_MODEL_PARAMETERS else "large"]


def check_options(samples: int | None, significance: float) -> None:
    if samples is not None and samples < 2:
        raise SpecdecError(f"--samples must be at least 2, got {samples}")
    if not 0 < significance < 1:
        raise SpecdecError(f"--significance must be in (0, 1), got {significance}")


def make_settings(
    pair: Pair, prompts: list[str], samples: int | None, significance: float, batch_size: int = 1
) -> Settings:
    """The distribution checks use the config's sampling settings, at temperature 1 if it is greedy."""
    s = pair.config.sampling
    runs = samples or default_samples(pair)
    return Settings(
        params=SamplingParams.from_config(s, s.temperature or 1.0),
        samples=runs,
        sampler_draws=max(MIN_SAMPLER_DRAWS, SAMPLER_DRAWS_PER_RUN * runs),
        significance=significance,
        seed=s.seed,
        greedy_tokens=pair.config.generation.max_new_tokens,
        prompts=prompts or DEFAULT_PROMPTS,
        batch_size=batch_size,
    )


def too_few_ran(rows: list[Row]) -> str | None:
    """Why the run says nothing, if it does not: none of the statistical tests on the model pair ran, or
    fewer than half of all of them (too few draws)."""
    tests = [r for r in rows if r.p_value is not None or r.status == NOT_RUN]
    ran = [r for r in tests if r.status != NOT_RUN]
    on_pair = sum(r.check.startswith(MODEL_CHECKS) for r in ran)
    if on_pair and 2 * len(ran) >= len(tests):
        return None
    return f"too few draws to test: {len(ran)} of {len(tests)} statistical checks ran, {on_pair} on the model pair"


def verify_distribution(
    cfg: Config, prompts: list[str], samples: int | None, significance: float, run: records.Run, batch_size: int = 1
) -> None:
    """Load the pair, run every check with a progress bar on stderr, print the table (or the JSON
    record), write the record; a failed check raises with EXIT_CHECK_FAILED, and too few checks run (too
    few draws) with EXIT_BAD_INPUT."""
    check_options(samples, significance)
    pair = load_pair_showing(cfg)
    settings = make_settings(pair, prompts, samples, significance, batch_size)
    start = time.perf_counter()
    with display.progress() as bar:
        rows = run_checks(pair, settings, display.progress_stage(bar))
    seconds = time.perf_counter() - start
    count = Counter(r.status for r in rows)
    failed = [r for r in rows if r.status == FAIL]
    too_few = too_few_ran(rows)
    env = pair.describe()
    record = {
        **records.header("verify-distribution", cfg, env),
        "verdict": "fail" if failed else "inconclusive" if too_few else "pass",
        "seconds": seconds,
        "summary": {"passed": count[PASS], "failed": count[FAIL], "not_run": count[NOT_RUN]},
        "settings": {
            **asdict(settings),
            "num_draft_tokens": cfg.speculation.num_draft_tokens,
            "multiplicity": "holm",
            "min_expected_per_bin": MIN_EXPECTED,
        },
        "checks": [asdict(r) for r in rows],
    }

    def show() -> None:
        title = (
            f"{cfg.name}: {describe_params(settings.params)}, {cfg.describe_drafting()}, "
            f"{cfg.describe_verification()}, "
            f"{settings.samples} runs per prompt in batches of {batch_size}, "
            f"{settings.sampler_draws} sampler draws per shape, "
            f"significance {significance:g} (Holm over {sum(r.alpha is not None for r in rows)} tests)"
        )
        display.stdout.print(display.verification_table(rows, title, display.environment_caption(env)))
        display.stderr.print(
            f"{count[PASS]} passed, {count[FAIL]} failed, {count[NOT_RUN]} not run in {seconds:.0f} s."
        )

    run.finish("verify-distribution", cfg.name, record, show)
    if failed:
        raise SpecdecError(
            f"{len(failed)} check(s) failed: " + "; ".join(f"{r.check} ({r.what})" for r in failed), EXIT_CHECK_FAILED
        )
    if too_few:
        raise SpecdecError(f"{too_few}; raise --samples (was {settings.samples})", EXIT_BAD_INPUT)
