"""`specdec benchmark`: the target alone and the speculative loop on a prompt set, measured as Spec-Bench
measures (decode tokens/s per prompt, speedup = mean speculative tok/s / mean baseline tok/s).

Every prompt runs, for each temperature, once target-only (gamma 0) and once per gamma of the sweep,
`repeats` times each with the same seed. A multi-turn prompt feeds each mode's own answer back before
the next turn, and all turns count (as in Spec-Bench): a prompt's numbers are its turns' sums.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from specdec_cli import display, records
from specdec_cli.config import Config
from specdec_cli.errors import EXIT_GATE_FAILED, SpecdecError
from specdec_cli.metrics import (StepRecord, acceptance_by_position, acceptance_rate, cost_ratio,
                                 draft_time_share, mean_accepted_length, median_and_spread,
                                 predicted_speedup, speedup)
from specdec_cli.pair import Pair, load_pair
from specdec_cli.prompts import Prompt, builtin_suite, load_prompts, select
from specdec_cli.report import (OVERALL, PEER_FAIRNESS, category_report, compare_report, detail_report,
                                environment_caption, markdown_document, peer_report, rich_table,
                                temperature_label)
from specdec_cli.sampling import SamplingParams

SPECDEC, HF = "specdec", "hf"
WARMUP_TOKENS = 32  # enough for one-time costs (allocations, thread pools); not the full length


@dataclass
class Measure:
    """One generation of a whole prompt (all turns summed)."""

    new_tokens: int = 0
    prefill_seconds: float | None = 0.0  # None: the generator cannot time prefill apart (transformers)
    decode_seconds: float = 0.0  # with prefill_seconds None: the whole call
    steps: list[StepRecord] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # all turns' answers, concatenated

    def add(self, other: Measure) -> None:
        self.new_tokens += other.new_tokens
        self.token_ids += other.token_ids
        if self.prefill_seconds is None or other.prefill_seconds is None:
            self.prefill_seconds = None
        else:
            self.prefill_seconds += other.prefill_seconds
        self.decode_seconds += other.decode_seconds
        self.steps += other.steps

    def to_dict(self) -> dict:
        total = self.decode_seconds + (self.prefill_seconds or 0.0)
        return {
            "new_tokens": self.new_tokens,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "tokens_per_second": _rate(self.new_tokens, self.decode_seconds),
            "end_to_end_tokens_per_second": _rate(self.new_tokens, total),
            # compact: [drafted, accepted, emitted, draft_seconds, verify_seconds] per target forward
            "steps": [[s.drafted, s.accepted, s.emitted, s.draft_seconds, s.verify_seconds] for s in self.steps],
            "token_ids": self.token_ids,
        }


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


# Generates one turn: (prompt ids, seed) -> (new token ids, measure). Used for specdec and for peers.
TurnGenerator = Callable[[list[int], int], tuple[list[int], Measure]]


@dataclass(frozen=True)
class Mode:
    """What one run measures: who generates, at which temperature, with how many draft tokens."""

    temperature: float
    gamma: int  # 0: target alone
    engine: str = SPECDEC

    @property
    def label(self) -> str:
        who = "" if self.engine == SPECDEC else f"{self.engine} "
        kind = "target only" if self.gamma == 0 else f"speculative γ={self.gamma}"
        return f"{who}{kind}, {temperature_label(self.temperature)}"


@dataclass
class Plan:
    temperatures: list[float]
    gammas: list[int]
    max_new_tokens: int
    repeats: int
    warmup: int
    ignore_eos: bool
    seed: int
    top_k: int
    top_p: float
    peer: str | None = None

    def params(self, temperature: float) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_k=self.top_k, top_p=self.top_p)

    def modes(self) -> list[Mode]:
        """Per temperature: the baseline first, then each gamma, then the peer's run of each gamma."""
        modes = []
        for t in self.temperatures:
            modes += [Mode(t, 0)] + [Mode(t, g) for g in self.gammas]
            if self.peer:
                modes += [Mode(t, g, self.peer) for g in self.gammas]
        return modes


