"""Lookup first, model elsewhere, with a plain and a feature draft: both sides draft and follow each
other with exact greedy output, and each side drafts its own length (the rest of the exactness
table: test_exactness.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_PAIR, cached

from specdec_cli.commands.verify import checks, statistics
from specdec_cli.config import TinyModel, parse_config
from specdec_cli.decoding.drafter import Drafter
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.errors import SpecdecError
from specdec_cli.loading.checkpoints import build_tiny
from specdec_cli.methods.feature.draft import init_draft
from specdec_cli.methods.feature.drafter import FeatureDrafter
from specdec_cli.methods.lookup import LookupFirstDrafter
from specdec_cli.methods.model import ModelDrafter
from specdec_cli.methods.ngram import NgramDrafter
from specdec_cli.pair import load_pair

PROMPT = "Copy this: the cat sat on the mat. Again: the cat sat on the mat. Once more: the cat"


def hybrid(target, kind: str) -> LookupFirstDrafter:
    vocab = target.config.vocab_size
    if kind == "feature":
        draft = init_draft(target, 1, torch.arange(vocab)).eval()
        model = FeatureDrafter(draft, draft.config.vocab_size)
    else:
        model = ModelDrafter(cached(build_tiny(TinyModel(seed=0, noise=0.005)).eval()))
    return LookupFirstDrafter(NgramDrafter(3, 2, vocab, torch.device("cpu")), model)


class Counting(Drafter):
    """Wraps the hybrid to count which side drafted each block (the drafter itself is the real one)."""

    def __init__(self, drafter):
        self.drafter, self.by_model, self.by_lookup = drafter, 0, 0
        self.widths = {True: [], False: []}  # block widths by whether the model drafted them
        self.reads_target_states = drafter.reads_target_states

    def start(self, *args):
        self.drafter.start(*args)

    def propose(self, *args):
        out = self.drafter.propose(*args)
        if out[0].shape[1]:
            self.by_model += self.drafter.model_drafted
            self.by_lookup += not self.drafter.model_drafted
            self.widths[self.drafter.model_drafted].append(out[0].shape[1])
        return out

    def commit(self, *args):
        self.drafter.commit(*args)

    def follow(self, *args):
        self.drafter.follow(*args)

    def keep(self, rows):
        self.drafter.keep(rows)


@pytest.mark.parametrize("kind", ["model", "feature"])
def test_greedy_output_is_the_targets(tiny_target, tokenizer, kind):
    prompt = tokenizer.encode(PROMPT)
    baseline = SpeculativeDecoder(cached(tiny_target), None, SamplingParams(), 1, set()).generate(prompt, 48, 0)
    drafter = Counting(hybrid(tiny_target, kind))
    result = SpeculativeDecoder(cached(tiny_target), drafter, SamplingParams(), 3, set()).generate(prompt, 48, 0)
    assert result.token_ids == baseline.token_ids
    assert drafter.by_lookup > 0 and drafter.by_model > 0  # both sides drafted, and followed each other


class CountingTrees(Counting):
    """Counts which side drafted each tree block."""

    def propose_tree(self, *args):
        tree = self.drafter.propose_tree(*args)
        self.by_model += self.drafter.model_drafted
        self.by_lookup += not self.drafter.model_drafted
        return tree

    def commit_tree(self, *args):
        self.drafter.commit_tree(*args)


@pytest.mark.parametrize("kind", ["model", "feature"])
def test_greedy_trees_are_the_targets(tiny_target, tokenizer, kind):
    """Lookup's trie where it finds a match, the model's tree elsewhere, at batch 1 and 4."""
    prompts = [tokenizer.encode(p) for p in (PROMPT, "abc abc abc", "Hello there", "a b a b a b a")]
    alone = SpeculativeDecoder(cached(tiny_target), None, SamplingParams(), 1, set())
    expected = [alone.generate(p, 40, 0).token_ids for p in prompts]
    for shape in (TreeShape(3, 2, 6), TreeShape(4, 3, 12)):
        drafter = CountingTrees(hybrid(tiny_target, kind))
        decoder = SpeculativeDecoder(cached(tiny_target), drafter, SamplingParams(), shape.depth, set(), shape)
        assert [r.token_ids for r in decoder.generate_batch(prompts, 40, 0)] == expected
        assert decoder.generate(prompts[0], 40, 0).token_ids == expected[0]
        assert drafter.by_lookup > 0 and drafter.by_model > 0  # both sides drafted, and followed each other


def lookup_pair(lookup_tokens: int | None, num_draft_tokens: int, tree: dict | None = None):
    lookup = {"min_n": 2, **({} if lookup_tokens is None else {"num_draft_tokens": lookup_tokens})}
    config = parse_config(
        {
            **TINY_PAIR,
            "draft": {"tiny": {"seed": 0, "noise": 0.005}, "lookup": lookup},
            "speculation": {"num_draft_tokens": num_draft_tokens, **({} if tree is None else {"tree": tree})},
            "runtime": {"device": "cpu", "dtype": "float32", "threads": 1},
        }
    )
    return load_pair(config)


@pytest.mark.parametrize("lookup_tokens, num_draft_tokens", [(6, 2)])
def test_sampled_output_is_the_targets_where_each_side_drafts_its_own_length(lookup_tokens, num_draft_tokens):
    pair = lookup_pair(lookup_tokens, num_draft_tokens)
    assert isinstance(pair.decoder(SamplingParams()).drafter, LookupFirstDrafter)
    ids = pair.encode(PROMPT)
    rows = checks.check_model(pair, ids, "p", SamplingParams(temperature=0.8), 300, seed=0, significance=0.01)
    statistics.holm(rows, 0.01)
    assert [r.what for r in rows if r.status == statistics.FAIL] == []
    # checks 3 and 4 cover the longest block, lookup's where it is the longer
    longest = max(num_draft_tokens, lookup_tokens or 0)
    status = {r.check: r.status for r in rows}
    assert f"3 position {longest + 1}" in status and status[f"4 tokens 1-{longest + 1}"] == statistics.PASS


def test_lookup_blocks_draft_their_own_length():
    """Lookup 6 tokens, the model 2: each side's greedy blocks reach their own length, no further,
    and the output stays the target's."""
    pair = lookup_pair(lookup_tokens=6, num_draft_tokens=2)
    assert (
        pair.decoder(SamplingParams()).num_draft_tokens == 6
        and pair.decoder(SamplingParams(), num_draft_tokens=8).num_draft_tokens == 8
    )
    ids = pair.encode(PROMPT)
    assert checks.check_greedy(pair, ids, "p", 48, seed=0).status == statistics.PASS
    decoder = pair.decoder(SamplingParams())
    decoder.drafter = counting = Counting(decoder.drafter)
    decoder.generate(ids, 48, 0)
    assert max(counting.widths[True]) == 2 and max(counting.widths[False]) == 6


