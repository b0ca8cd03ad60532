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
`--by-confidence` adds, on the greedy answers, the first draft token's agreement by how sure the
target was of its own token (its top-1 probability): whether the draft misses where the target
itself hesitates.

    python scripts/draft_agreement.py --work /tmp/new-prompts --drafts smollm2-135m-instruct-draft drafts/2m \
        --answers specdec_cli/drafts/smollm2-135m-instruct-answers-new-prompts.jsonl.gz
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec_cli.config import ModelSpec, load_config
from specdec_cli.distill.batches import answer_columns, make_batch
from specdec_cli.distill.corpus import SHARD, label_answers, read_answers, target_states
from specdec_cli.distill.settings import DistillSettings
from specdec_cli.distill.state import load_kept
from specdec_cli.distill.train import draft_log_probs, evaluate, format_eval
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
    parser.add_argument("--by-confidence", action="store_true", help="token 1's agreement by the target's top-1 p")
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
        if args.by_confidence:
            print(
                json.dumps(
                    {"draft": name, "by_target_confidence": by_confidence(draft, answers, pad, to_subset, autocast)}
                )
            )


CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)  # bins of the target's top-1 probability


@torch.no_grad()
def by_confidence(draft, answers: list[dict], pad: int, to_subset: torch.Tensor, autocast) -> list[dict]:
    """On greedy answers, per bin of the target's top-1 probability: the share of positions in it, the
    share whose target token the draft's vocabulary holds (the most it can agree on), and the first
    draft token's agreement with the target's token there."""
    sure, agree, held = [], [], []
    for start in range(0, len(answers), 8):
        group = answers[start : start + 8]
        batch = make_batch(group, pad, to_subset, draft.device)
        [q_log] = draft_log_probs(draft, batch, autocast, 1)
        # the target's top-1 probability, whether or not the draft's vocabulary holds the token
        top = torch.cat([a["top_logp"][:, 0] for a in group]).float().exp()[answer_columns(group) >= 0]
        predicted = draft.lm_head.token_ids[q_log.argmax(-1)]
        sure.append(top[batch.greedy])
        agree.append((predicted == batch.top1)[batch.greedy])
        held.append((to_subset[batch.top1] >= 0)[batch.greedy])
    sure, agree, held = torch.cat(sure), torch.cat(agree).float(), torch.cat(held).float()
    rows = []
    for low, high in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:]):
        inside = (sure >= low) & (sure < high)
        count = int(inside.sum())
        rows.append(
            {
                "target_top1": [low, min(high, 1.0)],
                "share": round(count / len(sure), 3),
                "in_vocabulary": round(held[inside].mean().item(), 3) if count else None,
                "agreement": round(agree[inside].mean().item(), 3) if count else None,
            }
        )
    return rows


if __name__ == "__main__":
    main()
