"""`specdec verify-distribution`: statistical evidence that speculative output is the target's own.

Four checks, all through the code `generate` uses (the sampler functions are looked up on the
`sampling` module at call time, so a patched or broken sampler is the one under test):
1. sampler: for many (p, q) shapes, the exact output distribution of accept-or-resample from the
   formula equals p, and N draws of `verify_sampled` pass a goodness-of-fit test against p (and the
   bonus token against the last position's distribution);
2. first token: N speculative runs (seeds s, s+1, ...) against the exact warped target distribution;
3. positions 2..k: the same runs, conditional on their most frequent prefixes, against the target's
   exact conditional distribution, one pooled test per position;
4. greedy identity: speculative greedy output equals target-only greedy output.

The goodness-of-fit tests are Pearson chi-square tests on bins that pool rare tokens; all of them form
one family, corrected for multiplicity with Holm's step-down method at the chosen significance.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from scipy import stats

from specdec_cli import display, records
from specdec_cli.decoding import sampling
from specdec_cli.config import Config
from specdec_cli.errors import EXIT_CHECK_FAILED, SpecdecError
from specdec_cli.models.pair import Pair, load_pair
from specdec_cli.decoding.params import SamplingParams

MIN_EXPECTED = 5.0  # chi-square needs about 5 expected counts per bin: rarer tokens are pooled
EXACT_TOLERANCE = 1e-6  # max |P(x) - p(x)| allowed for the formula (float32 inputs, float64 sums)
MIN_PREFIX_RUNS = 10  # a prefix seen in fewer runs carries too few draws to test
MAX_PREFIXES = 10  # conditional tests per position: the most frequent prefixes
SAMPLER_CHUNK = 512  # rows per verify_sampled call: [chunk, 2, V] float32 stays in the low MBs to 200 MB
# target top-2 logit margins below this are floating-point ties, where either token is a fair argmax
TIE_MARGIN = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.1}

Advance = Callable[[], None]
Stage = Callable[[str, int], Advance]  # (description, total units) -> call once per unit done


def no_progress(description: str, total: int) -> Advance:
    return lambda: None


@dataclass
class Row:
    """One line of the report. Statistical rows carry a p-value; Holm then sets threshold and passed."""

    check: str
    what: str
    samples: int
    statistic: str
    p_value: float | None = None
    tv: float | None = None
    tv_bound: float | None = None
    threshold: str = ""
    alpha: float | None = None  # the Holm-corrected significance this row's p-value was held to
    passed: bool = True
    note: str = ""


@dataclass
class Fit:
    """A pooled chi-square test, possibly summed over independent groups (one per prefix)."""

    statistic: float = 0.0
    df: int = 0
    n: int = 0
    abs_diff: float = 0.0  # sum over bins of |observed - expected|
    impossible: int = 0  # draws of tokens whose probability is exactly 0

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

    def row(self, check: str, what: str, significance: float) -> Row:
        if self.impossible:
            return Row(check, what, self.n, f"{self.impossible} draws of zero-probability tokens",
                       p_value=0.0, note="tokens the target can never produce")
        if self.df == 0:
            return Row(check, what, self.n, "not testable", note="too few draws to test; raise --samples")
        tv = self.abs_diff / (2 * self.n)
        # E[TV(empirical, truth)] <= sqrt(df / n) / 2 (Cauchy-Schwarz), and TV moves by at most 1/n per
        # draw, so McDiarmid adds sqrt(ln(1/delta) / 2n): an upper bound at confidence 1 - significance
        bound = tv + 0.5 * math.sqrt(self.df / self.n) + math.sqrt(math.log(1 / significance) / (2 * self.n))
        return Row(check, what, self.n, f"chi2={self.statistic:.1f}, df={self.df}",
                   p_value=float(stats.chi2.sf(self.statistic, self.df)), tv=tv, tv_bound=min(bound, 1.0))


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
        row.passed = not rejecting


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
        ("disjoint supports", (3 * z1).masked_fill(~half, -math.inf).softmax(-1),
         (3 * z2).masked_fill(half, -math.inf).softmax(-1)),
        ("q = p", peaked_p, peaked_p.clone()),
        ("one-hot q (n-gram draft)", peaked_p, one_hot),
        ("top-k 20", sampling.warp(3 * z1, SamplingParams(1.0, top_k=20)),
         sampling.warp(3 * z2, SamplingParams(1.0, top_k=20))),
        ("top-p 0.9", sampling.warp(3 * z1, SamplingParams(1.0, top_p=0.9)),
         sampling.warp(3 * z2, SamplingParams(1.0, top_p=0.9))),
        (f"configured warp ({describe_params(params)})", sampling.warp(3 * z1, params), sampling.warp(3 * z2, params)),
    ]
    return shapes


def exact_output(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum min(p, q)) residual(x), in float64, with the
    engine's residual."""
    p64, q64 = p.double(), q.double()
    accepted = torch.minimum(p64, q64)  # q min(1, p/q), also where q = 0
    return accepted + (1 - accepted.sum()) * sampling.residual(p, q).double()


