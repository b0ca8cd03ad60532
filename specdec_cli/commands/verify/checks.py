"""verify-distribution's checks 1-5 (the package's docstring says what each tests), all through the
code `generate` runs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from specdec_cli.commands.verify.laws import (
    EXACT_TOLERANCE,
    SAMPLER_DRAFTS,
    exact_errors,
    sampler_shapes,
)
from specdec_cli.commands.verify.statistics import (
    FAIL,
    MIN_EXPECTED,
    PASS,
    RANK_BINS,
    Advance,
    Fit,
    Row,
    Stage,
    holm,
    no_progress,
)
from specdec_cli.decoding import drift, sampling, tree
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.decoding.verification import SAMPLED_CHAIN_RULES
from specdec_cli.pair import Pair

MIN_PREFIX_RUNS = 10  # a prefix seen in fewer runs carries too few draws to test
MAX_PREFIXES = 10  # conditional tests per position: the most frequent prefixes
SAMPLER_ELEMENTS = 2**24  # rows per sampler call: each [rows, 3, V] float32 tensor stays within 64 MB
BLOCKS = 2  # runs generate BLOCKS * (num_draft_tokens + 1) tokens: later blocks start from rolled-back caches
MODEL_CHECKS = ("2 ", "3 ", "4 ")  # the statistical checks on the model pair, by row prefix


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
    """Logit differences below this are floating-point ties: between the target's top-2 (either is a
    fair argmax), or between a token and the top-k/top-p cut (the generating forward may have kept it)."""
    return drift.resolution(pair.dtype, pair.weights)


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


def tied_at_top_k(logits: torch.Tensor, params: SamplingParams, margin: float) -> torch.Tensor:
    """[..., V] the tokens level with the k-th largest logit within float noise (`margin`), where some of
    them are kept and some dropped: which ones the generating forward kept, its logits differing by such
    noise, is a tie (bfloat16 rounds many logits to the same value). None where the cut is clear."""
    k = params.top_k
    if not 0 < k < logits.shape[-1]:
        return torch.zeros_like(logits, dtype=torch.bool)
    kth = logits.topk(k, dim=-1).values[..., -1:]
    near = (logits - kth).abs() <= margin
    straddles = (logits >= kth - margin).sum(-1, keepdim=True) > k
    return near & straddles


def reference(logits: torch.Tensor, params: SamplingParams, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """The target's warped distribution [..., V] with the tokens tied at the top-k cut taken out (their
    probability 0: the tests condition on drawing none of them, which the generating forward and the
    reference agree on whichever of them either kept), and those tokens."""
    tied = tied_at_top_k(logits, params, margin)
    probs = sampling.warp(logits, params).masked_fill(tied, 0)
    return probs.double().cpu().numpy(), tied.cpu().numpy()


def add_draws(fit: Fit, logits: torch.Tensor, params: SamplingParams, counts: np.ndarray, margin: float) -> None:
    """Add the tokens drawn at one position (counts [V]) against the target's exact warped distribution
    there, from its `logits` [V]; draws of a token on the cut within float noise (`margin`: `reference`,
    `at_cut`) are ties, left out."""
    probs, tied = reference(logits, params, margin)
    for token in np.flatnonzero((counts > 0) & (probs == 0)):
        if tied[token] or at_cut(logits, params, int(token), margin):
            fit.ties += int(counts[token])
            counts[token] = 0
    if counts.sum() and probs.sum():
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
    """`runs` independent speculative generations of blocks * (num_draft_tokens + 1) tokens, as rows of batches of
    `batch_size` copies of the prompt (seeds seed, seed + batch_size, ...): the first block drafts the
    full num_draft_tokens, so every draft position and the bonus token are exercised, and the next blocks start
    from caches rolled back after a rejection or a full acceptance."""
    decoder = pair.decoder(params)
    outputs, drafted, accepted = [], 0, 0
    for start in range(0, runs, batch_size):
        rows = decoder.generate_batch(
            [prompt_ids] * min(batch_size, runs - start),
            blocks * (decoder.num_draft_tokens + 1),
            seed + start,
            ignore_eos=True,
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
    probs, tied = reference(logits, params, tie_margin(pair))
    probs /= probs.sum(1, keepdims=True).clip(min=np.finfo(float).tiny)  # given no tied token
    p_x = probs[np.arange(len(tokens)), tokens][:, None]
    u = np.where(probs > p_x, probs, 0).sum(1) + rng.random(len(tokens)) * np.where(probs == p_x, probs, 0).sum(1)
    u = u.clip(0, 1)  # float32 probabilities may sum to 1 + 1e-7
    zero = p_x[:, 0] == 0
    u[zero] = np.nan
    impossible = np.zeros(len(tokens), dtype=bool)
    for t in np.flatnonzero(zero):
        drawn = tokens[t]
        impossible[t] = not (tied[t, drawn] or at_cut(logits[t], params, drawn, tie_margin(pair)))
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
    """Checks 2-4 on `runs` speculative generations of blocks * (num_draft_tokens + 1) tokens from `prompt_ids`."""
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
    check 4 tests them in windows of num_draft_tokens + 1 positions, so the first is the first block's."""
    tokens = np.array(runs)
    vocab, span = pair.target.vocab_size, pair.decoder(params).num_draft_tokens + 1  # the longest block's
    advance = stage(f"target references, {label}", span + len(tokens))
    fit = Fit()
    margin = tie_margin(pair)
    add_draws(fit, next_logits(pair, prompt_ids), params, np.bincount(tokens[:, 0], minlength=vocab), margin)
    advance()
    rows = [fit.row("2 first token", f"{label}: token 1 vs the warped target", significance)]
    for position in range(2, min(span, tokens.shape[1]) + 1):
        prefixes = Counter(map(tuple, tokens[:, : position - 1].tolist()))
        fit = Fit()
        frequent = [(prefix, n) for prefix, n in prefixes.most_common(MAX_PREFIXES) if n >= MIN_PREFIX_RUNS]
        for prefix, _ in frequent:
            chosen = (tokens[:, : position - 1] == prefix).all(axis=1)
            counts = np.bincount(tokens[chosen, position - 1], minlength=vocab)
            add_draws(fit, next_logits(pair, prompt_ids + list(prefix)), params, counts, margin)
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
    """Speculative greedy output against the target alone's; a divergence passes only where replaying
    both runs shows rounding (decoding/drift.py)."""
    greedy = SamplingParams(0.0)
    ignore_eos = pair.config.generation.ignore_eos
    runs = [
        pair.decoder(greedy, speculative=speculative).generate(prompt_ids, max_new_tokens, seed, ignore_eos=ignore_eos)
        for speculative in (True, False)
    ]
    spec, base = ((r.token_ids, r.steps) for r in runs)
    advance()
    what = f"{label}: speculative greedy == target-only greedy"
    threshold = "identical, or rounding at the first difference"
    trees = pair.config.speculation.tree is not None
    divergence = drift.triage(pair.target, prompt_ids, base, spec, pair.dtype, pair.weights, trees)
    if divergence is None:
        return Row("5 greedy", what, len(base[0]), "identical", threshold=threshold)
    return Row(
        "5 greedy",
        what,
        len(base[0]),
        f"differs at {divergence.describe()}",
        threshold=threshold,
        status=PASS if divergence.rounding else FAIL,
        note="rounding" if divergence.rounding else "not rounding: a bug",
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
        pair.check_fits(ids, max(s.greedy_tokens, BLOCKS * (pair.decoder(s.params).num_draft_tokens + 1)))
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
