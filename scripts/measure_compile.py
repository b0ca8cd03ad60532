#!/usr/bin/env python3
"""Does a compiled decoding step pay on this CPU? Target-only and speculative decoding of the same
prompts three ways, alternated in one process so drift shows:
- `eager`: the default loop (the attention reads exactly the slots in use);
- `fixed`: the forwards through fixed input tensors, the cache read in steps of KEY_SLOTS_STEP slots,
  as CUDA graphs run them (decoding/graphs.py), still eager;
- `compiled`: the same fixed-shape forwards compiled by inductor (`fullgraph=True, dynamic=False`:
  one graph per input shape, as a CUDA graph would be).
Compile time (the first pass over every shape the loop meets) is reported apart; run the command a
second time to see a warm start from inductor's cache.

    python scripts/measure_compile.py -c smollm2-draft --dtype bfloat16 --prompts 3 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import transformers
from transformers.utils.output_capturing import maybe_install_capturing_hooks

from specdec_cli.bench.prompts import builtin_suite, select
from specdec_cli.config import apply_overrides, load_config
from specdec_cli.decoding.graphs import GraphedForward
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.loading.decode_matmul import PROCESS_CHOICE
from specdec_cli.pair import cpu_name, load_pair


def tokens_per_second(decoder, prompts, tokens) -> tuple[float, list[list[int]]]:
    results = [decoder.generate(ids, tokens, seed=0, ignore_eos=True) for ids in prompts]
    rate = sum(len(r.token_ids) for r in results) / sum(r.decode_seconds for r in results)
    return rate, [r.token_ids for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default="smollm2-draft")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--freezing", action="store_true", help="inductor's weight freezing")
    parser.add_argument("--concat-linear", action="store_true", help="with freezing: fused q/k/v and gate/up")
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    torch._inductor.config.freezing = args.freezing
    torch._inductor.config.cpp.enable_concat_linear = args.concat_linear
    config = apply_overrides(load_config(args.config), {"runtime.dtype": args.dtype, "runtime.device": "cpu"})
    pair = load_pair(config)
    prompts = [pair.encode(p.turns[0]) for p in select(builtin_suite(), None, 1)[: args.prompts]]  # one per category
    params = SamplingParams()
    decoders = {"target only": pair.decoder(params, speculative=False), "speculative": pair.decoder(params)}
    cached = [pair.target] + [m for m in (getattr(pair.drafter, "model", None),) if m is not None]
    for c in cached:  # transformers installs these at the first call for hidden states: not in a graph
        maybe_install_capturing_hooks(c.model)
    modes = {
        "eager": [None for _ in cached],
        "fixed": [GraphedForward(c.step, c.device) for c in cached],
        "compiled": [GraphedForward(torch.compile(c.step, fullgraph=True, dynamic=False), c.device) for c in cached],
    }

    def use(mode):
        for model, graphed in zip(cached, modes[mode]):
            model.graphed = graphed

    use("compiled")
    start = time.perf_counter()
    for decoder in decoders.values():  # every shape the loop meets, compiled once
        tokens_per_second(decoder, prompts, args.tokens)
    compile_seconds = time.perf_counter() - start
    runs = {(mode, name): [] for mode in modes for name in decoders}
    tokens = {}
    for _ in range(args.rounds):
        for mode in modes:
            use(mode)
            for name, decoder in decoders.items():
                rate, tokens[mode, name] = tokens_per_second(decoder, prompts, args.tokens)
                runs[mode, name].append(rate)
    print(
        json.dumps(
            {
                "cpu": cpu_name(),
                "threads": torch.get_num_threads(),
                "dtype": args.dtype,
                "decode_matmul": PROCESS_CHOICE.name(getattr(torch, args.dtype)),
                "freezing": args.freezing,
                "concat_linear": args.concat_linear,
                "versions": {
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "python": platform.python_version(),
                },
                "config": args.config,
                "prompts": args.prompts,
                "tokens": args.tokens,
                "compile_and_first_pass_seconds": round(compile_seconds, 1),
                "graphs_compiled": [g.captures for g in modes["compiled"]],
                "same_tokens_as_eager": {
                    f"{m}, {n}": tokens[m, n] == tokens["eager", n] for m in modes for n in decoders
                },
                "tokens_per_second": {f"{m}, {n}": [round(x, 1) for x in v] for (m, n), v in runs.items()},
                "median": {f"{m}, {n}": round(statistics.median(v), 1) for (m, n), v in runs.items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
