"""What a llama.cpp forward of n tokens costs against one token, on plain and repacked weight buffers:
what speculative decoding over llama.cpp's forward could gain on this machine. Run with llama.cpp's
python (specdec setup-llamacpp):

    ~/.cache/specdec/llamacpp-venv/bin/python scripts/llamacpp_forward_widths.py FILE.gguf

Each width: a 160-token context, then the width's tokens evaluated and removed again, the best of 30.
Repacked buffers where a forward of several tokens crashes in them: one token per forward only.
"""

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "specdec_cli" / "llamacpp_engine"))
from worker import load  # noqa: E402  (the peer's own loading, by its path)

WIDTHS = (1, 2, 3, 4, 6, 8)
CONTEXT, REPEATS = 160, 30


def model(gguf: str, extra_buffers: bool, one_token: bool):
    engine = {"gguf": gguf, "context": 512, "threads": 2, "lookup_tokens": 0, "max_n": 0}
    return load(engine, extra_buffers, one_token)


def seconds(llm, width: int) -> float:
    llm.reset()
    llm.eval([(7 * i) % 1000 + 10 for i in range(CONTEXT)])
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        llm.eval([(13 * i) % 1000 + 10 for i in range(width)])
        best = min(best, time.perf_counter() - start)
        llm.n_tokens = CONTEXT
        llm._ctx.kv_cache_seq_rm(-1, CONTEXT, -1)
    return best


def main(gguf: str, mode: str | None) -> None:
    if mode is not None:  # a child: one buffer mode, its widths as "width seconds" lines
        extra, one_token = mode != "plain", mode == "repacked-1"
        llm = model(gguf, extra, one_token)
        for width in (1,) if one_token else WIDTHS:
            print(width, seconds(llm, width), flush=True)
        return
    print("| buffers | " + " | ".join(f"{w} tokens" for w in WIDTHS) + " |")
    print("|---|" + "---|" * len(WIDTHS))
    for mode in ("plain", "repacked", "repacked-1"):
        done = subprocess.run([sys.executable, __file__, gguf, mode], capture_output=True, text=True)
        found = dict(line.split() for line in done.stdout.splitlines())
        cells = [f"{float(found[str(w)]) * 1e3:.2f} ms" if str(w) in found else "-" for w in WIDTHS]
        crashed = " (crashed)" if done.returncode else ""
        print(f"| {mode}{crashed} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
