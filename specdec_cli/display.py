"""Terminal output: the token stream on stdout, tables and progress on stderr."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:  # only for annotations: the CLI starts without importing transformers
    from transformers import PreTrainedTokenizerBase

# piped output has no terminal width: give wide tables room instead of rich's 80 columns
PIPED_WIDTH = 160
stdout = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else PIPED_WIDTH)
stderr = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else PIPED_WIDTH)

DRAFT_STYLE = "green"  # tokens the target accepted from the draft


def fmt(value, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


class TokenStream:
    """Prints generated text as it arrives; accepted draft tokens in colour on a terminal (Rich drops
    styles when stdout is piped, leaving plain text). Without a console it only collects token ids.

    Each token decodes a short window (the tokens since the last printed piece, plus the piece before
    them for context), so streaming costs the same per token however long the answer grows."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, console: Console | None = stdout):
        self.tokenizer = tokenizer
        self.console = console
        self.token_ids: list[int] = []
        self.prefix_offset = self.read_offset = 0  # window start; end of what is printed

    def __call__(self, new_tokens: list[int], num_from_draft: int) -> None:
        for i, token in enumerate(new_tokens):
            self.token_ids.append(token)
            if self.console is None:
                continue
            window = self.token_ids[self.prefix_offset :]
            printed = self.tokenizer.decode(window[: self.read_offset - self.prefix_offset], skip_special_tokens=True)
            text = self.tokenizer.decode(window, skip_special_tokens=True)
            if len(text) <= len(printed) or text.endswith("\ufffd"):
                continue  # nothing new, or an incomplete UTF-8 sequence: wait for the token that completes it
            self.console.print(Text(text[len(printed) :], style=DRAFT_STYLE if i < num_from_draft else ""), end="")
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def close(self) -> None:
        if self.console is not None:
            self.console.print()


def environment_caption(env: dict) -> str:
    if env.get("engine") == "vllm":
        return (
            f"vLLM {env['vllm']} ({env.get('vllm_device', '?')} build), {env['dtype']}, tensor parallel "
            f"{env['tensor_parallel_size']}, pipeline parallel {env['pipeline_parallel_size']}; tokens/s over "
            "the whole call (prefill included)"
        )
    v = env["versions"]
    matmul = f", decoding matmuls {env['decode_matmul']}" if env.get("decode_matmul") else ""
    quantized = f", {env['weights']} weights" if env.get("weights", "float") != "float" else ""
    return (
        f"{env['device']} ({env['device_name']}), {env['dtype']}{quantized}, {env['threads']} threads{matmul}; "
        f"torch {v['torch']}, transformers {v['transformers']}"
    )


