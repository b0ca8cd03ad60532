"""`specdec tune`: the draft tokens per block that decode fastest at each batch size and temperature,
predicted from short probes (bench/tuning.py), the best few run for real beside the target alone and
the config as it is, and written as a config with `speculation.schedule` and as vLLM's
`speculative_config`."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass

import yaml

from specdec_cli import display, records
from specdec_cli.bench import charts
from specdec_cli.bench.measure import BatchGenerate
from specdec_cli.bench.plan import Mode, Plan
from specdec_cli.bench.prompts import Prompt
from specdec_cli.bench.report import Report, environment_caption, markdown_document, rich_table, temperature_label
from specdec_cli.bench.run import run_batch, run_batches
from specdec_cli.bench.summary import summarize_batches
from specdec_cli.bench.tuning import Choice, Probe, finalists, mean_accepted, predicted_speedup, schedule_ranges
from specdec_cli.config import Config, Schedule, longest_block
from specdec_cli.decoding.metrics import StepRecord
from specdec_cli.decoding.params import BatchSchedule
from specdec_cli.errors import SpecdecError
from specdec_cli.pair import Pair, load_pair


class Stopped(Exception):
    """The budget is spent, or Ctrl-C stopped a run: tune keeps what it measured."""


PROBE_TOKENS = 32  # new tokens per probe row: enough blocks to time, short enough to probe every size
PROBED = ("new_tokens", "decode_seconds", "blocks", "steps")  # a probe's sums over its batches
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class TuneSettings:
    batch_sizes: list[int]
    temperatures: list[float]
    sample: int  # at least this many prompts in each batch size's probe
    finalists: int  # predicted best lengths run for real, besides the target alone and the config's own
    budget_minutes: float | None
    plan: Plan  # max_new_tokens, repeats, seed, sampling settings of the runs for real


def with_tokens(pair: Pair, tokens: int) -> Pair:
    """The pair drafting at most `tokens` per block at every batch size (0: the target alone)."""
    ranges = [[1, 1, tokens]]
    speculation = dataclasses.replace(pair.config.speculation, schedule=Schedule(greedy=ranges, sampled=ranges))
    return dataclasses.replace(pair, config=dataclasses.replace(pair.config, speculation=speculation))


def capped_generator(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> BatchGenerate:
    """A mode's batches with blocks of at most mode.num_draft_tokens drafts (run_batches' `make`)."""
    decoder = with_tokens(pair, mode.num_draft_tokens).decoder(plan.params(mode.temperature), mode.num_draft_tokens > 0)
    return lambda prompts, seed: decoder.generate_batch(prompts, max_new_tokens, seed, ignore_eos=plan.ignore_eos)


def batch_of(prompts: list[Prompt], size: int) -> list[Prompt]:
    """At least `size` prompts: the prompts, repeated when there are fewer."""
    return (prompts * math.ceil(size / len(prompts)))[: max(size, len(prompts))]


def probe(pair: Pair, prompts: list[Prompt], size: int, temperature: float, full: int, plan: Plan) -> Probe:
    """`prompts` in batches of `size`, PROBE_TOKENS each, target alone and at every draft length up to
    `full`, each length after a short unmeasured batch."""
    short = dataclasses.replace(plan, max_new_tokens=PROBE_TOKENS)
    batches = [prompts[start : start + size] for start in range(0, len(prompts), size)]
    runs = {}
    for tokens in range(full + 1):
        mode = Mode(temperature, tokens)
        run_batch(pair, batches[0], capped_generator(pair, mode, short, WARMUP_TOKENS), short, plan.seed)
        generate = capped_generator(pair, mode, short, PROBE_TOKENS)
        done = [run_batch(pair, batch, generate, short, plan.seed) for batch in batches]
        runs[tokens] = {key: sum(len(r[key]) if key == "steps" else r[key] for r in done) for key in PROBED}
    return Probe(
        batch_size=size,
        alone_tokens_per_second=runs[0]["new_tokens"] / runs[0]["decode_seconds"],
        block_seconds={g: r["decode_seconds"] / r["blocks"] for g, r in runs.items() if g},
        rows_per_block={g: r["steps"] / r["blocks"] for g, r in runs.items() if g},
    )


def probe_prompts(prompts: list[Prompt], size: int, sample: int) -> list[Prompt]:
    """Whole batches of `size` holding at least `sample` prompts, spread over the set (repeated where
    the set is smaller)."""
    count = size * math.ceil(sample / size)
    spread = prompts[:: max(1, len(prompts) // count)][:count]
    return batch_of(spread, count)[:count]


def config_tokens(cfg: Config, size: int, temperature: float) -> int:
    """What the config as it is drafts per block at this batch size."""
    schedule = cfg.batch_schedule(greedy=temperature == 0)
    return longest_block(cfg) if schedule is None else min(schedule.tokens(size), longest_block(cfg))


def check_tunable(cfg: Config) -> None:
    if cfg.speculation.tree is not None:
        raise SpecdecError(
            "tune chooses a chain's draft tokens by batch size (speculation.schedule), and the config drafts a "
            "tree: tune the chain (--num-draft-tokens N)"
        )


def tune(cfg: Config, prompts: list[Prompt], settings: TuneSettings, run: records.Run) -> None:
    """Per temperature and batch size: the config's full drafting on every prompt (its acceptance, cut
    short, predicts every shorter length's), a probe, then the predicted best lengths and the target alone."""
    check_tunable(cfg)
    with display.stderr.status(f"Loading {cfg.target.describe()} and {cfg.draft.describe()}..."):
        pair = load_pair(cfg)
    full, plan, started = longest_block(cfg), settings.plan, time.monotonic()
    choices: dict[tuple[float, int], Choice] = {}
    probes: dict[tuple[float, int], Probe] = {}
    acceptance: dict[tuple[float, int], list[StepRecord]] = {}
    batch_runs: list[dict] = []
    with display.progress() as bar:
        keys = [(t, size) for t in settings.temperatures for size in settings.batch_sizes]
        task = bar.add_task("tune", total=len(keys) * (3 + settings.finalists))

        def measure(size: int, temperature: float, tokens: int, budgeted: bool = True) -> list[dict]:
            """Run one length on every prompt: its batches' runs. Stopped once the budget is spent (the
            run that predicts is not `budgeted`) or on Ctrl-C."""
            if budgeted and budget_spent(started, settings.budget_minutes):
                raise Stopped
            rule = cfg.speculation.verification if tokens and temperature > 0 else "token"
            mode = Mode(temperature, tokens, verification=rule)
            bar.update(task, description=f"batch size {size}: {mode.label}")
            done, stopped = run_batches(
                pair, batch_of(prompts, size), plan, batched=[(size, mode)], make=capped_generator
            )
            batch_runs.extend(done)
            bar.advance(task)
            if stopped:
                raise Stopped
            return done

        try:
            for key in keys:
                temperature, size = key
                full_runs = measure(size, temperature, full, budgeted=False)
                steps = [StepRecord(*s) for r in full_runs for rep in r["repeats"] for s in rep["steps"]]
                acceptance[key] = steps
                bar.update(task, description=f"probe: batch size {size}, {temperature_label(temperature)}")
                probes[key] = probe(pair, probe_prompts(prompts, size, settings.sample), size, temperature, full, plan)
                bar.advance(task)
                predicted = {g: predicted_speedup(probes[key], g, steps) for g in range(full + 1)}
                choices[key] = Choice(size, temperature, predicted, {}, {}, config_tokens(cfg, size, temperature))
                for g in finalists(predicted, {full, choices[key].config_tokens}, settings.finalists):
                    if g != full:  # that one ran first
                        measure(size, temperature, g)
            partial = False
        except (KeyboardInterrupt, Stopped):
            partial = True
    rows = summarize_batches([], batch_runs)
    for key, choice in choices.items():
        measured = [r for r in rows if (r["temperature"], r["batch_size"]) == key]
        choice.measured = {r["num_draft_tokens"]: r["speedup"][0] for r in measured} | ({0: 1.0} if measured else {})
        choice.accepted_length = {r["num_draft_tokens"]: r["mean_accepted_length"] for r in measured}
    finish(cfg, pair, settings, choices, probes, acceptance, batch_runs, partial, run)


