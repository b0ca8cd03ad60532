"""Draft trees (decoding/tree.py): their structure and mask, the sampled rule against p on a small
vocabulary, the engine's trees against the target alone (greedy) and under verify-distribution's
checks (sampled), and named broken variants that those checks must catch. Each broken variant is a
realistic bug injected by monkeypatching the function the engine looks up."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from broken_rules import p_prime_not_renormalised, residual_without_clamp, siblings_tested_against_p
from conftest import cached, failing, tree_paths
from scipy import stats
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.commands.verify import checks, statistics
from specdec_cli.config import TinyModel, load_config
from specdec_cli.decoding import sampling, tree
from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.drafter import Drafter
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.decoding.sampling import residual, sample
from specdec_cli.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED
from specdec_cli.loading.checkpoints import build_tiny
from specdec_cli.loading.target_states import target_layers
from specdec_cli.methods.feature.draft import init_draft
from specdec_cli.methods.feature.drafter import FeatureDrafter
from specdec_cli.methods.feature.parts import feature_inputs
from specdec_cli.methods.model import ModelDrafter
from specdec_cli.pair import load_pair

SIGNIFICANCE = 0.01
PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "abc abc abc abc",
    "Once upon a time, in a land far away, there lived",
]
SHAPES = [TreeShape(4, 3, 16), TreeShape(3, 2, 6), TreeShape(5, 1, 5), TreeShape(2, 4, 20), TreeShape(1, 1, 1)]
ONE_THREAD = {"runtime": {"threads": 1}}
runner = CliRunner()


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # load_pair set it process-wide


# ---------------------------------------------------------------- structure


def reference_tree(log_probs, shape: TreeShape) -> tuple[dict, list]:
    """EAGLE-2's expansion by enumeration: log_probs(path) -> the draft's next-token log probabilities
    after the path [V]. Returns {path: score} of the kept nodes, and the fed frontiers (best first)."""
    candidates, frontier, fed = {}, [()], []
    for depth in range(shape.depth):
        new = {}
        for path in frontier:
            row = log_probs(path)
            for token in row.topk(shape.top_k).indices.tolist():
                new[path + (token,)] = candidates.get(path, 0.0) + float(row[token])
        candidates.update(new)
        frontier = sorted(new, key=new.get, reverse=True)[: shape.top_k]
        if depth < shape.depth - 1:
            fed.append(frontier)
    kept = sorted(candidates, key=candidates.get, reverse=True)[: shape.max_nodes]
    return {path: candidates[path] for path in kept}, fed


def grown_tree(table: torch.Tensor, shape: TreeShape) -> tuple[tree.DraftTree, torch.Tensor]:
    growth = tree.TreeGrowth(shape, 1, torch.device("cpu"))
    growth.grow(table[0, -1][None, None])
    for depth in range(1, shape.depth):
        growth.region([0])
        growth.grow(table[depth][growth.frontier_tokens[0]][None])
    return growth.select()


@pytest.mark.parametrize("shape", [TreeShape(3, 2, 7), TreeShape(4, 3, 16), TreeShape(2, 4, 20), TreeShape(3, 1, 3)])
def test_growth_is_eagle2s_dynamic_tree(shape):
    vocab = 12
    table = (2 * torch.randn(shape.depth, vocab + 1, vocab, generator=torch.Generator().manual_seed(0))).log_softmax(-1)
    expected, fed_frontiers = reference_tree(lambda path: table[len(path), path[-1] if path else -1], shape)
    drafted, fed = grown_tree(table, shape)
    paths = tree_paths(drafted)
    assert set(paths[1:]) == set(expected)  # the max_nodes most probable nodes
    for parent in set(drafted.parents[0].tolist()):  # siblings: most probable first
        sibling_scores = [expected[paths[i + 1]] for i, p in enumerate(drafted.parents[0].tolist()) if p == parent]
        assert sibling_scores == sorted(sibling_scores, reverse=True)
    # the draft's cache: the root in slot 0, then each fed frontier, best first
    fed_slot = {(): 0} | {
        path: 1 + d * shape.top_k + j for d, f in enumerate(fed_frontiers) for j, path in enumerate(f)
    }
    assert fed[0].tolist() == [fed_slot.get(path, -1) for path in paths]


def check_sampled_tree(drafted: tree.DraftTree, row: int, log_probs, shape: TreeShape) -> None:
    """A sampled tree against enumeration: each expanded node's q is the draft's after its path
    (log_probs(path) -> log q [V]) and it has top_k distinct children drawn from it; the nodes expanded
    at each depth are the frontier best by path log q; nothing else was cut (sampled_growth's count)."""
    grown, frontier = tree.sampled_growth(shape)
    paths = tree_paths(drafted, row)
    parents = [-1] + drafted.parents[row].tolist()
    assert len(paths) == 1 + grown.top_k + (grown.depth - 1) * frontier * grown.top_k
    score = {(): 0.0}
    for slot, path in enumerate(paths):
        children = [paths[i][-1] for i, parent in enumerate(parents) if parent == slot]
        expanded = int(drafted.sampled.of_slot[row, slot])
        if expanded < 0:
            assert children == []
            continue
        row_log_q = log_probs(path)
        q = drafted.sampled.q(torch.tensor([row]), torch.tensor([slot]), len(row_log_q))[0]
        torch.testing.assert_close(q, row_log_q.exp(), atol=1e-5, rtol=1e-4)
        assert len(set(children)) == len(children) == grown.top_k
        assert all(row_log_q[token] > -torch.inf for token in children)
        score.update({path + (token,): score[path] + float(row_log_q[token]) for token in children})
    for depth in range(1, grown.depth):
        at_depth = [path for path in paths if len(path) == depth]
        expanded = {path for slot, path in enumerate(paths) if int(drafted.sampled.of_slot[row, slot]) >= 0}
        best = sorted(at_depth, key=score.get, reverse=True)[:frontier]
        assert expanded & set(at_depth) == set(best)


@pytest.mark.parametrize(
    "shape, depth, frontier", [(TreeShape(4, 3, 16), 4, 1), (TreeShape(2, 4, 20), 2, 4), (TreeShape(4, 4, 6), 1, 1)]
)
def test_a_sampled_tree_keeps_every_drawn_child_within_max_nodes(shape, depth, frontier):
    grown, f = tree.sampled_growth(shape)
    assert (grown.depth, f) == (depth, frontier)
    assert grown.top_k + (grown.depth - 1) * f * grown.top_k <= shape.max_nodes


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_draft_models_tree_is_the_expansion_of_fresh_forwards(noisy_draft, tokenizer, temperature):
    """The draft's frontier forwards (tree mask and positions in its own cache) score every path as a
    fresh forward over the context and the path does; sampled, the children are drawn from the warped q."""
    shape, params = TreeShape(3, 3, 15), SamplingParams(temperature, top_k=20)
    prompts = [tokenizer.encode(p) for p in PROMPTS[1:3]]
    drafter = ModelDrafter(cached(noisy_draft))
    drafter.start(prompts, 100, None)
    drafted = drafter.propose_tree(shape, params, None)
    for row, prompt in enumerate(prompts):

        def log_probs(path, prompt=prompt):
            fresh = cached(noisy_draft)
            fresh.reset(len(prompt) + len(path))
            logits = fresh.forward(torch.tensor([prompt + list(path)]), logits="last").logits[0, -1]
            return tree.draft_log_probs(logits, params)

        if params.greedy:
            expected, _ = reference_tree(log_probs, shape)
            assert set(tree_paths(drafted, row)[1:]) == set(expected)
        else:
            check_sampled_tree(drafted, row, log_probs, shape)


def test_tree_mask_shows_context_and_ancestors_only():
    # root -> a (slot 1), b (slot 2); a -> c (slot 3): c sees the root, a and itself, never b
    parents = torch.tensor([[0, 0, 1]])
    drafted = tree.DraftTree(torch.tensor([[5, 6, 7]]), parents, depth=2)
    region = tree.target_region(drafted, start=[2])
    allowed, positions = region.attention(torch.arange(7))
    assert allowed[0].int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0],  # root: the context (slots 0, 1) and itself
        [1, 1, 1, 1, 0, 0, 0],  # a
        [1, 1, 1, 0, 1, 0, 0],  # b: not its sibling a
        [1, 1, 1, 1, 0, 1, 0],  # c
    ]
    assert positions[0].tolist() == [0, 1, 2, 3, 3, 4, 6]  # a and b at depth 1, c at depth 2
    assert region.positions.tolist() == [[2, 3, 3, 4]]


