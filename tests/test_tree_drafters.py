"""Draft trees of the drafters that draft a whole block at once: Medusa heads and DFlash (the static
top-k tree over their positions) and prompt lookup (a trie of several matches). Their structure
against enumeration, their greedy output against the target alone at several shapes, and a broken
lookup trie (siblings that repeat a token) verify-distribution's checks must catch. Their sampled
output is in the exactness table (test_exactness.py)."""

from __future__ import annotations

from itertools import islice

import pytest
import torch
from block_checkpoints import TARGET, write_dflash, write_medusa_vllm
from broken_rules import siblings_tested_against_p
from conftest import failing, tree_paths

from specdec_cli.commands.verify import checks, statistics
from specdec_cli.config import load_config
from specdec_cli.decoding import tree
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.methods.ngram import NgramDrafter
from specdec_cli.pair import load_pair

PROMPTS = ["Hello there, how are you?", "H", "abc abc abc abc", "Once upon a time, in a land far away"]
SHAPES = [TreeShape(3, 2, 6), TreeShape(2, 3, 9), TreeShape(4, 1, 4)]
RUNS = 300
ONE_THREAD, SIGNIFICANCE = {"runtime": {"threads": 1}}, 0.01
SHAPE = TreeShape(3, 3, 9)  # the configs': lookup's tree has three branches


def pair_of(write_config, tmp_path, kind: str):
    if kind == "ngram":
        target, draft = {"tiny": {"seed": 0}}, {"ngram": {"max_n": 3, "min_n": 1}}
    else:
        (write_medusa_vllm if kind == "medusa" else write_dflash)(tmp_path / kind)
        target, draft = TARGET, {"checkpoint": str(tmp_path / kind)}
    tree_spec = {"depth": SHAPE.depth, "top_k": SHAPE.top_k, "max_nodes": SHAPE.max_nodes}
    config = write_config({"target": target, "draft": draft, "speculation": {"tree": tree_spec}, **ONE_THREAD})
    return load_pair(load_config(str(config)))


# ---------------------------------------------------------------- structure


def full_static_tree(log_probs: torch.Tensor, shape: TreeShape) -> set[tuple]:
    """Enumerated: every node at depth i has depth i + 1's top_k as children, whatever its path;
    the max_nodes paths of the highest summed log probability."""
    scores, level = {}, [((), 0.0)]
    for row in log_probs:
        top = row.topk(shape.top_k).indices.tolist()
        level = [(path + (t,), score + float(row[t])) for path, score in level for t in top]
        scores.update(level)
    return set(sorted(scores, key=scores.get, reverse=True)[: shape.max_nodes])


@pytest.mark.parametrize("shape", [TreeShape(3, 2, 7), TreeShape(4, 3, 16), TreeShape(2, 4, 20), TreeShape(3, 1, 3)])
def test_static_tree_keeps_the_most_probable_nodes_of_the_full_tree(shape):
    vocab = 12
    log_probs = (2 * torch.randn(2, shape.depth, vocab, generator=torch.Generator().manual_seed(0))).log_softmax(-1)
    drafted = tree.static_tree(log_probs, shape)
    for row in range(2):
        assert set(tree_paths(drafted, row)[1:]) == full_static_tree(log_probs[row], shape)


def continuations_context() -> NgramDrafter:
    # the final 2-gram (7, 8) follows earlier occurrences with 1 2, 3 4 and 1 5 (the most recent)
    drafter = NgramDrafter(2, 2, 16, torch.device("cpu"))
    drafter.start([[7, 8, 1, 2, 7, 8, 3, 4, 7, 8, 1, 5, 7, 8]], 32, None)
    return drafter


@pytest.mark.parametrize(
    "shape, tokens, parents",
    [
        (TreeShape(2, 3, 6), [1, 5, 3, 4, 2], [0, 1, 0, 3, 1]),  # 1 2 joins 1 5 below their shared 1
        (TreeShape(2, 2, 6), [1, 5, 3, 4], [0, 1, 0, 3]),  # two branches
        (TreeShape(2, 3, 3), [1, 5, 3], [0, 1, 0]),  # cut at max_nodes
        (TreeShape(1, 3, 3), [1, 3], [0, 0]),  # 1 2 adds nothing at depth 1: no branch
    ],
)
def test_lookup_tree_is_a_trie_of_the_most_recent_continuations(shape, tokens, parents):
    assert continuations_context().lookup_tree(shape, 0) == (tokens, parents)


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("kind", ["ngram", "medusa", "dflash"])
def test_greedy_trees_are_the_target_alone(write_config, tmp_path, kind):
    pair = pair_of(write_config, tmp_path, kind)
    prompts = [pair.encode(p, raw=True) for p in PROMPTS]  # "H": Medusa has no state in its first block
    alone = pair.decoder(SamplingParams(), speculative=False)
    expected = [alone.generate(ids, 24, 0).token_ids for ids in prompts]
    for shape in SHAPES:
        decoder = pair.decoder(SamplingParams(), tree=shape)
        assert [r.token_ids for r in decoder.generate_batch(prompts, 24, 0)] == expected  # batch 4
        one = decoder.generate(prompts[3], 24, 0)
        assert one.token_ids == expected[3]  # batch 1
        if kind != "ngram" and shape.top_k == 1:  # a chain as deep as the 3 heads / 3 block positions
            assert max(s.drafted for s in one.steps) == 3


