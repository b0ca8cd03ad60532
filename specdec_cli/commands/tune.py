"""`specdec tune`: how blocks decode fastest at each batch size and temperature (draft tokens per block,
a tree, the verification rule, the confidence threshold), predicted from short probes
(bench/tuning.py), the best few run for real beside the target alone and the config as it is, and
written as a config with `speculation.schedule` and as vLLM's `speculative_config`."""

from __future__ import annotations

import copy
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
from specdec_cli.bench.run import MakeBatchGenerator, run_rounds
from specdec_cli.bench.summary import summarize_batches
from specdec_cli.bench.tuning import (
    CONFIG_STYLE,
    TARGET_ALONE,
    Choice,
    Probe,
    Setting,
    changes,
    finalists,
    mean_accepted,
    order,
    predicted_speedups,
    runs_under,
    schedule_ranges,
    written_setting,
    written_style,
)
from specdec_cli.config import VERIFICATIONS, Config, Schedule, Speculation, longest_block, validate
from specdec_cli.decoding.metrics import StepRecord
from specdec_cli.decoding.params import BatchSchedule, TreeShape
from specdec_cli.errors import SpecdecError
from specdec_cli.pair import Pair, load_pair_showing


class Stopped(Exception):
    """The budget is spent, or Ctrl-C stopped a run: tune keeps what it measured."""


PROBE_TOKENS = 32  # new tokens per probe row: enough blocks to time, short enough to probe every size
PROBED = ("new_tokens", "decode_seconds", "blocks", "steps")  # a probe's sums over its batches' median repeats
THRESHOLDS = (0.0, 0.2, 0.4)  # confidence thresholds tried where the draft stops when unsure
# each measured speedup stands on at least this many batch runs (the median of repeats counts): one slow
# batch must not decide a batch size that the prompts fill only once or twice
MIN_BATCH_RUNS = 3


@dataclass(frozen=True)
class TuneSettings:
    batch_sizes: list[int]
    temperatures: list[float]
    sample: int  # at least this many prompts in each batch size's probe
    finalists: int  # predicted best candidates run for real, besides the target alone and the config's own
    budget_minutes: float | None
    plan: Plan  # max_new_tokens, repeats, seed, sampling settings of the runs for real


def styled(speculation: Speculation, style: Setting) -> Speculation:
    """The config's speculation with what `style` changes: a tree, the rule, the threshold."""
    threshold = speculation.confidence_threshold if style.threshold is None else style.threshold
    return dataclasses.replace(
        speculation,
        tree=style.tree or speculation.tree,
        verification=style.verification or speculation.verification,
        confidence_threshold=threshold,
        schedule=None if style.tree else speculation.schedule,
    )


def with_setting(pair: Pair, setting: Setting) -> Pair:
    """The pair drafting `setting` at every batch size: a chain of at most setting.tokens per block (0:
    the target alone) under its rule and threshold, or its tree."""
    ranges = [[1, 1, setting.tokens]]
    speculation = styled(pair.config.speculation, setting.style)
    if setting.tree is None:
        speculation = dataclasses.replace(speculation, schedule=Schedule(greedy=ranges, sampled=ranges))
    drafter = pair.drafter
    if setting.threshold is not None:  # the drafter reads its threshold; the models stay shared
        drafter = copy.copy(drafter)
        drafter.confidence_threshold = setting.threshold
    return dataclasses.replace(pair, config=dataclasses.replace(pair.config, speculation=speculation), drafter=drafter)