def feature_draft(target, taps=(0, 1)):
    """A feature draft for `target` whose head scores every other token (a vocabulary subset)."""
    return init_draft(target, 1, torch.arange(0, target.config.vocab_size, 2), taps).eval()


def started_feature_drafter(target, draft, prompts: list[list[int]]) -> FeatureDrafter:
    """A feature drafter after the prefill, as the decode loop starts it."""
    reader = CachedModel(target, target.config.vocab_size, target_layers(draft))
    reader.reset(max(map(len, prompts)))
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(p[:-1]) for p in prompts], batch_first=True)
    states = reader.forward(ids, counts=[len(p) - 1 for p in prompts], logits="none", hidden=True).hidden
    drafter = FeatureDrafter(draft, draft.config.vocab_size)
    drafter.start(prompts, 100, states)
    return drafter


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_feature_drafts_tree_is_the_expansion_of_its_chain_steps(tiny_target, tokenizer, temperature):
    """Every node is read beside its parent's state: the tree scores each path as the chain's steps
    forced along it do (context beside the target's states, then the path beside the draft's own)."""
    shape, params = TreeShape(3, 3, 15), SamplingParams(temperature, top_k=20)
    draft = feature_draft(tiny_target)
    prompts = [tokenizer.encode(p) for p in PROMPTS[1:3]]
    drafted = started_feature_drafter(tiny_target, draft, prompts).propose_tree(shape, params, None)
    for row, prompt in enumerate(prompts):

        def log_probs(path, prompt=prompt):
            drafter = started_feature_drafter(tiny_target, draft, [prompt])
            out = drafter._forward(drafter.pending, drafter.pending_states, "last")
            logits, state = out.logits[:, -1], out.hidden[:, -1:]
            for token in path:
                inputs = feature_inputs(draft, torch.tensor([[token]]), state)
                out = drafter.model.forward(inputs_embeds=inputs, logits="last", hidden=True)
                logits, state = out.logits[:, -1], out.hidden[:, -1:]
            # the head scores its subset's columns: spread them over all V, -inf elsewhere
            spread = logits.new_full((1, drafter.vocab_size), float("-inf")).index_copy_(1, drafter.vocabulary, logits)
            return tree.draft_log_probs(spread[0], params)

        if params.greedy:
            expected, _ = reference_tree(log_probs, shape)
            assert set(tree_paths(drafted, row)[1:]) == set(expected)
        else:
            check_sampled_tree(drafted, row, log_probs, shape)


