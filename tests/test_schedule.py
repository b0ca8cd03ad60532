"""Draft tokens by batch size (`speculation.schedule`): read as vLLM reads its
`num_speculative_tokens_per_batch_size`, refused in one line when malformed, and exact: rows leave a
batch as they finish, the block length changes with the batch's size (to none, and back), and every
row's greedy output stays the target's, whichever drafter drafts."""

from __future__ import annotations

import pytest
import torch
from block_checkpoints import TARGET, write_dflash, write_medusa_pt
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.config import load_config
from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.drafter import Drafter
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.params import BatchSchedule, SamplingParams
from specdec_cli.errors import SpecdecError
from specdec_cli.methods.feature.draft import init_draft
from specdec_cli.methods.feature.draft import wire as wire_feature_draft
from specdec_cli.pair import load_pair
from specdec_cli.vllm_engine.settings import speculative_config, vllm_schedule

GREEDY = SamplingParams()
PROMPTS = [[1, 40, 41, 42, 40, 41], [7, 8, 9, 7, 8], [100, 101, 102, 103], [5, 6, 5, 6, 5]]
MAX_NEW = 40


def test_batch_sizes_map_to_draft_tokens_as_vllm_maps_them():
    # vLLM's own example: a size between two ranges takes the earlier one's tokens, past the last the last one's
    schedule = BatchSchedule.parse([[32, 128, 2], [1, 16, 3]])
    assert [schedule.tokens(b) for b in (1, 16, 17, 31, 32, 128, 129, 10_000)] == [3, 3, 3, 3, 2, 2, 2, 2]
    assert schedule.describe() == "1-16: 3, 32+: 2" and schedule.most == 3
    assert [BatchSchedule.parse([[1, 2, 4], [3, 3, 1], [4, 8, 0]]).tokens(b) for b in range(1, 10)] == [
        4, 4, 1, 0, 0, 0, 0, 0, 0,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "schedule, message",
    [
        ({"greedy": [[2, 4, 1]]}, "starts at batch size 1"),
        ({"greedy": [[1, 4, 1], [4, 8, 0]]}, "overlap at batch size 4"),
        ({"sampled": [[1, 4, -1]]}, "draft tokens >= 0"),
        ({"sampled": [[1, 4]]}, "each entry is"),
        ({"greedy": []}, "non-empty list"),
        ({"greedy": "1-4: 2"}, "must be list"),
        ({"greedy": [[1, 4, 9]]}, "more than the chain's 3"),
        ({"greedy": [[1, 4, 1]], "tree": None}, "unknown key"),
    ],
)
def test_a_bad_schedule_is_one_error_line(write_config, schedule, message):
    config = write_config({"speculation": {"num_draft_tokens": 3, "schedule": schedule}})
    result = CliRunner().invoke(app, ["generate", "-c", str(config), "-p", "hi"])
    assert result.exit_code == 2 and result.output.count("Error:") == 1 and message in result.output, result.output


def test_a_schedule_goes_with_chains_only(write_config):
    config = write_config({"speculation": {"tree": {"depth": 2, "max_nodes": 6}, "schedule": {"greedy": [[1, 4, 1]]}}})
    result = CliRunner().invoke(app, ["generate", "-c", str(config), "-p", "hi"])
    assert result.exit_code == 2 and "drop it or the tree" in result.output, result.output


def stops_where(alone: list[list[int]]) -> int:
    """An EOS token that ends the rows' target-alone outputs at different lengths, one row running to
    the limit: the batch shrinks step by step."""
    for token in sorted({t for row in alone for t in row}):
        stops = [row.index(token) if token in row else MAX_NEW for row in alone]
        if len(set(stops)) >= 3 and max(stops) == MAX_NEW and min(stops) >= 4:
            return token
    raise AssertionError("no token ends the rows at different lengths")


def scheduled_pair(kind: str, write_config, tmp_path, tiny_target, schedule: list):
    """(the target's CachedModel, the drafter) of `kind`, as the assembly builds it, with `schedule`."""
    if kind == "feature":  # no config names a feature draft built in the test: built as the assembly does
        vocab = tiny_target.config.vocab_size
        feature = wire_feature_draft(init_draft(tiny_target, 1, torch.arange(vocab)).eval(), vocab, 0.0, False)
        decoder = SpeculativeDecoder(
            CachedModel(tiny_target, vocab, feature.state_layers),
            feature.drafter,
            GREEDY,
            3,
            set(),
            schedule=BatchSchedule.parse(schedule),
        )
        return decoder
    draft = {
        "model": {"tiny": {"seed": 0, "noise": 0.005}},
        "lookup-first": {"tiny": {"seed": 0, "noise": 0.005}, "lookup": {"max_n": 3, "min_n": 1}},
        "ngram": {"ngram": {"max_n": 3, "min_n": 1}},
        "suffix": {"suffix": {}},
        "recycling": {"recycling": {"candidates": 4}},
        "medusa": {"checkpoint": str(tmp_path / "medusa")},
        "dflash": {"checkpoint": str(tmp_path / "dflash")},
    }[kind]
    if kind == "medusa":
        write_medusa_pt(tmp_path / "medusa")
    if kind == "dflash":
        write_dflash(tmp_path / "dflash")
    target = TARGET if kind in ("medusa", "dflash") else {"tiny": {"seed": 0}}
    config = write_config(
        {"target": target, "draft": draft, "speculation": {"num_draft_tokens": 3, "schedule": {"greedy": schedule}}}
    )
    return load_pair(load_config(str(config))).decoder(GREEDY)


