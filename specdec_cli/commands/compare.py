"""`specdec compare`: two benchmark records side by side, as a table and as charts; runs nothing."""

from __future__ import annotations

import json
from pathlib import Path

from specdec_cli import display, records
from specdec_cli.bench import charts
from specdec_cli.bench.report import chart_links, compare_report, markdown, rich_table
from specdec_cli.errors import SpecdecError, read_text

# what compare reads of a record, by type; the optional fields are missing from records written
# before they existed
REQUIRED = {"name": str, "timestamp": str, "summary": list}
OPTIONAL = {"config": dict, "settings": dict, "batch_summary": (list, type(None)), "peers": (list, type(None))}
ROW = {"group": str, "temperature": (int, float), "num_draft_tokens": int}
BATCH_ROW = {"batch_size": int, "temperature": (int, float), "num_draft_tokens": int}


def load_record(path: Path) -> dict:
    """A benchmark record.json, or the run folder holding one; a file that is not one is refused."""
    file = path / "record.json" if path.is_dir() else path
    try:
        record = json.loads(read_text("benchmark record", file))
    except json.JSONDecodeError as exc:
        raise SpecdecError(f"benchmark record {file} is not JSON: {exc}") from None
    if not isinstance(record, dict) or record.get("command") != "benchmark":
        raise SpecdecError(f"{file} is not a benchmark record")
    problem = shape_problem(record)
    if problem:
        raise SpecdecError(f"benchmark record {file} is damaged: {problem}")
    record["batch_summary"] = record.get("batch_summary") or []
    record["peers"] = record.get("peers") or []
    # a record from before rows named their rule verified every sampled chain by the config's
    rule = record.get("config", {}).get("speculation", {}).get("verification", "token")
    for row in record["summary"] + record["batch_summary"]:
        row.setdefault(
            "verification",
            rule if row["temperature"] > 0 and row["num_draft_tokens"] and not row.get("tree") else "token",
        )
    return record


def shape_problem(record: dict) -> str | None:
    """What in `record` is not as compare reads it, or None."""
    for key, kind in REQUIRED.items():
        if not isinstance(record.get(key), kind):
            return f"`{key}` is missing or of the wrong type"
    for key, kind in OPTIONAL.items():
        if key in record and not isinstance(record[key], kind):
            return f"`{key}` is of the wrong type"
    for table, fields in (("summary", ROW), ("batch_summary", BATCH_ROW)):
        for i, row in enumerate(record.get(table) or []):
            if not isinstance(row, dict) or not all(isinstance(row.get(key), kind) for key, kind in fields.items()):
                return f"{table} row {i} lacks one of {', '.join(fields)}, or has it of the wrong type"
    return None


def compare(a: Path, b: Path, run: records.Run) -> None:
    """Print the table of A and B and write it, with both records' charts side by side, to a run folder
    runs/<time>-compare-<A's name>-vs-<B's name>/."""
    record_a, record_b = load_record(a), load_record(b)
    table = compare_report(record_a, record_b, (f"A: {a}", f"B: {b}"))
    record = {
        "command": "compare",
        "timestamp": records.timestamp(),
        "a": str(a),
        "b": str(b),
        "header": table.header,
        "rows": table.rows,
    }
    files = (
        charts.draw([(f"A: {charts.heading(record_a)}", record_a), (f"B: {charts.heading(record_b)}", record_b)])
        if run.recording
        else {}
    )
    report = "\n".join(["# specdec compare", "", *chart_links(list(files)), markdown(table)])
    name = f"{record_a['name']}-vs-{record_b['name']}"
    run.finish(
        "compare",
        name,
        record,
        lambda: display.stdout.print(rich_table(table)),
        {"report.md": report, **files},
    )
