"""The exact output laws of the sampled chain rules: for a target p and a draft q, the distribution of
the tokens each rule emits, computed from its formula (token verification) or summed over every
chain of drafts from the engine's own acceptance chances (block verification)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specdec_cli.decoding import sampling
from specdec_cli.decoding.params import SamplingParams

EXACT_TOLERANCE = 1e-6  # max |P(x) - p(x)| allowed for the formula (float32 inputs, float64 sums)
SAMPLER_DRAFTS = 2  # drafts per chain in the sampler check: with 1, block verification is token verification
EXACT_BLOCK_VOCAB = 12  # the block rule's exact law sums over every chain: the shapes' likeliest tokens


def describe_params(params: SamplingParams) -> str:
    return f"temperature {params.temperature:g}, top-k {params.top_k or 'off'}, top-p {params.top_p:g}"


def sampler_shapes(vocab_size: int, params: SamplingParams, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, p, q) pairs of the shapes a real run meets, at the configured vocabulary size."""
    gen = torch.Generator().manual_seed(seed)
    z1, z2 = (torch.randn(vocab_size, generator=gen) for _ in range(2))
    half = torch.arange(vocab_size) < vocab_size // 2
    peaked_p, peaked_q = (3 * z1).softmax(-1), (3 * z2).softmax(-1)
    one_hot = torch.zeros(vocab_size)
    one_hot[peaked_p.topk(3).indices[-1]] = 1.0  # an n-gram draft proposing p's third choice
    shapes = [
        ("peaked p, peaked q", peaked_p, peaked_q),
        ("flat p, flat q", (0.1 * z1).softmax(-1), (0.1 * z2).softmax(-1)),
        ("peaked p, flat q", peaked_p, (0.1 * z2).softmax(-1)),
        (
            "disjoint supports",
            (3 * z1).masked_fill(~half, -math.inf).softmax(-1),
            (3 * z2).masked_fill(half, -math.inf).softmax(-1),
        ),
        ("q = p", peaked_p, peaked_p.clone()),
        ("one-hot q (n-gram draft)", peaked_p, one_hot),
        (
            "top-k 20",
            sampling.warp(3 * z1, SamplingParams(1.0, top_k=20)),
            sampling.warp(3 * z2, SamplingParams(1.0, top_k=20)),
        ),
        (
            "top-p 0.9",
            sampling.warp(3 * z1, SamplingParams(1.0, top_p=0.9)),
            sampling.warp(3 * z2, SamplingParams(1.0, top_p=0.9)),
        ),
        (f"configured warp ({describe_params(params)})", sampling.warp(3 * z1, params), sampling.warp(3 * z2, params)),
    ]
    return shapes


def exact_output(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum min(p, q)) residual(x), in float64, with the
    engine's residual."""
    p64, q64 = p.double(), q.double()
    accepted = torch.minimum(p64, q64)  # q min(1, p/q), also where q = 0
    return accepted + (1 - accepted.sum()) * sampling.residual(p, q).double()


def exact_block_output(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The law [V, V] of the first two tokens that block verification of 2 drafts emits (the target
    drawing the second where it emits one), with p and q at both positions: every chain of drafts,
    weighted by q, with the engine's chances h and corrections (`sampling.block_acceptance`), in float64."""
    p64, q64 = p.double(), q.double()
    vocab = p.shape[-1]
    drafts = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V^2, 2]: every chain
    n = len(drafts)
    h, leftover = sampling.block_acceptance(
        drafts, q64.expand(n, SAMPLER_DRAFTS, vocab), p64.expand(n, SAMPLER_DRAFTS + 1, vocab)
    )
    mass = leftover.sum(-1, keepdim=True)
    correction = torch.where(mass > 0, leftover / mass.clamp_min(torch.finfo(mass.dtype).tiny), p64)
    chain = q64[drafts].prod(-1)  # [V^2]
    # tau, the drafts kept, is the last i whose eta_i < h_i (keeping none always passes): it stops at j
    # when j passes and every later one fails
    h = F.pad(h, (1, 0), value=1.0)
    stop = [h[:, j] * (1 - h[:, j + 1 :]).prod(-1) * chain for j in range(SAMPLER_DRAFTS + 1)]
    law = torch.zeros(vocab, vocab, dtype=torch.float64)
    law.index_put_((drafts[:, 0], drafts[:, 1]), stop[2], accumulate=True)  # both kept
    law.index_add_(0, drafts[:, 0], stop[1][:, None] * correction[:, 1])  # x_1 kept, then its correction
    law += torch.outer(stop[0] @ correction[:, 0], p64)  # the correction, then the target's next token
    return law


def exact_errors(shapes: list[tuple[str, torch.Tensor, torch.Tensor]], verification: str) -> tuple[list[float], str]:
    """max |P - p| per shape for the configured rule's exact law, and what was computed."""
    if verification == "token":
        errors = [float((exact_output(p, q) - p.double()).abs().max()) for _, p, q in shapes]
        return errors, f"exact output distribution from the formula, {len(shapes)} shapes, V={len(shapes[0][1])}"
    errors = []
    for _, p, q in shapes:
        likeliest = (p + q).topk(EXACT_BLOCK_VOCAB).indices
        p_top, q_top = (x[likeliest].double() / x[likeliest].double().sum() for x in (p, q))
        errors.append(float((exact_block_output(p_top, q_top) - torch.outer(p_top, p_top)).abs().max()))
    what = (
        f"exact law of 2 block-verified drafts from block_acceptance, {len(shapes)} shapes on their "
        f"{EXACT_BLOCK_VOCAB} likeliest tokens"
    )
    return errors, what