def budget_spent(started: float, budget_minutes: float | None) -> bool:
    return budget_minutes is not None and time.monotonic() - started > 60 * budget_minutes


def tuned_schedule(choices: dict[tuple[float, int], Choice], before: Schedule | None) -> Schedule:
    """Greedy ranges from the greedy choices; sampled ones from the length measured best on average over
    the sampled temperatures (one schedule serves them all); the config's own (`before`) where none was
    tuned."""
    greedy = {size: c.chosen for (t, size), c in choices.items() if t == 0}
    sampled: dict[int, int] = {}
    for size in sorted({size for (t, size) in choices if t > 0}):
        tables = [c.measured or c.predicted for (t, s), c in choices.items() if t > 0 and s == size]
        common = set.intersection(*(set(table) for table in tables))
        sampled[size] = max(sorted(common), key=lambda g: statistics.fmean(table[g] for table in tables))
    before = before or Schedule()
    return Schedule(
        greedy=schedule_ranges(greedy) if greedy else before.greedy,
        sampled=schedule_ranges(sampled) if sampled else before.sampled,
    )


def tuned_config(cfg: Config, schedule: Schedule) -> str:
    """The config as it ran (flags applied, checkpoints resolved), with the schedule: YAML specdec reads."""
    data = cfg.to_dict()
    data.pop("source")
    data["speculation"]["schedule"] = dataclasses.asdict(schedule)
    return f"# written by `specdec tune` from {cfg.source}\n" + yaml.safe_dump(data, sort_keys=False)