# ---------------------------------------------------------------- the sampled rule


BROKEN_RULES = [
    pytest.param(siblings_tested_against_p, id="siblings-tested-against-p"),
    pytest.param(p_prime_not_renormalised, id="p'-not-renormalised"),
]


def emitted_at_one_node(p: torch.Tensor, children: list[int], draws: int, seed: int) -> np.ndarray:
    """Counts of the token emitted at a node with these children (most probable draft first)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(children).expand(draws, -1)
    passed, leftover = tree.try_children(
        p.expand(draws, -1), tokens, torch.ones(draws, len(children), dtype=torch.bool), gen
    )
    order = torch.arange(len(children))
    first = torch.where(passed, order, len(children)).min(dim=1).values
    emitted = torch.where(
        first < len(children),
        tokens[:, 0].new_tensor(children)[first.clamp_max(len(children) - 1)],
        sample(leftover, gen),
    )
    return np.bincount(emitted.numpy(), minlength=len(p))


CASES = [
    ("children hold little mass", [0.4, 0.3, 0.1, 0.1, 0.06, 0.04], [5, 2, 4]),
    ("children hold most", [0.05, 0.3, 0.25, 0.2, 0.1, 0.1], [1, 2, 3]),
    ("children hold all", [0.5, 0.3, 0.2, 0.0, 0.0, 0.0], [1, 0, 2]),
    ("a child the target never takes", [0.5, 0.3, 0.2, 0.0, 0.0, 0.0], [3, 0]),
]


def p_value(counts: np.ndarray, p: list[float]) -> float:
    expected = np.array(p) / np.sum(p) * counts.sum()
    assert counts[expected == 0].sum() == 0, "a token of probability 0 was emitted"
    kept = expected > 0
    return stats.chisquare(counts[kept], expected[kept]).pvalue


@pytest.mark.parametrize("name, p, children", CASES, ids=[c[0] for c in CASES])
def test_one_node_emits_p(name, p, children):
    counts = emitted_at_one_node(torch.tensor(p), children, 200_000, seed=1)
    assert p_value(counts, p) > SIGNIFICANCE


@pytest.mark.parametrize("broken", BROKEN_RULES)
def test_one_node_check_fails_on_broken_rules(monkeypatch, broken):
    monkeypatch.setattr(tree, "try_children", broken)
    _, p, children = CASES[1]
    assert p_value(emitted_at_one_node(torch.tensor(p), children, 200_000, seed=1), p) < 1e-6


def test_the_exact_output_of_the_rule_is_p():
    """Enumerated, not drawn: child j is reached with the mass p' has left and accepted with p'(x_j)."""
    for _, p, children in CASES:
        p = torch.tensor(p, dtype=torch.float64)
        left, out = 1.0, torch.zeros_like(p)
        for x in children:
            kept = float(p[x]) / left if left > 0 else 0.0
            out[x] += left * kept
            left -= left * kept
        out += left * residual(p, torch.zeros_like(p).index_fill_(0, torch.tensor(children), 1.0))
        assert torch.allclose(out, p, atol=1e-12)


def two_level_tree(rows: int) -> tree.DraftTree:
    # root -> 1 (slot 1), 3 (slot 2), 4 (slot 3); slot 1 -> 0 (slot 4), 2 (slot 5)
    return tree.DraftTree(
        torch.tensor([[1, 3, 4, 0, 2]]).expand(rows, -1), torch.tensor([[0, 0, 0, 1, 1]]).expand(rows, -1), 2
    )


def walk_draws(params: SamplingParams, logits: torch.Tensor, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """First and second emitted tokens of `rows` walks of verify_sampled over the two-level tree."""
    drafted = two_level_tree(rows)
    num_accepted, next_token, path = tree.verify_sampled(
        drafted, logits.expand(rows, -1, -1), params, torch.Generator().manual_seed(seed)
    )
    on_path = drafted.tokens.gather(1, (path[:, 1:] - 1).clamp_min(0))  # [rows, 2]
    emitted = torch.cat([on_path, next_token[:, None]], dim=1)
    emitted = torch.where(torch.arange(3) < num_accepted[:, None], emitted, next_token[:, None])
    return emitted[:, 0].numpy(), torch.where(num_accepted >= 1, emitted[:, 1], -1).numpy()


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.6, top_k=4), SamplingParams(1.0, top_p=0.8)])
def test_the_walk_emits_the_targets_tokens(params):
    logits = 1.5 * torch.randn(1, 6, 6, generator=torch.Generator().manual_seed(3))
    probs = sampling.warp(logits[0], params).double().numpy()  # per slot
    first, second = walk_draws(params, logits, 100_000, seed=0)
    p_values = [p_value(np.bincount(first, minlength=6), probs[0])]
    for slot, token in ((1, 1), (2, 3), (3, 4)):  # after a child, the next token is the target's there
        p_values.append(p_value(np.bincount(second[first == token], minlength=6), probs[slot]))
    assert min(p_values) > SIGNIFICANCE / len(p_values), p_values


# ---------------------------------------------------------------- the rule for children drawn from q

draw_children = tree.draw_children  # the engine's, for broken variants that wrap it


def best_of_drawn(log_probs, count, generator):
    """Bug: children pruned by value after drawing: of the `count` drawn, only the most probable stays."""
    drawn = draw_children(log_probs, count, generator)
    return drawn.gather(-1, log_probs.gather(-1, drawn).argmax(dim=-1, keepdim=True))


def broken_recursive_rejection(bug: str):
    """`tree.recursive_rejection` with one named bug: "q'-not-updated" (x_i stays in q': tested as
    drawn with replacement), "q'-not-renormalised" (x_i zeroed in q', the rest left as it was),
    "p'-with-q" (p' = norm(max(0, p' - q)) with the node's q, not q')."""

    def rule(target_probs, draft_probs, tokens, children, count, generator):
        n = tokens.shape[1]
        slots, rank = torch.arange(n), children.long().cumsum(dim=1) - 1
        p, q = target_probs.double(), draft_probs.double()
        passed = torch.zeros_like(children)
        u = torch.rand(len(tokens), count, dtype=torch.float64, generator=generator)
        for i in range(count):
            slot = torch.where(children & (rank == i), slots, n).min(dim=1).values
            x = tokens.gather(1, slot.clamp_max(n - 1)[:, None])
            p_x, q_x = p.gather(1, x)[:, 0], q.gather(1, x)[:, 0]
            drawn = (slot < n) & (q_x > 0)
            accept = drawn & (u[:, i] * q_x < p_x)
            passed |= accept[:, None] & (slots == slot[:, None])
            rejected = (drawn & ~accept)[:, None]
            p = torch.where(rejected, residual(p, draft_probs.double() if bug == "p'-with-q" else q), p)
            if bug != "q'-not-updated":
                q_without = q.scatter(1, x, 0.0)
                if bug != "q'-not-renormalised":
                    q_without = q_without / q_without.sum(dim=1, keepdim=True)
                q = torch.where(rejected, q_without, q)
        return passed, p

    return rule


BROKEN_RECURSIVE = [
    pytest.param("recursive_rejection", broken_recursive_rejection("q'-not-updated"), id="q'-not-updated"),
    pytest.param("recursive_rejection", broken_recursive_rejection("q'-not-renormalised"), id="q'-not-renormalised"),
    pytest.param("recursive_rejection", broken_recursive_rejection("p'-with-q"), id="p'-with-q"),
    pytest.param("draw_children", best_of_drawn, id="best-of-drawn-kept"),
]

RECURSIVE_CASES = [
    ("flat q, peaked p", [0.4, 0.3, 0.1, 0.1, 0.06, 0.04], [0.15, 0.15, 0.2, 0.2, 0.15, 0.15], 3),
    ("q misses p's best", [0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.0, 0.3, 0.3, 0.2, 0.1, 0.1], 3),
    ("q has fewer tokens than children", [0.3, 0.3, 0.2, 0.1, 0.1, 0.0], [0.6, 0.0, 0.0, 0.4, 0.0, 0.0], 3),
    ("q = p", [0.4, 0.3, 0.1, 0.1, 0.06, 0.04], [0.4, 0.3, 0.1, 0.1, 0.06, 0.04], 2),
    ("peaked q, flat p", [0.2, 0.2, 0.15, 0.15, 0.15, 0.15], [0.02, 0.02, 0.8, 0.1, 0.03, 0.03], 2),
]


def recursive_draws(p: list[float], q: list[float], count: int, seed: int, draws: int = 200_000) -> np.ndarray:
    """verify-distribution's one-node draws: children drawn from q, the token the rule emits."""
    return checks.tree_rule_draws(
        torch.tensor(p), torch.tensor(q), count, draws, torch.Generator().manual_seed(seed), sampled=True
    )


