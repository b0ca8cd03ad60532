"""Benchmark prompts: load them from a file or the built-in suite, and pick a subset.

Accepted file formats, one prompt per line:
  * Spec-Bench question.jsonl: {"question_id": ..., "category": "...", "turns": ["...", ...]}
  * JSONL: {"prompt": "..."} with optional "id" and "category"
  * plain text: each non-blank line is a prompt
  * Parquet (`.parquet`, SPEED-Bench's files): a row per prompt, with Spec-Bench's fields
    (`question_id`, `category`, `turns`; others, such as `sub_category`, `source`, `difficulty` and
    `multiturn`, are ignored), read with pyarrow (`pip install 'specdec[parquet]'`)
A `.jsonl` file is read as JSONL, a `.txt` file as text; any other file is JSONL when its first
non-blank line starts with "{".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specdec_cli.errors import SpecdecError, read_text

DEFAULT_CATEGORY = "default"  # for prompts whose file gives no category


@dataclass(frozen=True)
class Prompt:
    """One benchmark item; several turns make a multi-turn conversation.

    The benchmark feeds the model's own answer to turn k back before turn k+1.
    """

    id: str
    category: str
    turns: tuple[str, ...]


def load_prompts(path: Path) -> list[Prompt]:
    """Read prompts from `path`; any problem raises SpecdecError naming the file and line (or row)."""
    if path.suffix == ".parquet":
        rows = parquet_rows(path)
        return _checked(
            [(f"{path}: row {i}", _from_object(row, i, f"{path}: row {i}")) for i, row in enumerate(rows, 1)], str(path)
        )
    text = read_text("prompt file", path)
    if path.suffix == ".jsonl":
        is_jsonl = True
    elif path.suffix == ".txt":
        is_jsonl = False
    else:
        first = next((line for line in text.splitlines() if line.strip()), "")
        is_jsonl = first.lstrip().startswith("{")
    return _parse(text, str(path), is_jsonl)


def builtin_suite() -> list[Prompt]:
    """The suite shipped in specdec_cli/bench/data/benchmark_prompts.jsonl (Spec-Bench format)."""
    data = resources.files("specdec_cli.bench") / "data" / "benchmark_prompts.jsonl"
    return _parse(data.read_text(encoding="utf-8"), "benchmark_prompts.jsonl", is_jsonl=True)


def training_prompts() -> list[Prompt]:
    """Prompts for `specdec distill`, disjoint from the benchmark suite (a test checks it)."""
    data = resources.files("specdec_cli.bench") / "data" / "training_prompts.txt"
    return _parse(data.read_text(encoding="utf-8"), "training_prompts.txt", is_jsonl=False)


def select(prompts: list[Prompt], category: str | None, limit: int | None) -> list[Prompt]:
    """Keep prompts of `category` (all if None), then the first `limit` of each category.

    The limit applies per category, not overall, so that a small --limit still exercises
    every kind of task; file order is kept.
    """
    if category is not None:
        known = sorted({p.category for p in prompts})
        if category not in known:
            raise SpecdecError(f"unknown category {category!r}; known: {', '.join(known)}")
        prompts = [p for p in prompts if p.category == category]
    if limit is None:
        return list(prompts)
    if limit < 1:
        raise SpecdecError(f"limit must be at least 1, got {limit}")
    taken: dict[str, int] = {}
    chosen: list[Prompt] = []
    for p in prompts:
        if taken.get(p.category, 0) < limit:
            taken[p.category] = taken.get(p.category, 0) + 1
            chosen.append(p)
    return chosen


def parquet_rows(path: Path) -> list[dict]:
    """A Parquet file's rows as dicts."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise SpecdecError(f"{path}: reading Parquet needs pyarrow: pip install 'specdec[parquet]'") from None
    try:
        return pyarrow.parquet.read_table(path).to_pylist()
    except (OSError, ValueError, pyarrow.ArrowException) as exc:
        raise SpecdecError(f"{path}: not a readable Parquet file: {exc}") from None


def _parse(text: str, name: str, is_jsonl: bool) -> list[Prompt]:
    prompts = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        if is_jsonl:
            prompt = _from_object(_json_object(line, where), lineno, where)
        else:
            prompt = Prompt(str(lineno), DEFAULT_CATEGORY, (line.strip(),))
        prompts.append((where, prompt))
    return _checked(prompts, name)


def _checked(prompts: list[tuple[str, Prompt]], name: str) -> list[Prompt]:
    """The prompts, each with where it was read, once it is sure their ids differ and there are some."""
    seen: set[str] = set()
    for where, prompt in prompts:
        if prompt.id in seen:
            raise SpecdecError(f"{where}: duplicate prompt id {prompt.id!r}")
        seen.add(prompt.id)
    if not prompts:
        raise SpecdecError(f"{name}: no prompts found")
    return [prompt for _, prompt in prompts]


def _json_object(line: str, where: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{where}: malformed JSON ({e.msg})") from None


def _from_object(obj: object, lineno: int, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise SpecdecError(f"{where}: expected a JSON object")
    if "turns" in obj:  # Spec-Bench
        for field in ("question_id", "category"):
            if field not in obj:
                raise SpecdecError(f"{where}: missing field {field!r}")
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns:
            raise SpecdecError(f"{where}: 'turns' must be a non-empty list of strings")
        prompt_id, category = obj["question_id"], obj["category"]
    elif "prompt" in obj:
        turns = [obj["prompt"]]
        prompt_id = obj.get("id", str(lineno))
        category = obj.get("category", DEFAULT_CATEGORY)
    else:
        raise SpecdecError(f"{where}: missing field 'prompt' (or Spec-Bench 'turns')")
    # Spec-Bench's own question ids are integers.
    if isinstance(prompt_id, bool) or not isinstance(prompt_id, (str, int)):
        raise SpecdecError(f"{where}: id must be a string or integer")
    if not isinstance(category, str) or not category.strip():
        raise SpecdecError(f"{where}: category must be a non-empty string")
    for turn in turns:
        if not isinstance(turn, str):
            raise SpecdecError(f"{where}: prompt text must be a string, got {type(turn).__name__}")
        if not turn.strip():
            raise SpecdecError(f"{where}: empty prompt text")
    return Prompt(str(prompt_id), category, tuple(turns))
