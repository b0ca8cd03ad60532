"""The acceptance test, the residual, warping, and a statistical test of the sampler's output; block
verification's exact law, its draws, broken variants the checks catch, and the drafts it keeps."""

from __future__ import annotations

import itertools

import pytest
import torch
from broken_rules import (
    block_acceptance_unnormalised,
    block_acceptance_with_token_residual,
    verify_block_accepting_token_wise,
    verify_block_stopping_at_the_first_failure,
)
from scipy import stats

from specdec_cli.decoding import sampling
from specdec_cli.decoding.sampling import (
    SamplingParams,
    accepted_prefix_length,
    residual,
    sample,
    verify_greedy,
    verify_sampled,
    warp,
)
from specdec_cli.methods.model import draft_token, stack_drafts


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
    """A draft whose head scores 5 of 12 tokens warps and draws over those 5 columns alone: spread over
    the whole vocabulary, its q is the full-width warp of the same logits with -inf elsewhere, and its
    draws, mapped to the subset's ids, follow it."""
    subset = torch.tensor([1, 4, 5, 8, 11])
    columns = torch.tensor([[2.0, 0.5, 1.0, -1.0, 1.5], [0.0, 1.0, 0.2, 0.1, -2.0]])
    logits = torch.full((2, 12), float("-inf")).index_copy_(1, subset, columns)
    draws = 20000
    tokens, q = draft_token(columns.repeat(draws, 1), params, torch.Generator().manual_seed(0), subset)
    _, spread = stack_drafts([tokens[:2]], [q[:2]], 2, 12, torch.device("cpu"), subset)
    assert torch.allclose(spread[:, 0], warp(logits, params), atol=1e-6)
    for row in range(2):
        counts = torch.bincount(tokens[row::2], minlength=12)
        expected = spread[row, 0].double() / spread[row, 0].double().sum() * draws  # float32 sums miss a little
        assert counts[expected == 0].sum() == 0  # only tokens of the subset that survive warping
        kept = expected > 0
        assert stats.chisquare(counts[kept].numpy(), expected[kept].numpy()).pvalue > 1e-3


# ---------------------------------------------------------------- block verification


class Chain:
    """A target p and a draft q over a small vocabulary whose next-token distributions depend on the whole
    prefix: one random row per prefix of up to num_draft_tokens tokens, float64."""

    def __init__(self, vocab: int, num_draft_tokens: int, seed: int, scale: float = 1.5):
        self.vocab, self.num_draft_tokens = vocab, num_draft_tokens
        g = torch.Generator().manual_seed(seed)
        prefixes = sum(vocab**n for n in range(num_draft_tokens + 1))
        self.p, self.q = (
            (torch.randn(prefixes, vocab, generator=g, dtype=torch.float64) * scale).softmax(-1) for _ in "pq"
        )

    def row(self, prefixes: torch.Tensor) -> torch.Tensor:
        """Table row of each prefix [N, L] -> [N]: the prefixes shorter than L first, then base-V order."""
        length = prefixes.shape[1]
        place = self.vocab ** torch.arange(length - 1, -1, -1)
        return sum(self.vocab**n for n in range(length)) + (prefixes * place).sum(-1)

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of every prefix of tokens [N, L], the empty one first -> [N, L + 1]."""
        return torch.stack([self.row(tokens[:, :n]) for n in range(tokens.shape[1] + 1)], 1)

    def sequences(self, length: int) -> torch.Tensor:
        return torch.tensor(list(itertools.product(range(self.vocab), repeat=length)))

    def inputs(self, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft_probs [N, g, V], target_probs [N, g + 1, V]) after each prefix of the drafts."""
        rows = self.rows(drafts)
        return self.q[rows[:, :-1]], self.p[rows]

    def probability(self, table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Each token's probability given the ones before it [N, L], from `table` (p or q)."""
        return table[self.rows(tokens)[:, :-1]].gather(-1, tokens[..., None])[..., 0]


def stop_probabilities(h: torch.Tensor) -> torch.Tensor:
    """P(tau = j | drafts) [N, g + 1] when tau is the last i with eta_i < h_i (0 always passes)."""
    h = torch.nn.functional.pad(h, (1, 0), value=1.0)
    return torch.stack([h[:, j] * (1 - h[:, j + 1 :]).prod(-1) for j in range(h.shape[1])], 1)


def exact_block_law(chain: Chain) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, p) over every sequence of num_draft_tokens + 1 tokens: the law of block verification's output, continued
    by the target after it, summed over every draft chain from `sampling.block_acceptance`; and the
    target's own law."""
    g = chain.num_draft_tokens
    drafts, sequences = chain.sequences(g), chain.sequences(g + 1)  # [N, g], [S, g + 1]
    draft_probs, target_probs = chain.inputs(drafts)
    h, leftover = sampling.block_acceptance(drafts, draft_probs, target_probs)
    mass = leftover.sum(-1, keepdim=True)
    correction = torch.where(mass > 0, leftover / mass, target_probs)  # [N, g + 1, V]
    stop = stop_probabilities(h) * chain.probability(chain.q, drafts).prod(-1)[:, None]  # [N, g + 1]
    step = chain.probability(chain.p, sequences)  # [S, g + 1]: p(s_k | s_1..s_{k-1})
    law = torch.zeros(len(sequences), dtype=torch.float64)
    for j in range(g + 1):  # j drafts kept, then the correction s_j, then the target draws the rest
        same = (drafts[:, None, :j] == sequences[None, :, :j]).all(-1)  # [N, S]
        corrected = correction[:, j].T[sequences[:, j]].T  # [N, S]: w_j(s_j) of each chain
        law += (stop[:, j, None] * same * corrected).sum(0) * step[:, j + 1 :].prod(-1)
    return law, step.prod(-1)


