import math

import pytest

from specdec_cli.decoding.metrics import (
    StepRecord,
    acceptance_by_position,
    acceptance_rate,
    accepted_length_histogram,
    conditional_acceptance_by_position,
    cost_ratio,
    draft_time_share,
    mean_accepted_length,
    median_and_spread,
    predicted_speedup,
    speedup,
    vllm_counters,
    vllm_mean_acceptance_length,
)

# num_draft_tokens = 4. Block 1 accepts everything (+ bonus), blocks 2-3 are cut by a rejection
# (+ recovered token), block 4 drafted only 2 and the max-new-tokens limit dropped the extra token.
STEPS = [
    StepRecord(drafted=4, accepted=4, emitted=5, draft_seconds=0.4, verify_seconds=1.0),
    StepRecord(drafted=4, accepted=1, emitted=2, draft_seconds=0.4, verify_seconds=1.0),
    StepRecord(drafted=4, accepted=2, emitted=3, draft_seconds=0.4, verify_seconds=1.0),
    StepRecord(drafted=2, accepted=2, emitted=2, draft_seconds=0.2, verify_seconds=0.6),
]
TARGET_ONLY = [StepRecord(0, 0, 1, 0.0, 0.5)] * 3


def test_mean_accepted_length_counts_bonus_and_recovered_tokens():
    assert mean_accepted_length(STEPS) == 3.0  # (5 + 2 + 3 + 2) / 4
    assert mean_accepted_length(TARGET_ONLY) == 1.0
    assert mean_accepted_length([]) is None


def test_vllm_mean_acceptance_length_is_not_lowered_by_a_cut_block_or_a_lookup_miss():
    # 1 + (4 + 1 + 2 + 2) / 4: block 4 emitted 2 of its 3 tokens, but counts its 2 accepted drafts
    assert vllm_mean_acceptance_length(STEPS) == 3.25
    miss = StepRecord(drafted=0, accepted=0, emitted=1, draft_seconds=0.01, verify_seconds=1.0)
    assert vllm_mean_acceptance_length(STEPS + [miss]) == 3.25
    assert mean_accepted_length(STEPS + [miss]) == 2.6  # tokens per target forward counts both
    assert vllm_mean_acceptance_length(TARGET_ONLY) is None


def test_acceptance_rate():
    assert acceptance_rate(STEPS) == 9 / 14  # (4 + 1 + 2 + 2) / (4 + 4 + 4 + 2)
    assert acceptance_rate(TARGET_ONLY) is None


def test_acceptance_by_position():
    # pos 1: 4 of 4; pos 2: A, C, D of 4; pos 3 and 4: only A of the 3 blocks that drafted 4.
    assert acceptance_by_position(STEPS, 4) == [1.0, 0.75, 1 / 3, 1 / 3]
    assert acceptance_by_position(STEPS, 5)[4] is None
    assert acceptance_by_position(TARGET_ONLY, 2) == [None, None]
    # blocks longer than num_draft_tokens (prompt lookup ahead of a 2-token draft model) extend the positions
    assert acceptance_by_position(STEPS, 2) == [1.0, 0.75, 1 / 3, 1 / 3]


def test_conditional_acceptance_by_position():
    # pos 2: A, C, D kept it of the 4 that kept pos 1; pos 3: only A of A and C (D drafted 2)
    assert conditional_acceptance_by_position(STEPS, 4) == [1.0, 0.75, 0.5, 1.0]
    assert conditional_acceptance_by_position(TARGET_ONLY, 2) == [None, None]
    # the joint rate is the running product where every block drafts as far
    full = [StepRecord(3, a, a + 1, 0.1, 1.0) for a in (0, 1, 1, 2, 3, 3)]
    conditional, joint = conditional_acceptance_by_position(full, 3), acceptance_by_position(full, 3)
    assert joint == pytest.approx([conditional[0], conditional[0] * conditional[1], math.prod(conditional)])


def test_accepted_length_histogram_counts_drafting_blocks():
    miss = StepRecord(drafted=0, accepted=0, emitted=1, draft_seconds=0.01, verify_seconds=1.0)
    assert accepted_length_histogram(STEPS + [miss]) == [0, 1, 2, 0, 1]
    assert accepted_length_histogram(TARGET_ONLY) == []


def test_vllm_counters():
    miss = StepRecord(drafted=0, accepted=0, emitted=1, draft_seconds=0.01, verify_seconds=1.0)
    counters = vllm_counters(STEPS + [miss])
    assert counters == {
        "num_drafts": 4,
        "num_draft_tokens": 14,
        "num_accepted_tokens": 9,
        "num_accepted_tokens_per_pos": [4, 3, 1, 1],
    }
    # vLLM's mean acceptance length from its counters is specdec's
    assert 1 + counters["num_accepted_tokens"] / counters["num_drafts"] == vllm_mean_acceptance_length(STEPS)
    assert vllm_counters(TARGET_ONLY)["num_accepted_tokens_per_pos"] == []


def test_draft_time_share():
    assert draft_time_share(STEPS) == pytest.approx(1.4 / 5.0)
    assert draft_time_share(TARGET_ONLY) == 0.0
    assert draft_time_share([]) is None


def test_cost_ratio():
    assert cost_ratio(0.002, 0.02) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        cost_ratio(0.002, 0.0)


def test_predicted_speedup_hand_values():
    # (1 - 0.5^3) / (0.5 * (2 * 0.1 + 1)) = 0.875 / 0.6
    assert predicted_speedup(0.5, 2, 0.1) == pytest.approx(0.875 / 0.6)
    # c = 0: (1 - 0.8^4) / 0.2 = 0.5904 / 0.2
    assert predicted_speedup(0.8, 3, 0.0) == pytest.approx(2.952)
    # nothing accepted: one token per (num_draft_tokens * c + 1) time units
    assert predicted_speedup(0.0, 4, 0.25) == 0.5


def test_predicted_speedup_alpha_one_limit():
    assert predicted_speedup(1.0, 4, 0.25) == 2.5  # (4 + 1) / (4 * 0.25 + 1)
    assert predicted_speedup(1 - 1e-12, 4, 0.25) == pytest.approx(2.5, rel=1e-9)


def test_predicted_speedup_matches_paper_formula():
    alpha, num_draft_tokens, c = 0.73, 5, 0.05
    paper = (1 - alpha ** (num_draft_tokens + 1)) / ((1 - alpha) * (num_draft_tokens * c + 1))
    assert predicted_speedup(alpha, num_draft_tokens, c) == pytest.approx(paper, rel=1e-12)


@pytest.mark.parametrize("alpha", [-0.1, 1.1, math.nan])
def test_predicted_speedup_rejects_bad_alpha(alpha):
    with pytest.raises(ValueError):
        predicted_speedup(alpha, 4, 0.1)


def test_speedup_is_ratio_of_means_not_mean_of_ratios():
    baseline, speculative = [10.0, 100.0], [30.0, 120.0]
    assert speedup(baseline, speculative) == pytest.approx(75 / 55)
    mean_of_ratios = (30 / 10 + 120 / 100) / 2  # 2.1
    assert speedup(baseline, speculative) != pytest.approx(mean_of_ratios)


def test_speedup_rejects_mismatched_lists():
    with pytest.raises(ValueError):
        speedup([10.0], [20.0, 30.0])
    with pytest.raises(ValueError):
        speedup([], [])


def test_median_and_spread():
    assert median_and_spread([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0, 10.0)
    assert median_and_spread([4.0]) == (4.0, 4.0, 4.0)
    with pytest.raises(ValueError):
        median_and_spread([])
