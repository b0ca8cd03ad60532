"""The acceptance test, the residual, warping, and a statistical test of the sampler's output."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from specdec_cli.decoding.sampling import (
    SamplingParams,
    accepted_prefix_length,
    residual,
    sample,
    verify_greedy,
    verify_sampled,
    warp,
)
from specdec_cli.drafters.model import draft_token


def test_acceptance_matches_the_notes_examples():
    # note, case 1: q(x) = 0.2 < p(x) = 0.5, always accepted; case 2: q(y) = 0.5 > p(y) = 0.2,
    # accepted with probability 0.4. Token 0 is x, token 1 is y, token 2 takes the rest.
    p = torch.tensor([0.5, 0.2, 0.3])
    q = torch.tensor([0.2, 0.5, 0.3])
    n = 200_000
    generator = torch.Generator().manual_seed(0)
    for token, expected in ((0, 1.0), (1, 0.4)):
        drafts = torch.full((n, 1), token)
        num_accepted, _ = verify_sampled(drafts, q.expand(n, 1, 3), p.expand(n, 2, 3), generator)
        assert num_accepted.float().mean().item() == pytest.approx(expected, abs=0.005)


def test_residual_hand_computed():
    p = torch.tensor([0.5, 0.2, 0.3])
    q = torch.tensor([0.2, 0.5, 0.3])
    # max(0, p - q) = [0.3, 0, 0]: every rejection delivers x, supplying its missing 0.3
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    # q == p leaves no mass: fall back to p
    assert torch.allclose(residual(p, p.clone()), p)


def exact_output_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum min(p, q)) residual(x), from the note."""
    accept = torch.minimum(q, p)  # q * min(1, p/q) without 0/0
    return accept + (1 - accept.sum()) * residual(p, q)


def random_pairs(vocab: int, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)

    def dist(scale: float) -> torch.Tensor:
        return (torch.randn(vocab, generator=g, dtype=torch.float64) * scale).softmax(0)

    half = vocab // 2
    disjoint_p = torch.cat([dist(1)[:half], torch.zeros(vocab - half, dtype=torch.float64)])
    disjoint_q = torch.cat([torch.zeros(half, dtype=torch.float64), dist(1)[half:]])
    p_flat = dist(0.3)
    one_hot = torch.zeros(vocab, dtype=torch.float64)
    one_hot[3] = 1
    logits_p, logits_q = torch.randn(vocab, generator=g) * 2, torch.randn(vocab, generator=g) * 2
    warped = [warp(x, SamplingParams(temperature=0.8, top_k=5, top_p=0.9)).double() for x in (logits_p, logits_q)]
    return {
        "peaked": (dist(3), dist(3)),
        "flat": (p_flat, dist(0.3)),
        "disjoint": (disjoint_p / disjoint_p.sum(), disjoint_q / disjoint_q.sum()),
        "q == p": (p_flat, p_flat.clone()),
        "one-hot q": (dist(1), one_hot),
        "top-k/top-p warped": tuple(warped),
    }


@pytest.mark.parametrize("seed", range(5))
def test_exact_output_distribution_is_p(seed):
    for name, (p, q) in random_pairs(vocab=12, seed=seed).items():
        assert torch.allclose(exact_output_distribution(p, q), p, atol=1e-12), name


def first_token_counts(sampler, p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Run accept-or-resample n times (batched) on one draft position; count the emitted token."""
    generator = torch.Generator().manual_seed(seed)
    vocab = p.shape[0]
    p32, q32 = p.float(), q.float()
    drafts = sample(q32.expand(n, vocab), generator)[:, None]  # [n, 1] drawn from q
    target = torch.stack([p32, p32]).expand(n, 2, vocab)
    num_accepted, next_token = sampler(drafts, q32.expand(n, 1, vocab), target, generator)
    first = torch.where(num_accepted == 1, drafts[:, 0], next_token)
    return torch.bincount(first, minlength=vocab)


def goodness_of_fit(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square p-value of counts against p, rare cells (expected < 5) pooled into one."""
    expected = p.double() / p.double().sum() * counts.sum()
    if (counts[p == 0] > 0).any():
        return 0.0  # a token the target never samples was emitted
    rare = expected < 5
    observed = torch.cat([counts[~rare].double(), counts[rare].double().sum()[None]])
    expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    keep = expected > 0
    return float(stats.chisquare(observed[keep], expected[keep]).pvalue)


def broken_accept_q_over_p(drafts, draft_probs, target_probs, generator):
    """A realistic bug: accept with min(1, q/p) instead of min(1, p/q)."""
    return verify_sampled(drafts, target_probs[:, :-1], torch.cat([draft_probs, target_probs[:, -1:]], 1), generator)


def broken_resample_from_p(drafts, draft_probs, target_probs, generator):
    """A realistic bug: on rejection sample from p instead of norm(max(0, p - q))."""
    num_accepted, _ = verify_sampled(drafts, draft_probs, target_probs, generator)
    return num_accepted, sample(target_probs[:, 0], generator)


SAMPLES = 40_000
ALPHA = 0.001


def failing_pairs(sampler) -> list[str]:
    pairs = random_pairs(vocab=16, seed=1)
    threshold = ALPHA / len(pairs)  # Bonferroni over the pairs
    return [
        name
        for i, (name, (p, q)) in enumerate(pairs.items())
        if goodness_of_fit(first_token_counts(sampler, p, q, SAMPLES, seed=i), p) < threshold
    ]


def test_sampler_output_distribution_equals_target():
    assert failing_pairs(verify_sampled) == []


@pytest.mark.parametrize("broken", [broken_accept_q_over_p, broken_resample_from_p])
def test_the_statistical_check_catches_a_broken_sampler(broken):
    failed = failing_pairs(broken)
    # some shapes hide a given bug (q == p; disjoint supports make the residual equal p), the
    # generic overlapping ones must not
    assert {"peaked", "flat"} <= set(failed), failed


def test_bonus_token_comes_from_the_last_position():
    vocab, n = 6, 30_000
    generator = torch.Generator().manual_seed(0)
    p0 = torch.full((vocab,), 1 / vocab)
    bonus = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])
    drafts = torch.zeros(n, 1, dtype=torch.long)
    num_accepted, next_token = verify_sampled(
        drafts, p0.expand(n, 1, vocab), torch.stack([p0, bonus]).expand(n, 2, vocab), generator
    )
    assert bool((num_accepted == 1).all())  # q == p: always accepted
    assert goodness_of_fit(torch.bincount(next_token, minlength=vocab), bonus.double()) > ALPHA