def block_draws(chain: Chain, n: int, seed: int) -> torch.Tensor:
    """n runs of `sampling.verify_block` on draft chains drawn from q, each output continued by the
    target to num_draft_tokens + 1 tokens; counts per sequence (in `Chain.sequences` order)."""
    generator = torch.Generator().manual_seed(seed)
    g, vocab = chain.num_draft_tokens, chain.vocab
    chains = chain.sequences(g)
    drafts = chains[sample(chain.probability(chain.q, chains).prod(-1).expand(n, -1), generator)]  # [n, g] from q
    num_accepted, next_token = sampling.verify_block(drafts, *chain.inputs(drafts), generator)
    output = torch.cat([drafts, next_token[:, None]], 1)
    output[torch.arange(n), num_accepted] = next_token
    for k in range(1, g + 1):  # past the block, the target draws the next token
        drawn = sample(chain.p[chain.row(output[:, :k])], generator)
        output[:, k] = torch.where(num_accepted < k, drawn, output[:, k])
    place = vocab ** torch.arange(g, -1, -1)
    return torch.bincount((output * place).sum(-1), minlength=vocab ** (g + 1))


CHAINS = [
    Chain(vocab=3, num_draft_tokens=3, seed=0),
    Chain(vocab=4, num_draft_tokens=2, seed=1),
    Chain(vocab=2, num_draft_tokens=4, seed=2, scale=3),
]


def chain_id(chain: Chain) -> str:
    return f"V={chain.vocab},g={chain.num_draft_tokens}"


def exact_failures() -> list[str]:
    return [chain_id(c) for c in CHAINS if not torch.allclose(*exact_block_law(c), atol=1e-12)]


def draws_failures() -> list[str]:
    threshold = ALPHA / len(CHAINS)  # Bonferroni over the chains
    return [
        chain_id(c)
        for i, c in enumerate(CHAINS)
        if goodness_of_fit(block_draws(c, SAMPLES, seed=i), exact_block_law(c)[1]) < threshold
    ]


def test_block_verification_output_is_the_targets_exactly_and_in_draws():
    assert exact_failures() == [] and draws_failures() == []


