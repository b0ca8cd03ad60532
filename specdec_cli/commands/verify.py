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
2. first token: N speculative runs (seeds s, s+1, ...) of BLOCKS * (gamma + 1) tokens each, token 1
   against the exact warped target distribution;
3. positions 2..gamma+1: the same runs, conditional on their most frequent prefixes, against the
   target's exact conditional distribution, one pooled test per position;
4. every token: each token of every run ranked in the target's exact distribution after that run's own
   prefix (a randomized probability integral transform, uniform under exactness), one test per block
   of gamma + 1 positions; this reaches past the first block, where rare prefixes leave check 3 no data;
5. greedy identity: speculative greedy output equals target-only greedy output.

The goodness-of-fit tests are Pearson chi-square tests on bins that pool rare tokens; all of them form
one family, corrected for multiplicity with Holm's step-down method at the chosen significance. A test
with too few draws for a single degree of freedom is reported as not run, neither passed nor failed.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats

from specdec_cli import display, records
from specdec_cli.config import Config
from specdec_cli.decoding import sampling, tree
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.decoding.verification import SAMPLED_CHAIN_RULES
from specdec_cli.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, SpecdecError
from specdec_cli.pair import Pair, load_pair

MIN_EXPECTED = 5.0  # chi-square needs about 5 expected counts per bin: rarer tokens are pooled
EXACT_TOLERANCE = 1e-6  # max |P(x) - p(x)| allowed for the formula (float32 inputs, float64 sums)
MIN_PREFIX_RUNS = 10  # a prefix seen in fewer runs carries too few draws to test
MAX_PREFIXES = 10  # conditional tests per position: the most frequent prefixes
SAMPLER_ELEMENTS = 2**24  # rows per sampler call: each [rows, 3, V] float32 tensor stays within 64 MB
SAMPLER_DRAFTS = 2  # drafts per chain in the sampler check: with 1, block verification is token verification
EXACT_BLOCK_VOCAB = 12  # the block rule's exact law sums over every chain: the shapes' likeliest tokens
# logit differences below this are floating-point ties: between the target's top-2 (either is a fair
# argmax), or between a token and the top-k/top-p cut (the generating forward may have kept it)
TIE_MARGIN = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.1}
BLOCKS = 2  # runs generate BLOCKS * (gamma + 1) tokens: later blocks start from rolled-back caches
RANK_BINS = 10  # equal bins of [0, 1] for the rank values of check 4 (fewer when draws are few)
MODEL_CHECKS = ("2 ", "3 ", "4 ")  # the statistical checks on the model pair, by row prefix
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


# ---------------------------------------------------------------- 1. the sampler alone


def sampler_shapes(vocab_size: int, params: SamplingParams, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, p, q) pairs of the shapes a real run meets, at the configured vocabulary size."""
    gen = torch.Generator().manual_seed(seed)
    z1, z2 = (torch.randn(vocab_size, generator=gen) for _ in range(2))
    half = torch.arange(vocab_size) < vocab_size // 2
    peaked_p, peaked_q = (3 * z1).softmax(-1), (3 * z2).softmax(-1)
    one_hot = torch.zeros(vocab_size)
    one_hot[peaked_p.topk(3).indices[-1]] = 1.0  # an n-gram draft proposing p's third choice
    shapes = [
        ("peaked p, peaked q", peaked_p, peaked_q),
        ("flat p, flat q", (0.1 * z1).softmax(-1), (0.1 * z2).softmax(-1)),
        ("peaked p, flat q", peaked_p, (0.1 * z2).softmax(-1)),
        (
            "disjoint supports",
            (3 * z1).masked_fill(~half, -math.inf).softmax(-1),
            (3 * z2).masked_fill(half, -math.inf).softmax(-1),
        ),
        ("q = p", peaked_p, peaked_p.clone()),
        ("one-hot q (n-gram draft)", peaked_p, one_hot),
        (
            "top-k 20",
            sampling.warp(3 * z1, SamplingParams(1.0, top_k=20)),
            sampling.warp(3 * z2, SamplingParams(1.0, top_k=20)),
        ),
        (
            "top-p 0.9",
            sampling.warp(3 * z1, SamplingParams(1.0, top_p=0.9)),
            sampling.warp(3 * z2, SamplingParams(1.0, top_p=0.9)),
        ),
        (f"configured warp ({describe_params(params)})", sampling.warp(3 * z1, params), sampling.warp(3 * z2, params)),
    ]
    return shapes


def exact_output(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum min(p, q)) residual(x), in float64, with the
    engine's residual."""
    p64, q64 = p.double(), q.double()
    accepted = torch.minimum(p64, q64)  # q min(1, p/q), also where q = 0
    return accepted + (1 - accepted.sum()) * sampling.residual(p, q).double()


