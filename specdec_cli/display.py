"""Terminal output: the token stream on stdout, tables and progress on stderr."""

from __future__ import annotations

import sys
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
quiet = Console(quiet=True)  # for output that is collected but not shown

DRAFT_STYLE = "green"  # tokens the target accepted from the draft


def fmt(value, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


class TokenStream:
    """Prints generated text as it arrives; accepted draft tokens in colour on a terminal (Rich drops
    styles when stdout is piped, leaving plain text)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, console: Console = stdout):
        self.tokenizer = tokenizer
        self.console = console
        self.token_ids: list[int] = []
        self.text = ""

    def __call__(self, new_tokens: list[int], num_from_draft: int) -> None:
        for i, token in enumerate(new_tokens):
            self.token_ids.append(token)
            text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue  # an incomplete UTF-8 sequence: wait for the token that completes it
            piece, self.text = text[len(self.text):], text
            self.console.print(Text(piece, style=DRAFT_STYLE if i < num_from_draft else ""), end="")

    def close(self) -> None:
        self.console.print()


def environment_caption(env: dict) -> str:
    v = env["versions"]
    return (f"{env['device']} ({env['device_name']}), {env['dtype']}, {env['threads']} threads, "
            f"{env['cache']} cache; torch {v['torch']}, transformers {v['transformers']}")


def generation_table(stats: dict, env: dict, title: str) -> Table:
    table = Table(title=title, caption=environment_caption(env), show_header=False)
    table.add_column("statistic", style="bold")
    table.add_column("value", justify="right")
    positions = ", ".join(fmt(r) for r in stats["acceptance_by_position"]) or "n/a"
    rows = [
        ("New tokens", f"{stats['new_tokens']} (stopped by {stats['stop_reason']})"),
        ("Decode tokens/s", fmt(stats["tokens_per_second"], ".1f")),
        ("Prefill / decode time", f"{stats['prefill_seconds']:.2f} s / {stats['decode_seconds']:.2f} s"),
        ("Target forward passes", str(stats["target_forwards"])),
        ("Mean accepted length (tokens per target forward, incl. bonus)",
         fmt(stats["mean_accepted_length"])),
        ("Draft acceptance rate", f"{fmt(stats['acceptance_rate'], '.1%')} "
                                  f"({stats['accepted_draft_tokens']}/{stats['draft_tokens']} drafts)"),
        ("Acceptance by draft position", positions),
        ("Time drafting / verifying", f"{stats['draft_seconds']:.2f} s / {stats['verify_seconds']:.2f} s "
                                      f"({fmt(stats['draft_time_share'], '.0%')} drafting)"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def progress():
    """A progress bar on stderr for long work (benchmark prompts, verify stages, distill steps)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=stderr)


def progress_stage(bar):
    """A verify `Stage` that adds one bar per stage: (description, total) -> advance()."""
    def stage(description: str, total: int):
        task = bar.add_task(description, total=total)
        return lambda: bar.advance(task)
    return stage


def verification_table(rows: list, title: str, caption: str) -> Table:
    """One row per check of `specdec verify-distribution` (rows: verify.Row)."""
    table = Table(title=title, caption=caption)
    for name in ("check", "what", "samples", "statistic", "p-value", "TV (upper bound)", "threshold", "result"):
        table.add_column(name, justify="right" if name in ("samples", "p-value") else "left")
    for r in rows:
        tv = "n/a" if r.tv is None else f"{r.tv:.3f} (<= {r.tv_bound:.3f})"
        result = "[green]PASS[/]" if r.passed else "[bold red]FAIL[/]"
        what = f"{r.what}\n[dim]{r.note}[/]" if r.note else r.what
        table.add_row(r.check, what, str(r.samples), r.statistic, fmt(r.p_value, ".3g"), tv, r.threshold, result)
    return table