@pytest.mark.parametrize("broken", [block_acceptance_with_token_residual, block_acceptance_unnormalised])
def test_both_block_checks_catch_a_broken_acceptance(monkeypatch, broken):
    monkeypatch.setattr(sampling, "block_acceptance", broken)  # verify_block looks it up at call time
    assert exact_failures() and draws_failures()


@pytest.mark.parametrize("broken", [verify_block_accepting_token_wise, verify_block_stopping_at_the_first_failure])
def test_the_block_draws_catch_a_broken_draw(monkeypatch, broken):
    monkeypatch.setattr(sampling, "verify_block", broken)
    # the exact law is summed from block_acceptance, which these bugs leave alone: the draws must see them
    assert exact_failures() == [] and draws_failures()


def expected_accepted(chain: Chain) -> tuple[float, float]:
    """Exact expected drafts kept per block over every draft chain: (token verification, block verification)."""
    drafts = chain.sequences(chain.num_draft_tokens)
    q = chain.probability(chain.q, drafts)  # [N, g]
    weight = q.prod(-1)
    token = (chain.probability(chain.p, drafts) / q).clamp_max(1).cumprod(-1).sum(-1)  # sum_i P(keep x_1..x_i)
    h, _ = sampling.block_acceptance(drafts, *chain.inputs(drafts))
    block = stop_probabilities(h) @ torch.arange(chain.num_draft_tokens + 1, dtype=torch.float64)
    return float(weight @ token), float(weight @ block)


def test_block_verification_keeps_the_papers_11_9_where_token_keeps_10_9():
    # Sun et al.'s example: p = (1/3, 2/3), q = (2/3, 1/3) at every position, 2 drafts
    chain = Chain(vocab=2, num_draft_tokens=2, seed=0)
    chain.p[:], chain.q[:] = (
        torch.tensor([1 / 3, 2 / 3], dtype=torch.float64),
        torch.tensor([2 / 3, 1 / 3], dtype=torch.float64),
    )
    assert expected_accepted(chain) == pytest.approx((10 / 9, 11 / 9), abs=1e-12)
    n, generator = 200_000, torch.Generator().manual_seed(0)
    drafts = sample(chain.q[0].expand(n, 2, 2), generator)
    inputs = chain.inputs(drafts)
    for verify, expected in ((verify_sampled, 10 / 9), (sampling.verify_block, 11 / 9)):
        assert verify(drafts, *inputs, generator)[0].double().mean().item() == pytest.approx(expected, abs=0.01)


def test_block_verification_keeps_at_least_as_many_drafts_as_token_verification():
    gains = []
    for seed in range(40):
        chain = Chain(vocab=2 + seed % 3, num_draft_tokens=1 + seed % 4, seed=seed, scale=0.5 + seed % 5)
        token, block = expected_accepted(chain)
        assert block >= token - 1e-12, seed
        if chain.num_draft_tokens == 1:  # one draft: the two rules are the same
            assert block == pytest.approx(token, abs=1e-12)
        else:
            gains.append(block - token)
    assert min(gains) >= 0 and sum(g > 1e-3 for g in gains) > len(gains) // 2


def test_a_position_not_drafted_ends_the_block():
    """-1 with q = 0 at the second position: the block is the first draft alone, bonus included."""
    chain = Chain(vocab=4, num_draft_tokens=2, seed=3)
    drafts = chain.sequences(2)[::5]  # a few chains
    draft_probs, target_probs = chain.inputs(drafts)
    cut_probs = draft_probs.clone()
    cut_probs[:, 1] = 0
    h, leftover = sampling.block_acceptance(
        torch.stack([drafts[:, 0], torch.full_like(drafts[:, 0], -1)], 1), cut_probs, target_probs
    )
    h_one, leftover_one = sampling.block_acceptance(drafts[:, :1], draft_probs[:, :1], target_probs[:, :2])
    assert torch.equal(h[:, 1], torch.zeros(len(drafts), dtype=torch.float64))
    assert torch.allclose(h[:, :1], h_one) and torch.allclose(leftover[:, :2], leftover_one)