def exact_block_output(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The law [V, V] of the first two tokens that block verification of 2 drafts emits (the target
    drawing the second where it emits one), with p and q at both positions: every chain of drafts,
    weighted by q, with the engine's chances h and corrections (`sampling.block_acceptance`), in float64."""
    p64, q64 = p.double(), q.double()
    vocab = p.shape[-1]
    drafts = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V^2, 2]: every chain
    n = len(drafts)
    h, leftover = sampling.block_acceptance(
        drafts, q64.expand(n, SAMPLER_DRAFTS, vocab), p64.expand(n, SAMPLER_DRAFTS + 1, vocab)
    )
    mass = leftover.sum(-1, keepdim=True)
    correction = torch.where(mass > 0, leftover / mass.clamp_min(torch.finfo(mass.dtype).tiny), p64)
    chain = q64[drafts].prod(-1)  # [V^2]
    # tau, the drafts kept, is the last i whose eta_i < h_i (keeping none always passes): it stops at j
    # when j passes and every later one fails
    h = F.pad(h, (1, 0), value=1.0)
    stop = [h[:, j] * (1 - h[:, j + 1 :]).prod(-1) * chain for j in range(SAMPLER_DRAFTS + 1)]
    law = torch.zeros(vocab, vocab, dtype=torch.float64)
    law.index_put_((drafts[:, 0], drafts[:, 1]), stop[2], accumulate=True)  # both kept
    law.index_add_(0, drafts[:, 0], stop[1][:, None] * correction[:, 1])  # x_1 kept, then its correction
    law += torch.outer(stop[0] @ correction[:, 0], p64)  # the correction, then the target's next token
    return law


def exact_errors(shapes: list[tuple[str, torch.Tensor, torch.Tensor]], verification: str) -> tuple[list[float], str]:
    """max |P - p| per shape for the configured rule's exact law, and what was computed."""
    if verification == "token":
        errors = [float((exact_output(p, q) - p.double()).abs().max()) for _, p, q in shapes]
        return errors, f"exact output distribution from the formula, {len(shapes)} shapes, V={len(shapes[0][1])}"
    errors = []
    for _, p, q in shapes:
        likeliest = (p + q).topk(EXACT_BLOCK_VOCAB).indices
        p_top, q_top = (x[likeliest].double() / x[likeliest].double().sum() for x in (p, q))
        errors.append(float((exact_block_output(p_top, q_top) - torch.outer(p_top, p_top)).abs().max()))
    what = (
        f"exact law of 2 block-verified drafts from block_acceptance, {len(shapes)} shapes on their "
        f"{EXACT_BLOCK_VOCAB} likeliest tokens"
    )
    return errors, what


