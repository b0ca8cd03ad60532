#!/usr/bin/env python3
"""Which CPU matrix product decodes fastest end to end? Target-only and speculative decoding of the
same prompts with each product of loading/decode_matmul.py serving the models' linear layers, in
rounds within one process (so drift shows), with the tokens of each product compared. `--fusion`
instead times the target's layers' products alone, each way, with q/k/v and gate/up as separate
products and as one product over the concatenated weights (as vLLM fuses them).

    python scripts/measure_matmuls.py -c smollm2-draft --dtype bfloat16 --prompts 4 --tokens 64
    python scripts/measure_matmuls.py -c smollm2-ngram --dtype float32 --prompts 4 --batch 4
    python scripts/measure_matmuls.py -c smollm2-draft --dtype bfloat16 --fusion
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
from specdec_cli.loading.decode_matmul import (
    F_LINEAR,
    PACKED,
    PROCESS_CHOICE,
    TURNED,
    Chosen,
    detour,
    pack,
    packed_linear,
)
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
    if args.fusion:
        print(json.dumps({**environment, "rows": fusion_rows(load_pair(config).target.model, dtype)}, indent=1))
        return
    PROCESS_CHOICE.chosen[dtype] = Chosen(PACKED, PACKED)  # every model gets its prepacked copies
    pair = load_pair(config)
    prompts = [pair.encode(p.turns[0]) for p in select(builtin_suite(), None, 1)[: args.prompts]]
    decoders = {
        "target only": pair.decoder(SamplingParams(), speculative=False),
        "speculative": pair.decoder(SamplingParams()),
    }
    products = [Chosen(F_LINEAR, F_LINEAR), Chosen(TURNED, F_LINEAR), Chosen(TURNED, PACKED), Chosen(PACKED, PACKED)]
    batches = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    speeds = {(product, name): [] for product in products for name in decoders}
    tokens = {}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for product in products:
            PROCESS_CHOICE.chosen[dtype] = product
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
        for name in decoders
    ]
    settings = {"prompts": len(prompts), "tokens": args.tokens, "batch": args.batch}
    print(json.dumps({**environment, **settings, "rows": rows}, indent=1))


def fusion_rows(model: torch.nn.Module, dtype: torch.dtype, repeats: int = 30) -> list[dict]:
    """Milliseconds per forward for the layers' projections at 1 and 5 token rows, each way, separate
    and fused (median of `repeats` passes over every layer)."""
    groups = {"separate": [], "fused": []}
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections = [attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj]
        rest = [attention.o_proj.weight, mlp.down_proj.weight]
        groups["separate"] += [p.weight for p in projections] + rest
        groups["fused"] += [
            torch.cat([p.weight for p in projections[:3]]),
            torch.cat([p.weight for p in projections[3:]]),
        ]
        groups["fused"] += rest
    ways = {F_LINEAR: lambda x, w, p: torch.nn.functional.linear(x, w), TURNED: lambda x, w, p: detour(x, w)}
    ways[PACKED] = lambda x, w, p: packed_linear(x, p)
    out = []
    with torch.no_grad():
        for grouping, weights in groups.items():
            packed = [pack(w) for w in weights]
            for rows in (1, 5):
                inputs = {w.shape[1]: torch.randn(1, rows, w.shape[1], dtype=dtype) for w in weights}
                for way, product in ways.items():
                    times = []
                    for _ in range(repeats + 3):
                        start = time.perf_counter()
                        for w, p in zip(weights, packed):
                            product(inputs[w.shape[1]], w, p)
                        times.append(time.perf_counter() - start)
                    ms = 1000 * statistics.median(times[3:])
                    out.append({"projections": grouping, "rows": rows, "product": way, "ms": round(ms, 3)})
    return out


if __name__ == "__main__":
    main()
