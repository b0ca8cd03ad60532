"""`specdec benchmark`: the target alone and the speculative loop on a prompt set, measured as Spec-Bench
measures. The parts live in bench/: plan (modes and prompts), run, summary, report, peers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdec_cli import display, records
from specdec_cli.bench import charts
from specdec_cli.bench.contexts import with_context
from specdec_cli.bench.plan import HF, LLAMACPP, SPECDEC, VLLM, Mode, Plan
from specdec_cli.bench.prompts import Prompt
from specdec_cli.bench.report import (
    batch_report,
    category_report,
    context_report,
    detail_report,
    environment_caption,
    markdown_document,
    peer_report,
    rich_table,
    verification,
)
from specdec_cli.bench.run import locate_peer_divergences, run_batches, run_benchmark, run_contexts
from specdec_cli.bench.summary import (
    add_weight_read_rates,
    gate_failures,
    inexact_runs,
    summarize,
    summarize_batches,
    summarize_contexts,
    summarize_peers,
)
from specdec_cli.config import Config
from specdec_cli.errors import EXIT_CHECK_FAILED, EXIT_GATE_FAILED, SpecdecError
from specdec_cli.methods import registry
from specdec_cli.pair import dtype_name, load_pair_showing


@dataclass
class Measured:
    runs: list = field(default_factory=list)
    batch_runs: list = field(default_factory=list)
    context_runs: list = field(default_factory=list)
    partial: bool = False
    versions: dict | None = None  # vLLM's version and build, or llama.cpp's, where it ran
    warning: str | None = None  # what vLLM's CPU build does differently
    caption: str | None = None  # how the peer ran, where only its run tells (llama.cpp's)


def execute(
    cfg: Config,
    prompts: list[Prompt],
    plan: Plan,
    run: records.Run,
    min_speedup: float | None,
    min_accept_length: float | None,
) -> None:
    pair, caption = prepare(cfg, plan)
    measured = measure(pair, prompts, plan)
    if plan.peer and plan.engine == SPECDEC:
        locate_peer_divergences(pair, prompts, measured.runs)
    caption = " ".join(part for part in (measured.caption, caption) if part) or None
    if measured.warning:
        caption = f"{caption} {measured.warning}"
    summary = summarize(measured.runs, plan.engine)
    record = benchmark_record(cfg, pair, prompts, plan, measured, summary, caption)
    report(cfg, record, run)
    if measured.partial:
        display.stderr.print("Interrupted: the record holds the prompts finished in every mode (partial: true).")
        raise KeyboardInterrupt
    inexact = inexact_runs(summary + record["context_summary"])
    if inexact:
        raise SpecdecError(
            "greedy output left the target alone's by more than rounding, a bug: "
            + "; ".join(inexact)
            + " (greedy_divergence in the record's runs says where)",
            EXIT_CHECK_FAILED,
        )
    failures = gate_failures(summary, min_speedup, min_accept_length)
    if failures:
        raise SpecdecError("benchmark gate not met: " + "; ".join(failures), EXIT_GATE_FAILED)


def prepare(cfg: Config, plan: Plan):
    """The loaded pair (with vLLM as the engine: the target's tokenizer alone) and the caption that
    says how the peer or engine ran; refuses what vLLM cannot run before any work."""
    if VLLM in (plan.engine, plan.peer):
        from specdec_cli.vllm_engine.client import vllm_python

        vllm_python()  # before any work: without vLLM's environment the run could not finish
    if plan.peer == LLAMACPP:
        from specdec_cli.llamacpp_engine.client import llamacpp_python
        from specdec_cli.loading.checkpoints import gguf_file

        llamacpp_python(), gguf_file(cfg.target)  # before any work, as vLLM's
    caption, note = None, None
    if plan.engine == VLLM:
        from specdec_cli.bench.vllm_peer import VLLM_ENGINE, target_text
        from specdec_cli.vllm_engine.settings import speculative_config, vllm_schedule

        # a draft vLLM cannot run: one line before any work
        speculative_config(cfg.draft, plan.num_draft_tokens_list[0], vllm_schedule(cfg, plan.temperatures))
        pair = target_text(cfg)  # vLLM loads the models: specdec only encodes the prompts
        caption = VLLM_ENGINE
    else:
        pair = load_pair_showing(cfg)
    if plan.peer == HF:
        from specdec_cli.bench.peers import hf_peer_engine, peer_caption

        plan.peer_engine, note = hf_peer_engine(pair)
        caption = peer_caption(plan.peer_engine, note)
    elif plan.peer == VLLM:
        from specdec_cli.bench.vllm_peer import VLLM_FAIRNESS, vllm_peer_engine

        plan.peer_engine, note = vllm_peer_engine(pair, plan)
        caption = " ".join([VLLM_FAIRNESS] + ([note] if note else []))
    elif plan.peer == LLAMACPP:
        from specdec_cli.bench.llamacpp_peer import llamacpp_peer_engine

        plan.peer_engine, note = llamacpp_peer_engine(pair)
        caption = note
    if note:
        display.stderr.print(f"Note: {note}")
    return pair, caption


class RunProgress:
    """A progress task over runs: each call (prompt index, prompts, prompt, mode) begins one run."""

    def __init__(self, progress, description: str, total: int):
        self.progress, self.task, self.begun = progress, progress.add_task(description, total=total), 0

    def __call__(self, i: int, n: int, prompt: Prompt, mode: Mode) -> None:
        description = f"prompt {i + 1}/{n} {prompt.id}: {mode.label}"
        self.progress.update(self.task, completed=self.begun, description=description)
        self.begun += 1

    def finish(self, completed: int) -> None:
        self.progress.update(self.task, completed=completed)


def measure(pair, prompts: list[Prompt], plan: Plan) -> Measured:
    """Every mode of the plan on every prompt, in specdec's loop and vLLM's as the plan says, with
    progress; Ctrl-C ends it with what every mode finished (`partial`)."""
    measured = Measured()
    # every context length's prompts made before any work: a length the window or the text cannot hold is one line
    contexts = [(length, *with_context(pair, prompts, length, plan.max_new_tokens)) for length in plan.context_lengths]
    engine_modes = [mode for modes in plan.engine_modes().values() for mode in modes]
    vllm_modes = engine_modes if VLLM in (plan.engine, plan.peer) else []
    batched = plan.batch_modes() + plan.batched(vllm_modes)
    with display.progress() as progress:
        batch_task = progress.add_task("batches", total=len(batched)) if batched else None
        begun = []  # the (batch size, mode) pairs begun so far

        def on_batch(size: int, mode: Mode, start: int, n: int) -> None:
            if (size, mode) not in begun:
                begun.append((size, mode))
            progress.update(
                batch_task,
                completed=len(begun) - 1,
                description=f"batch size {size}, prompts {start + 1}-{min(start + size, n)}/{n}: {mode.label}",
            )

        if plan.engine == SPECDEC:
            modes = plan.modes()
            on_run = RunProgress(progress, f"warm-up ({plan.warmup} per mode)", len(prompts) * len(modes))
            measured.runs, measured.partial = run_benchmark(pair, prompts, plan, on_run)
            on_run.finish(len(measured.runs))
            if plan.batch_modes() and not measured.partial:
                measured.batch_runs, measured.partial = run_batches(pair, prompts, plan, on_batch)
            if contexts and not measured.partial:
                total = len(contexts) * len(prompts) * sum(m.engine == SPECDEC for m in modes)
                on_run = RunProgress(progress, "contexts", total)
                measured.context_runs, measured.partial = run_contexts(pair, contexts, plan, on_run)
                on_run.finish(len(measured.context_runs))
        if vllm_modes and not measured.partial:
            from specdec_cli.bench.vllm_peer import cpu_build_sampling, run_vllm

            on_run = RunProgress(progress, "vllm: starting an engine", len(prompts) * len(vllm_modes))
            done = run_vllm(pair, prompts, plan, on_run, on_batch)
            on_run.finish(on_run.begun)
            measured.runs += done.runs
            measured.batch_runs += done.batch_runs
            measured.partial = done.partial
            measured.versions = {"vllm": done.version, "vllm_device": done.device}
            measured.warning = cpu_build_sampling(
                done.device, [m.temperature for m in vllm_modes if m.num_draft_tokens]
            )
        if plan.peer == LLAMACPP and not measured.partial:
            from specdec_cli.bench.llamacpp_peer import run_llamacpp

            on_run = RunProgress(progress, "llamacpp: starting", len(prompts) * len(engine_modes))
            done = run_llamacpp(pair, prompts, plan, on_run)
            on_run.finish(len(done.runs))
            measured.runs += done.runs
            measured.partial = done.partial
            measured.versions, measured.caption = {"llamacpp": done.version}, done.caption
        if batch_task is not None:
            progress.update(batch_task, completed=len(begun))
    return measured


def benchmark_record(
    cfg: Config, pair, prompts: list[Prompt], plan: Plan, measured: Measured, summary: dict, caption: str | None
) -> dict:
    if plan.engine == VLLM:
        from specdec_cli.vllm_engine.settings import environment

        found = measured.versions or {}
        dtype = dtype_name(pair.dtype)
        where = environment(cfg, dtype, found.get("vllm", ""), found.get("vllm_device", ""))
    else:
        from specdec_cli.bench.bandwidth import read_bandwidth

        bandwidth = read_bandwidth(pair.device)
        where = pair.describe() | {"read_bandwidth_bytes_per_second": bandwidth}
        add_weight_read_rates(summary, where["target_weight_bytes"], bandwidth)
    return {
        **records.header("benchmark", cfg, where),
        "engine": plan.engine,
        "partial": measured.partial,
        "settings": {
            **asdict(plan),
            "multi_turn": "every turn counts; each mode feeds back its own answers",
            "prompts": len(prompts),
        },
        "summary": summary,
        "peers": summarize_peers(measured.runs),
        "peer_fairness": caption if plan.peer else None,
        "engine_note": caption if plan.engine == VLLM else None,
        "peer_versions": measured.versions if plan.peer else None,
        "batch_summary": summarize_batches(measured.runs, measured.batch_runs),
        "context_summary": summarize_contexts(measured.context_runs),
        "prompt_set": [asdict(p) for p in prompts],
        "runs": measured.runs,
        "batch_runs": measured.batch_runs,
        "context_runs": measured.context_runs,
    }


def report(cfg: Config, record: dict, run: records.Run) -> None:
    """The record, its tables (on stdout, and as report.md with the charts beside the record)."""
    rule = verification(record)
    summary, peers = record["summary"], record["peers"]
    tables = (
        [
            category_report(summary, registry.describe(cfg.draft), rule, record["engine_note"], record["engine"]),
            detail_report(summary, rule),
        ]
        + ([peer_report(peers, record["peer_fairness"])] if peers else [])
        + ([batch_report(record["batch_summary"], rule)] if record["batch_runs"] else [])
        + ([context_report(record["context_summary"], rule)] if record.get("context_summary") else [])
    )
    chart_files = charts.draw([(charts.heading(record), record)]) if run.recording else {}
    markdown = markdown_document(record, tables, list(chart_files))

    def show() -> None:
        for table in tables:
            display.stdout.print(rich_table(table))
        display.stdout.print(environment_caption(record["environment"]))

    run.finish("benchmark", cfg.name, record, show, {"report.md": markdown, **chart_files})