@pytest.mark.parametrize("name, p, q, count", RECURSIVE_CASES, ids=[c[0] for c in RECURSIVE_CASES])
def test_one_node_with_drawn_children_emits_p(name, p, q, count):
    assert p_value(recursive_draws(p, q, count, seed=1), p) > SIGNIFICANCE


@pytest.mark.parametrize("function, broken", BROKEN_RECURSIVE)
def test_one_node_check_fails_on_broken_recursive_rules(monkeypatch, function, broken):
    """What catches the bugs of `recursive_rejection`: they act only after a rejection (p'-with-q after
    two), so they need a q far from p on few tokens and many draws. The tiny pair's runs (its draft is
    the target with a little noise: the first child is nearly always accepted) miss them at this
    file's sample size, and verify-distribution's one-node check on its V = 256 shapes is borderline
    at its draws; best-of-drawn-kept is caught there too (test_tree_checks_fail_on_broken_engines)."""
    monkeypatch.setattr(tree, function, broken)
    failures = [name for name, p, q, count in RECURSIVE_CASES if p_value(recursive_draws(p, q, count, 1), p) < 1e-6]
    assert failures


def test_the_exact_output_of_recursive_rejection_is_p():
    """Enumerated, not drawn: every ordered draw of the children from q without replacement, with its
    chance, through the rule's acceptance chances, p' and q' updates."""

    def emitted(p, q, left):
        if left == 0 or q.sum() == 0:  # every child rejected (or q ran out: the rest never pass)
            return p
        out = torch.zeros_like(p)
        for x in q.nonzero()[:, 0].tolist():
            accept = min(1.0, float(p[x] / q[x]))
            out[x] += q[x] * accept
            without = q.clone()
            without[x] = 0
            rest = without / without.sum() if without.sum() > 0 else without
            out += q[x] * (1 - accept) * emitted(residual(p, q), rest, left - 1)
        return out

    for _, p, q, count in RECURSIVE_CASES:
        p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
        assert torch.allclose(emitted(p, q, count), p, atol=1e-12)


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def noisy_draft():
    return build_tiny(TinyModel(seed=0, noise=0.005)).eval()


