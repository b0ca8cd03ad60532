#!/usr/bin/env python3
"""Which CPU matrix product decodes fastest end to end? Target-only and speculative decoding of the
same prompts with each product of loading/decode_matmul.py serving the models' linear layers, in
rounds within one process (so drift shows), with the tokens of each product compared. `--fusion`
instead compares sibling projections (q/k/v, gate/up) taken as one product, as loading takes them,
with separate products, the process's chosen product serving both.

    python scripts/measure_matmuls.py -c smollm2-draft --dtype bfloat16 --prompts 4 --tokens 64
    python scripts/measure_matmuls.py -c smollm2-ngram --dtype float32 --prompts 4 --batch 4
    python scripts/measure_matmuls.py -c smollm2-draft --dtype bfloat16 --fusion
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
import transformers

from specdec_cli.bench.prompts import builtin_suite, select
from specdec_cli.config import apply_overrides, load_config
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.loading import decode_matmul
from specdec_cli.loading.decode_matmul import F_LINEAR, MKL_PACKED, PACKED, PROCESS_CHOICE, TRANSPOSED, Chosen
from specdec_cli.pair import cpu_name, load_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default="smollm2-draft")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="decode the prompts in batches of this size")
    parser.add_argument("--fusion", action="store_true")
    args = parser.parse_args()
    config = apply_overrides(load_config(args.config), {"runtime.dtype": args.dtype, "runtime.device": "cpu"})
    dtype = getattr(torch, args.dtype)
    environment = {
        "config": args.config,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    texts = [p.turns[0] for p in select(builtin_suite(), None, 1)[: args.prompts]]  # one per category
    settings = {"prompts": len(texts), "tokens": args.tokens, "batch": args.batch}
    if args.fusion:
        rows = fusion_rows(config, texts, args)
        environment["decode_matmul"] = PROCESS_CHOICE.name(dtype)
        print(json.dumps({**environment, **settings, "rows": rows}, indent=1))
        return
    products = [
        Chosen(F_LINEAR, F_LINEAR),
        Chosen(TRANSPOSED, F_LINEAR),
        Chosen(TRANSPOSED, PACKED),
        Chosen(PACKED, PACKED),
        Chosen(MKL_PACKED, MKL_PACKED),
    ]
    pairs = {}
    for product in products:
        PROCESS_CHOICE.chosen[dtype] = product  # the pair's models get the copies this product reads
        pairs[product] = load_pair(config)
    prompts = [pairs[products[0]].encode(text) for text in texts]
    batches = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    modes = ("target only", "speculative")
    speeds = {(product, name): [] for product in products for name in modes}
    tokens = {}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for product, pair in pairs.items():
            PROCESS_CHOICE.chosen[dtype] = product
            decoders = {name: pair.decoder(SamplingParams(), speculative=name == "speculative") for name in modes}
            for name, decoder in decoders.items():
                runs = [decoder.generate_batch(batch, args.tokens, seed=0, ignore_eos=True) for batch in batches]
                tokens[product, name] = [r.token_ids for results in runs for r in results]
                if round_index:
                    new_tokens = sum(len(r.token_ids) for results in runs for r in results)
                    speeds[product, name].append(new_tokens / sum(max(r.decode_seconds for r in rs) for rs in runs))
    reference = tokens[products[0], "target only"]
    rows = [
        {
            "product": str(product),
            "mode": name,
            "tok_s": [round(s, 2) for s in speeds[product, name]],
            "median_tok_s": round(statistics.median(speeds[product, name]), 2),
            "prompts_equal_to_f_linear_target_only": sum(a == b for a, b in zip(tokens[product, name], reference)),
        }
        for product in products
        for name in modes
    ]
    print(json.dumps({**environment, **settings, "rows": rows}, indent=1))


def fusion_rows(config, prompts: list[str], args) -> list[dict]:
    """Tokens/s with sibling projections (q/k/v, gate/up) as one product (as loading does) and as
    separate products, two pairs loaded side by side and run in alternating rounds."""
    pairs = {"fused": load_pair(config)}
    names, decode_matmul.SIBLING_NAMES = decode_matmul.SIBLING_NAMES, ()
    pairs["separate"] = load_pair(config)
    decode_matmul.SIBLING_NAMES = names
    speeds, tokens = {}, {}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for grouping, pair in pairs.items():
            ids = [pair.encode(p) for p in prompts]
            batches = [ids[i : i + args.batch] for i in range(0, len(ids), args.batch)]
            for name, speculative in (("target only", False), ("speculative", True)):
                decoder = pair.decoder(SamplingParams(), speculative=speculative)
                runs = [decoder.generate_batch(batch, args.tokens, seed=0, ignore_eos=True) for batch in batches]
                tokens[grouping, name] = [r.token_ids for results in runs for r in results]
                if round_index:
                    new_tokens = sum(len(r.token_ids) for results in runs for r in results)
                    seconds = sum(max(r.decode_seconds for r in rs) for rs in runs)
                    speeds.setdefault((grouping, name), []).append(new_tokens / seconds)
    return [
        {
            "projections": grouping,
            "mode": name,
            "tok_s": [round(s, 2) for s in values],
            "median_tok_s": round(statistics.median(values), 2),
            "prompts_equal_to_separate": sum(a == b for a, b in zip(tokens[grouping, name], tokens["separate", name])),
        }
        for (grouping, name), values in speeds.items()
    ]


if __name__ == "__main__":
    main()
