"""`specdec compare`: two benchmark records side by side, as a table and as charts; runs nothing."""

from __future__ import annotations

import json
from pathlib import Path

from specdec_cli import display, records
from specdec_cli.bench import charts
from specdec_cli.bench.report import chart_links, compare_report, markdown, rich_table
from specdec_cli.errors import SpecdecError


def load_record(path: Path) -> dict:
    """A benchmark record.json, or the run folder holding one."""
    file = path / "record.json" if path.is_dir() else path
    try:
        record = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecdecError(f"cannot read benchmark record {file}: {exc}") from None
    if record.get("command") != "benchmark":
        raise SpecdecError(f"{file} is not a benchmark record")
    # a record from before rows named their rule verified every sampled chain by the config's
    rule = record.get("config", {}).get("speculation", {}).get("verification", "token")
    for row in record["summary"] + (record.get("batch_summary") or []):
        row.setdefault(
            "verification",
            rule if row["temperature"] > 0 and row["num_draft_tokens"] and not row.get("tree") else "token",
        )
    return record


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
