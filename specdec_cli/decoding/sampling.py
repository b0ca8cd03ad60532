"""Warping and the speculative acceptance test.

Glossary (as in vLLM's rejection sampler):
- draft tokens: the gamma tokens the drafter proposed, drawn from its distributions q.
- accepted tokens: the leading draft tokens that pass the test u * q(x) < p(x), i.e. each is kept
  with probability min(1, p(x) / q(x)).
- recovered token: at the first rejected position, a token drawn from norm(max(0, p - q)).
- bonus token: when every draft token is accepted, a token drawn from the target's last position.
Each target forward therefore yields accepted + 1 tokens, and the output is distributed exactly as
the (warped) target alone would sample it.

All functions take a leading batch dimension and never move data to the host, so a GPU loop pays
one synchronisation per block, when it reads how many tokens were accepted.
"""

from __future__ import annotations

import torch

from specdec_cli.decoding.params import SamplingParams


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p. Target and draft go through this same
    function, so the output matches the warped target. logits: [..., V] -> probs [..., V] float32."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # keep the smallest prefix whose mass reaches top_p (the top token is always kept)
        sorted_logits = sorted_logits.masked_fill(mass_before >= params.top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i, without
    the host sync of torch.multinomial. The noise is float64: float32 draws are coarse near 0, where
    the winner is decided, and devices' generators may floor or round them differently.
    probs: [..., V] -> [...] int64."""
    noise = torch.empty(probs.shape, dtype=torch.float64, device=probs.device).exponential_(generator=generator)
    # a zero draw would turn 0/0 into NaN, which argmax would pick: keep E positive
    return (probs.double() / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def accepted_prefix_length(accepted: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row. accepted: [B, g] bool -> [B] int64."""
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept while the draft equals the target's argmax, then emit the target's argmax.
    draft_tokens: [B, g]; target_logits: [B, g + 1, V] -> (num_accepted [B], next_token [B])."""
    target_tokens = target_logits.argmax(dim=-1)  # [B, g + 1]
    num_accepted = accepted_prefix_length(draft_tokens == target_tokens[:, :-1])
    next_token = target_tokens.gather(1, num_accepted[:, None])[:, 0]
    return num_accepted, next_token


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), or p itself where that has no mass (p == q, where rejection cannot
    happen except through rounding). [..., V] -> [..., V]."""
    leftover = (target_probs - draft_probs).clamp_min_(0)
    total = leftover.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, leftover / total.clamp_min(torch.finfo(total.dtype).tiny), target_probs)


def verify_sampled(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept-or-resample. draft_tokens: [B, g]; draft_probs: [B, g, V]; target_probs: [B, g + 1, V]
    -> (num_accepted [B], next_token [B]): the recovered token, or the bonus token if all passed."""
    batch, gamma = draft_tokens.shape
    drafted = draft_tokens.clamp_min(0)[..., None]  # -1 (not drafted) has q = 0 everywhere: rejected below
    p = target_probs[:, :gamma].gather(-1, drafted)[..., 0].double()  # [B, g]
    q = draft_probs.gather(-1, drafted)[..., 0].double()  # [B, g]
    u = torch.rand(batch, gamma, dtype=torch.float64, device=p.device, generator=generator)
    # q == 0 means the draft could not have proposed x: reject (also avoids 0 / 0)
    num_accepted = accepted_prefix_length((u * q < p) & (q > 0))
    # row i < g: the residual at draft position i; row g: the bonus distribution
    candidates = torch.cat([residual(target_probs[:, :gamma], draft_probs), target_probs[:, gamma:]], 1)
    chosen = candidates[torch.arange(batch, device=p.device), num_accepted]  # [B, V]
    return num_accepted, sample(chosen, generator)
