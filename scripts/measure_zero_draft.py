"""What a schedule entry of 0 draft tokens costs against the target alone: the same prompts decoded by
the target-only loop and by the speculative loop whose schedule drafts nothing, in alternating
rounds, at batch 1 and 8 (greedy, 64 new tokens, EOS ignored so every row runs the whole length).

    python scripts/measure_zero_draft.py -c smollm2-draft -c smollm2-ngram
"""

import argparse
import time
from pathlib import Path

import torch

from specdec_cli.bench.prompts import load_prompts
from specdec_cli.config import Schedule, load_config
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.pair import load_pair

PROMPTS = Path(__file__).parents[1] / "docs/experiments/data/unseen-13.jsonl"


def tokens_per_second(decoder, prompts: list[list[int]], batch: int, tokens: int) -> float:
    start, made = time.perf_counter(), 0
    for first in range(0, len(prompts) - batch + 1, batch):
        results = decoder.generate_batch(prompts[first : first + batch], tokens, 0, ignore_eos=True)
        made += sum(len(r.token_ids) for r in results)
    return made / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", action="append", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    texts = [p.turns[0] for p in load_prompts(PROMPTS)][:8]
    print("| config | batch | target alone tok/s | schedule 0 tok/s | schedule 0 / alone |")
    print("|---|---|---|---|---|")
    for name in args.config:
        cfg = load_config(name)
        cfg.runtime.threads = 2
        cfg.speculation.schedule = Schedule(greedy=[[1, 64, 0]])
        pair = load_pair(cfg)
        prompts = [pair.encode(t) for t in texts]
        params = SamplingParams(temperature=0.0)
        decoders = {"alone": pair.decoder(params, speculative=False), "zero": pair.decoder(params)}
        for batch in (1, 8):
            rates = {k: [] for k in decoders}
            tokens_per_second(decoders["zero"], prompts[:batch], batch, 8)  # warm-up
            for _ in range(args.rounds):
                for kind, decoder in decoders.items():
                    rates[kind].append(tokens_per_second(decoder, prompts, batch, args.tokens))
            alone, zero = max(rates["alone"]), max(rates["zero"])
            print(f"| {name} | {batch} | {alone:.1f} | {zero:.1f} | {zero / alone:.3f} |", flush=True)


if __name__ == "__main__":
    main()
