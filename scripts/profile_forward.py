"""Where a decoding token's time goes: the machine's read bandwidth, then torch's profiler over 64
target-alone tokens of the default pair's target, with float and int4 weights (2 threads).

    python scripts/profile_forward.py
"""

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specdec_cli.bench.bandwidth import read_bandwidth
from specdec_cli.bench.prompts import load_prompts
from specdec_cli.config import load_config
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.pair import load_pair

PROMPTS = Path(__file__).parents[1] / "docs/experiments/data/unseen-13.jsonl"


def main() -> None:
    torch.set_num_threads(2)
    print(f"read bandwidth (torch sum over 512 MiB, 2 threads): {read_bandwidth(torch.device('cpu')) / 1e9:.1f} GB/s")
    prompt = load_prompts(PROMPTS)[0].turns[0]
    for weights in ("float", "int4"):
        cfg = load_config("smollm2-draft")
        cfg.runtime.weights, cfg.runtime.threads = weights, 2
        pair = load_pair(cfg)
        ids = pair.encode(prompt)
        decoder = pair.decoder(SamplingParams(temperature=0.0), speculative=False)
        decoder.generate(ids, 16, 0)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            result = decoder.generate(ids, 64, 0)
        seconds = result.decode_seconds / len(result.token_ids)
        print(f"{weights}: {1 / seconds:.1f} tok/s, {seconds * 1e3:.1f} ms a token")
        print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))


if __name__ == "__main__":
    main()
