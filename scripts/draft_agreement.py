"""Held-out agreement of saved feature drafts on the same answers: what `specdec distill` prints while
training, for drafts trained apart (another corpus, other taps, the shipped one), side by side.

    python scripts/draft_agreement.py --work drafts/2m/distill-work --drafts drafts/2m smollm2-135m-instruct-draft

`--work` is a distill work folder kept with `--keep-work`: its first label shard holds the answers held
out there (with `--training-tokens`, exactly the held-out answers; otherwise the first 256 answers).
With `--answers FILE` (distill's `--answers` format), `--count` answers spread over that file are
labelled by the target into `--work` first (kept there for the next run): answers to prompts no
draft trained on, such as specdec_cli/drafts/smollm2-135m-instruct-answers-new-prompts.jsonl.gz.
Each draft reads the target states it was trained on; they are computed here, in the work folder's
dtype, so drafts reading other taps compare on the same answers. Prints one line per draft: greedy
agreement and expected acceptance at T=1 per draft position, and the vocabulary's coverage.

    python scripts/draft_agreement.py --work /tmp/new-prompts --drafts smollm2-135m-instruct-draft drafts/2m \
        --answers specdec_cli/drafts/smollm2-135m-instruct-answers-new-prompts.jsonl.gz
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec_cli.config import ModelSpec, load_config
from specdec_cli.distill.corpus import SHARD, label_answers, read_answers, target_states
from specdec_cli.distill.settings import DistillSettings
from specdec_cli.distill.state import load_kept
from specdec_cli.distill.train import evaluate, format_eval
from specdec_cli.loading.target_states import target_layers
from specdec_cli.loading.tokens import padding_id
from specdec_cli.pair import load_checkpoint, resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="a distill work folder (--keep-work)")
    parser.add_argument("--drafts", nargs="+", required=True, help="draft folders or built-in draft names")
    parser.add_argument("--answers", type=Path, help="answers to label into --work first (JSON lines, .gz or not)")
    parser.add_argument("--count", type=int, default=SHARD, help="with --answers: how many, spread over the file")
    parser.add_argument("--config", default="smollm2-draft", help="the config whose target the drafts are for")
    parser.add_argument("--dtype", default="bfloat16", help="the target's dtype (the labels' is the work folder's)")
    parser.add_argument("--positions", type=int, default=3, help="draft positions measured")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    target, tokenizer = load_checkpoint(cfg.target, torch.device("cpu"), dtype)
    pad = padding_id(tokenizer)
    if args.answers:
        given = read_answers(args.answers, tokenizer, DistillSettings().answer_tokens)
        count = min(args.count, len(given), SHARD)
        spread = [given[i * len(given) // count] for i in range(count)]
        args.work.mkdir(parents=True, exist_ok=True)
        label_answers(target, spread, pad, DistillSettings().top_k, args.work, (-1,))
    heldout = load_kept(args.work / "labels-00000.pt")
    vocab_size = target.get_output_embeddings().weight.shape[0]
    autocast = None if dtype == torch.float32 else dtype
    for name in args.drafts:
        draft, _ = load_checkpoint(ModelSpec(checkpoint=name), torch.device("cpu"), dtype, target=target)
        states = target_states(target, heldout, pad, target_layers(draft))
        answers = [a | {"features": s} for a, s in zip(heldout, states)]
        to_subset = torch.full((vocab_size,), -1, dtype=torch.long)
        to_subset[draft.lm_head.token_ids] = torch.arange(len(draft.lm_head.token_ids))
        with torch.no_grad():
            figures = evaluate(draft.eval(), answers, pad, to_subset, autocast, args.positions)
        print(f"{name}: {format_eval({'step': 'final', **figures})}")
        print(json.dumps({"draft": name, "heldout_answers": len(heldout), **figures}))


if __name__ == "__main__":
    main()
