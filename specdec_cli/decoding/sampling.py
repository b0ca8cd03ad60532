"""Warping and the speculative acceptance test.

Glossary (as in vLLM's rejection sampler):
- draft tokens: the num_draft_tokens tokens the drafter proposed, drawn from its distributions q.
- accepted tokens: the leading draft tokens that pass the test u * q(x) < p(x), i.e. each is kept
  with probability min(1, p(x) / q(x)).
- recovered token: at the first rejected position, a token drawn from norm(max(0, p - q)).
- bonus token: when every draft token is accepted, a token drawn from the target's last position.
Each target forward therefore yields accepted + 1 tokens, and the output is distributed exactly as
the (warped) target alone would sample it. That is token verification (`verify_sampled`); block
verification (`verify_block`) judges the drafts together, with its own acceptance test and residual,
and keeps at least as many of them on average.

All functions take a leading batch dimension and never move data to the host, so a GPU loop pays
one synchronisation per block, when it reads how many tokens were accepted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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
    """One draw per row: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i / sum(p)
    (weights need not be normalised), without the host sync of torch.multinomial. The noise is
    float64: float32 draws are coarse near 0, where the winner is decided, and devices' generators may
    floor or round them differently.
    probs: [..., V] -> [...] int64."""
    noise = torch.empty(probs.shape, dtype=torch.float64, device=probs.device).exponential_(generator=generator)
    # a zero draw would turn 0/0 into NaN, which argmax would pick: keep E positive
    return (probs.double() / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def spread(probs: torch.Tensor, vocabulary: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """probs [..., S] over a draft head's `vocabulary` [S] (its columns' token ids) as [..., V], zero at
    every other id; None: probs are over all V already."""
    if vocabulary is None:
        return probs
    return probs.new_zeros(*probs.shape[:-1], vocab_size).index_copy_(-1, vocabulary, probs)


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
    batch, num_draft_tokens = draft_tokens.shape
    drafted = draft_tokens.clamp_min(0)[..., None]  # -1 (not drafted) has q = 0 everywhere: rejected below
    p = target_probs[:, :num_draft_tokens].gather(-1, drafted)[..., 0].double()  # [B, g]
    q = draft_probs.gather(-1, drafted)[..., 0].double()  # [B, g]
    u = torch.rand(batch, num_draft_tokens, dtype=torch.float64, device=p.device, generator=generator)
    # q == 0 means the draft could not have proposed x: reject (also avoids 0 / 0)
    num_accepted = accepted_prefix_length((u * q < p) & (q > 0))
    # row i < g: the residual at draft position i; row g: the bonus distribution
    candidates = torch.cat(
        [residual(target_probs[:, :num_draft_tokens], draft_probs), target_probs[:, num_draft_tokens:]], 1
    )
    chosen = candidates[torch.arange(batch, device=p.device), num_accepted]  # [B, V]
    return num_accepted, sample(chosen, generator)


def block_acceptance(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What block verification (`verify_block`) decides with: h [B, g] float64, h_i the chance that the
    block keeps at least its first i drafts whatever the draws after them (i = 1..g), and the corrections
    w [B, g + 1, V]: w_i is the unnormalised distribution of the token after i kept drafts (w_g: the
    bonus distribution, scaled). draft_tokens: [B, g]; draft_probs: [B, g, V]; target_probs: [B, g + 1, V]."""
    num_draft_tokens = draft_tokens.shape[1]
    drafted = draft_tokens.clamp_min(0)[..., None]  # -1 (not drafted) has q = 0 everywhere: the block ends before it
    p = target_probs[:, :num_draft_tokens].gather(-1, drafted)[..., 0].double()  # [B, g]
    q = draft_probs.gather(-1, drafted)[..., 0].double()  # [B, g]
    log_ratio = torch.where(q > 0, p.log() - q.log(), -math.inf)  # q == 0: the draft could not have proposed x
    # k_i = min(1, k_{i-1} r_i) from k_0 = 1 has the closed form log k_i = S_i - max_{j <= i} S_j, where
    # S_i = log r_1 + ... + log r_i: no loop over positions, and no underflow of long products
    sums = F.pad(log_ratio.cumsum(dim=-1), (1, 0))  # [B, g + 1], S_0 = 0
    kept = (sums - sums.cummax(dim=-1).values).exp()  # [B, g + 1]: k_0 .. k_g
    # nothing is drafted after the last position: q = 0 there makes w_g = k_g * bonus and h_g = k_g
    later_q = F.pad(draft_probs, (0, 0, 0, 1))  # [B, g + 1, V]
    leftover = (kept[..., None].to(target_probs.dtype) * target_probs - later_q).clamp_min_(0)  # w_0 .. w_g
    mass = leftover[:, 1:].sum(dim=-1, dtype=torch.float64)  # [B, g]: Z_1 .. Z_g (keeping none always passes)
    denominator = mass + 1 - kept[:, 1:]
    # a zero denominator (k_i = 1, Z_i = 0) makes stopping after i impossible whatever h_i is
    h = torch.where(denominator > 0, mass / denominator.clamp_min(torch.finfo(mass.dtype).tiny), 1.0)
    return h, leftover


