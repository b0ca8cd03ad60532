"""verify-distribution's statistics: a row per check, Pearson chi-square fits on pooled bins, and
Holm's step-down correction over the whole family."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats

MIN_EXPECTED = 5.0  # chi-square needs about 5 expected counts per bin: rarer tokens are pooled
RANK_BINS = 10  # equal bins of [0, 1] for the rank values of check 4 (fewer when draws are few)
PASS, FAIL, NOT_RUN = "pass", "fail", "not run"

Advance = Callable[[], None]
Stage = Callable[[str, int], Advance]  # (description, total units) -> call once per unit done


def no_progress(description: str, total: int) -> Advance:
    return lambda: None


@dataclass
class Row:
    """One line of the report. Statistical rows carry a p-value; Holm then sets threshold and status.
    A test that could not run (too few draws) has no p-value and status NOT_RUN: not a pass.
    tv: the total variation between the draws and the target on the test's bins (averaged over prefix
    groups with weights n_g / n); tv_bound: above the output's own binned TV at confidence
    1 - significance, i.e. the test's resolution (see Fit.row)."""

    check: str
    what: str
    samples: int
    statistic: str
    p_value: float | None = None
    tv: float | None = None
    tv_bound: float | None = None
    threshold: str = ""
    alpha: float | None = None  # the Holm-corrected significance this row's p-value was held to
    status: str = PASS  # PASS, FAIL or NOT_RUN
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASS


@dataclass
class Fit:
    """A pooled chi-square test, possibly summed over independent groups (one per prefix)."""

    statistic: float = 0.0
    df: int = 0
    n: int = 0
    abs_diff: float = 0.0  # sum over bins of |observed - expected|
    spread: float = 0.0  # sum over groups of sqrt(df_g n_g): the sampling-error term of the TV bound
    impossible: int = 0  # draws of tokens whose probability is exactly 0
    ties: int = 0  # draws left out: probability 0, but on the top-k/top-p cut within float noise

    def add(self, counts: np.ndarray, probs: np.ndarray) -> None:
        n = int(counts.sum())
        expected = probs / probs.sum() * n
        bins = pool_bins(expected)
        self.impossible += int(counts[bins < 0].sum())
        kept = bins >= 0
        observed = np.bincount(bins[kept], weights=counts[kept])
        expect = np.bincount(bins[kept], weights=expected[kept])
        self.n += n
        self.abs_diff += float(np.abs(observed - expect).sum())
        if len(expect) > 1:  # a single bin holds no information
            self.statistic += float(((observed - expect) ** 2 / expect).sum())
            self.df += len(expect) - 1
            self.spread += math.sqrt((len(expect) - 1) * n)

    def row(self, check: str, what: str, significance: float) -> Row:
        note = f"{self.ties} draws on the top-k/top-p cut within float noise: ties, left out" if self.ties else ""
        if self.impossible:
            return Row(
                check,
                what,
                self.n,
                f"{self.impossible} draws of zero-probability tokens",
                p_value=0.0,
                note="tokens the target can never produce",
            )
        if self.df == 0:
            return Row(
                check, what, self.n, "not testable", status=NOT_RUN, note="too few draws to test; raise --samples"
            )
        tv = self.abs_diff / (2 * self.n)
        # The output's binned TV from the target is at most tv + TV(empirical, output). In group g (df_g + 1
        # bins, n_g draws) E[TV_g] <= sqrt(df_g / n_g) / 2 (Cauchy-Schwarz); the groups mix with weights
        # n_g / n, so E <= sum_g sqrt(df_g n_g) / 2n. One draw moves the mixture's TV by at most 1/n, so
        # McDiarmid adds sqrt(ln(1/significance) / 2n): a bound at confidence 1 - significance.
        bound = tv + self.spread / (2 * self.n) + math.sqrt(math.log(1 / significance) / (2 * self.n))
        return Row(
            check,
            what,
            self.n,
            f"chi2={self.statistic:.1f}, df={self.df}",
            p_value=float(stats.chi2.sf(self.statistic, self.df)),
            tv=tv,
            tv_bound=min(bound, 1.0),
            note=note,
        )


def pool_bins(expected: np.ndarray) -> np.ndarray:
    """Bin index per category, -1 where the expected count is 0. Categories expecting at least
    MIN_EXPECTED keep their own bin; rarer ones are merged, rarest first, into bins that reach it
    (a short remainder joins the previous pooled bin, or the smallest own bin)."""
    bins = np.full(len(expected), -1)
    order = np.argsort(expected, kind="stable")
    order = order[expected[order] > 0]
    rare = order[expected[order] < MIN_EXPECTED]
    common = order[expected[order] >= MIN_EXPECTED]
    bins[common] = np.arange(len(common))
    next_bin, mass, members, last_full = len(common), 0.0, [], None
    for token in rare:
        members.append(token)
        mass += expected[token]
        if mass >= MIN_EXPECTED:
            bins[members] = last_full = next_bin
            next_bin, mass, members = next_bin + 1, 0.0, []
    if members:
        fallback = last_full if last_full is not None else (0 if len(common) else next_bin)
        bins[members] = fallback
    return bins


def holm(rows: list[Row], significance: float) -> None:
    """Holm's step-down correction over every row with a p-value: the i-th smallest p-value is
    compared with significance / (m - i); the first that is not below stops the rejections."""
    tested = sorted((r for r in rows if r.p_value is not None), key=lambda r: r.p_value)
    rejecting = True
    for i, row in enumerate(tested):
        row.alpha = significance / (len(tested) - i)
        row.threshold = f"p >= {row.alpha:.2g} (Holm)"
        rejecting = rejecting and row.p_value < row.alpha
        row.status = FAIL if rejecting else PASS
