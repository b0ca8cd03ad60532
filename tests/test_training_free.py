"""Drafters that need no training: suffix decoding (methods/suffix.py) and token recycling
(methods/recycling.py). Their structures hold what they say (substring counts, the shared cache of
earlier answers, the adjacency table, the tree template), and a q that is not their drafts' one-hot
is caught. Their exact output is in the exactness table (test_exactness.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from conftest import earlier_answers

from specdec_cli.commands.verify import checks, statistics
from specdec_cli.config import SuffixSettings, load_config
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.methods import registry
from specdec_cli.methods.recycling import RecyclingDrafter, template
from specdec_cli.methods.suffix import GrowingTrie, SuffixDrafter, SuffixTrie
from specdec_cli.pair import load_pair

CPU = torch.device("cpu")
TREE = {"depth": 3, "top_k": 2, "max_nodes": 6}
PROMPTS = ["abc abc abc abc abc", "Hello there, hello there, hello", "one two one two one two", "H"]
KINDS = {  # the pair's draft section and tree
    "suffix": ({"suffix": {"max_spec_factor": 2.0}}, None),
    "suffix+tree": ({"suffix": {"max_spec_factor": 2.0}}, TREE),
    "model+suffix": ({"tiny": {"seed": 0, "noise": 0.005}, "suffix": {"num_draft_tokens": 5}}, None),
    "recycling": ({"recycling": {"candidates": 4}}, None),
    "recycling+tree": ({"recycling": {"candidates": 4}}, TREE),
}


def pair_of(write_config, kind: str):
    draft, tree = KINDS[kind]
    return load_pair(load_config(str(write_config({"draft": draft, "speculation": {"tree": tree}}))))


# ---------------------------------------------------------------- suffix decoding's parts


def counts(trie: SuffixTrie) -> Counter:
    """Every substring the trie holds, with its count."""
    found, stack = Counter(), [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            found[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return found


def substrings(sequences: list[list[int]], depth: int) -> Counter:
    return Counter(
        tuple(s[i:j]) for s in sequences for i in range(len(s)) for j in range(i + 1, min(i + depth, len(s)) + 1)
    )


def test_a_trie_counts_every_substring_up_to_its_depth_and_forgets_what_is_taken_out():
    rng = random.Random(0)
    sequences = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    shared = SuffixTrie(5)
    for s in sequences:
        shared.add(s)
    assert counts(shared) == substrings(sequences, 5)
    grown = GrowingTrie(5, sequences[0][:3])
    grown.extend(sequences[0][3:])
    assert counts(grown) == substrings(sequences[:1], 5)
    for s in sequences[1:]:
        shared.add(s, -1)
    assert counts(shared) == substrings(sequences[:1], 5)  # nothing left of the others, no empty nodes


def drafter(**settings) -> SuffixDrafter:
    """Suffix decoding as the registry builds it from draft.suffix, for a target of 258 ids."""
    target = registry.Target(None, None, 258, CPU, torch.float32, "float", False, 0.0)
    return registry.SUFFIX.build(SuffixSettings(**settings), target).drafter


def test_suffix_decoding_drafts_the_most_frequent_continuation_of_the_best_match():
    d = drafter()
    d.start([[1, 2, 3, 4, 5, 1, 2, 3]], 64, None)
    assert d.lookup(8) == [4, 5, 1]  # a match of 3 tokens earns 3 (max_spec_factor 1)
    assert d.lookup(2) == [4, 5]  # the block's length caps it
    d = drafter(max_spec_factor=4.0)
    d.start([[1, 2, 3, 1, 2, 3, 1, 2, 9, 1, 2]], 64, None)
    assert d.lookup(3) == [3, 1, 2]  # "1 2" went on with 3 twice, with 9 once
    d = drafter(max_spec_factor=4.0, min_token_prob=0.7)
    d.start([[1, 2, 3, 1, 2, 3, 1, 2, 9, 1, 2]], 64, None)
    assert d.lookup(3) == []  # 2 of the 4 times "1 2" occurred: not sure enough to draft
    d.start([[5, 6, 7]], 64, None)
    assert d.lookup(3) == []  # nothing repeats


def test_a_shorter_match_wins_where_the_longest_leaves_the_trie_no_room():
    """A trie cut at depth 4 holds "1 2 3" with one token after it: the 3-token match drafts 1 token,
    "2 3" 2 and "3" 3, each followed by the same tokens half of the time; the summed estimates
    (0.5, 1.0, 1.5) pick the 1-token match."""
    d = drafter(max_tree_depth=4, max_spec_factor=4.0)
    d.start([[1, 2, 3, 4, 5, 6, 1, 2, 3]], 64, None)
    assert d.lookup(8) == [4, 5, 6]


def test_a_suffix_tree_grows_best_first_with_distinct_siblings():
    d = drafter(max_spec_factor=8.0, min_token_prob=0.0)
    d.start([[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]], 64, None)
    shape = TreeShape(depth=3, top_k=2, max_nodes=5)
    tokens, parents = d.lookup_tree(shape, 0)
    # "1 2" went on with 3 (3 of 5 times), 4, 5; "1 2 3" with 1, "1 2 3 1" with 2, "1 2 4" with 1:
    # best first, at most 2 children a node (4 before 5: as frequent, seen first), 3 deep, 5 nodes
    assert (tokens, parents) == ([3, 1, 2, 4, 1], [0, 1, 2, 0, 4])
    assert all(p <= i for i, p in enumerate(parents))  # a parent (slot p = node p - 1) before its children
    siblings = [(p, t) for p, t in zip(parents, tokens)]
    assert len(set(siblings)) == len(siblings)
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    assert max(depth) <= shape.depth


def test_earlier_requests_answers_are_drafted_but_never_a_requests_own():
    d = drafter(max_spec_factor=4.0)
    d.start([[50, 51]], 64, None)
    d.commit([[]], [0], [7], None)
    d.commit([[]], [0], [8], None)
    d.commit([[]], [0], [9], None)  # answer 7 8 9
    d.start([[60, 7]], 64, None)  # another request: "7" went on with 8 9 in the earlier answer
    assert d.lookup(3) == [8, 9]  # a match of 1 token earns 4 (max_spec_factor 4): the answer ends after 9
    d.commit([[8]], [1], [9], None)
    d.start([[50, 51], [50, 51]], 64, None)  # the first prompt again (twice): its answer is out of the cache
    assert counts(d.shared) == substrings([[8, 9]], 24)
    d.start([[70]], 64, None)  # back in once no row runs that prompt
    assert counts(d.shared) == substrings([[7, 8, 9], [8, 9]], 24)


def test_the_shared_cache_keeps_the_last_max_cached_requests_answers():
    d = drafter(max_cached_requests=2)
    answers = [[10, 11, 12], [20, 21], [30, 31, 32]]
    for i, answer in enumerate(answers):
        d.start([[i]], 64, None)
        d.commit([answer[:-1]], [len(answer) - 1], [answer[-1]], None)
    d.start([[9]], 64, None)
    assert counts(d.shared) == substrings(answers[1:], 24)
    assert counts(drafter(max_cached_requests=0).shared) == Counter()


# ---------------------------------------------------------------- token recycling's parts


@pytest.mark.parametrize("shape", [TreeShape(3, 2, 6), TreeShape(4, 3, 16), TreeShape(1, 4, 4), TreeShape(6, 2, 12)])
def test_the_recycling_template_is_a_tree_of_the_shape(shape):
    parents, ranks = template(shape)
    assert len(parents) == min(shape.max_nodes, shape.candidates)
    depth = [0]
    for i, (parent, rank) in enumerate(zip(parents, ranks)):
        assert parent <= i and 0 <= rank < shape.top_k  # its parent is an earlier node (or the root)
        depth.append(depth[parent] + 1)
    assert max(depth) <= shape.depth
    assert len(set(zip(parents, ranks))) == len(parents)  # distinct children
    assert ranks[0] == 0 and parents[:2] == (0, 1 if shape.depth > 1 else 0)  # the first-ranked path first


def test_recycling_learns_each_tokens_next_tokens_from_the_verification_and_drafts_along_them():
    d = RecyclingDrafter(3, 10, CPU)
    d.start([[4, 5]], 16, None)
    logits = torch.zeros(1, 3, 10)
    logits[0, 0, [7, 1, 2]] = torch.tensor([3.0, 2.0, 1.0])  # after 5
    logits[0, 1, [8, 3, 2]] = torch.tensor([3.0, 2.0, 1.0])  # after 7
    logits[0, 2, 9] = 5.0  # after a position that held no token: ignored
    d.observe(torch.tensor([[5, 7, -1]]), logits)
    assert d.table[5].tolist() == [7, 1, 2] and d.table[7].tolist() == [8, 3, 2]
    assert d.table[9].tolist() == [0, 1, 2]  # never verified: placeholders
    tokens, q = d.propose(3, SamplingParams(temperature=1.0), None)
    assert tokens.tolist() == [[7, 8, 0]]
    assert torch.equal(q, torch.nn.functional.one_hot(tokens, 10).float())
    tree = d.propose_tree(TreeShape(2, 2, 4), SamplingParams(), None)
    assert tree.tokens.tolist() == [[7, 8, 1, 3]] and tree.parents.tolist() == [[0, 1, 0, 1]]


# ---------------------------------------------------------------- a broken q


@pytest.mark.parametrize("kind", ["suffix", "recycling"])
def test_a_q_that_is_not_the_drafts_one_hot_is_caught(kind, write_config, monkeypatch):
    """The bug: reporting how likely the drafter thought its draft (here 0.3 on it, the rest spread)
    as q, while it drafts that token every time."""
    pair = pair_of(write_config, kind)
    propose = pair.drafter.propose

    def unsure(num_draft_tokens, params, generator):
        tokens, q = propose(num_draft_tokens, params, generator)
        return tokens, None if q is None else 0.3 * q + 0.7 / q.shape[-1] * (tokens >= 0)[..., None]

    monkeypatch.setattr(pair.drafter, "propose", unsure)
    params, ids = SamplingParams(temperature=1.0), pair.encode(PROMPTS[0], raw=True)
    earlier_answers(pair, ids, params)
    rows = checks.check_model(pair, ids, "p", params, 200, 0, 0.01)
    statistics.holm(rows, 0.01)
    assert [r.check for r in rows if r.status == statistics.FAIL]