@pytest.mark.parametrize("shape", SHAPES, ids=[s.describe().split(" (")[0] for s in SHAPES])
def test_greedy_trees_are_the_target_alone(tiny_target, noisy_draft, tokenizer, shape):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    alone = SpeculativeDecoder(cached(tiny_target), None, SamplingParams(), 1, set())
    expected = [alone.generate(p, 30, 0).token_ids for p in prompts]
    decoder = SpeculativeDecoder(
        cached(tiny_target), ModelDrafter(cached(noisy_draft)), SamplingParams(), shape.depth, set(), shape
    )
    assert [r.token_ids for r in decoder.generate_batch(prompts, 30, 0)] == expected  # batch 4
    one = decoder.generate(prompts[3], 30, 0)
    assert one.token_ids == expected[3]  # batch 1
    if shape.max_nodes > shape.depth:  # side branches are accepted too: more than the chain of first choices
        assert max(s.accepted for s in one.steps) >= 1


class CheckedTree(Drafter):
    """Passes every call to a model or feature drafter; after start, commit_tree and keep, checks that
    its cache holds the rows' contexts but `pending`; a draft model's with the keys and values a fresh
    prefill of them gives (right tokens, right positions, nothing of a rejected branch)."""

    def __init__(self, drafter: ModelDrafter | FeatureDrafter):
        self.inner = drafter
        self.reads_target_states = drafter.reads_target_states
        self.context: list[list[int]] = []
        self.blocks = 0

    def check(self):
        model = self.inner.model
        if isinstance(self.inner, FeatureDrafter):  # input j is (state j, token j + 1): one entry fewer
            assert [n + len(p) + 1 for n, p in zip(model.lengths, self.inner.pending)] == list(map(len, self.context))
            return
        for row, context in enumerate(self.context):
            length = model.lengths[row]
            assert context[length:] == self.inner.pending[row]
            fresh = CachedModel(model.model, model.vocab_size)
            fresh.reset(length)
            fresh.forward(torch.tensor([context[:length]]), logits="none")
            for ours, theirs in zip(model.cache.layers, fresh.cache.layers):
                torch.testing.assert_close(ours.keys[row, :, :length], theirs.keys[0, :, :length], atol=1e-4, rtol=0)
                torch.testing.assert_close(
                    ours.values[row, :, :length], theirs.values[0, :, :length], atol=1e-4, rtol=0
                )

    def start(self, prompts, max_tokens, target_states):
        self.inner.start(prompts, max_tokens, target_states)
        self.context = [list(p) for p in prompts]
        self.check()

    def propose_tree(self, shape, params, generator):
        return self.inner.propose_tree(shape, params, generator)

    def commit_tree(self, path, draft_ids, num_accepted, next_tokens, target_states):
        self.inner.commit_tree(path, draft_ids, num_accepted, next_tokens, target_states)
        for context, ids, accepted, token in zip(self.context, draft_ids, num_accepted, next_tokens):
            context += ids[:accepted] + [token]
        self.blocks += 1
        self.check()

    def follow(self, tokens, target_states):  # the last block, at the token limit: the target's alone
        self.inner.follow(tokens, target_states)
        for context, new in zip(self.context, tokens):
            context += new
        self.check()

    def keep(self, rows):
        self.inner.keep(rows)
        self.context = [self.context[r] for r in rows]
        self.check()