def lookup_blocks(params: SamplingParams) -> list[tuple[int, int]]:
    """(width, accepted) of each lookup block, lookup up to 6 tokens and the model 2. The target here
    is a fixed token stream: it keeps draft tokens while they match the stream, then emits the
    stream's next token (all the drafter's lengths depend on)."""
    pattern = list(range(100, 110))
    stream = pattern[5:] + pattern * 5
    stream.insert(17, 200)  # a token the context never had
    model = ModelDrafter(cached(build_tiny(TinyModel(seed=0, noise=0.005)).eval()))
    drafter = LookupFirstDrafter(NgramDrafter(3, 2, 258, torch.device("cpu")), model, lookup_tokens=6, model_tokens=2)
    drafter.start([pattern * 2 + pattern[:5]], 128, None)
    generator = torch.Generator().manual_seed(0)
    done, blocks = 0, []
    while done < 40:
        drafts = drafter.propose(6, params, generator)[0][0].tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == stream[done + accepted]:
            accepted += 1
        if not drafter.model_drafted:
            blocks.append((len(drafts), accepted))
        drafter.commit([drafts], [accepted], [stream[done + accepted]], None)
        done += accepted + 1
    return blocks


def test_sampled_lookup_blocks_start_at_the_models_length_and_double_while_accepted_whole():
    # 2, 4, 6, 6 while the stream copies its context, back to 2 after the block that met token 200
    assert lookup_blocks(SamplingParams(temperature=1.0))[:6] == [(2, 2), (4, 4), (6, 6), (6, 2), (2, 2), (4, 4)]
    # greedy lookup blocks are drafted at full length from the start
    assert lookup_blocks(SamplingParams())[:4] == [(6, 6), (6, 6), (6, 3), (6, 6)]


def test_lookup_length_is_checked():
    with pytest.raises(SpecdecError, match="lookup num_draft_tokens must be between 1 and 256, got 0"):
        parse_config({**TINY_PAIR, "draft": {"tiny": {"seed": 0}, "lookup": {"num_draft_tokens": 0}}})
    with pytest.raises(SpecdecError, match="num_draft_tokens"):  # the ngram drafter's length is the decoder's
        parse_config({**TINY_PAIR, "draft": {"ngram": {"num_draft_tokens": 6}}})


@pytest.mark.parametrize("kind", ["model", "feature"])
def test_the_model_follows_blocks_it_did_not_draft(tiny_target, tokenizer, kind):
    """After lookup and model blocks in turn, the model drafts what it drafts from a fresh start on
    the whole context: no token it did not draft was lost or read twice."""
    drafter = hybrid(tiny_target, kind)
    counting = Counting(drafter)
    SpeculativeDecoder(cached(tiny_target), counting, SamplingParams(), 3, set()).generate(
        tokenizer.encode(PROMPT), 40, 0
    )
    assert counting.by_lookup > 0 and counting.by_model > 0
    [context] = drafter.lookup.contexts  # everything verified, the last block's token included
    target = cached(tiny_target)
    target.reset(len(context))
    states = target.forward(torch.tensor([context[:-1]]), hidden=True).hidden
    fresh = hybrid(tiny_target, kind).model
    fresh.start([context], len(context) + 8, states)
    greedy = SamplingParams()
    assert drafter.model.propose(3, greedy, None)[0].tolist() == fresh.propose(3, greedy, None)[0].tolist()


def test_titles_name_each_sides_length():
    assert parse_config(TINY_PAIR).describe_drafting() == "3 draft tokens"
    config = parse_config(
        {
            **TINY_PAIR,
            "draft": {"tiny": {"seed": 0}, "lookup": {"num_draft_tokens": 6}},
            "speculation": {"num_draft_tokens": 2, "confidence_threshold": 0.2},
        }
    )
    assert config.describe_drafting() == "2 draft tokens (fewer below confidence 0.2), up to 6 by prompt lookup"