def verify_block(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025):
    the drafts are judged as a block, so a draft that token verification rejects can still be kept when
    the drafts before it were undersampled (p > q) and left probability to spare. Same arguments and
    results as `verify_sampled`.

    The rule. Position i + 1's distributions, given the i drafts before it, are p_{i+1}(x) and q_{i+1}(x);
    r_i = p_i(x_i) / q_i(x_i) (0 where q_i(x_i) = 0). Then
        k_0 = 1, k_i = min(1, k_{i-1} r_i)                      how much of x_1..x_i the block may keep
        w_i(x) = max(0, k_i p_{i+1}(x) - q_{i+1}(x)), Z_i = sum_x w_i(x)   what keeping them leaves over
        h_i = Z_i / (Z_i + 1 - k_i) for i < g, h_g = k_g
    Draw eta_1..eta_g ~ U(0, 1); tau is the largest i with eta_i < h_i (0 if none, so a later draft can
    pass where an earlier one failed); emit x_1..x_tau and a token from norm(w_tau), the recovered token
    (w_g = k_g times the bonus distribution). With g = 1 this is exactly token verification.

    Why the output is distributed as the target. Write M_q(x^i), M_p(x^i) for the draft's and target's
    probabilities of a prefix x^i = x_1..x_i, and A(x^i) = M_q(x^i) k_i, the mass of x^i the block keeps.
    1. Given x^i drafted, P(tau >= i) = k_i. At i = g this is h_g. Below, tau >= i if eta_i passes or
       some later eta does, independently, and P(tau >= i + 1 | x^i) = sum_x q_{i+1}(x) k_{i+1}(x^i x)
       = sum_x min(q_{i+1}(x), k_i p_{i+1}(x)) = k_i - Z_i, so P(tau >= i) = 1 - (1 - h_i)(1 - k_i + Z_i)
       = k_i by the choice of h_i. Hence P(tau = i | x^i) = Z_i, and the token y after x^i is delivered
       as the correction with probability M_q(x^i) w_i(y) = max(0, A(x^i) p_{i+1}(y) - M_q(x^i y)).
    2. As in the note on token verification, each token's probability is "accepted + delivered":
       A(x^i y) = min(M_q(x^i y), A(x^i) p_{i+1}(y)), so y kept as a draft after x^i (A(x^i y), none
       after x^g) plus y delivered as the correction there add up to exactly A(x^i) p_{i+1}(y). Let F(x^i)
       be the chance that the output, continued by the target after the block, begins with x^i. Beyond
       the A(x^i) still held in drafts, F(x^i) - A(x^i) has x^i complete already and the target draws y:
       F(x^i y) = A(x^i) p_{i+1}(y) + (F(x^i) - A(x^i)) p_{i+1}(y) = F(x^i) p_{i+1}(y). From F() = 1,
       F(x^i) = M_p(x^i) for every prefix: the target's distribution, warped as the draft's is.
    Never worse: k_i >= min(1, r_1) ... min(1, r_i), token verification's chance to keep x^i, and by
    1. the expected number kept is sum_i E[k_i].
    """
    batch, num_draft_tokens = draft_tokens.shape
    h, leftover = block_acceptance(draft_tokens, draft_probs, target_probs)
    eta = torch.rand(batch, num_draft_tokens, dtype=torch.float64, device=h.device, generator=generator)
    passed = torch.cat([torch.ones(batch, 1, dtype=torch.bool, device=h.device), eta < h], dim=1)
    num_accepted = (passed * torch.arange(num_draft_tokens + 1, device=h.device)).amax(
        dim=-1
    )  # tau: the last that passed
    rows = torch.arange(batch, device=h.device)
    chosen = leftover[rows, num_accepted]  # [B, V]
    # nothing left over (a stop of probability 0, reached by rounding): the target's own distribution
    chosen = torch.where(chosen.sum(dim=-1, keepdim=True) > 0, chosen, target_probs[rows, num_accepted])
    return num_accepted, sample(chosen, generator)
