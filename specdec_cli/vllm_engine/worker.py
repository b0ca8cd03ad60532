"""Runs inside vLLM's own environment, started by specdec with that environment's python and this
file's path: it imports only vLLM, the standard library and specdec's worker_protocol.py by its path
(specdec is not installed there).

Protocol, one JSON object per line. The first line on stdin holds `engine`, the keyword arguments of
vllm.LLM; the reply is {"ready": true, "version": ...}. Every later line holds `prompts` (token id
lists) and `sampling` (vllm.SamplingParams' arguments); the reply holds per prompt the new token ids
and the per-request speculative decoding metrics, the call's wall time, and the change of vLLM's
`vllm:spec_decode_*` counters. End of input ends the worker. A failure is one {"error": ...} line and
exit code 2. Everything else vLLM writes (its logs, on stdout too) goes to stderr.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # worker_protocol.py: by its path
from worker_protocol import reply, run  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on CPU; vLLM's default is larger


def counters(llm) -> dict:
    """vLLM's speculative decoding counters: name -> value, or a list of values (per draft position)."""
    found = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            found[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", 0)
    return found


def change(before: dict, after: dict) -> dict:
    out = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old or [0] * len(value)
            out[name] = [a - b for a, b in zip(value, old)]
        else:
            out[name] = value - (old or 0)
    return out


def generate(llm, request: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(**request["sampling"], detokenize=False)
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    before = counters(llm)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    outputs = []
    for result in results:
        output = result.outputs[0]
        metrics = output.spec_decode_metrics
        outputs.append(
            {"token_ids": list(output.token_ids), "spec_decode": metrics.to_dict() if metrics is not None else None}
        )
    return {"outputs": outputs, "seconds": seconds, "counters": change(before, counters(llm))}


def serve(protocol) -> None:
    import vllm
    from vllm.platforms import current_platform

    settings = json.loads(sys.stdin.readline())
    llm = vllm.LLM(**settings["engine"])
    reply(protocol, {"ready": True, "version": vllm.__version__, "device": current_platform.device_type})
    for line in sys.stdin:
        if line.strip():
            reply(protocol, generate(llm, json.loads(line)))


def main() -> None:
    run(serve)


if __name__ == "__main__":  # vLLM starts its engine in processes that import this file again
    main()
