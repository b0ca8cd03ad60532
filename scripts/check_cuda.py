#!/usr/bin/env python3
"""Check specdec's CUDA path on a machine with an NVIDIA GPU in one prepared run, and print one summary.

    python scripts/check_cuda.py [--budget-minutes 8] [--out DIR]
    python scripts/check_cuda.py --dry-run    # the same steps on the CPU at tiny sizes (the tests run it)

specdec runs from this source tree on the packages installed; no step needs a network. Each step is
a subprocess with a time limit, and the run as a whole keeps to the budget: a step that runs out is
reported and the next one runs. The steps:
1. the CUDA-marked tests;
2. the decode loop of every drafter, batches of 4, greedy and sampled, under
   `torch.cuda.set_sync_debug_mode("error")` (tests/test_host_syncs.py);
3. generate (eager, then with CUDA graphs), verify-distribution and benchmark (batch 1 and 4) on the
   tiny random pair;
4. scripts/random_shapes.py: the verification cost by width, eager and CUDA-graph replayed, and
   speculative against target-alone tokens/s beside the prediction, at Llama-3.1-8B shapes.
Exit 0 when every step passed. `--out` keeps each step's output and summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPECDEC = [sys.executable, "-m", "specdec_cli"]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def run(command: list[str], limit: float, env: dict) -> tuple[int | None, str, str]:
    """(exit status, None when it ran out of time; stdout; stderr). The whole process group is
    stopped at the limit, pytest's or specdec's children too."""
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=limit)
        return process.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        return None, out, err


def generate_figures(out: str) -> str:
    s = json.loads(out)["stats"]
    return f"{s['tokens_per_second']:.1f} tok/s, {s['mean_accepted_length']:.2f} tokens/forward"


def verify_figures(out: str) -> str:
    summary = json.loads(out)["summary"]
    return f"{summary['passed']} passed, {summary['failed']} failed, {summary['not_run']} not run"


def benchmark_figures(out: str) -> str:
    rows = json.loads(out)["batch_summary"]
    return "; ".join(
        f"batch {r['batch_size']}, T={r['temperature']:g}: {r['speedup'][0]:.2f}x, "
        f"{r['mean_accepted_length']:.2f} tokens/forward"
        for r in rows
    )


def last_line(out: str) -> str:
    lines = out.strip().splitlines()
    return lines[-1] if lines else ""


def steps(dry_run: bool, out_dir: Path) -> list[tuple[str, list[str], float, object]]:
    """(name, command, time limit in seconds, what to read from its stdout)."""
    device = "cpu" if dry_run else "cuda"
    # the dry run checks that the selections hold tests; on the CPU they would only skip
    collect = ["--collect-only"] if dry_run else []
    shapes = [sys.executable, "scripts/random_shapes.py", "--json", str(out_dir / "random_shapes.json")]
    common = ["-c", "tiny-random", "--device", device, "--json", "--no-record"]
    samples, prompts, tokens = ("40", "1", "8") if dry_run else ("150", "4", "32")
    return [
        (
            "CUDA tests",
            [*PYTEST, *collect, "-m", "cuda", "tests", "--deselect", "tests/test_host_syncs.py"],
            150,
            last_line,
        ),
        (
            "one sync per block (sync debug mode)",
            [*PYTEST, *collect, "-m", "cuda", "tests/test_host_syncs.py"],
            90,
            last_line,
        ),
        (
            "tiny pair: generate",
            [*SPECDEC, "generate", *common, "--prompt", "Explain KV caches."],
            40,
            generate_figures,
        ),
        (
            "tiny pair: generate, CUDA graphs",
            [*SPECDEC, "generate", *common, "--cuda-graphs", "auto", "--prompt", "Explain KV caches."],
            60,
            generate_figures,
        ),
        (
            "tiny pair: verify-distribution",
            [*SPECDEC, "verify-distribution", *common, "--samples", samples],
            120,
            verify_figures,
        ),
        (
            "tiny pair: benchmark, batch 1 and 4",
            [*SPECDEC, "benchmark", *common, "--limit", prompts, "--batch-sizes", "1,4", "--max-new-tokens", tokens],
            60,
            benchmark_figures,
        ),
        ("random weights at 8B shapes", [*shapes, "--dry-run"] if dry_run else shapes, 300, None),
    ]


def shapes_figures(path: Path) -> str:
    result = json.loads(path.read_text())
    longest = max(row["context"] for row in result["verification"])
    widths = {row["width"]: row for row in result["verification"] if row["context"] == longest}
    parts = [
        f"verify width {w} at {row['context']}: {row['eager_ms']:.1f} ms eager, {row['graphs_ms']:.1f} ms graphs"
        for w, row in widths.items()
        if w in (1, min(widths, key=lambda x: abs(x - 5)), max(widths))
    ]
    for row in result["speculative"]:
        if "speedup_over_eager" in row:
            parts.append(f"target alone batch {row['batch']} with graphs: {row['speedup_over_eager']:.2f}x eager")
        if "speedup" in row:
            predicted = row["predicted_speedup"]
            parts.append(f"{row['draft']} batch {row['batch']}: {row['speedup']:.2f}x (predicted {predicted:.2f}x)")
    return "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at tiny sizes")
    parser.add_argument("--budget-minutes", type=float, default=8.0, help="the whole run's limit")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "check-cuda", help="each step's output")
    args = parser.parse_args()

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(f"Error: no CUDA GPU (torch {torch.__version__}); --dry-run checks this on the CPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    deadline = time.monotonic() + 60 * args.budget_minutes
    rows = []
    for index, (name, command, limit, figures) in enumerate(steps(args.dry_run, args.out)):
        left = deadline - time.monotonic()
        if left < 5:
            rows.append({"step": name, "status": "not run: budget spent", "seconds": 0.0, "detail": ""})
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        start = time.monotonic()
        limit = min(limit, left)
        code, out, err = run(command, limit, env)
        seconds = time.monotonic() - start
        (args.out / f"step-{index}.log").write_text(f"$ {' '.join(command)}\n--- stdout\n{out}\n--- stderr\n{err}")
        status = "PASS" if code == 0 else f"FAIL (exit {code})" if code is not None else f"FAIL (over {limit:.0f} s)"
        detail = last_line(err)
        if code == 0:
            try:
                detail = shapes_figures(args.out / "random_shapes.json") if figures is None else figures(out)
            except (ValueError, KeyError, TypeError, OSError):
                pass
        rows.append({"step": name, "status": status, "seconds": seconds, "detail": detail})
    where = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name()
    summary = {"device": where, "torch": torch.__version__, "cuda": torch.version.cuda, "steps": rows}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nspecdec CUDA check: {where}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    for row in rows:
        print(f"{row['status']:24s} {row['step']:38s} {row['seconds']:6.1f} s  {row['detail']}")
    return 0 if all(row["status"] == "PASS" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