def sampler_draws(
    verify: Callable, p: torch.Tensor, q: torch.Tensor, bonus: torch.Tensor, draws: int, gen: torch.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw 2 tokens from q and run `verify` on them, p at both positions and `bonus` after them, `draws`
    times. Returns each run's first two output tokens [draws] twice (p being context-free here, the target
    draws the second where a run emitted one), and the counts of the bonus token over the runs that
    accepted both drafts."""
    vocab = p.shape[-1]
    targets = torch.stack([p, p, bonus])
    chunk = max(1, SAMPLER_ELEMENTS // (len(targets) * vocab))
    first, second, after = [], [], np.zeros(vocab)
    for start in range(0, draws, chunk):
        rows = min(chunk, draws - start)
        # the drafts and the target's later token are the test's input, not code under test: multinomial
        # is far cheaper at large V
        drafts = torch.multinomial(q, rows * SAMPLER_DRAFTS, replacement=True, generator=gen).view(rows, -1)
        later = torch.multinomial(p, rows, replacement=True, generator=gen)
        accepted, next_token = verify(
            drafts, q.expand(rows, SAMPLER_DRAFTS, vocab), targets.expand(rows, -1, vocab), gen
        )
        first.append(torch.where(accepted >= 1, drafts[:, 0], next_token))
        second.append(torch.where(accepted == 2, drafts[:, 1], torch.where(accepted == 1, next_token, later)))
        after += np.bincount(next_token[accepted == SAMPLER_DRAFTS].numpy(), minlength=vocab)
    return torch.cat(first).numpy(), torch.cat(second).numpy(), after


def tree_rule_draws(
    p: torch.Tensor, q: torch.Tensor, children: int, draws: int, gen: torch.Generator, sampled: bool = False
) -> np.ndarray:
    """Counts of the token a draft tree's rule emits at a node of `children` children, over `draws`
    runs: the first child that passed, else a draw from the leftover. Deterministic candidates: q's
    top `children` tokens through `tree.try_children`; `sampled`: children drawn from q without
    replacement (`tree.draw_children`, as a sampled tree takes them) through `tree.recursive_rejection`."""
    vocab = p.shape[-1]
    top = q.topk(children).indices
    counts = np.zeros(vocab)
    chunk = max(1, SAMPLER_ELEMENTS // vocab)
    for start in range(0, draws, chunk):
        rows = min(chunk, draws - start)
        targets = p.expand(rows, vocab)
        if sampled:
            tokens = tree.draw_children(q.log().expand(rows, vocab), children, gen)
            drawn = torch.ones(tokens.shape, dtype=torch.bool)
            passed, leftover = tree.recursive_rejection(targets, q.expand(rows, vocab), tokens, drawn, children, gen)
        else:
            tokens = top.expand(rows, -1)
            passed, leftover = tree.try_children(targets, tokens, torch.ones(tokens.shape, dtype=torch.bool), gen)
        tried = tokens.shape[1]
        first = torch.where(passed, torch.arange(tried), tried).min(dim=1).values  # tried: none passed
        taken = tokens.gather(1, first.clamp_max(tried - 1)[:, None])[:, 0]
        emitted = torch.where(first < tried, taken, sampling.sample(leftover, gen))
        counts += np.bincount(emitted.numpy(), minlength=vocab)
    return counts


def check_sampler(
    vocab_size: int,
    params: SamplingParams,
    draws: int,
    seed: int,
    significance: float,
    stage: Stage = no_progress,
    verification: str = "token",
    tree_children: int = 0,
) -> list[Row]:
    """The chain's accept-or-resample on every shape; with `tree_children`, also a draft tree's rules at a
    node of that many children: q's most probable tokens (deterministic candidates), and draws from q
    without replacement (recursive rejection sampling)."""
    shapes = sampler_shapes(vocab_size, params, seed)
    bonus = (3 * torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed + 1))).softmax(-1)
    errors, what = exact_errors(shapes, verification)
    worst = int(np.argmax(errors))
    rows = [
        Row(
            "1 sampler",
            what,
            len(shapes),
            f"max |P-p| = {errors[worst]:.1e}",
            threshold=f"<= {EXACT_TOLERANCE:g}",
            status=PASS if errors[worst] <= EXACT_TOLERANCE else FAIL,
            note=f"worst: {shapes[worst][0]}",
        )
    ]
    rule = SAMPLED_CHAIN_RULES[verification]()  # it calls sampling's function: a patched one is under test
    name = f"{rule.name} verification"
    gen = torch.Generator().manual_seed(seed)
    bonus_fit = Fit()
    advance = stage("sampler draws", len(shapes))
    for shape, p, q in shapes:
        first, second, after = sampler_draws(rule.accept, p, q, bonus, draws, gen)
        probs = p.double().numpy()
        fit = Fit()
        fit.add(np.bincount(first, minlength=vocab_size), probs)
        for token, n in Counter(first.tolist()).most_common(MAX_PREFIXES):
            if n >= MIN_PREFIX_RUNS:
                fit.add(np.bincount(second[first == token], minlength=vocab_size), probs)
        rows.append(
            fit.row("1 sampler", f"{name} draws of {SAMPLER_DRAFTS} drafts, tokens 1 and 2: {shape}", significance)
        )
        bonus_fit.add(after, bonus.double().numpy())
        if tree_children:
            fit = Fit()
            fit.add(tree_rule_draws(p, q, tree_children, draws, gen), p.double().numpy())
            rows.append(fit.row("1 sampler", f"tree rule draws, {tree_children} children: {name}", significance))
            fit = Fit()
            fit.add(tree_rule_draws(p, q, tree_children, draws, gen, sampled=True), p.double().numpy())
            what = f"recursive rejection draws, {tree_children} children drawn from q: {shape}"
            rows.append(fit.row("1 sampler", what, significance))
        advance()
    rows.append(bonus_fit.row("1 sampler", "bonus token after full acceptance, all shapes", significance))
    return rows


# ---------------------------------------------------------------- 2, 3, 4. the model pair


def next_logits(pair: Pair, context: list[int]) -> torch.Tensor:
    """The target's next-token logits after `context` [V], from one fresh forward over all of it."""
    pair.target.reset(len(context))
    return pair.target.forward(torch.tensor([context], device=pair.device), logits="last").logits[0, -1]


