"""scripts/check_cuda.py's dry run: every step of the GPU check, on the CPU at tiny sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_cuda_check_runs_on_the_cpu_at_tiny_sizes(tmp_path):
    done = subprocess.run(
        [sys.executable, "scripts/check_cuda.py", "--dry-run", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert [row["status"] for row in summary["steps"]] == ["PASS"] * 7
    shapes = json.loads((tmp_path / "random_shapes.json").read_text())
    drafts = [row for row in shapes["speculative"] if "speedup" in row]
    assert {row["draft"] for row in drafts} == {"eagle3-shaped", "1b-shaped"}
    # the agreement knob sets acceptance, and the output stays the target's own
    assert all(row["same_tokens_as_target_alone"] and row["mean_accepted_length"] > 1.5 for row in drafts)