class Counting(Drafter):
    """Passes every call to the drafter, noting the batch's size at each `propose` and `follow`."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.reads_target_states, self.observes = inner.reads_target_states, inner.observes
        self.rows, self.proposed_at, self.followed_at = 0, [], []

    def start(self, prompts, max_tokens, target_states):
        self.rows = len(prompts)
        self.inner.start(prompts, max_tokens, target_states)

    def propose(self, num_draft_tokens, params, generator):
        self.proposed_at.append((self.rows, num_draft_tokens))
        return self.inner.propose(num_draft_tokens, params, generator)

    def commit(self, *block):
        self.inner.commit(*block)

    def follow(self, tokens, target_states):
        self.followed_at.append(self.rows)
        self.inner.follow(tokens, target_states)

    def observe(self, inputs, logits):
        self.inner.observe(inputs, logits)

    def keep(self, rows):
        self.rows = len(rows)
        self.inner.keep(rows)


KINDS = ["model", "feature", "ngram", "suffix", "recycling", "lookup-first", "medusa", "dflash"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("schedule", [[[1, 2, 3], [3, 4, 0]], [[1, 2, 0], [3, 4, 3]]], ids=["then-draft", "then-alone"])
def test_rows_leaving_change_the_block_length_and_the_output_stays_the_targets(
    kind, schedule, write_config, tmp_path, tiny_target
):
    decoder = scheduled_pair(kind, write_config, tmp_path, tiny_target, schedule)
    decoder.drafter = counting = Counting(decoder.drafter)
    target_alone = SpeculativeDecoder(decoder.target, None, GREEDY, 1, set())
    alone = [r.token_ids for r in target_alone.generate_batch(PROMPTS, MAX_NEW, seed=0, ignore_eos=True)]
    target_alone.eos_token_ids = decoder.eos_token_ids = {stops_where(alone)}
    expected = [r.token_ids for r in target_alone.generate_batch(PROMPTS, MAX_NEW, seed=0)]
    assert [r.token_ids for r in decoder.generate_batch(PROMPTS, MAX_NEW, seed=0)] == expected
    # drafted where the schedule says so, at its length; followed the target alone elsewhere
    tokens = BatchSchedule.parse(schedule).tokens
    # (shorter only near the token limit, where the block's own token needs one of the remaining slots)
    assert counting.proposed_at[0][1] == 3 and all(
        0 < num_draft_tokens <= tokens(rows) for rows, num_draft_tokens in counting.proposed_at
    )
    assert {tokens(rows) for rows in counting.followed_at[:-1]} == {0}
    assert len(set(rows for rows, _ in counting.proposed_at) | set(counting.followed_at)) >= 3


def test_verify_distribution_passes_a_scheduled_config(write_config):
    config = write_config(
        {
            "speculation": {"num_draft_tokens": 3, "schedule": {"sampled": [[1, 1, 2], [2, 64, 3]]}},
            "sampling": {"temperature": 1.0, "seed": 0},
        }
    )
    result = CliRunner().invoke(app, ["verify-distribution", "-c", str(config), "--samples", "300", "--json"])
    assert result.exit_code == 0, result.output


def test_vllm_reads_the_schedule_as_its_per_batch_size_setting(write_config):
    schedule = {"greedy": [[4, 8, 0], [1, 3, 2]], "sampled": [[1, 3, 2], [4, 8, 0]]}
    cfg = load_config(str(write_config({"draft": {"ngram": {}}, "speculation": {"schedule": schedule}})))
    speculative = speculative_config(cfg.draft, 3, vllm_schedule(cfg, [0.0, 1.0]))
    assert speculative["num_speculative_tokens_per_batch_size"] == [[1, 3, 2], [4, 8, 0]]
    assert "num_speculative_tokens_per_batch_size" not in speculative_config(cfg.draft, 3, None)
    # one vLLM engine serves every temperature of a run: one schedule for them all, or none
    cfg.speculation.schedule.sampled = [[1, 8, 1]]
    assert vllm_schedule(cfg, [0.0]).ranges == ((1, 3, 2), (4, 8, 0))
    with pytest.raises(SpecdecError, match="one speculation.schedule for every temperature"):
        vllm_schedule(cfg, [0.0, 1.0])