def tie_margin(pair: Pair) -> float:
    return TIE_MARGIN.get(pair.dtype, 1e-3)


def at_cut(logits: torch.Tensor, params: SamplingParams, token: int, margin: float) -> bool:
    """Whether `token`, which warp drops from the reference `logits` [V], lies on the top-k/top-p cut
    within float noise (`margin`, in logits): the generating forward, whose logits differ by such noise,
    may have kept it, so drawing it is a tie, not evidence of a bug."""
    kept = sampling.warp(logits, params) > 0
    if logits[token] >= logits[kept].min() - margin:  # level with the kth largest, or the nucleus's last
        return True
    if params.top_p >= 1:
        return False
    # the first token past the nucleus is kept when the mass before it comes out just under top_p;
    # logit noise `margin` moves each probability by a factor of about 1 +- 2 margin / T
    top_k_only = sampling.warp(logits, replace(params, top_p=1.0))
    first_out = int(top_k_only.masked_fill(kept, 0).argmax())
    return (
        token == first_out
        and float(top_k_only[token]) > 0
        and float(top_k_only[kept].sum()) < params.top_p + 2 * margin / params.temperature
    )


def add_draws(fit: Fit, pair: Pair, context: list[int], params: SamplingParams, counts: np.ndarray) -> None:
    """Add the tokens drawn after `context` (counts [V]) against the target's exact warped distribution
    there; draws of a token it excludes only by float noise at the cut are ties, left out."""
    logits = next_logits(pair, context)
    probs = sampling.warp(logits, params).double().cpu().numpy()
    for token in np.flatnonzero((counts > 0) & (probs == 0)):
        if at_cut(logits, params, int(token), tie_margin(pair)):
            fit.ties += int(counts[token])
            counts[token] = 0
    fit.add(counts, probs)


@dataclass
class Runs:
    tokens: np.ndarray  # [runs, k] the first k new tokens of each run
    drafted: int = 0
    accepted: int = 0


def speculative_runs(
    pair: Pair,
    prompt_ids: list[int],
    params: SamplingParams,
    runs: int,
    seed: int,
    blocks: int,
    advance: Advance,
    batch_size: int = 1,
) -> Runs:
    """`runs` independent speculative generations of blocks * (gamma + 1) tokens, as rows of batches of
    `batch_size` copies of the prompt (seeds seed, seed + batch_size, ...): the first block drafts the
    full gamma, so every draft position and the bonus token are exercised, and the next blocks start
    from caches rolled back after a rejection or a full acceptance."""
    decoder = pair.decoder(params)
    outputs, drafted, accepted = [], 0, 0
    for start in range(0, runs, batch_size):
        rows = decoder.generate_batch(
            [prompt_ids] * min(batch_size, runs - start), blocks * (decoder.gamma + 1), seed + start, ignore_eos=True
        )
        for result in rows:
            outputs.append(result.token_ids)
            drafted += sum(s.drafted for s in result.steps)
            accepted += sum(s.accepted for s in result.steps)
            advance()
    return Runs(np.array(outputs), drafted, accepted)


