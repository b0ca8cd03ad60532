"""llama.cpp beside specdec on the same GGUF and the same chat-templated prompt ids, greedy, batch 1.

    python scripts/measure_llamacpp.py --gguf FILE --prompts docs/experiments/data/unseen-13.jsonl \
        --llamacpp-python ~/.cache/specdec/llamacpp-venv/bin/python -c smollm2-draft --weights float,int8,int4

First llama.cpp (llama-cpp-python, in its own environment: this file runs there too, as the worker)
decodes every prompt with the target alone and with its prompt lookup; then, in this process, specdec
decodes them with the target alone and with the config's drafting, for each --weights. One process
decodes at a time. Decode tokens/s counts every new token over the time after the prompt's prefill
(the prompt but its last token), as specdec's records do; a forward is one llama.cpp eval call or one
specdec target forward. Prints a markdown table and writes the figures as JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# llama.cpp's modes: (name, prompt lookup, its repacked/AMX weight buffers). With those buffers, a
# forward of more than one token crashed (segfault in llama_decode) on an Intel Xeon with AMX: there
# the prompt goes in one token at a time, and prompt lookup, whose verification forwards several
# tokens, runs without them, beside the target alone without them.
MODES = [("alone", False, True), ("alone, plain buffers", False, False), ("lookup, plain buffers", True, False)]


def worker() -> None:
    """In llama.cpp's environment: settings on stdin, the results of every mode as JSON on stdout."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    default_params = llama_cpp.llama_model_default_params
    settings = json.loads(sys.stdin.read())
    results = {}
    for mode, lookup, extra_buffers in MODES:

        def model_params(extra_buffers=extra_buffers):
            params = default_params()
            params.use_extra_bufts = extra_buffers
            return params

        llama_cpp.llama_cpp.llama_model_default_params = model_params  # what Llama() reads
        llama_cpp.llama.llama_cpp.llama_model_default_params = model_params
        llm = llama_cpp.Llama(
            settings["gguf"],
            n_ctx=settings["context"],
            n_threads=settings["threads"],
            n_threads_batch=settings["threads"],
            n_batch=settings["context"] if not extra_buffers else 1,
            logits_all=lookup,  # its drafter reads every position's logits
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=settings["lookup_tokens"]) if lookup else None,
            verbose=False,
        )
        evals = []
        original = llm.eval

        def counted(tokens, original=original, evals=evals):
            evals.append(len(tokens))
            return original(tokens)

        llm.eval = counted
        rows = []
        for ids in [settings["prompts"][0]] + settings["prompts"]:  # the first again as a warm-up
            llm.reset()
            llm.eval(ids[:-1])
            evals.clear()
            tokens, start = [], time.perf_counter()
            for token in llm.generate(ids, temp=0.0, top_k=1, reset=False):
                if token in settings["eos"]:
                    break
                tokens.append(token)
                if len(tokens) == settings["max_new_tokens"]:
                    break
            seconds = time.perf_counter() - start
            rows.append({"token_ids": tokens, "seconds": seconds, "forwards": len(evals)})
        results[mode] = rows[1:]
        del llm
    print(json.dumps({"version": llama_cpp.__version__, "results": results}))


def specdec_runs(config: str, weights: list[str], threads: int, encoded, max_new_tokens: int) -> dict:
    import torch

    from specdec_cli.config import load_config
    from specdec_cli.decoding.params import SamplingParams
    from specdec_cli.pair import load_pair

    runs = {}
    for kind in weights:
        cfg = load_config(config)
        cfg.runtime.weights, cfg.runtime.threads = kind, threads
        pair = load_pair(cfg)
        for mode, speculative in (("alone", False), ("speculative", True)):
            decoder = pair.decoder(SamplingParams(temperature=0.0), speculative=speculative)
            rows = []
            for ids in [encoded[0]] + encoded:  # the first again as a warm-up
                result = decoder.generate(ids, max_new_tokens, 0)
                rows.append(
                    {"token_ids": result.token_ids, "seconds": result.decode_seconds, "forwards": len(result.steps)}
                )
            runs[f"specdec {kind} {mode}"] = rows[1:]
        del pair
        torch.set_num_threads(threads)
    return runs


def summary(name: str, rows: list[dict], reference: list[dict]) -> str:
    rates = [len(r["token_ids"]) / r["seconds"] for r in rows]
    per_forward = sum(len(r["token_ids"]) for r in rows) / sum(r["forwards"] for r in rows)
    same = sum(r["token_ids"] == ref["token_ids"] for r, ref in zip(rows, reference))
    return (
        f"| {name} | {statistics.median(rates):.1f} | {min(rates):.1f}-{max(rates):.1f} | {per_forward:.2f} "
        f"| {same}/{len(rows)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--llamacpp-python", required=True)
    parser.add_argument("-c", "--config", default="smollm2-draft")
    parser.add_argument("--weights", default="float,int4")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lookup-tokens", type=int, default=10)
    parser.add_argument("--out", default="llamacpp-beside.json")
    args = parser.parse_args()

    from specdec_cli.bench.prompts import load_prompts
    from specdec_cli.config import load_config
    from specdec_cli.loading.checkpoints import load_tokenizer
    from specdec_cli.loading.tokens import encode_prompt

    cfg = load_config(args.config)
    tokenizer, eos = load_tokenizer(cfg.target)
    encoded = [encode_prompt(tokenizer, p.turns[0]) for p in load_prompts(Path(args.prompts))]
    settings = {
        "gguf": args.gguf,
        "prompts": encoded,
        "eos": sorted(eos),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "context": 2048,
        "lookup_tokens": args.lookup_tokens,
    }
    done = subprocess.run(
        [args.llamacpp_python, __file__, "--worker"], input=json.dumps(settings), capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"llama.cpp worker failed: {done.stderr[-2000:]}")
    llamacpp = json.loads(done.stdout)
    runs = {f"llama.cpp {mode}": rows for mode, rows in llamacpp["results"].items()}
    runs.update(specdec_runs(args.config, args.weights.split(","), args.threads, encoded, args.max_new_tokens))
    print(f"llama-cpp-python {llamacpp['version']}, {len(encoded)} prompts, greedy, {args.max_new_tokens} tokens")
    print("| engine, weights, mode | decode tok/s (median) | range | tokens per forward | same tokens as alone |")
    print("|---|---|---|---|---|")
    for name, rows in runs.items():
        alone = runs[name.replace("speculative", "alone").replace("lookup", "alone")]  # same weights and buffers
        print(summary(name, rows, alone))
    with open(args.out, "w") as file:
        json.dump({"settings": {**settings, "prompts": len(encoded)}, "runs": runs}, file)


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
