"""Drafting stops at the first draft token the draft gives less than `confidence_threshold`: blocks get
shorter, and the output stays the target's (greedy identity, batch rows, the statistical checks)."""

from __future__ import annotations

import pytest
import torch
from conftest import cached

from specdec_cli.commands.verify import checks, statistics
from specdec_cli.config import load_config
from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.loading.target_states import target_layers
from specdec_cli.methods import model as model_drafters
from specdec_cli.methods.feature.draft import init_draft
from specdec_cli.methods.feature.drafter import FeatureDrafter
from specdec_cli.methods.model import ModelDrafter
from specdec_cli.pair import load_pair

GREEDY = SamplingParams()
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown", "Once upon a time, there", "abc abc"]
NUM_DRAFT_TOKENS = 4
TREE = TreeShape(3, 2, 6)


def drafter(kind: str, target, noisy_draft, threshold: float):
    if kind == "model":
        return ModelDrafter(cached(noisy_draft), threshold)
    return FeatureDrafter(
        init_draft(target, 1, torch.arange(target.config.vocab_size)).eval(), target.config.vocab_size, threshold
    )


def drafted_before_the_limit(steps) -> list[int]:
    return [s.drafted for s in steps[:-NUM_DRAFT_TOKENS]]  # the last blocks are cut by max_new_tokens anyway


@pytest.mark.parametrize("kind", ["model", "feature"])
@pytest.mark.parametrize("threshold", [0.2, 0.4])
def test_greedy_output_is_the_targets_with_shorter_blocks(tiny_target, noisy_draft, tokenizer, kind, threshold):
    prompt = tokenizer.encode(PROMPTS[0])
    alone = SpeculativeDecoder(cached(tiny_target), None, GREEDY, 1, set()).generate(prompt, 48, 0)
    always = SpeculativeDecoder(
        cached(tiny_target), drafter(kind, tiny_target, noisy_draft, 0), GREEDY, NUM_DRAFT_TOKENS, set()
    )
    stopping = SpeculativeDecoder(
        cached(tiny_target), drafter(kind, tiny_target, noisy_draft, threshold), GREEDY, NUM_DRAFT_TOKENS, set()
    )
    full, short = always.generate(prompt, 48, 0), stopping.generate(prompt, 48, 0)
    assert short.token_ids == full.token_ids == alone.token_ids
    assert set(drafted_before_the_limit(full.steps)) == {NUM_DRAFT_TOKENS}
    drafted = drafted_before_the_limit(short.steps)
    assert 0 in drafted and any(0 < d < NUM_DRAFT_TOKENS for d in drafted), (
        drafted
    )  # stopped at the first and later tokens


@pytest.mark.parametrize("shape", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["model", "feature"])
def test_each_row_is_its_prompt_alone(tiny_target, noisy_draft, tokenizer, kind, shape):
    """Shorter chains, and shallower trees (one stops growing at a frontier the draft is unsure of):
    every row of a batch is still its prompt decoded by the target alone."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    alone = SpeculativeDecoder(cached(tiny_target), None, GREEDY, 1, set())
    expected = [alone.generate(p, 32, 0).token_ids for p in prompts]
    drafts = drafter(kind, tiny_target, noisy_draft, 0.3)
    target = CachedModel(tiny_target, tiny_target.config.vocab_size, target_layers(drafts.model.model))
    depth = shape.depth if shape else NUM_DRAFT_TOKENS
    decoder = SpeculativeDecoder(target, drafts, GREEDY, depth, set(), shape)
    rows = decoder.generate_batch(prompts, 32, 0)
    assert [r.token_ids for r in rows] == expected
    # a tree's path is as deep as the tree: shallower trees show as fewer tokens drafted along it
    drafted = [s.drafted for r in rows for s in r.steps[:-depth]]
    assert depth in drafted and any(d < depth for d in drafted), drafted


@pytest.fixture
def stopping_pair(write_config):
    config = {
        "speculation": {"num_draft_tokens": NUM_DRAFT_TOKENS, "confidence_threshold": 0.3},
        "runtime": {"threads": 1},
    }
    return load_pair(load_config(str(write_config(config))))


def failing_checks(pair, params) -> list[str]:
    prompt = pair.encode("Hello there, how are you?")
    rows = checks.check_model(pair, prompt, "p", params, 300, seed=0, significance=0.01)
    statistics.holm(rows, 0.01)
    return [r.check for r in rows if not r.passed]


def test_sampled_output_is_distributed_as_the_target(stopping_pair, monkeypatch):
    params = SamplingParams(temperature=0.6)
    steps = stopping_pair.decoder(params).generate(stopping_pair.encode(PROMPTS[0]), 40, 0).steps
    assert any(d < NUM_DRAFT_TOKENS for d in drafted_before_the_limit(steps))  # the checks below see shorter blocks
    assert failing_checks(stopping_pair, params) == []
    # the bug this guards against: stopping at a draft token because of the token drawn (its own q)
    # rather than the draft's distribution; the checks see it
    drawn = {}

    def draft_token(logits, params, generator):
        drawn["token"], q = real_draft_token(logits, params, generator)
        return drawn["token"], q

    def confident_in_the_drawn_token(logits, q, threshold):
        return bool((q.gather(-1, drawn["token"][:, None]) >= threshold).any())

    real_draft_token = model_drafters.draft_token
    monkeypatch.setattr(model_drafters, "draft_token", draft_token)
    monkeypatch.setattr(model_drafters, "confident", confident_in_the_drawn_token)
    assert failing_checks(stopping_pair, params)


# ---------------------------------------------------------------- trees


@pytest.fixture
def stopping_tree_pair(write_config):
    tree_spec = {"depth": 3, "top_k": 3, "max_nodes": 9}
    config = {"speculation": {"tree": tree_spec, "confidence_threshold": 0.5}, "runtime": {"threads": 1}}
    return load_pair(load_config(str(write_config(config))))


def prune_unlikely_children(monkeypatch) -> None:
    """Bug: the threshold prunes nodes as EAGLE-2's cut does: the tree grows every depth, then drops
    each child drawn with q(x) below the threshold (and so its subtree): it looks at the tokens drawn."""
    real_propose_tree = ModelDrafter.propose_tree

    def propose_tree(self, shape, params, generator):
        drafted = real_propose_tree(self, shape, params, generator)
        rows = torch.arange(len(drafted.tokens))
        q_of_node = torch.stack(
            [
                drafted.sampled.q(rows, drafted.parents[:, i].clamp_min(0), self.model.vocab_size)[rows, token]
                for i, token in enumerate(drafted.tokens.T)
            ],
            dim=1,
        )
        return drafted._replace(parents=drafted.parents.masked_fill(q_of_node < self.confidence_threshold, -1))

    monkeypatch.setattr(ModelDrafter, "propose_tree", propose_tree)
    monkeypatch.setattr(model_drafters, "confident_frontier", lambda log_probs, threshold: True)


def test_sampled_trees_that_stop_are_distributed_as_the_target(stopping_tree_pair, monkeypatch):
    params = SamplingParams(temperature=0.6)
    steps = stopping_tree_pair.decoder(params).generate(stopping_tree_pair.encode(PROMPTS[0]), 40, 0).steps
    assert any(d < 3 for d in drafted_before_the_limit(steps))  # the checks below see shallower trees
    assert failing_checks(stopping_tree_pair, params) == []
    prune_unlikely_children(monkeypatch)
    assert failing_checks(stopping_tree_pair, params)
