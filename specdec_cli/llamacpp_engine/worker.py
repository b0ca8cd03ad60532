"""Runs inside llama.cpp's own environment (`specdec setup-llamacpp`), started by specdec with that
environment's python and this file's path: it imports only llama-cpp-python, the standard library and
specdec's worker_protocol.py by its path.

Protocol, one JSON object per line, as vLLM's worker. The first line holds `engine`: the GGUF file,
threads, context length and `lookup_tokens` (0: the target alone; else llama.cpp's prompt lookup
drafting that many tokens). The reply is {"ready": true, "version": ..., "buffers": ...}. Every later
line holds `prompt` (token ids) and `sampling`; the reply holds the new token ids, the prompt's
prefill time, the decoding time after it, and each forward's [drafted, accepted, emitted]. End of
input ends the worker; a failure is one {"error": ...} line and exit code 2.

llama.cpp lays quantized weights out again for the CPU's matrix instructions ("extra buffers": AMX,
repacking). On some CPUs a forward of several tokens crashes in those buffers (seen with 0.3.36 on an
Intel Xeon with AMX); a probe in a child process decodes four tokens with them first. Where it does
not come back, the target alone keeps them and takes one token per forward (its prompt too), and
prompt lookup, whose verifications take several, runs without them (`buffers` says which).
"""

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # worker_protocol.py: by its path
from worker_protocol import reply, run  # noqa: E402

PROBE_SECONDS = 120


def load(engine: dict, extra_buffers: bool, one_token: bool = False):
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    defaults = llama_cpp.llama_model_default_params

    def model_params():
        params = defaults()
        params.use_extra_bufts = extra_buffers
        return params

    # Llama() takes its model parameters from this function and has no argument for the buffers
    llama_cpp.llama_cpp.llama_model_default_params = model_params
    llama_cpp.llama.llama_cpp.llama_model_default_params = model_params
    lookup = engine["lookup_tokens"]
    return llama_cpp.Llama(
        engine["gguf"],
        n_ctx=engine["context"],
        n_batch=engine["context"],
        n_ubatch=1 if one_token else 512,  # 512: llama.cpp's own default
        n_threads=engine["threads"],
        n_threads_batch=engine["threads"],
        seed=engine.get("seed", 0),
        # prompt lookup reads every position's logits (without them it fails on prompts longer than n_batch)
        logits_all=bool(lookup),
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup, max_ngram_size=engine["max_n"])
        if lookup
        else None,
        verbose=False,
    )


def extra_buffers_work(gguf: str) -> bool:
    """Whether a forward of several tokens comes back with the extra buffers, in a child process."""
    probe = [sys.executable, __file__, "--probe", gguf]
    try:
        return subprocess.run(probe, capture_output=True, timeout=PROBE_SECONDS).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def probe(gguf: str) -> None:
    llm = load({"gguf": gguf, "context": 64, "threads": 1, "lookup_tokens": 0, "max_n": 0}, extra_buffers=True)
    llm.eval([1, 2, 3, 4])  # a crash ends the process: its exit code says it


def generate(llm, request: dict) -> dict:
    """One prompt: its prefill (all but its last token) timed apart, then decoding from its last token."""
    ids, sampling = request["prompt"], request["sampling"]
    forwards = []  # per eval call: [tokens in it, tokens it gave]
    original_eval = llm.eval

    def counted(tokens):
        forwards.append([len(tokens), 0])
        return original_eval(tokens)

    llm.reset()
    llm.set_seed(request["seed"])
    start = time.perf_counter()
    original_eval(ids[:-1])
    prefill = time.perf_counter() - start
    llm.eval = counted
    tokens, eos = [], set(request["eos"])
    start = time.perf_counter()
    try:
        # the cached prefix is kept: generate() evaluates the prompt's last token onwards
        for token in llm.generate(ids, **sampling):
            forwards[-1][1] += 1
            tokens.append(token)
            if token in eos or len(tokens) == request["max_new_tokens"]:
                break
    finally:
        llm.eval = original_eval
    seconds = time.perf_counter() - start
    steps = [[width - 1, max(given - 1, 0), given] for width, given in forwards if given]
    return {"token_ids": tokens, "prefill_seconds": prefill, "decode_seconds": seconds, "steps": steps}


def serve(protocol) -> None:
    import llama_cpp

    engine = json.loads(sys.stdin.readline())["engine"]
    if extra_buffers_work(engine["gguf"]):
        llm, buffers = load(engine, True), "repacked (llama.cpp's extra buffers)"
    elif not engine["lookup_tokens"]:
        llm = load(engine, True, one_token=True)
        buffers = "repacked, one token per forward, the prompt's too (several crash in them on this CPU)"
    else:
        llm, buffers = load(engine, False), "plain (several tokens per forward crash in the repacked ones on this CPU)"
    reply(protocol, {"ready": True, "version": llama_cpp.__version__, "buffers": buffers})
    for line in sys.stdin:
        if line.strip():
            reply(protocol, generate(llm, json.loads(line)))


def main() -> None:
    run(serve)


if __name__ == "__main__":
    probe(sys.argv[2]) if sys.argv[1:2] == ["--probe"] else main()
