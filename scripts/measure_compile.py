#!/usr/bin/env python3
"""Does torch.compile pay for the decode loop? Target-only and speculative decoding of the same
prompts, eager and with the models' forwards compiled, alternated in one process (eager, compiled,
eager, compiled) so drift shows; compile time is reported apart.

    python scripts/measure_compile.py -c smollm2-draft --dtype float32 --prompts 3 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import transformers

from specdec_cli.bench.prompts import builtin_suite, select
from specdec_cli.config import apply_overrides, load_config
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.pair import cpu_name, load_pair


def tokens_per_second(decoder, prompts, tokens) -> float:
    results = [decoder.generate(ids, tokens, seed=0, ignore_eos=True) for ids in prompts]
    return sum(len(r.token_ids) for r in results) / sum(r.decode_seconds for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default="smollm2-draft")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    config = apply_overrides(load_config(args.config), {"runtime.dtype": args.dtype, "runtime.device": "cpu"})
    pair = load_pair(config)
    prompts = [pair.encode(p.turns[0]) for p in select(builtin_suite(), None, 1)[: args.prompts]]  # one per category
    params = SamplingParams()
    decoders = {"target only": pair.decoder(params, speculative=False), "speculative": pair.decoder(params)}
    models = [pair.target.model] + [m for m in (getattr(pair.drafter, "model", None),) if m is not None]
    models = [getattr(m, "model", m) for m in models]  # CachedModel -> its PreTrainedModel
    eager = [m.forward for m in models]
    compiled = [torch.compile(f, dynamic=True) for f in eager]

    def use(forwards):
        for model, forward in zip(models, forwards):
            model.forward = forward

    use(compiled)
    start = time.perf_counter()
    for decoder in decoders.values():  # every shape the loop meets, compiled once
        tokens_per_second(decoder, prompts, args.tokens)
    compile_seconds = time.perf_counter() - start
    runs = {(mode, name): [] for mode in ("eager", "compiled") for name in decoders}
    for _ in range(args.rounds):
        for mode, forwards in (("eager", eager), ("compiled", compiled)):
            use(forwards)
            for name, decoder in decoders.items():
                runs[mode, name].append(tokens_per_second(decoder, prompts, args.tokens))
    print(
        json.dumps(
            {
                "cpu": cpu_name(),
                "threads": torch.get_num_threads(),
                "dtype": args.dtype,
                "versions": {
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "python": platform.python_version(),
                },
                "config": args.config,
                "prompts": args.prompts,
                "tokens": args.tokens,
                "compile_and_first_pass_seconds": round(compile_seconds, 1),
                "tokens_per_second": {f"{m}, {n}": [round(x, 1) for x in v] for (m, n), v in runs.items()},
                "median": {f"{m}, {n}": round(statistics.median(v), 1) for (m, n), v in runs.items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
