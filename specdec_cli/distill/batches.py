"""Training batches: the corpus shuffled into an endless, resumable stream, each batch padded into
tensors with the target's top-k mapped into the draft's vocabulary."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from specdec_cli.decoding.cache import right_padded


def batches(corpus: list[dict], batch_size: int, seed: int, step: int):
    """Endless shuffled batches; deterministic given the seed, and resumable at any step."""
    order: list[int] = []
    epoch = 0
    skipped = 0
    while True:
        if not order:
            order = list(range(len(corpus)))
            random.Random(seed + epoch).shuffle(order)
            epoch += 1
        group, order = order[:batch_size], order[batch_size:]
        if skipped < step:
            skipped += 1
            continue
        yield [corpus[i] for i in group]


def pad_right(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows right-padded with `pad` [B, longest], and the attention mask (1: a real token)."""
    ids, lengths = right_padded(seqs, torch.device("cpu"), pad)
    return ids, (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()


@dataclass
class Batch:
    ids: torch.Tensor  # [B, L] input j is token j + 1 of prompt + answer, right-padded ...
    features: torch.Tensor  # [B, L, taps * hidden] ... beside the target's states at token j
    mask: torch.Tensor
    rows: torch.Tensor  # [N] (row, column) of every input whose output predicts an answer token
    cols: torch.Tensor
    targets: torch.Tensor  # [N, k] the target's top-k as indices into the draft's vocabulary
    weights: torch.Tensor  # [N, k] their target probabilities, 0 where the draft cannot score them
    top1: torch.Tensor  # [N] the target's most likely token id
    greedy: torch.Tensor  # [N] whether the position belongs to a greedy answer


def answer_columns(answers: list[dict]) -> torch.Tensor:
    """[N] per answer token of `answers`, the input that drafts it; -1 where none does."""
    return torch.cat([torch.arange(len(a["answer"])) + len(a["prompt"]) - 2 for a in answers])


def make_batch(answers: list[dict], pad: int, to_subset: torch.Tensor, device: torch.device) -> Batch:
    ids, mask = pad_right([a["prompt"][1:] + a["answer"] for a in answers], pad)
    features = torch.nn.utils.rnn.pad_sequence([a["features"] for a in answers], batch_first=True)
    # input j reads token j + 1 and predicts token j + 2: input P - 2 predicts the first answer token
    # (after a one-token prompt no input does: the first token is never drafted)
    rows = torch.cat([torch.full((len(a["answer"]),), i) for i, a in enumerate(answers)])
    cols = answer_columns(answers)
    top_ids = torch.cat([a["top_ids"] for a in answers]).long()
    subset = to_subset[top_ids]
    weights = torch.cat([a["top_logp"] for a in answers]).float().exp() * (subset >= 0)
    greedy = torch.cat([torch.full((len(a["answer"]),), a["greedy"]) for a in answers])
    drafted = cols >= 0
    return Batch(
        ids.to(device),
        features.to(device),
        mask.to(device),
        *(t[drafted].to(device) for t in (rows, cols, subset.clamp(min=0), weights, top_ids[:, 0], greedy)),
    )