def decode_checked(tiny_target, noisy_draft, tokenizer, temperature: float) -> CheckedTree:
    checked = CheckedTree(ModelDrafter(cached(noisy_draft)))
    shape = TreeShape(3, 2, 6)
    decoder = SpeculativeDecoder(cached(tiny_target), checked, SamplingParams(temperature), 3, set(), shape)
    decoder.generate_batch([tokenizer.encode(p) for p in PROMPTS], 24, 0)
    return checked


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_draft_keeps_the_accepted_path_and_nothing_else(tiny_target, noisy_draft, tokenizer, temperature):
    assert decode_checked(tiny_target, noisy_draft, tokenizer, temperature).blocks >= 5


def test_the_draft_check_catches_a_path_left_in_place(tiny_target, noisy_draft, tokenizer, monkeypatch):
    compact = CachedModel.compact

    def broken(self, start, path, kept):  # the draft's cache keeps the tree's slots as they were
        return (
            compact(self, start, path, kept)
            if self.model is tiny_target
            else rejected_keys_kept_compact(self, start, path, kept)
        )

    monkeypatch.setattr(CachedModel, "compact", broken)
    with pytest.raises(AssertionError):
        decode_checked(tiny_target, noisy_draft, tokenizer, 0.0)


@pytest.mark.parametrize("shape", [TreeShape(4, 3, 16), TreeShape(2, 4, 20)], ids=["4,3,16", "2,4,20"])
def test_greedy_feature_trees_are_the_target_alone(tiny_target, tokenizer, shape):
    # the first prompt has one token: its row has no target state to draft from in the first block
    prompts = [tokenizer.encode(p) for p in ["H"] + PROMPTS[1:]]
    alone = SpeculativeDecoder(cached(tiny_target), None, SamplingParams(), 1, set())
    expected = [alone.generate(p, 30, 0).token_ids for p in prompts]
    draft = feature_draft(tiny_target)
    target = CachedModel(tiny_target, tiny_target.config.vocab_size, target_layers(draft))
    decoder = SpeculativeDecoder(
        target, FeatureDrafter(draft, draft.config.vocab_size), SamplingParams(), shape.depth, set(), shape
    )
    assert [r.token_ids for r in decoder.generate_batch(prompts, 30, 0)] == expected  # batch 4
    assert decoder.generate(prompts[0], 30, 0).token_ids == expected[0]  # batch 1


def test_a_feature_draft_holds_the_context_after_every_tree(tiny_target, tokenizer):
    """Its rule (methods/feature/drafter.py): cache + pending + 1 = the context, after every call."""
    draft = feature_draft(tiny_target)
    checked = CheckedTree(FeatureDrafter(draft, draft.config.vocab_size))
    target = CachedModel(tiny_target, tiny_target.config.vocab_size, target_layers(draft))
    decoder = SpeculativeDecoder(target, checked, SamplingParams(1.0), 3, set(), TreeShape(3, 2, 6))
    decoder.generate_batch([tokenizer.encode(p) for p in ["H"] + PROMPTS[1:]], 24, 0)
    assert checked.blocks >= 5