def branch_prompt(tokenizer, target, temperature: float = 0.0) -> tuple[list[int], int]:
    """A prompt whose final 3-gram "xyz" was followed by b a, by b b, and most recently by Q: lookup's
    chain drafts Q, its tree of three branches also b (once: the trie merges both). b is searched over
    every byte: greedy, the target's most likely token after the prompt; sampled, a token it takes
    with a probability near 1/2, where taking it twice as often as it should shows best."""
    xyz = tokenizer.encode("xyz")

    def prompt(b: int) -> list[int]:
        return xyz + [b] + tokenizer.encode("a and ") + xyz + [b] + tokenizer.encode("b then ") + xyz + [81] + xyz

    candidates = torch.arange(256)
    with torch.no_grad():
        logits = target(torch.tensor([prompt(b) for b in candidates.tolist()])).logits[:, -1]
    if not temperature:
        b = int(logits.softmax(-1)[candidates, candidates].argmax())
        assert logits[b].argmax() == b
        return prompt(b), b
    p = (logits / temperature).softmax(-1)[candidates, candidates]
    b = int((p * (1 - p)).argmax())
    assert 0.2 < p[b] < 0.8
    return prompt(b), b


def test_a_lookup_tree_accepts_a_match_the_chain_does_not_draft(write_config, tmp_path, tokenizer):
    pair = pair_of(write_config, tmp_path, "ngram")
    ids, b = branch_prompt(tokenizer, pair.target.model)
    chain = pair.decoder(SamplingParams(), num_draft_tokens=3).generate(ids, 8, 0)
    trie = pair.decoder(SamplingParams()).generate(ids, 8, 0)
    assert trie.token_ids == chain.token_ids and trie.token_ids[0] == b
    assert chain.steps[0].accepted == 0 and trie.steps[0].accepted >= 1


# ---------------------------------------------------------------- sampled


def rows_of(pair, ids: list[int], params: SamplingParams, batch_size: int) -> list[statistics.Row]:
    rows = checks.check_model(pair, ids, "p", params, RUNS, seed=0, significance=SIGNIFICANCE, batch_size=batch_size)
    rows += [checks.check_greedy(pair, ids, "p", 24, seed=0)]
    statistics.holm(rows, SIGNIFICANCE)
    return rows


def accepted(rows: list[statistics.Row]) -> int:
    """Draft tokens accepted over the runs (from the first row's note)."""
    return int(rows[0].note.split("/")[0])


def branches_not_merged(self, shape: TreeShape, row: int) -> tuple[list[int], list[int]]:
    """Bug: every continuation its own branch from the root, so siblings can repeat a token (the
    rule then tries it twice, as if it were two tokens: it comes out about twice as often)."""
    tokens: list[int] = []
    parents: list[int] = []
    for continuation in islice(self.continuations(shape.depth, row), shape.top_k):
        for i, token in enumerate(continuation[: shape.max_nodes - len(tokens)]):
            parents.append(len(tokens) if i else 0)  # the node before it, or the root
            tokens.append(token)
    return tokens, parents


@pytest.mark.parametrize(
    "inject",
    [
        None,
        lambda mp: mp.setattr(NgramDrafter, "lookup_tree", branches_not_merged),
        lambda mp: mp.setattr(tree, "try_children", siblings_tested_against_p),
    ],
    ids=["trie", "branches-not-merged", "siblings-against-p"],
)
def test_lookup_tree_checks_pass_and_catch_broken_rules(write_config, tmp_path, tokenizer, monkeypatch, inject):
    """A lookup trie is verified with `try_children` at T > 0 (a draft model's sampled tree is not):
    the deterministic-candidate rule's bugs are caught here. p' not renormalised under-samples the
    second branch only, too rare here: the one-node checks catch it (tests/test_tree.py)."""
    pair = pair_of(write_config, tmp_path, "ngram")
    ids, _ = branch_prompt(tokenizer, pair.target.model, temperature=0.6)
    if inject:
        inject(monkeypatch)
    rows = rows_of(pair, ids, SamplingParams(0.6), batch_size=4)
    assert bool(failing(rows)) == bool(inject)
    assert accepted(rows) > RUNS / 10