def specdec_generator(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> TurnGenerator:
    decoder = pair.decoder(plan.params(mode.temperature), speculative=mode.gamma > 0,
                           num_draft_tokens=mode.gamma or None)

    def generate(prompt_ids: list[int], seed: int) -> tuple[list[int], Measure]:
        r = decoder.generate(prompt_ids, max_new_tokens, seed, ignore_eos=plan.ignore_eos)
        return r.token_ids, Measure(len(r.token_ids), r.prefill_seconds, r.decode_seconds, r.steps, r.token_ids)

    return generate


def make_generator(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> TurnGenerator:
    if mode.engine == HF:
        from specdec_cli.peers import hf_generator
        return hf_generator(pair, plan.params(mode.temperature), mode.gamma, max_new_tokens, plan.ignore_eos)
    return specdec_generator(pair, mode, plan, max_new_tokens)


def run_prompt(pair: Pair, prompt: Prompt, generate: TurnGenerator, plan: Plan) -> Measure:
    """All turns of a prompt; each turn after the first sees the earlier turns and this run's answers."""
    total, history = Measure(), []
    for turn in prompt.turns:
        ids = pair.encode(turn, history=history)
        pair.check_fits(ids, plan.max_new_tokens)
        token_ids, measure = generate(ids, plan.seed)
        total.add(measure)
        answer = pair.tokenizer.decode(token_ids, skip_special_tokens=True)
        history += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    return total


# Called before each run with (prompt index, number of prompts, prompt, mode).
OnRun = Callable[[int, int, Prompt, Mode], None]


def run_benchmark(pair: Pair, prompts: list[Prompt], plan: Plan, on_run: OnRun | None = None
                  ) -> tuple[list[dict], bool]:
    """Measure every prompt in every mode. Returns (runs, partial): Ctrl-C stops early and keeps only
    the prompts measured in every mode, so baselines and speculative runs cover the same prompts."""
    modes = plan.modes()
    generators = {m: make_generator(pair, m, plan, plan.max_new_tokens) for m in modes}
    runs: list[dict] = []
    try:
        if plan.warmup and prompts:
            first = Prompt(prompts[0].id, prompts[0].category, prompts[0].turns[:1])
            for mode in modes:  # short generations that pay one-time costs; not recorded
                warm = make_generator(pair, mode, plan, min(WARMUP_TOKENS, plan.max_new_tokens))
                for _ in range(plan.warmup):
                    run_prompt(pair, first, warm, plan)
        for i, prompt in enumerate(prompts):
            prompt_runs = []
            for mode in modes:
                if on_run:
                    on_run(i, len(prompts), prompt, mode)
                measures = [run_prompt(pair, prompt, generators[mode], plan) for _ in range(plan.repeats)]
                prompt_runs.append({"prompt_id": prompt.id, "category": prompt.category,
                                    "temperature": mode.temperature, "gamma": mode.gamma, "engine": mode.engine,
                                    "repeats": [m.to_dict() for m in measures]})
            runs += prompt_runs
    except KeyboardInterrupt:
        return runs, True
    return runs, False


# --- aggregation: pure functions of the records above, so --compare and tests can use them too ---

def steps_of(run: dict) -> list[StepRecord]:
    return [StepRecord(*s) for rep in run["repeats"] for s in rep["steps"]]


def per_token_acceptance(steps: list[StepRecord]) -> float | None:
    """Leviathan's alpha, estimated as accepted / (accepted + rejections).

    Acceptance stops at the first rejection, so positions after it are never tested; accepted/drafted
    counts them as failures and underestimates alpha (gamma 4, alpha 0.5 gives 0.23). Each block is
    a run of successes ended by one failure unless all drafts passed: this is the maximum-likelihood
    alpha of that geometric model."""
    accepted = sum(s.accepted for s in steps)
    rejections = sum(s.accepted < s.drafted for s in steps)
    return accepted / (accepted + rejections) if accepted + rejections else None


def _group_tps(runs: list[dict], key: str) -> list[list[float]]:
    """Per repeat index, the per-prompt tokens/s (key: decode or end-to-end)."""
    repeats = min(len(r["repeats"]) for r in runs)
    return [[r["repeats"][i][key] for r in runs] for i in range(repeats)]


def summarize_mode(baseline: list[dict], speculative: list[dict], gamma: int) -> dict:
    """The numbers of one table cell group: same prompts in both lists, same order.

    Tokens/s is the mean over prompts per repeat; its median and (min, max) over repeats are reported.
    Speedup is Spec-Bench's mean(spec tok/s) / mean(baseline tok/s), per repeat, then its median."""
    base_tps = _group_tps(baseline, "tokens_per_second")
    spec_tps = _group_tps(speculative, "tokens_per_second")
    speedups = [speedup(b, s) for b, s in zip(base_tps, spec_tps)]
    base_steps = [s for r in baseline for s in steps_of(r)]
    spec_steps = [s for r in speculative for s in steps_of(r)]
    drafted = sum(s.drafted for s in spec_steps)
    target_forwards = len(base_steps)
    c = (cost_ratio(sum(s.draft_seconds for s in spec_steps) / drafted,
                    sum(s.verify_seconds for s in base_steps) / target_forwards)
         if drafted and target_forwards else None)
    alpha = per_token_acceptance(spec_steps)
    return {
        "prompts": len(speculative),
        "gamma": gamma,
        "baseline_tokens_per_second": median_and_spread([statistics.fmean(t) for t in base_tps]),
        "speculative_tokens_per_second": median_and_spread([statistics.fmean(t) for t in spec_tps]),
        "speedup": median_and_spread(speedups),
        "mean_accepted_length": mean_accepted_length(spec_steps),
        "acceptance_rate": acceptance_rate(spec_steps),
        "per_token_acceptance": alpha,
        "acceptance_by_position": acceptance_by_position(spec_steps, gamma),
        "draft_time_share": draft_time_share(spec_steps),
        "cost_ratio": c,
        "predicted_speedup": predicted_speedup(alpha, gamma, c) if alpha is not None and c is not None else None,
        "greedy_identical": greedy_identical(baseline, speculative),
        "baseline_prefill_seconds": _mean_prefill(baseline),
        "speculative_prefill_seconds": _mean_prefill(speculative),
    }


def greedy_identical(baseline: list[dict], speculative: list[dict]) -> int | None:
    """Prompts whose greedy speculative output equals the target-only output, token for token (None
    when sampled, or for records from before token ids were kept)."""
    if baseline[0]["temperature"] != 0 or "token_ids" not in baseline[0]["repeats"][0]:
        return None
    return sum(b["repeats"][0]["token_ids"] == s["repeats"][0]["token_ids"] for b, s in zip(baseline, speculative))


def _mean_prefill(runs: list[dict]) -> float | None:
    values = [rep["prefill_seconds"] for r in runs for rep in r["repeats"]]
    return statistics.fmean(values) if values and None not in values else None


def _by_prompt(runs: list[dict], engine: str, temperature: float, gamma: int, group: str = OVERALL
               ) -> dict[str, dict]:
    return {r["prompt_id"]: r for r in runs if (r["engine"], r["temperature"], r["gamma"]) == (engine, temperature, gamma)
            and group in (OVERALL, r["category"])}


def summarize(runs: list[dict]) -> list[dict]:
    """One entry per (group, temperature, gamma), group being each category and "overall"; prompts
    missing a mode (an interrupted run) are left out of that comparison."""
    out = []
    specdec = [r for r in runs if r["engine"] == SPECDEC]
    categories = sorted({r["category"] for r in specdec})
    for temperature in sorted({r["temperature"] for r in specdec}):
        for gamma in sorted({r["gamma"] for r in specdec} - {0}):
            for group in categories + [OVERALL]:
                base = _by_prompt(specdec, SPECDEC, temperature, 0, group)
                spec = _by_prompt(specdec, SPECDEC, temperature, gamma, group)
                ids = [i for i in spec if i in base]
                if ids:
                    out.append({"group": group, "temperature": temperature,
                                **summarize_mode([base[i] for i in ids], [spec[i] for i in ids], gamma)})
    return out


def summarize_peers(runs: list[dict]) -> list[dict]:
    """Per (engine, temperature, gamma), the peer beside specdec's run of the same prompts, as
    end-to-end tokens/s (prefill + decode), because transformers' generate() does not time them apart."""
    out = []
    key = "end_to_end_tokens_per_second"
    for engine, temperature, gamma in sorted({(r["engine"], r["temperature"], r["gamma"])
                                              for r in runs if r["engine"] != SPECDEC}):
        peers = _by_prompt(runs, engine, temperature, gamma)
        ours = _by_prompt(runs, SPECDEC, temperature, gamma)
        ids = [i for i in peers if i in ours]
        if ids:
            ours_tps = [statistics.fmean(t) for t in _group_tps([ours[i] for i in ids], key)]
            peer_tps = [statistics.fmean(t) for t in _group_tps([peers[i] for i in ids], key)]
            out.append({"engine": engine, "temperature": temperature, "gamma": gamma, "prompts": len(ids),
                        "specdec_tokens_per_second": median_and_spread(ours_tps),
                        "peer_tokens_per_second": median_and_spread(peer_tps)})
    return out


def gate_failures(summary: list[dict], min_speedup: float | None, min_accept_length: float | None) -> list[str]:
    """Overall rows that miss a gate, as readable lines; every (temperature, gamma) must pass."""
    failures = []
    for row in (r for r in summary if r["group"] == OVERALL):
        mode = f"{temperature_label(row['temperature'])}, γ={row['gamma']}"
        measured = row["speedup"][0]
        if min_speedup is not None and measured < min_speedup:
            failures.append(f"speedup {measured:.2f} < {min_speedup:g} ({mode})")
        length = row["mean_accepted_length"]
        if min_accept_length is not None and (length is None or length < min_accept_length):
            failures.append(f"mean accepted length {length if length is None else f'{length:.2f}'} "
                            f"< {min_accept_length:g} ({mode})")
    return failures


# --- the command: choose prompts and modes, measure with a progress bar, write and show the results ---

QUICK_LIMIT = 1  # prompts per category of the built-in suite when neither --prompts nor --limit is given
PEERS = (HF,)


def parse_list(text: str | None, kind: type, option: str) -> list | None:
    """"1,2,4" -> [1, 2, 4]; None when the option was not given."""
    if text is None:
        return None
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SpecdecError(f"{option}: expected comma-separated {kind.__name__} values, got {text!r}") from None
    if not values:
        raise SpecdecError(f"{option}: no values given")
    return list(dict.fromkeys(values))  # drop repeats, keep order


def make_plan(cfg: Config, gammas: list[int] | None, temperatures: list[float] | None, repeats: int,
              warmup: int, peer: str | None) -> Plan:
    """Defaults: the config's gamma; greedy and the config's temperature (1.0 if the config is greedy)."""
    gammas = gammas or [cfg.speculation.num_draft_tokens]
    temperatures = temperatures or list(dict.fromkeys([0.0, cfg.sampling.temperature or 1.0]))
    if min(gammas) < 1:
        raise SpecdecError(f"--gamma values must be >= 1, got {gammas}")
    if min(temperatures) < 0:
        raise SpecdecError(f"--temperatures must be >= 0 (0 is greedy), got {temperatures}")
    if repeats < 1 or warmup < 0:
        raise SpecdecError("--repeats must be >= 1 and --warmup >= 0")
    if peer is not None and peer not in PEERS:
        raise SpecdecError(f"unknown --peer {peer!r}; known: {', '.join(PEERS)}")
    s = cfg.sampling
    return Plan(temperatures, gammas, cfg.generation.max_new_tokens, repeats, warmup, cfg.generation.ignore_eos,
                s.seed, s.top_k, s.top_p, peer)


def choose_prompts(path: Path | None, category: str | None, limit: int | None) -> list[Prompt]:
    if path is None:
        return select(builtin_suite(), category, limit or QUICK_LIMIT)
    return select(load_prompts(path), category, limit)


def execute(cfg: Config, prompts: list[Prompt], plan: Plan, as_json: bool, min_speedup: float | None,
            min_accept_length: float | None) -> None:
    with display.stderr.status(f"Loading {cfg.target.describe()} and {cfg.draft.describe()}..."):
        pair = load_pair(cfg)
    modes = plan.modes()
    with display.progress() as progress:
        task = progress.add_task(f"warm-up ({plan.warmup} per mode)", total=len(prompts) * len(modes))

        def on_run(i: int, n: int, prompt: Prompt, mode: Mode) -> None:
            progress.update(task, completed=i * len(modes) + modes.index(mode),
                            description=f"prompt {i + 1}/{n} {prompt.id}: {mode.label}")

        runs, partial = run_benchmark(pair, prompts, plan, on_run)
        progress.update(task, completed=len(runs))
    summary = summarize(runs)
    peers = summarize_peers(runs)
    record = {
        "command": "benchmark", "name": cfg.name, "timestamp": records.timestamp(), "partial": partial,
        "settings": {**asdict(plan), "multi_turn": "every turn counts; each mode feeds back its own answers",
                     "prompts": len(prompts)},
        "summary": summary, "peers": peers, "peer_fairness": PEER_FAIRNESS if plan.peer else None,
        "environment": pair.describe(), "config": cfg.to_dict(),
        "prompt_set": [asdict(p) for p in prompts], "runs": runs,
    }
    tables = [category_report(summary), detail_report(summary)] + ([peer_report(peers)] if peers else [])
    folder = records.write_record("benchmark", cfg.name, record)
    (folder / "report.md").write_text(markdown_document(record, tables))
    if as_json:
        print(records.dumps(record))
    else:
        for table in tables:
            display.stdout.print(rich_table(table))
        display.stdout.print(environment_caption(record["environment"]))
    display.stderr.print(f"Record: {folder / 'record.json'}, report: {folder / 'report.md'}")
    if partial:
        display.stderr.print("Interrupted: the record holds the prompts finished in every mode (partial: true).")
        raise KeyboardInterrupt
    failures = gate_failures(summary, min_speedup, min_accept_length)
    if failures:
        raise SpecdecError("benchmark gate not met: " + "; ".join(failures), EXIT_GATE_FAILED)


def load_record(path: Path) -> dict:
    """A benchmark record.json, or the run folder holding one."""
    file = path / "record.json" if path.is_dir() else path
    try:
        record = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecdecError(f"cannot read benchmark record {file}: {exc}") from None
    if record.get("command") != "benchmark":
        raise SpecdecError(f"{file} is not a benchmark record")
    return record


def compare(a: Path, b: Path, as_json: bool) -> None:
    table = compare_report(load_record(a), load_record(b), (f"A: {a}", f"B: {b}"))
    if as_json:
        print(records.dumps({"command": "benchmark-compare", "a": str(a), "b": str(b), "header": table.header,
                             "rows": table.rows}))
    else:
        display.stdout.print(rich_table(table))