# ---------------------------------------------------------------- verify-distribution on trees

RUNS = 300


def tree_pair(write_config, shape: str = "3,2,6", **sampling):
    depth, top_k, nodes = map(int, shape.split(","))
    config = write_config(
        {
            "speculation": {"tree": {"depth": depth, "top_k": top_k, "max_nodes": nodes}},
            "sampling": sampling,
            **ONE_THREAD,
        }
    )
    return load_pair(load_config(str(config)))


def model_rows(pair, params: SamplingParams, batch_size: int = 1) -> list[statistics.Row]:
    ids = pair.encode(PROMPTS[3])
    rows = checks.check_model(pair, ids, "p", params, RUNS, seed=0, significance=SIGNIFICANCE, batch_size=batch_size)
    rows += [checks.check_greedy(pair, ids, "p", 32, seed=0)]
    statistics.holm(rows, SIGNIFICANCE)
    return rows


SAMPLED = [
    (SamplingParams(0.6, top_k=20), 1),
    (SamplingParams(1.0, top_p=0.9), 4),
    (SamplingParams(1.0, top_k=20), 4),
    (SamplingParams(0.6, top_p=0.9), 1),
]
SAMPLED_IDS = ["T0.6-top-k-batch1", "T1-top-p-batch4", "T1-top-k-batch4", "T0.6-top-p-batch1"]


def accepted(rows: list[statistics.Row]) -> int:
    """Draft tokens accepted over the runs (from the first row's note)."""
    return int(rows[0].note.split("/")[0])


@pytest.mark.parametrize("params, batch_size", SAMPLED, ids=SAMPLED_IDS)
def test_tree_checks_pass_on_the_real_engine(write_config, params, batch_size):
    """A draft model's trees at T > 0: children drawn from q, recursive rejection sampling."""
    rows = model_rows(tree_pair(write_config), params, batch_size)
    assert failing(rows) == []
    assert sum(r.p_value is not None for r in rows) >= 5  # the tests ran, not skipped for want of draws
    assert accepted(rows) > RUNS  # the walk went down the trees


@pytest.mark.parametrize("params, batch_size", SAMPLED, ids=SAMPLED_IDS)
def test_feature_tree_checks_pass(write_config, tmp_path, params, batch_size):
    from test_host_syncs import feature_draft_folder  # specdec's feature draft for an 8-layer tiny target

    changes = {
        "target": {"tiny": {"seed": 0, "num_layers": 8}},
        "draft": {"checkpoint": str(feature_draft_folder(tmp_path))},
        "speculation": {"tree": {"depth": 3, "top_k": 2, "max_nodes": 6}},
        **ONE_THREAD,
    }
    pair = load_pair(load_config(str(write_config(changes))))
    assert isinstance(pair.drafter, FeatureDrafter)
    rows = model_rows(pair, params, batch_size)
    assert failing(rows) == [] and sum(r.p_value is not None for r in rows) >= 5
    assert accepted(rows) > 0  # the walk went down the trees now and then (a weak draft)


def greedy_at_temperature(monkeypatch) -> None:
    """The silent fallback: trees verified greedily when sampling."""
    monkeypatch.setattr(
        tree, "verify_sampled", lambda drafted, logits, params, gen: tree.verify_greedy(drafted, logits)
    )


def sibling_in_mask(monkeypatch) -> None:
    """A node also attends to its earlier siblings (a mask causal over the tree's order among siblings)."""
    ancestry = tree.ancestry

    def broken(parents, depth):
        earlier_sibling = (parents[:, :, None] == parents[:, None, :]) & torch.ones_like(
            parents[0, :, None] == parents[0, None, :]
        ).tril(-1)
        return ancestry(parents, depth) | (earlier_sibling & (parents >= 0)[:, :, None])

    monkeypatch.setattr(tree, "ancestry", broken)


def rejected_keys_kept_compact(self, start, path, kept):
    """CachedModel.compact that forgets to move the path: the tree's slots stay as they were, with
    rejected nodes' keys where the path should be."""
    self.lengths = [s + k for s, k in zip(start, kept)]


def rejected_keys_kept(monkeypatch) -> None:
    monkeypatch.setattr(CachedModel, "compact", rejected_keys_kept_compact)


def eagle2_cut_of_drawn_children(monkeypatch) -> None:
    """Sampled children grown as EAGLE-2's tree: a frontier of top_k and the max_nodes most probable
    nodes kept, so a node loses children for their values after they were drawn."""
    monkeypatch.setattr(tree, "sampled_growth", lambda shape: (shape, shape.top_k))


