#!/usr/bin/env python3
"""Check specdec's CUDA path end to end on a machine with an NVIDIA GPU, and print one summary.

    python scripts/check_cuda.py            # with specdec installed (pip install -e '.[test]')

It runs the CUDA-marked tests (among them the decode loop of every drafter under
`torch.cuda.set_sync_debug_mode("error")`, and timing on cuda:1 where there are two GPUs), then
generate, verify-distribution and benchmark on the tiny random pair and on the default SmolLM2 pair
(bfloat16 and CUDA-event timing, the defaults on CUDA; batches of 1 and 4), and prints a table of
what passed with tokens/s, speedup and acceptance. Exit 0 when all passed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPECDEC = [sys.executable, "-m", "specdec_cli"]


def run(name: str, command: list[str]) -> tuple[str, bool, float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    ok = done.returncode == 0
    if not ok:
        print(f"--- {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
    return name, ok, seconds, done.stdout


def generate_figures(out: str) -> str:
    s = json.loads(out)["stats"]
    return (
        f"{s['tokens_per_second']:.1f} tok/s, {s['mean_accepted_length']:.2f} tokens/forward, "
        f"acceptance {s['acceptance_rate'] or 0:.0%}"
    )


def verify_figures(out: str) -> str:
    summary = json.loads(out)["summary"]
    return f"{summary['passed']} passed, {summary['failed']} failed, {summary['not_run']} not run"


def benchmark_figures(out: str) -> str:
    rows = json.loads(out)["batch_summary"]
    return "; ".join(
        f"batch {r['batch_size']}, T={r['temperature']:g}: {r['baseline_tokens_per_second'][0]:.1f} -> "
        f"{r['speculative_tokens_per_second'][0]:.1f} tok/s ({r['speedup'][0]:.2f}x), "
        f"{r['mean_accepted_length']:.2f} tokens/forward"
        for r in rows
    )


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("No CUDA GPU: nothing to check (torch " + torch.__version__ + ")", file=sys.stderr)
        return 2
    tests = [sys.executable, "-m", "pytest", "-q", "-m", "cuda"]
    steps = [
        ("CUDA tests", [*tests, "tests"], None),
        # every drafter, batches of 4, greedy and sampled, under set_sync_debug_mode("error")
        ("one sync per block (sync debug mode)", [*tests, "tests/test_host_syncs.py"], None),
    ]
    if torch.cuda.device_count() > 1:  # timing and placement on a GPU that is not the current one
        steps.append(
            (
                "cuda:1: generate",
                SPECDEC + ["generate", "-c", "tiny-random", "--device", "cuda:1", "--json", "--prompt", "Hi"],
                generate_figures,
            )
        )
    for config, samples, tokens in (("tiny-random", "300", "64"), ("smollm2-draft", "150", "128")):
        common = ["-c", config, "--device", "cuda", "--json"]
        steps += [
            (
                f"{config}: generate",
                SPECDEC + ["generate", *common, "--prompt", "Explain KV caches briefly.", "--max-new-tokens", tokens],
                generate_figures,
            ),
            (
                f"{config}: verify-distribution",
                SPECDEC + ["verify-distribution", *common, "--samples", samples],
                verify_figures,
            ),
            (
                f"{config}: benchmark",
                SPECDEC + ["benchmark", *common, "--limit", "1", "--max-new-tokens", tokens],
                benchmark_figures,
            ),
        ]
    rows = []
    for name, command, figures in steps:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        name, ok, seconds, out = run(name, command)
        detail = out.strip().splitlines()[-1] if figures is None and out.strip() else ""
        if ok and figures is not None:
            detail = figures(out)
        rows.append((name, ok, seconds, detail))
    print(f"\nspecdec CUDA check: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    for name, ok, seconds, detail in rows:
        print(f"{'PASS' if ok else 'FAIL'}  {name:34s} {seconds:6.1f} s  {detail}")
    return 0 if all(ok for _, ok, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
