"""The protocol of specdec's engine workers (vllm_engine/worker.py, llamacpp_engine/worker.py): one
JSON object per line each way. They run in their engines' own environments, where specdec is not
installed, and import this file by its path: standard library only."""

import json
import os
import sys


def reply(protocol, message: dict) -> None:
    protocol.write(json.dumps(message) + "\n")
    protocol.flush()


def run(serve) -> None:
    """Call `serve(protocol)`, the replies on stdout alone: whatever else writes there (the engine's
    logs, its child processes, which inherit the descriptor) goes to stderr. Any failure is one
    {"error": ...} line and exit code 2."""
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        serve(protocol)
    except Exception as exc:  # noqa: BLE001 -- any failure of the engine's is reported as one line
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reply(protocol, {"error": f"{type(exc).__name__}: {' '.join(lines[:3])}".strip()})
        sys.exit(2)