@pytest.mark.parametrize(
    "inject",
    [
        pytest.param(greedy_at_temperature, id="greedy-at-T>0"),
        pytest.param(sibling_in_mask, id="sibling-in-mask"),
        pytest.param(rejected_keys_kept, id="rejected-keys-visible"),
        pytest.param(lambda mp: mp.setattr(tree, "draw_children", best_of_drawn), id="best-of-drawn-kept"),
        pytest.param(eagle2_cut_of_drawn_children, id="eagle2-cut-of-drawn-children"),
        # the rule tree.py shares with chains, patched where chains' tests patch it
        pytest.param(lambda mp: mp.setattr(sampling, "residual", residual_without_clamp), id="residual-without-clamp"),
    ],
)
def test_tree_checks_fail_on_broken_engines(write_config, monkeypatch, inject):
    pair = tree_pair(write_config, "3,3,9")
    inject(monkeypatch)
    assert failing(model_rows(pair, SamplingParams(0.6)))


# ---------------------------------------------------------------- the command line


def test_verify_distribution_runs_tree_configs_and_catches_a_broken_rule(write_config, monkeypatch):
    config = str(write_config({"sampling": {"temperature": 1.0}, **ONE_THREAD}))
    args = ["verify-distribution", "-c", config, "--tree", "3,2,6", "--samples", "60", "--json", "-p", PROMPTS[3]]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["verdict"] == "pass" and record["config"]["speculation"]["tree"] == {
        "depth": 3,
        "top_k": 2,
        "max_nodes": 6,
    }
    assert sum("tree rule draws" in row["what"] for row in record["checks"]) == 9
    monkeypatch.setattr(tree, "try_children", p_prime_not_renormalised)
    failed = runner.invoke(app, args)
    assert failed.exit_code == EXIT_CHECK_FAILED
    assert any(
        "tree rule draws" in row["what"] and row["status"] == "fail" for row in json.loads(failed.stdout)["checks"]
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tree", "4,3"], "--tree: expected DEPTH,TOP_K,MAX_NODES"),
        (["--tree", "4,3,40"], "at most the nodes drafted"),
        (["--tree", "4,0,4"], "depth and top_k must be >= 1"),
        (["--tree", "3,2,6", "--num-draft-tokens", "2"], "give one of them"),
    ],
)
def test_bad_tree_settings_are_one_error_line(write_config, args, message):
    result = runner.invoke(app, ["generate", "-c", str(write_config()), "-p", "abc", *args])
    assert result.exit_code == EXIT_BAD_INPUT
    assert result.output.strip().splitlines()[-1].startswith("Error: ") and message in result.output


def test_generate_names_the_tree(write_config):
    result = runner.invoke(app, ["generate", "-c", str(write_config()), "-p", "abc", "--tree", "3,2,6", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["config"]["speculation"]["tree"]["max_nodes"] == 6
    assert record["stats"]["new_tokens"] == 16 and all(s["drafted"] <= 3 for s in record["steps"])


def test_benchmark_measures_chains_and_trees_side_by_side(write_config, tmp_path):
    # the draft is the target and the tree one path: greedy, every block accepts the whole depth
    config = write_config({"draft": {"tiny": {"seed": 0}}, "generation": {"max_new_tokens": 12, "ignore_eos": True}})
    args = ["benchmark", "-c", str(config), "--num-draft-tokens-list", "2", "--tree", "3,1,3", "--temperatures", "0,1"]
    result = runner.invoke(app, args + ["--batch-sizes", "2", "--category", "qa", "--limit", "2", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert [(r["temperature"], r["num_draft_tokens"], r["tree"]) for r in record["runs"][:3]] == [
        (0.0, 0, None),
        (0.0, 2, None),
        (0.0, 3, "3,1,3"),
    ]
    overall = {(r["temperature"], r["tree"]): r for r in record["summary"] if r["group"] == "overall"}
    assert set(overall) == {(0.0, None), (0.0, "3,1,3"), (1.0, None), (1.0, "3,1,3")}
    greedy_tree = overall[(0.0, "3,1,3")]
    assert greedy_tree["mean_accepted_length"] == 4.0 and greedy_tree["acceptance_by_position"] == [1.0] * 3
    assert greedy_tree["greedy_identical"] == greedy_tree["prompts"] == 2
    assert greedy_tree["predicted_speedup"] is None  # Leviathan's formula is a chain's
    assert {(r["batch_size"], r["tree"]) for r in record["batch_summary"]} >= {(2, "3,1,3"), (2, None)}
    report = next((tmp_path / "runs").glob("*-benchmark-tiny-test")) / "report.md"
    assert "greedy, tree 3,1,3" in report.read_text() and "| tree 3,1,3 |" in report.read_text()
