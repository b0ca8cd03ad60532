"""A chain's forwards attending in chunks of a fixed number of tokens (the default on a CPU) against all
tokens at once, in one process, alternating rounds: the 13 unseen prompts, greedy, 128 new tokens,
batch 1, the target alone and the config's speculative decoding, tokens/s (decode) and prompts whose
greedy output equals the target alone's; first, a target forward's time by width (1, 3 and 6 tokens
after a 150-token context, the median of 15 alternating rounds).

    python scripts/measure_attention_chunks.py -c smollm2-draft --weights int4 --rounds 3
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdec_cli.bench.prompts import load_prompts
from specdec_cli.config import load_config
from specdec_cli.decoding import cache
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.pair import cpu_name, load_pair

PROMPTS = Path(__file__).parents[1] / "docs/experiments/data/unseen-13.jsonl"


def decode(decoder, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    tokens, seconds, outputs = 0, 0.0, []
    for ids in prompts:
        result = decoder.generate(ids, 128, 0)
        tokens, seconds = tokens + len(result.token_ids), seconds + result.decode_seconds
        outputs.append(result.token_ids)
    return tokens / seconds, outputs


def forward_costs(target) -> None:
    context = [(7 * i + 3) % 5000 + 100 for i in range(150)]
    target.reset(400)
    target.forward(torch.tensor([context]))
    seconds: dict[tuple[int, int], list[float]] = {}
    in_chunks = cache.DECODING_WIDTH
    for _ in range(15):
        for width in (in_chunks, 0):
            cache.DECODING_WIDTH = width
            for n in (1, 3, 6):
                start = time.perf_counter()
                target.forward(torch.tensor([list(range(200, 200 + n))]))
                seconds.setdefault((width, n), []).append(time.perf_counter() - start)
                target.lengths = [len(context)]  # the block's keys are written over next time
    cache.DECODING_WIDTH = in_chunks
    print("| tokens | in chunks, ms | at once, ms | ratio |\n|---|---|---|---|")
    for n in (1, 3, 6):
        chunked, at_once = (statistics.median(seconds[w, n]) * 1e3 for w in (in_chunks, 0))
        print(f"| {n} | {chunked:.2f} | {at_once:.2f} | {chunked / at_once:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", default="smollm2-draft")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cfg = load_config(args.config)
    cfg.runtime.threads, cfg.runtime.weights = 2, args.weights
    pair = load_pair(cfg)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, {pair.weights} weights, torch {torch.__version__}")
    forward_costs(pair.target)
    prompts = [pair.encode(p.turns[0]) for p in load_prompts(PROMPTS)]
    params = SamplingParams(temperature=0.0)
    alone, speculative = pair.decoder(params, speculative=False), pair.decoder(params)
    speculative.generate(prompts[0], 16, 0)  # warm-up
    print("| round | attention | target alone tok/s | speculative tok/s | speculative / alone | same greedy tokens |")
    print("|---|---|---|---|---|---|")
    in_chunks = cache.DECODING_WIDTH
    for round_ in range(1, args.rounds + 1):
        for width, name in ((in_chunks, f"in chunks of {cache.QUERY_CHUNK}"), (0, "at once")):
            cache.DECODING_WIDTH = width
            alone_rate, alone_out = decode(alone, prompts)
            rate, out = decode(speculative, prompts)
            same = f"{sum(a == b for a, b in zip(alone_out, out))}/{len(prompts)}"
            print(f"| {round_} | {name} | {alone_rate:.1f} | {rate:.1f} | {rate / alone_rate:.3f} | {same} |")


if __name__ == "__main__":
    main()
