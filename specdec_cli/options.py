"""Pieces every command shares: option definitions, config loading with overrides, error reporting."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from specdec_cli.config import DEFAULT_CONFIG, Config, apply_overrides, load_config, parse_tree
from specdec_cli.errors import EXIT_INTERRUPTED, SpecdecError, known_failure, one_line, read_text

# Options shared by every command. A flag overrides the YAML when given, including 0 and false.
ConfigOpt = Annotated[
    Optional[str],
    typer.Option(
        "--config", "-c", help=f"YAML config: a path, or a name in ./configs/ or built in (default: {DEFAULT_CONFIG})."
    ),
]
TemperatureOpt = Annotated[Optional[float], typer.Option(help="Sampling temperature; 0 is greedy.")]
TopKOpt = Annotated[Optional[int], typer.Option(help="Keep the k most likely tokens; 0 disables.")]
TopPOpt = Annotated[Optional[float], typer.Option(help="Nucleus mass in (0, 1]; 1 disables.")]
SeedOpt = Annotated[Optional[int], typer.Option(help="Random seed (same seed, same tokens).")]
NumDraftTokensOpt = Annotated[Optional[int], typer.Option(help="Draft tokens per target forward (a chain).")]
ConfidenceOpt = Annotated[
    Optional[float],
    typer.Option(help="A draft model stops drafting a block at a token it gives less probability than this; 0 never."),
]
VerificationOpt = Annotated[
    Optional[str],
    typer.Option(
        help="How sampled drafts are verified: token (each on its own) or block (together, Sun et al. 2025); "
        "both exact, block keeps at least as many on average."
    ),
]
TreeOpt = Annotated[
    Optional[str],
    typer.Option(
        help="Draft a tree instead of a chain: DEPTH,TOP_K,MAX_NODES, e.g. 4,3,16 (per depth the top-k children "
        "of the top-k most probable nodes; the max-nodes most probable verified at once)."
    ),
]
PromptsOpt = Annotated[
    Optional[Path],
    typer.Option(
        help='Spec-Bench question.jsonl, JSONL of {"prompt": ...}, or text (a prompt per line) '
        "(default: the built-in suite, 1 prompt per category)."
    ),
]
CategoryOpt = Annotated[Optional[str], typer.Option(help="Only prompts of this category.")]
LimitOpt = Annotated[Optional[int], typer.Option(help="At most this many prompts per category.")]
MaxNewOpt = Annotated[Optional[int], typer.Option(help="Most tokens to generate.")]
IgnoreEosOpt = Annotated[
    Optional[bool], typer.Option("--ignore-eos/--stop-at-eos", help="Keep generating past end-of-sequence.")
]
DeviceOpt = Annotated[Optional[str], typer.Option(help="auto, cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[Optional[str], typer.Option(help="auto, float32, bfloat16 or float16.")]
WeightsOpt = Annotated[
    Optional[str],
    typer.Option(help="The linear layers' weights: auto, float, int8 or int4 (quantized at load; CPU)."),
]
ThreadsOpt = Annotated[Optional[int], typer.Option(help="CPU threads for torch.")]
CudaGraphsOpt = Annotated[
    Optional[str], typer.Option(help="off, on or auto (on for a GPU): decoding forwards replay CUDA graphs.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON record to stdout, nothing else.")]
RunsDirOpt = Annotated[
    Optional[str],  # not Path: Path("") is ".", and an empty --runs-dir is refused, not read as the working directory
    typer.Option(
        metavar="DIR", help="Folder for run records (default: $SPECDEC_RUNS_DIR, else ./runs).", show_default=False
    ),
]
RecordOpt = Annotated[bool, typer.Option("--record/--no-record", help="Write the run's record (and report).")]


def reports_errors(command):
    """Known failures become one `Error: ...` line on stderr and their exit code; set SPECDEC_DEBUG=1
    for the traceback. Ctrl-C exits with 130."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            print("\nInterrupted.", file=sys.stderr)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as exc:
            if os.environ.get("SPECDEC_DEBUG"):
                raise
            known = known_failure(exc)
            message = one_line(str(known) if known else f"{type(exc).__name__}: {exc}")
            hint = "" if known else " (internal error; set SPECDEC_DEBUG=1 for the traceback)"
            print(f"Error: {message}{hint}", file=sys.stderr)
            raise typer.Exit(known.exit_code if known else 1) from None

    return wrapper


def configure(config: str | None, tree: str | None = None, loop_benchmark: bool = False, **overrides) -> Config:
    """Load the YAML and apply flags given as section__key=value (None: not given). `tree`: --tree's
    text. --num-draft-tokens asks for a chain and --tree for a tree, over whichever the YAML has.
    `loop_benchmark`: the command may run synthetic acceptance (benchmark); others refuse it."""
    cfg = load_config(config)
    if overrides.get("speculation__num_draft_tokens") is not None:
        if tree is not None:
            raise SpecdecError("--num-draft-tokens drafts a chain and --tree a tree: give one of them")
        cfg.speculation.tree = None
    overrides["speculation__tree"] = parse_tree(tree) if tree is not None else None
    cfg = apply_overrides(cfg, {key.replace("__", "."): value for key, value in overrides.items()})
    if cfg.speculation.synthetic_acceptance is not None and not loop_benchmark:
        raise SpecdecError(
            "speculation.synthetic_acceptance keeps drafts by chance, so the output is not the target's: "
            "only `specdec benchmark` runs it (a loop benchmark)"
        )
    return cfg


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise SpecdecError("give exactly one of --prompt TEXT (or - for stdin) and --prompt-file PATH")
    if prompt == "-":
        return read_text("the prompt on stdin")
    if prompt_file is not None:
        return read_text("prompt file", prompt_file)
    return prompt
