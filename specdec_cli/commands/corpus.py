"""`specdec corpus`: the target's answers to a large mix of prompts, into resumable shards (distill/writing.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec_cli import display, records
from specdec_cli.bench.prompts import builtin_suite, load_prompts
from specdec_cli.config import Config
from specdec_cli.distill import writing


def write_corpus(
    cfg: Config,
    out: Path,
    target_tokens: int,
    shape: writing.CorpusShape,
    engine: str,
    dtype: str,
    batch_size: int,
    exclude: list[Path],
    run: records.Run,
) -> None:
    """Write the corpus (no prompt sharing 8 words with the built-in benchmark prompts or `exclude`'s),
    then its record and a line of what it holds."""
    excluded = [turn for p in builtin_suite() for turn in p.turns]
    excluded += [turn for path in exclude for p in load_prompts(path) for turn in p.turns]
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    manifest = writing.write_corpus(cfg, shape, target_tokens, out, engine, dtype, batch_size, excluded)
    summary = writing.summary(manifest)
    run.finish(
        "corpus",
        cfg.name,
        {**records.header("corpus", cfg), "out": str(out), **summary},
        lambda: display.stdout.print(
            f"{out}: {summary['answers']:,} answers, {summary['answer_tokens']:,} answer tokens in "
            f"{summary['shards']} shards, {summary['tokens_per_second']:.0f} answer tokens/s while writing",
            highlight=False,
        ),
    )