def test_greedy_verification():
    logits = torch.full((1, 4, 5), -1.0)
    for position, token in enumerate([2, 4, 1, 3]):
        logits[0, position, token] = 1.0
    assert [int(x) for x in verify_greedy(torch.tensor([[2, 4, 1]]), logits)] == [3, 3]  # all + bonus
    assert [int(x) for x in verify_greedy(torch.tensor([[2, 0, 1]]), logits)] == [1, 4]  # stop at 2nd
    assert [int(x) for x in verify_greedy(torch.tensor([[0, 4, 1]]), logits)] == [0, 2]
    assert accepted_prefix_length(torch.tensor([[True, False, True]])).tolist() == [1]


def test_warp_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert torch.allclose(warp(logits, SamplingParams(temperature=1.0, top_k=2)), torch.tensor([4 / 7, 3 / 7, 0, 0]))
    # top-p 0.6: 0.4 alone is short of 0.6, 0.4 + 0.3 reaches it; the rest is cut
    assert torch.allclose(warp(logits, SamplingParams(temperature=1.0, top_p=0.6)), torch.tensor([4 / 7, 3 / 7, 0, 0]))
    assert torch.allclose(warp(logits, SamplingParams(temperature=1.0, top_p=0.4)), torch.tensor([1.0, 0, 0, 0]))
    sharper = warp(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(sharper, torch.tensor([16, 9, 4, 1]) / 30)


def test_sampling_is_the_float64_exponential_race():
    """The race argmax(p / E) is decided by the smallest E, where float32 draws are coarsest and
    devices' generators may round differently: the noise is drawn in float64. (On CPU float32 noise
    gives the same draws from the same generator state, so this pins the rule, not a CPU bias.)"""
    probs = torch.tensor([[0.2, 0.3, 0.5]]).expand(4096, 3)
    drawn = sample(probs, torch.Generator().manual_seed(3))
    noise = torch.empty(probs.shape, dtype=torch.float64).exponential_(generator=torch.Generator().manual_seed(3))
    assert torch.equal(drawn, (probs.double() / noise).argmax(dim=-1))


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3), SamplingParams(1.0, top_p=0.8)],
)
def test_a_draft_over_a_vocabulary_subset_draws_from_the_same_q(params):
    """A draft whose head scores 5 of 12 tokens (the rest -inf) warps and draws over those 5 alone:
    its q over the whole vocabulary is the full-width warp's, and its draws follow it."""
    subset = torch.tensor([1, 4, 5, 8, 11])
    logits = torch.full((2, 12), float("-inf"))
    logits[:, subset] = torch.tensor([[2.0, 0.5, 1.0, -1.0, 1.5], [0.0, 1.0, 0.2, 0.1, -2.0]])
    draws = 20000
    tokens, q = draft_token(logits.repeat(draws, 1), params, torch.Generator().manual_seed(0), subset)
    assert torch.allclose(q[:2], warp(logits, params), atol=1e-6)
    for row in range(2):
        counts = torch.bincount(tokens[row::2], minlength=12)
        expected = q[row].double() / q[row].double().sum() * draws  # float32 sums miss draws by a little
        assert counts[expected == 0].sum() == 0  # only tokens of the subset that survive warping
        kept = expected > 0
        assert stats.chisquare(counts[kept].numpy(), expected[kept].numpy()).pvalue > 1e-3