def rank_values(
    pair: Pair, prompt_ids: list[int], tokens: list[int], params: SamplingParams, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """For one run's tokens x_1..x_k, u_t = P(p(Y) > p(x_t)) + V P(p(Y) = p(x_t)), Y ~ p, the target's
    exact distribution after the run's own prefix, V ~ U(0, 1). Under exactness each u_t is uniform given
    the past, so all of them are iid uniform (randomized probability integral transform). Returns u [k],
    NaN where p(x_t) = 0, and which of those are impossible draws rather than ties at the cut."""
    pair.target.reset(len(prompt_ids) + len(tokens))
    context = torch.tensor([prompt_ids + tokens[:-1]], device=pair.device)
    logits = pair.target.forward(context).logits[0, len(prompt_ids) - 1 :]  # [k, V]: one fresh forward
    probs = sampling.warp(logits, params).double().cpu().numpy()
    p_x = probs[np.arange(len(tokens)), tokens][:, None]
    u = np.where(probs > p_x, probs, 0).sum(1) + rng.random(len(tokens)) * np.where(probs == p_x, probs, 0).sum(1)
    u = u.clip(0, 1)  # float32 probabilities may sum to 1 + 1e-7
    zero = p_x[:, 0] == 0
    u[zero] = np.nan
    impossible = np.zeros(len(tokens), dtype=bool)
    for t in np.flatnonzero(zero):
        impossible[t] = not at_cut(logits[t], params, tokens[t], tie_margin(pair))
    return u, impossible


def rank_fit(u: np.ndarray, impossible: np.ndarray) -> Fit:
    """One chi-square test of the rank values u (NaN: left out) against the uniform, on equal bins."""
    values = u[~np.isnan(u)]
    fit = Fit(impossible=int(impossible.sum()), ties=int(np.isnan(u).sum() - impossible.sum()))
    bins = max(1, min(RANK_BINS, int(len(values) / MIN_EXPECTED)))
    fit.add(np.histogram(values, bins=bins, range=(0, 1))[0].astype(float), np.ones(bins))
    return fit


def check_model(
    pair: Pair,
    prompt_ids: list[int],
    label: str,
    params: SamplingParams,
    runs: int,
    seed: int,
    significance: float,
    stage: Stage = no_progress,
    blocks: int = BLOCKS,
    batch_size: int = 1,
) -> list[Row]:
    """Checks 2-4 on `runs` speculative generations of blocks * (gamma + 1) tokens from `prompt_ids`."""
    result = speculative_runs(
        pair, prompt_ids, params, runs, seed, blocks, stage(f"speculative runs, {label}", runs), batch_size
    )
    rows = check_token_runs(pair, prompt_ids, label, params, result.tokens, significance, stage, seed)
    accepted = f"{result.accepted}/{result.drafted} draft tokens accepted over the runs"
    rows[0].note = "; ".join(filter(None, [accepted, rows[0].note]))
    return rows


def check_token_runs(
    pair: Pair,
    prompt_ids: list[int],
    label: str,
    params: SamplingParams,
    runs: list[list[int]] | np.ndarray,
    significance: float,
    stage: Stage = no_progress,
    seed: int = 0,
) -> list[Row]:
    """Checks 2-4 on independent runs of equally many tokens sampled after `prompt_ids` (rows [runs, k]);
    check 4 tests them in windows of gamma + 1 positions, so the first is the first block's."""
    tokens = np.array(runs)
    vocab, span = pair.target.vocab_size, pair.decoder(params).gamma + 1  # the longest block's
    advance = stage(f"target references, {label}", span + len(tokens))
    fit = Fit()
    add_draws(fit, pair, prompt_ids, params, np.bincount(tokens[:, 0], minlength=vocab))
    advance()
    rows = [fit.row("2 first token", f"{label}: token 1 vs the warped target", significance)]
    for position in range(2, min(span, tokens.shape[1]) + 1):
        prefixes = Counter(map(tuple, tokens[:, : position - 1].tolist()))
        fit = Fit()
        frequent = [(prefix, n) for prefix, n in prefixes.most_common(MAX_PREFIXES) if n >= MIN_PREFIX_RUNS]
        for prefix, _ in frequent:
            chosen = (tokens[:, : position - 1] == prefix).all(axis=1)
            add_draws(
                fit, pair, prompt_ids + list(prefix), params, np.bincount(tokens[chosen, position - 1], minlength=vocab)
            )
        advance()
        what = (
            f"{label}: token {position} given its {len(frequent)} most frequent prefixes "
            f"(each in >= {MIN_PREFIX_RUNS} runs)"
        )
        rows.append(fit.row(f"3 position {position}", what, significance))
    rng = np.random.default_rng(seed)
    u, impossible = np.zeros(tokens.shape), np.zeros(tokens.shape, dtype=bool)
    for i, run in enumerate(tokens.tolist()):
        u[i], impossible[i] = rank_values(pair, prompt_ids, run, params, rng)
        advance()
    for start in range(0, tokens.shape[1], span):
        window = f"{start + 1}-{min(start + span, tokens.shape[1])}"
        rows.append(
            rank_fit(u[:, start : start + span], impossible[:, start : start + span]).row(
                f"4 tokens {window}",
                f"{label}: every run's tokens {window}, ranked in the target's distribution "
                "after the run's own prefix (uniform if exact)",
                significance,
            )
        )
    return rows


# ---------------------------------------------------------------- 5. greedy identity


def check_greedy(
    pair: Pair, prompt_ids: list[int], label: str, max_new_tokens: int, seed: int, advance: Advance = lambda: None
) -> Row:
    greedy = SamplingParams(0.0)
    ignore_eos = pair.config.generation.ignore_eos
    spec = pair.decoder(greedy).generate(prompt_ids, max_new_tokens, seed, ignore_eos=ignore_eos).token_ids
    base = (
        pair.decoder(greedy, speculative=False)
        .generate(prompt_ids, max_new_tokens, seed, ignore_eos=ignore_eos)
        .token_ids
    )
    advance()
    tolerance = tie_margin(pair)
    what = f"{label}: speculative greedy == target-only greedy"
    threshold = f"identical, or top-2 margin < {tolerance:g} at the first difference"
    if spec == base:
        return Row("5 greedy", what, len(base), "identical", threshold=threshold)
    position = next((i for i, (a, b) in enumerate(zip(spec, base)) if a != b), min(len(spec), len(base)))
    top2 = next_logits(pair, prompt_ids + base[:position]).topk(2).values
    margin = float(top2[0] - top2[1])
    tie = margin < tolerance
    return Row(
        "5 greedy",
        what,
        len(base),
        f"differs at token {position + 1}, top-2 margin {margin:.2g}",
        threshold=threshold,
        status=PASS if tie else FAIL,
        note="floating-point tie" if tie else "not a tie: a bug",
    )


# ---------------------------------------------------------------- all together


@dataclass
class Settings:
    params: SamplingParams  # of the distribution checks
    samples: int  # speculative runs per prompt
    sampler_draws: int  # chains through the sampler per shape
    significance: float
    seed: int
    greedy_tokens: int
    prompts: list[str] = field(default_factory=list)
    batch_size: int = 1  # the speculative runs are rows of batches of this many copies of a prompt


def describe_params(params: SamplingParams) -> str:
    return f"temperature {params.temperature:g}, top-k {params.top_k or 'off'}, top-p {params.top_p:g}"


def run_checks(pair: Pair, settings: Settings, stage: Stage = no_progress) -> list[Row]:
    """Every check on every prompt; Holm is applied over all the statistical rows together."""
    s = settings
    tree_shape = pair.config.speculation.tree
    rows = check_sampler(
        pair.target.vocab_size,
        s.params,
        s.sampler_draws,
        s.seed,
        s.significance,
        stage,
        pair.config.speculation.verification,
        tree_shape.top_k if tree_shape else 0,
    )
    encoded = [pair.encode(text) for text in s.prompts]
    for ids in encoded:
        pair.check_fits(ids, max(s.greedy_tokens, BLOCKS * (pair.decoder(s.params).gamma + 1)))
    for i, ids in enumerate(encoded):
        rows += check_model(
            pair, ids, f"prompt {i + 1}", s.params, s.samples, s.seed, s.significance, stage, batch_size=s.batch_size
        )
    advance = stage("greedy identity", len(encoded))
    rows += [
        check_greedy(pair, ids, f"prompt {i + 1}", s.greedy_tokens, s.seed, advance) for i, ids in enumerate(encoded)
    ]
    holm(rows, s.significance)
    return rows


# ---------------------------------------------------------------- the command

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
    cfg: Config, prompts: list[str], samples: int | None, significance: float, as_json: bool, batch_size: int = 1
) -> None:
    """Load the pair, run every check with a progress bar on stderr, print the table (or the JSON
    record), write the record; a failed check raises with EXIT_CHECK_FAILED, and too few checks run (too
    few draws) with EXIT_BAD_INPUT."""
    check_options(samples, significance)
    with display.stderr.status(f"Loading {cfg.target.describe()} and {cfg.draft.describe()}..."):
        pair = load_pair(cfg)
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
            "gamma": cfg.speculation.num_draft_tokens,
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

    records.finish("verify-distribution", cfg.name, record, as_json, show)
    if failed:
        raise SpecdecError(
            f"{len(failed)} check(s) failed: " + "; ".join(f"{r.check} ({r.what})" for r in failed), EXIT_CHECK_FAILED
        )
    if too_few:
        raise SpecdecError(f"{too_few}; raise --samples (was {settings.samples})", EXIT_BAD_INPUT)