def sampler_draws(p: torch.Tensor, q: torch.Tensor, bonus: torch.Tensor, draws: int,
                  gen: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draw a token from q and run `verify_sampled` with gamma = 1, `draws` times. Returns the counts
    of the emitted first token, and of the bonus token over the runs that accepted the draft."""
    vocab = p.shape[-1]
    first, after = np.zeros(vocab), np.zeros(vocab)
    for start in range(0, draws, SAMPLER_CHUNK):
        rows = min(SAMPLER_CHUNK, draws - start)
        # the drafts are the test's input, not code under test: multinomial is far cheaper at large V
        drafts = torch.multinomial(q, rows, replacement=True, generator=gen)[:, None]  # [rows, 1]
        targets = torch.stack([p, bonus]).expand(rows, 2, vocab)
        accepted, next_token = sampling.verify_sampled(drafts, q.expand(rows, 1, vocab), targets, gen)
        emitted = torch.where(accepted == 1, drafts[:, 0], next_token)
        first += np.bincount(emitted.numpy(), minlength=vocab)
        after += np.bincount(next_token[accepted == 1].numpy(), minlength=vocab)
    return first, after


def check_sampler(vocab_size: int, params: SamplingParams, draws: int, seed: int, significance: float,
                  stage: Stage = no_progress) -> list[Row]:
    shapes = sampler_shapes(vocab_size, params, seed)
    bonus = (3 * torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed + 1))).softmax(-1)
    errors = [float((exact_output(p, q) - p.double()).abs().max()) for _, p, q in shapes]
    worst = int(np.argmax(errors))
    rows = [Row("1 sampler", f"exact output distribution from the formula, {len(shapes)} shapes, "
                             f"V={vocab_size}", len(shapes), f"max |P-p| = {errors[worst]:.1e}",
                threshold=f"<= {EXACT_TOLERANCE:g}", passed=errors[worst] <= EXACT_TOLERANCE,
                note=f"worst: {shapes[worst][0]}")]
    gen = torch.Generator().manual_seed(seed)
    bonus_fit = Fit()
    advance = stage("sampler draws", len(shapes))
    for name, p, q in shapes:
        first, after = sampler_draws(p, q, bonus, draws, gen)
        fit = Fit()
        fit.add(first, p.double().numpy())
        rows.append(fit.row("1 sampler", f"verify_sampled draws: {name}", significance))
        bonus_fit.add(after, bonus.double().numpy())
        advance()
    rows.append(bonus_fit.row("1 sampler", "bonus token after full acceptance, all shapes", significance))
    return rows


# ---------------------------------------------------------------- 2, 3. the model pair

def next_logits(pair: Pair, context: list[int]) -> torch.Tensor:
    """The target's next-token logits after `context` [V], from one fresh forward over all of it."""
    pair.target.reset(len(context))
    return pair.target.forward(torch.tensor([context], device=pair.device), last_only=True).logits[0, -1]


def target_distribution(pair: Pair, context: list[int], params: SamplingParams) -> np.ndarray:
    """The exact warped next-token distribution of the target after `context`, float64."""
    return sampling.warp(next_logits(pair, context), params).double().cpu().numpy()


@dataclass
class Runs:
    tokens: np.ndarray  # [runs, k] the first k new tokens of each run
    drafted: int = 0
    accepted: int = 0


def speculative_runs(pair: Pair, prompt_ids: list[int], params: SamplingParams, runs: int, seed: int,
                     advance: Advance) -> Runs:
    """`runs` independent speculative generations of gamma + 1 tokens (seeds seed, seed + 1, ...): the
    first block drafts the full gamma, so every draft position and the bonus token are exercised."""
    decoder = pair.decoder(params)
    outputs, drafted, accepted = [], 0, 0
    for i in range(runs):
        result = decoder.generate(prompt_ids, decoder.gamma + 1, seed + i, ignore_eos=True)
        outputs.append(result.token_ids)
        drafted += sum(s.drafted for s in result.steps)
        accepted += sum(s.accepted for s in result.steps)
        advance()
    return Runs(np.array(outputs), drafted, accepted)


def check_model(pair: Pair, prompt_ids: list[int], label: str, params: SamplingParams, runs: int, seed: int,
                significance: float, stage: Stage = no_progress) -> list[Row]:
    result = speculative_runs(pair, prompt_ids, params, runs, seed, stage(f"speculative runs, {label}", runs))
    vocab = pair.target.vocab_size
    k = result.tokens.shape[1]
    advance = stage(f"target references, {label}", k)
    fit = Fit()
    fit.add(np.bincount(result.tokens[:, 0], minlength=vocab), target_distribution(pair, prompt_ids, params))
    advance()
    note = f"{result.accepted}/{result.drafted} draft tokens accepted over the runs"
    rows = [fit.row("2 first token", f"{label}: token 1 vs the warped target", significance)]
    rows[0].note = note
    for position in range(2, k + 1):
        prefixes = Counter(map(tuple, result.tokens[:, : position - 1].tolist()))
        fit = Fit()
        frequent = [(prefix, n) for prefix, n in prefixes.most_common(MAX_PREFIXES) if n >= MIN_PREFIX_RUNS]
        for prefix, _ in frequent:
            chosen = (result.tokens[:, : position - 1] == prefix).all(axis=1)
            counts = np.bincount(result.tokens[chosen, position - 1], minlength=vocab)
            fit.add(counts, target_distribution(pair, prompt_ids + list(prefix), params))
        advance()
        rows.append(fit.row(f"3 position {position}", f"{label}: token {position} given its {len(frequent)} most "
                                                      f"frequent prefixes (each in >= {MIN_PREFIX_RUNS} runs)", significance))
    return rows


# ---------------------------------------------------------------- 4. greedy identity

def check_greedy(pair: Pair, prompt_ids: list[int], label: str, max_new_tokens: int, seed: int,
                 advance: Advance = lambda: None) -> Row:
    greedy = SamplingParams(0.0)
    ignore_eos = pair.config.generation.ignore_eos
    spec = pair.decoder(greedy).generate(prompt_ids, max_new_tokens, seed, ignore_eos=ignore_eos).token_ids
    base = pair.decoder(greedy, speculative=False).generate(prompt_ids, max_new_tokens, seed,
                                                            ignore_eos=ignore_eos).token_ids
    advance()
    tolerance = TIE_MARGIN.get(pair.dtype, 1e-3)
    what = f"{label}: speculative greedy == target-only greedy"
    threshold = f"identical, or top-2 margin < {tolerance:g} at the first difference"
    if spec == base:
        return Row("4 greedy", what, len(base), "identical", threshold=threshold)
    position = next((i for i, (a, b) in enumerate(zip(spec, base)) if a != b), min(len(spec), len(base)))
    top2 = next_logits(pair, prompt_ids + base[:position]).topk(2).values
    margin = float(top2[0] - top2[1])
    tie = margin < tolerance
    return Row("4 greedy", what, len(base), f"differs at token {position + 1}, top-2 margin {margin:.2g}",
               threshold=threshold, passed=tie, note="floating-point tie" if tie else "not a tie: a bug")


# ---------------------------------------------------------------- all together

@dataclass
class Settings:
    params: SamplingParams  # of the distribution checks
    samples: int  # speculative runs per prompt
    sampler_draws: int  # verify_sampled draws per shape
    significance: float
    seed: int
    greedy_tokens: int
    prompts: list[str] = field(default_factory=list)


def describe_params(params: SamplingParams) -> str:
    return f"temperature {params.temperature:g}, top-k {params.top_k or 'off'}, top-p {params.top_p:g}"


def run_checks(pair: Pair, settings: Settings, stage: Stage = no_progress) -> list[Row]:
    """Every check on every prompt; Holm is applied over all the statistical rows together."""
    s = settings
    rows = check_sampler(pair.target.vocab_size, s.params, s.sampler_draws, s.seed, s.significance, stage)
    encoded = [pair.encode(text) for text in s.prompts]
    for ids in encoded:
        pair.check_fits(ids, max(s.greedy_tokens, pair.config.speculation.num_draft_tokens + 1))
    for i, ids in enumerate(encoded):
        rows += check_model(pair, ids, f"prompt {i + 1}", s.params, s.samples, s.seed, s.significance, stage)
    advance = stage("greedy identity", len(encoded))
    rows += [check_greedy(pair, ids, f"prompt {i + 1}", s.greedy_tokens, s.seed, advance)
             for i, ids in enumerate(encoded)]
    holm(rows, s.significance)
    return rows


# ---------------------------------------------------------------- the command

# Default prompts: a chat turn whose template repeats tokens, so an n-gram drafter finds matches too.
DEFAULT_PROMPTS = ["Write a short story about a robot who learns to paint.",
                   "List three facts about the moon, one per line."]
SMALL_MODEL_PARAMETERS = 50_000_000
# speculative runs per prompt: the tiny pair affords many; a 100M+ model on 2 CPU cores ~150 in 2 min
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


def make_settings(pair: Pair, prompts: list[str], samples: int | None, significance: float) -> Settings:
    """The distribution checks use the config's sampling settings, at temperature 1 if it is greedy."""
    s = pair.config.sampling
    runs = samples or default_samples(pair)
    return Settings(params=SamplingParams.from_config(s, s.temperature or 1.0), samples=runs,
                    sampler_draws=max(MIN_SAMPLER_DRAWS, SAMPLER_DRAWS_PER_RUN * runs),
                    significance=significance, seed=s.seed, greedy_tokens=pair.config.generation.max_new_tokens,
                    prompts=prompts or DEFAULT_PROMPTS)


def verify_distribution(cfg: Config, prompts: list[str], samples: int | None, significance: float,
                        as_json: bool) -> None:
    """Load the pair, run every check with a progress bar on stderr, print the table (or the JSON
    record), write the record; a failed check raises with EXIT_CHECK_FAILED."""
    check_options(samples, significance)
    with display.stderr.status(f"Loading {cfg.target.describe()} and {cfg.draft.describe()}..."):
        pair = load_pair(cfg)
    settings = make_settings(pair, prompts, samples, significance)
    start = time.perf_counter()
    with display.progress() as bar:
        rows = run_checks(pair, settings, display.progress_stage(bar))
    seconds = time.perf_counter() - start
    failed = [r for r in rows if not r.passed]
    env = pair.describe()
    record = {
        **records.header("verify-distribution", cfg, env), "verdict": "fail" if failed else "pass",
        "seconds": seconds,
        "settings": {**asdict(settings), "gamma": cfg.speculation.num_draft_tokens,
                     "multiplicity": "holm", "min_expected_per_bin": MIN_EXPECTED},
        "checks": [asdict(r) for r in rows],
    }
    folder = records.write_record("verify-distribution", cfg.name, record)
    if as_json:
        print(records.dumps(record))
    else:
        title = (f"{cfg.name}: {describe_params(settings.params)}, {cfg.speculation.num_draft_tokens} draft "
                 f"tokens, {settings.samples} runs per prompt, {settings.sampler_draws} sampler draws per shape, "
                 f"significance {significance:g} (Holm over {sum(r.alpha is not None for r in rows)} tests)")
        display.stdout.print(display.verification_table(rows, title, display.environment_caption(env)))
        display.stderr.print(f"{len(rows) - len(failed)}/{len(rows)} checks passed in {seconds:.0f} s. "
                             f"Record: {folder / 'record.json'}")
    if failed:
        raise SpecdecError(f"{len(failed)} check(s) failed: " + "; ".join(f"{r.check} ({r.what})" for r in failed),
                           EXIT_CHECK_FAILED)