def vllm_configs(cfg: Config, schedule: Schedule) -> tuple[dict[str, dict], str | None]:
    """vLLM's speculative_config per schedule (greedy, sampled; one when they agree), or why vLLM has none."""
    from specdec_cli.vllm_engine.settings import speculative_config

    kinds = {kind: ranges for kind, ranges in dataclasses.asdict(schedule).items() if ranges is not None}
    if len(kinds) == 2 and schedule.greedy == schedule.sampled:
        kinds = {"all": schedule.greedy}
    try:
        return {
            kind: speculative_config(cfg.draft, longest_block(cfg), BatchSchedule.parse(ranges))
            for kind, ranges in kinds.items()
        }, None
    except SpecdecError as exc:
        return {}, str(exc)


def finish(cfg, pair, settings, choices, probes, acceptance, batch_runs, partial, run: records.Run) -> None:
    schedule = tuned_schedule(choices, cfg.speculation.schedule)
    vllm, no_vllm = vllm_configs(cfg, schedule)
    table = tune_table(choices)
    record = {
        **records.header("tune", cfg, pair.describe()),
        "partial": partial,
        "settings": {
            "batch_sizes": settings.batch_sizes,
            "temperatures": settings.temperatures,
            "sample": settings.sample,
            "finalists": settings.finalists,
            "budget_minutes": settings.budget_minutes,
            "probe_tokens": PROBE_TOKENS,
            "max_new_tokens": settings.plan.max_new_tokens,
            "repeats": settings.plan.repeats,
        },
        "choices": [dataclasses.asdict(c) | {"chosen": c.chosen} for c in choices.values()],
        "schedule": dataclasses.asdict(schedule),
        "vllm_speculative_config": vllm,
        "vllm_unavailable": no_vllm,
        # per temperature and batch size, the full drafting's blocks, which predict every length
        "acceptance": [
            {
                "temperature": t,
                "batch_size": size,
                "blocks": len(steps),
                "mean_accepted": {g: mean_accepted(steps, g) for g in range(longest_block(cfg) + 1)},
            }
            for (t, size), steps in acceptance.items()
        ],
        "probes": [
            {
                "temperature": t,
                "batch_size": size,
                "alone_tokens_per_second": p.alone_tokens_per_second,
                "block_seconds": p.block_seconds,
                "rows_per_block": p.rows_per_block,
            }
            for (t, size), p in probes.items()
        ],
        "batch_runs": batch_runs,
    }
    files = {"tuned.yaml": tuned_config(cfg, schedule)}
    files |= {f"vllm-speculative-config-{kind}.json": records.dumps(c) + "\n" for kind, c in vllm.items()}
    chart_files = charts.draw_tuning(record) if run.recording and choices else {}
    tables = [table, schedule_report(schedule)]
    files |= chart_files | {"report.md": markdown_document(record, tables, list(chart_files))}

    def show() -> None:
        display.stdout.print(rich_table(table))
        display.stdout.print(rich_table(schedule_report(schedule)))
        if no_vllm:
            display.stdout.print(f"No vLLM speculative_config: {no_vllm}")
        display.stdout.print(environment_caption(record["environment"]))

    run.finish("tune", cfg.name, record, show, files)
    if partial:
        display.stderr.print("Stopped early: the choices hold what was measured (partial: true).")


def tune_table(choices: dict[tuple[float, int], Choice]) -> Report:
    """Batch size x temperature: the chosen draft tokens, predicted and measured speedup, the config's."""
    rows = []
    for (temperature, size), c in sorted(choices.items()):
        chosen = c.chosen
        rows.append(
            [
                str(size),
                temperature_label(temperature),
                "off" if chosen == 0 else str(chosen),
                f"{c.predicted[chosen]:.2f}x",
                f"{c.measured[chosen]:.2f}x" if chosen in c.measured else "n/a",
                f"{c.measured[c.config_tokens]:.2f}x" if c.config_tokens in c.measured else "n/a",
                f"{c.accepted_length[chosen]:.2f}" if c.accepted_length.get(chosen) else "n/a",
            ]
        )
    return Report(
        "Draft tokens per block by batch size (speedup over the target alone at that batch size)",
        ["batch size", "temperature", "draft tokens", "predicted", "measured", "config's own", "acc len"],
        rows,
        "predicted: from the probes; measured: all prompts, this run; config's own: its drafting unchanged",
    )


def schedule_report(schedule: Schedule) -> Report:
    """The schedule tune wrote, as ranges of batch sizes."""
    rows = [
        [kind, BatchSchedule.parse(ranges).describe()]
        for kind, ranges in (("greedy", schedule.greedy), ("sampled", schedule.sampled))
        if ranges is not None
    ]
    title = "speculation.schedule (tuned.yaml): draft tokens by batch size"
    return Report(title, ["decoding", "batch sizes: draft tokens"], rows)
