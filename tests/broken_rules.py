"""Broken variants of the verification rules, as realistic bugs: the statistical and exact checks must
catch each (tests/test_sampling.py, tests/test_tree.py, tests/test_tree_drafters.py, tests/test_verify.py)."""

from __future__ import annotations

import torch

from specdec_cli.decoding import sampling
from specdec_cli.decoding.sampling import accepted_prefix_length, sample, verify_sampled

# ---------------------------------------------------------------- token verification


def residual_without_clamp(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    leftover = target_probs - draft_probs  # bug: negative mass is kept
    total = leftover.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, leftover / total.clamp_min(torch.finfo(total.dtype).tiny), target_probs)


# ---------------------------------------------------------------- block verification

real_block_acceptance = sampling.block_acceptance


def block_acceptance_with_token_residual(draft_tokens, draft_probs, target_probs):
    """A realistic bug: the correction is token verification's norm(max(0, p - q)), not norm(max(0, k_i p - q))."""
    h, _ = real_block_acceptance(draft_tokens, draft_probs, target_probs)
    return h, (target_probs - torch.nn.functional.pad(draft_probs, (0, 0, 0, 1))).clamp_min(0)


def block_acceptance_unnormalised(draft_tokens, draft_probs, target_probs):
    """A realistic bug: h_i = Z_i, the residual mass, without dividing it by Z_i + 1 - k_i."""
    _, leftover = real_block_acceptance(draft_tokens, draft_probs, target_probs)
    return leftover[:, 1:].sum(-1, dtype=torch.float64), leftover


def verify_block_accepting_token_wise(draft_tokens, draft_probs, target_probs, generator):
    """A realistic bug: drafts kept by token verification's test, the correction drawn from the block rule's."""
    _, leftover = real_block_acceptance(draft_tokens, draft_probs, target_probs)
    num_accepted, _ = verify_sampled(draft_tokens, draft_probs, target_probs, generator)
    return num_accepted, sample(leftover[torch.arange(len(leftover)), num_accepted], generator)


def verify_block_stopping_at_the_first_failure(draft_tokens, draft_probs, target_probs, generator):
    """A realistic bug: tau = the drafts before the first eta_i >= h_i, not the last i with eta_i < h_i."""
    h, leftover = real_block_acceptance(draft_tokens, draft_probs, target_probs)
    num_accepted = accepted_prefix_length(torch.rand(h.shape, dtype=torch.float64, generator=generator) < h)
    return num_accepted, sample(leftover[torch.arange(len(leftover)), num_accepted], generator)


# ---------------------------------------------------------------- deterministic tree children (try_children)


def siblings_tested_against_p(target_probs, tokens, children, generator):
    """Bug: p' is never updated: every child is tried against p, and the leftover is p itself."""
    mass = target_probs.gather(1, tokens).double() * children
    u = torch.rand(mass.shape, dtype=torch.float64, generator=generator)
    return u < mass, target_probs


def p_prime_not_renormalised(target_probs, tokens, children, generator):
    """Bug: a rejected child is zeroed in p' but p' is not renormalised, so a later child is accepted
    with p(x), not p(x) over the mass left (the leftover's draw normalises by itself)."""
    mass = target_probs.gather(1, tokens).double() * children
    u = torch.rand(mass.shape, dtype=torch.float64, generator=generator)
    drafted = torch.zeros_like(target_probs).scatter_add_(1, tokens, children.to(target_probs.dtype))
    return u < mass, (target_probs - drafted).clamp_min(0)


# ---------------------------------------------------------------- greedy verification


def verify_greedy_within_top_two(draft_tokens: torch.Tensor, target_logits: torch.Tensor):
    """A realistic bug: a draft is kept while it is among the target's two likeliest tokens (a tolerance
    meant for near-ties), not only when it is the argmax."""
    top_two = target_logits[:, :-1].topk(2, dim=-1).indices  # [B, g, 2]
    num_accepted = accepted_prefix_length((draft_tokens[..., None] == top_two).any(dim=-1))
    next_token = target_logits.argmax(dim=-1).gather(1, num_accepted[:, None])[:, 0]
    return num_accepted, next_token