def setting_generator(pair: Pair, setting: Setting) -> MakeBatchGenerator:
    """run_batches' `make` for `setting`: batches of it, `max_new_tokens` each."""
    styled_pair = with_setting(pair, setting)

    def make(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> BatchGenerate:
        decoder = styled_pair.decoder(plan.params(mode.temperature), setting.tokens > 0, tree=setting.tree)
        return lambda prompts, seed: decoder.generate_batch(prompts, max_new_tokens, seed, ignore_eos=plan.ignore_eos)

    return make


def batch_of(prompts: list[Prompt], size: int) -> list[Prompt]:
    """At least `size` prompts: the prompts, repeated when there are fewer."""
    return (prompts * math.ceil(size / len(prompts)))[: max(size, len(prompts))]


def mode_of(setting: Setting, temperature: float, cfg: Config) -> Mode:
    rule = styled(cfg.speculation, setting.style).verification if setting.tokens and temperature > 0 else "token"
    return Mode(temperature, setting.tokens, tree=setting.tree, verification=rule)


def candidates(cfg: Config, pair: Pair) -> dict[str, Setting]:
    """Every setting tune predicts: the config's own chain at every length up to its longest block (0:
    the target alone), that chain under the other verification rule and under other confidence
    thresholds (drafts that stop when unsure), and a draft tree where the drafter grows one."""
    full = longest_block(cfg)
    settings = [Setting(tokens) for tokens in range(full + 1)]
    rule = cfg.speculation.verification
    settings.append(Setting(full, verification=next(r for r in VERIFICATIONS if r != rule)))
    if pair.drafter.stops_when_unsure:
        own = cfg.speculation.confidence_threshold
        settings += [Setting(full, threshold=t) for t in THRESHOLDS if t != own]
    depth = max(3, cfg.speculation.num_draft_tokens)
    tree = Setting(depth, tree=TreeShape(depth=depth, top_k=2, max_nodes=2 * depth))
    try:
        validate(dataclasses.replace(cfg, speculation=styled(cfg.speculation, tree.style)))
        settings.append(tree)
    except SpecdecError:  # a drafter whose trees cannot take that shape
        pass
    return {s.label: s for s in settings}


def probe(
    pair: Pair, prompts: list[Prompt], size: int, temperature: float, settings: list[Setting], plan: Plan
) -> tuple[Probe, list[dict]]:
    """`prompts` in batches of `size`, PROBE_TOKENS each, with every setting round by round (a slow
    stretch of the machine moves them alike), each batch repeated to MIN_BATCH_RUNS batch runs per
    setting, and of each batch's repeats the median counts (one slow run does not move a setting alone).
    Returns the probe and its runs, each marked with its setting."""
    # the finalists' --repeats is not the probe's: it repeats only to MIN_BATCH_RUNS
    short = dataclasses.replace(plan, max_new_tokens=PROBE_TOKENS, repeats=1)
    short = size_plan(short, math.ceil(len(prompts) / size))
    entries = [(mode_of(s, temperature, pair.config), setting_generator(pair, s)) for s in settings]
    done, stopped = run_rounds(pair, prompts, short, size, entries)
    if stopped:
        raise Stopped
    sums = {}
    for setting, batches in zip(settings, done):
        medians = [median_repeat(batch["repeats"]) for batch in batches]
        sums[setting.label] = {key: sum(len(r[key]) if key == "steps" else r[key] for r in medians) for key in PROBED}
    probed = Probe(
        batch_size=size,
        block_seconds={label: r["decode_seconds"] / r["blocks"] for label, r in sums.items()},
        rows_per_block={label: r["steps"] / r["blocks"] for label, r in sums.items()},
        tokens_per_second={label: r["new_tokens"] / r["decode_seconds"] for label, r in sums.items()},
    )
    return probed, [r | {"setting": s.label} for s, batches in zip(settings, done) for r in batches]


def median_repeat(repeats: list[dict]) -> dict:
    """The repeat of one batch (the same tokens each time) whose decoding took the median time (of two,
    the faster)."""
    return sorted(repeats, key=lambda r: r["decode_seconds"])[(len(repeats) - 1) // 2]


def probe_prompts(prompts: list[Prompt], size: int, sample: int) -> list[Prompt]:
    """Whole batches of `size` holding at least `sample` prompts, spread over the set (repeated where
    the set is smaller)."""
    count = size * math.ceil(sample / size)
    spread = prompts[:: max(1, len(prompts) // count)][:count]
    return batch_of(spread, count)[:count]


def size_plan(plan: Plan, batches: int) -> Plan:
    """The plan for a batch size the prompts fill `batches` times: repeated to MIN_BATCH_RUNS batch runs."""
    return dataclasses.replace(plan, repeats=max(plan.repeats, math.ceil(MIN_BATCH_RUNS / batches)))


def config_label(cfg: Config, size: int, temperature: float) -> str:
    """What the config as it is drafts per block at this batch size."""
    schedule = cfg.batch_schedule(greedy=temperature == 0)
    full = longest_block(cfg)
    return str(full if schedule is None else min(schedule.tokens(size), full))


def check_tunable(cfg: Config) -> None:
    if cfg.speculation.tree is not None:
        raise SpecdecError(
            "tune chooses a chain's draft tokens by batch size (speculation.schedule), and the config drafts a "
            "tree: tune the chain (--num-draft-tokens N)"
        )


def tune(cfg: Config, prompts: list[Prompt], settings: TuneSettings, run: records.Run) -> None:
    """Per temperature and batch size: the config's full drafting on every prompt beside the target alone
    (its acceptance, cut short, predicts every shorter length's; its speedup scales the probe's), a probe
    of every candidate, then the predicted best few and the target alone."""
    check_tunable(cfg)
    pair = load_pair_showing(cfg)
    options = candidates(cfg, pair)
    replay = pair.drafter.copies_context
    full, plan, started = Setting(longest_block(cfg)), settings.plan, time.monotonic()
    choices: dict[tuple[float, int], Choice] = {}
    probes: dict[tuple[float, int], Probe] = {}
    acceptance: list[dict] = []  # per temperature and batch size, what the full drafting's run predicts with
    acceptance_runs: list[dict] = []  # the full drafting's and the target alone's, which predict
    probe_runs: list[dict] = []  # the probes', which time a block of every candidate
    batch_runs: list[dict] = []  # the finalists', which are measured
    with display.progress() as bar:
        keys = [(t, size) for t in settings.temperatures for size in settings.batch_sizes]
        rounds = {size: math.ceil(len(batch_of(prompts, size)) / size) for size in settings.batch_sizes}
        task = bar.add_task("tune", total=sum(1 + 2 * rounds[size] for _, size in keys))

        def round_by_round(size: int, temperature: float, labels: list[str], what: str, into: list[dict]) -> list[dict]:
            """`labels` on every prompt, batch by batch, each repeat of each in turn, so the machine's drift
            moves them alike; their runs, each marked with its setting, added to `into` (also when stopped by
            Ctrl-C) and returned."""
            description = f"batch size {size}, {temperature_label(temperature)}: {what}"

            def on_batch(start: int) -> None:
                bar.update(task, description=description, advance=start > 0)

            entries = [
                (mode_of(options[label], temperature, cfg), setting_generator(pair, options[label])) for label in labels
            ]
            runs_plan = size_plan(plan, rounds[size])
            done, stopped = run_rounds(pair, batch_of(prompts, size), runs_plan, size, entries, on_batch)
            bar.advance(task)
            runs = [r | {"setting": label} for label, label_runs in zip(labels, done) for r in label_runs]
            into.extend(runs)
            if stopped:
                raise Stopped
            return runs

        try:
            for key in keys:
                temperature, size = key
                what = "full drafting beside the target alone"
                runs = round_by_round(size, temperature, [TARGET_ALONE, full.label], what, into=acceptance_runs)
                steps = [
                    StepRecord(*s)
                    for r in runs
                    if r["setting"] == full.label
                    for rep in r["repeats"]
                    for s in rep["steps"]
                ]
                full_speedup = summary_row(runs, full.label)["speedup"][0]
                acceptance.append(
                    {
                        "temperature": temperature,
                        "batch_size": size,
                        "blocks": len(steps),
                        "mean_accepted": {g: mean_accepted(steps, g, replay) for g in range(full.tokens + 1)},
                        "replayed": replay,  # shorter blocks' acceptance replayed rather than cut
                        # measured beside the target alone: what the probe's predictions are scaled to
                        "full_drafting_speedup": full_speedup,
                    }
                )
                bar.update(task, description=f"probe: batch size {size}, {temperature_label(temperature)}")
                # a rule alone changes sampled chains only: greedy, it would rerun the config's chain
                probed = [s for s in options.values() if s.cut or changes(s.style, greedy=temperature == 0)]
                sample = probe_prompts(prompts, size, settings.sample)
                probes[key], runs = probe(pair, sample, size, temperature, probed, plan)
                probe_runs.extend(runs)
                bar.advance(task)
                predicted = predicted_speedups(probes[key], probed, steps, replay, full, full_speedup)
                choices[key] = Choice(size, temperature, predicted, {}, {}, config_label(cfg, size, temperature))
                if budget_spent(started, settings.budget_minutes):
                    raise Stopped
                labels = finalists(predicted, {full.label, choices[key].config_label}, settings.finalists)
                round_by_round(size, temperature, labels, ", ".join(map(shown, labels)), into=batch_runs)
            partial = False
        except (KeyboardInterrupt, Stopped):
            partial = True
    for key, choice in choices.items():
        measured = [r for r in batch_runs if (r["temperature"], r["batch_size"]) == key]
        for label in {r["setting"] for r in measured} - {TARGET_ALONE}:
            row = summary_row(measured, label)
            if row:
                choice.measured[label] = row["speedup"][0]
                choice.accepted_length[label] = row["mean_accepted_length"]
        if choice.measured:
            choice.measured[TARGET_ALONE] = 1.0
    by_purpose = {"acceptance_runs": acceptance_runs, "probe_runs": probe_runs, "batch_runs": batch_runs}
    finish(cfg, pair, settings, options, choices, probes, acceptance, by_purpose, partial, run)


def summary_row(runs: list[dict], label: str) -> dict | None:
    """`label` against the target alone in runs that ran them round by round (one setting at a time:
    settings that differ only in threshold would share a summary's group)."""
    rows = summarize_batches([], [r for r in runs if r["setting"] in (TARGET_ALONE, label)])
    return rows[0] if rows else None


def budget_spent(started: float, budget_minutes: float | None) -> bool:
    return budget_minutes is not None and time.monotonic() - started > 60 * budget_minutes


def tuned_schedule(
    choices: dict[tuple[float, int], Choice], style: Setting, options: dict[str, Setting], before: Schedule | None
) -> Schedule | None:
    """Under the written style (a tree: no schedule), greedy ranges from each greedy batch size's best
    setting; sampled ones from the setting measured best on average over the sampled temperatures (one
    schedule serves them all); the config's own (`before`) where none was tuned."""
    if style.tree is not None:
        return None
    greedy = {size: options[written_setting(c, style, options)].tokens for (t, size), c in choices.items() if t == 0}
    sampled: dict[int, int] = {}
    for size in sorted({size for (t, size) in choices if t > 0}):
        cells = [c for (t, s), c in choices.items() if t > 0 and s == size]
        tables = [c.measured or c.predicted for c in cells]
        common = set.intersection(*(set(table) for table in tables))
        runs = sorted((label for label in common if runs_under(options[label], style, greedy=False)), key=order)
        best = max(runs, key=lambda label: statistics.fmean(table[label] for table in tables))
        sampled[size] = options[best].tokens
    before = before or Schedule()
    return Schedule(
        greedy=schedule_ranges(greedy) if greedy else before.greedy,
        sampled=schedule_ranges(sampled) if sampled else before.sampled,
    )


def tuned_config(cfg: Config, style: Setting, schedule: Schedule | None) -> str:
    """The config as it ran (flags applied, checkpoints resolved) in the written style, with the schedule:
    YAML specdec reads."""
    data = dataclasses.replace(cfg, speculation=styled(cfg.speculation, style)).to_dict()
    data.pop("source")
    data["speculation"]["schedule"] = dataclasses.asdict(schedule) if schedule else None
    return f"# written by `specdec tune` from {cfg.source}\n" + yaml.safe_dump(data, sort_keys=False)


def vllm_configs(cfg: Config, style: Setting, schedule: Schedule | None) -> tuple[dict[str, dict], str | None]:
    """vLLM's speculative_config per schedule (greedy, sampled; one when they agree), or why vLLM has none."""
    from specdec_cli.vllm_engine.settings import speculative_config

    if schedule is None or styled(cfg.speculation, style).verification != "token":
        return {}, "vLLM drafts chains verified token by token, and the tuned config drafts a tree or a block rule"
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


def finish(
    cfg, pair, settings, options, choices, probes, acceptance, runs: dict[str, list[dict]], partial, run: records.Run
) -> None:
    """The record (with `runs`: every batch run, by what it was for), tuned.yaml, vLLM's settings, the
    tables and the chart."""
    style = written_style(list(choices.values()), options)
    written = {key: written_setting(c, style, options) for key, c in choices.items()}
    schedule = tuned_schedule(choices, style, options, cfg.speculation.schedule)
    vllm, no_vllm = vllm_configs(cfg, style, schedule)
    table = tune_table(choices, written, str(longest_block(cfg)))
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
            "min_batch_runs": MIN_BATCH_RUNS,
        },
        "candidates": list(options),
        # what tuned.yaml changes besides the schedule (null: the config's tree, rule and threshold)
        "style": None if style == CONFIG_STYLE else style.label,
        "choices": [
            dataclasses.asdict(c) | {"chosen": c.chosen, "written": written[key]} for key, c in choices.items()
        ],
        "schedule": dataclasses.asdict(schedule) if schedule else None,
        "vllm_speculative_config": vllm,
        "vllm_unavailable": no_vllm,
        "acceptance": acceptance,
        "probes": [{"temperature": t, "batch_size": size} | dataclasses.asdict(p) for (t, size), p in probes.items()],
        **runs,
    }
    files = {"tuned.yaml": tuned_config(cfg, style, schedule)}
    files |= {f"vllm-speculative-config-{kind}.json": records.dumps(c) + "\n" for kind, c in vllm.items()}
    chart_files = charts.draw_tuning(record) if run.recording and choices else {}
    tables = [table, schedule_report(style, schedule)]
    files |= chart_files | {"report.md": markdown_document(record, tables, list(chart_files))}

    def show() -> None:
        for report in tables:
            display.stdout.print(rich_table(report))
        if no_vllm:
            display.stdout.print(f"No vLLM speculative_config: {no_vllm}")
        display.stdout.print(environment_caption(record["environment"]))

    run.finish("tune", cfg.name, record, show, files)
    if partial:
        display.stderr.print("Stopped early: the choices hold what was measured (partial: true).")


def shown(label: str) -> str:
    return "off" if label == TARGET_ALONE else label


def tune_table(choices: dict[tuple[float, int], Choice], written: dict[tuple[float, int], str], full: str) -> Report:
    """Batch size x temperature: the setting tuned.yaml runs, its predicted and measured speedup, the
    config's, the full drafting's two measurements (how far two runs of one setting fall apart probed),
    and the measured best of all where tuned.yaml could not take it."""
    rows = []
    for key, c in sorted(choices.items()):
        temperature, size = key
        label = written[key]
        rows.append(
            [
                str(size),
                temperature_label(temperature),
                shown(label),
                f"{c.predicted[label]:.2f}x",
                f"{c.measured[label]:.2f}x" if label in c.measured else "n/a",
                f"{c.measured[c.config_label]:.2f}x" if c.config_label in c.measured else "n/a",
                # the full drafting's prediction is its first measurement (the probe is scaled to it)
                f"{c.predicted[full]:.2f}x / " + (f"{c.measured[full]:.2f}x" if full in c.measured else "n/a"),
                f"{c.accepted_length[label]:.2f}" if c.accepted_length.get(label) else "n/a",
                ""
                if c.chosen == label
                else f"{shown(c.chosen)}: {c.measured.get(c.chosen, c.predicted[c.chosen]):.2f}x",
            ]
        )
    return Report(
        "Speculation by batch size (speedup over the target alone at that batch size)",
        [
            "batch size",
            "temperature",
            "tuned",
            "predicted",
            "measured",
            "config's own",
            "full, twice",
            "acc len",
            "best of all",
        ],
        rows,
        "tuned: draft tokens (or tree, rule, threshold) tuned.yaml runs; predicted: from the probes, scaled to "
        "the full drafting's first run; measured: all prompts, this run; config's own: its drafting unchanged; "
        f"full, twice: the config's full drafting ({full}) measured first (step 1) and again among the finalists, "
        "beside the target alone both times: differences of this size are run-to-run spread, not the settings; "
        "best of all: where one config could not run it at every batch size",
    )


def schedule_report(style: Setting, schedule: Schedule | None) -> Report:
    """What tune wrote: the style, and the schedule as ranges of batch sizes."""
    rows = [["style", "the config's own" if style == CONFIG_STYLE else style.label]]
    if schedule is not None:
        rows += [
            [kind, BatchSchedule.parse(ranges).describe()]
            for kind, ranges in (("greedy", schedule.greedy), ("sampled", schedule.sampled))
            if ranges is not None
        ]
    title = "tuned.yaml: speculation and draft tokens by batch size"
    return Report(title, ["decoding", "batch sizes: draft tokens"], rows)