def generation_table(stats: dict, env: dict, title: str) -> Table:
    table = Table(title=title, caption=environment_caption(env), show_header=False)
    table.add_column("statistic", style="bold")
    table.add_column("value", justify="right")
    positions = ", ".join(fmt(r) for r in stats["acceptance_by_position"]) or "n/a"
    given = ", ".join(fmt(r) for r in stats["conditional_acceptance_by_position"]) or "n/a"
    histogram = " ".join(f"{k}:{n}" for k, n in enumerate(stats["accepted_length_histogram"])) or "n/a"
    rows = [
        ("New tokens", f"{stats['new_tokens']} (stopped by {stats['stop_reason']})"),
        ("Decode tokens/s", fmt(stats["tokens_per_second"], ".1f")),
        ("Prefill / decode time", f"{stats['prefill_seconds']:.2f} s / {stats['decode_seconds']:.2f} s"),
        ("Target forward passes", str(stats["target_forwards"])),
        ("Mean accepted length: tokens per target forward, incl. bonus", fmt(stats["mean_accepted_length"])),
        (
            "Mean acceptance length as vLLM/SGLang: 1 + accepted / drafting blocks",
            fmt(stats["vllm_mean_acceptance_length"]),
        ),
        (
            "Draft acceptance rate",
            f"{fmt(stats['acceptance_rate'], '.1%')} "
            f"({stats['vllm_counters']['num_accepted_tokens']}/{stats['vllm_counters']['num_draft_tokens']} drafts)",
        ),
        ("Acceptance by draft position", positions),
        ("Acceptance by position, given the ones before", given),
        ("Blocks by accepted drafts (accepted:blocks)", histogram),
        (
            "Time drafting / verifying",
            f"{stats['draft_seconds']:.2f} s / {stats['verify_seconds']:.2f} s "
            f"({fmt(stats['draft_time_share'], '.0%')} drafting)",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def batch_table(rows: list[dict], overall: dict, env: dict, title: str) -> Table:
    """`generate --prompts`: a row per prompt, then the overall figures (tokens/s over wall time)."""
    table = Table(title=title, caption=environment_caption(env))
    for name in ("prompt", "new tokens", "stopped by", "tokens/s", "mean accepted length", "acceptance rate"):
        table.add_column(name, justify="left" if name == "prompt" else "right")
    for row in rows + [{"prompt_id": "overall", "stats": overall}]:
        s = row["stats"]
        table.add_row(
            row["prompt_id"],
            str(s["new_tokens"]),
            s["stop_reason"],
            fmt(s["tokens_per_second"], ".1f"),
            fmt(s["mean_accepted_length"]),
            fmt(s["acceptance_rate"], ".1%"),
            style="bold" if row["prompt_id"] == "overall" else None,
        )
    return table


def progress():
    """Progress on stderr for long work (benchmark prompts, verify stages, distill steps): a bar on a
    terminal, and in a log (CI) a plain line now and then."""
    if not stderr.is_terminal:
        return ProgressLines(stderr)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=stderr,
    )


class ProgressLines:
    """The part of rich's Progress that specdec uses, printed as lines like
    `progress: prompt 3/13 ...: 6/26 (23%), 1m02s elapsed, ETA 3m28s`, at most one per `every` seconds
    for a task, and one when it completes."""

    def __init__(self, console: Console, every: float = 30.0):
        self.console, self.every = console, every
        self.tasks: list[dict] = []

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: float, completed: float = 0) -> int:
        now = time.monotonic()
        self.tasks.append(
            {
                "description": description,
                "total": total,
                "completed": completed,
                "resumed_at": completed,
                "started": now,
                "printed": now,
            }
        )
        return len(self.tasks) - 1

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, advance=advance)

    def update(
        self, task: int, advance: float | None = None, completed: float | None = None, description: str | None = None
    ) -> None:
        t = self.tasks[task]
        before = t["completed"]
        t["completed"] = completed if completed is not None else before + (advance or 0)
        t["description"] = description or t["description"]
        now = time.monotonic()
        finished = t["completed"] >= t["total"] > before
        if finished or now - t["printed"] >= self.every:
            t["printed"] = now
            self.console.print(
                progress_line(t["description"], t["completed"], t["total"], now - t["started"], t["resumed_at"]),
                markup=False,
                highlight=False,
            )


def progress_line(description: str, done: float, total: float, elapsed: float, resumed_at: float = 0) -> str:
    """`resumed_at`: what was done before this run (a resumed job); the ETA comes from this run's rate."""
    share = done / total if total else 1.0
    rate = (done - resumed_at) / elapsed if elapsed > 0 else 0.0
    eta = f", ETA {duration((total - done) / rate)}" if share < 1 and rate > 0 else ""
    return f"progress: {description}: {done:g}/{total:g} ({share:.0%}), {duration(elapsed)} elapsed{eta}"


def duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def progress_stage(bar):
    """A verify `Stage` that adds one bar per stage: (description, total) -> advance()."""

    def stage(description: str, total: int):
        task = bar.add_task(description, total=total)
        return lambda: bar.advance(task)

    return stage


def verification_table(rows: list, title: str, caption: str) -> Table:
    """One row per check of `specdec verify-distribution` (rows: verify.Row). The TV column: the draws'
    total variation from the target on the test's bins, and the bound the output's own stays under at
    the row's confidence (the test's resolution)."""
    table = Table(title=title, caption=caption)
    for name in ("check", "what", "samples", "statistic", "p-value", "binned TV (bound)", "threshold", "result"):
        table.add_column(name, justify="right" if name in ("samples", "p-value") else "left")
    results = {"pass": "[green]PASS[/]", "fail": "[bold red]FAIL[/]", "not run": "[yellow]NOT RUN[/]"}
    for r in rows:
        tv = "n/a" if r.tv is None else f"{r.tv:.3f} (<= {r.tv_bound:.3f})"
        result = results[r.status]
        what = f"{r.what}\n[dim]{r.note}[/]" if r.note else r.what
        table.add_row(r.check, what, str(r.samples), r.statistic, fmt(r.p_value, ".3g"), tv, r.threshold, result)
    return table
