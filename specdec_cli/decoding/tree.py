"""Draft trees: drafting one (EAGLE-2's dynamic tree, a static tree over per-depth distributions, a
trie of lookup's continuations), its attention mask, and its verification.

A block's tree has a root, the block's first input (the last token of the context), and n drafted
nodes. Slots number them as the target reads them: slot 0 is the root, slot i + 1 node i. Every row
of a batch has its own tree of n nodes. Nodes are ordered so that a parent comes before its
children and siblings come in order of draft probability, most probable first.

In a cache, a tree occupies the slots after the root as a `Region`: every node attends to the
context and to its own ancestors (itself included) only, at position root position + depth. After
verification the accepted path is moved to the slots right after the root (`CachedModel.compact`),
where a chain would have put it; slots past the path are never visible again.

Verification walks from the root. Greedy: go to the child whose token is the target's argmax, while
there is one; emit the target's argmax where the walk stops. Sampled: `recursive_rejection` below
where the tree's children were drawn from the draft's q (`SampledChildren`), else `try_children`
(deterministic candidates: a top-k, a static tree, a lookup trie).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import torch

from specdec_cli.decoding import sampling  # looked up at each call: a patched rule (tests) reaches trees too
from specdec_cli.decoding.host import to_device
from specdec_cli.decoding.params import SamplingParams, TreeShape


class SampledChildren(NamedTuple):
    """A tree whose every expanded node's children are all the `count` tokens drawn from the draft's
    q at that node without replacement, in the order drawn (`draw_children`)."""

    probs: torch.Tensor  # [B, m, S] q at each expanded node: the distribution its children were drawn from
    of_slot: torch.Tensor  # [B, n + 1] each slot's row in probs (-1: not expanded, no children)
    count: int  # children per expanded node
    vocabulary: torch.Tensor | None  # [S] the token id of each column of probs (None: every id, in order)

    def q(self, rows: torch.Tensor, slots: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[B, V] q at the node in slot `slots` [B] of each row (any q where it has no children)."""
        return sampling.spread(self.probs[rows, self.of_slot[rows, slots].clamp_min(0)], self.vocabulary, vocab_size)


class DraftTree(NamedTuple):
    tokens: torch.Tensor  # [B, n] node tokens
    # [B, n] each node's parent slot: 0 the root, i + 1 node i (< its own slot); -1 a placeholder that
    # is no node of the tree (a row that drafted nothing: the walk emits the target's token at the root)
    parents: torch.Tensor
    depth: int  # the depth the tree was drafted to: no path is longer
    sampled: SampledChildren | None = None  # None: the children are deterministic candidates

    @property
    def slot_parents(self) -> torch.Tensor:
        """[B, n + 1] the parent slot of every slot; the root's is -1."""
        return torch.cat([torch.full_like(self.parents[:, :1], -1), self.parents], dim=1)

    def without(self, rows: torch.Tensor) -> DraftTree:
        """The tree with the rows where `rows` [B] is True drafting nothing (every node a placeholder)."""
        return DraftTree(
            self.tokens.masked_fill(rows[:, None], 0),
            self.parents.masked_fill(rows[:, None], -1),
            self.depth,
            self.sampled,
        )


def ancestry(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, m, m] True where slot j is slot i's ancestor or i itself, from parents [B, m] (-1: none).
    Paths of length <= depth: squaring the one-step relation doubles the length it reaches."""
    slots = torch.arange(parents.shape[1], device=parents.device)
    reach = (parents[..., None] == slots) | (slots[:, None] == slots)  # a parent (none for -1), or itself
    for _ in range(math.ceil(math.log2(max(depth, 1)))):
        reach = (reach.float() @ reach.float()) > 0
    return reach


class Region(NamedTuple):
    """A tree in a cache: per row, the slots from `start` (the root's) on. The cache's next inputs
    are the region's last n slots."""

    start: list[int]  # per row, the root's slot
    depths: torch.Tensor  # [B, T] every region slot's depth (the root's is 0)
    visible: torch.Tensor  # [B, n, T] the region slots each input attends to: its ancestors and itself

    def attention(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For cache slots `keys` [K]: which each input may attend to [B, n, K] (the row's context
        before the root, and its ancestors in the region), and every slot's position [B, K]."""
        start = to_device(self.start, keys.device)[:, None]  # [B, 1]
        offset = keys - start  # [B, K]: slot within the region
        inside = (offset >= 0) & (offset < self.depths.shape[1])
        at = offset.clamp(0, self.depths.shape[1] - 1)
        ancestors = self.visible.gather(2, at[:, None].expand(-1, self.visible.shape[1], -1))
        allowed = (offset < 0)[:, None] | (inside[:, None] & ancestors)
        positions = torch.where(inside, start + self.depths.gather(1, at), keys)
        return allowed, positions

    @property
    def positions(self) -> torch.Tensor:
        """[B, n] the inputs' positions: the root's plus their depth."""
        n = self.visible.shape[1]
        return to_device(self.start, self.depths.device)[:, None] + self.depths[:, -n:]


def target_region(tree: DraftTree, start: list[int]) -> Region:
    """The region of [root, nodes] fed to the target in one forward after `start` (the root's slot)."""
    visible = ancestry(tree.slot_parents, tree.depth)
    return Region(start, visible.sum(-1) - 1, visible)


def sampled_growth(shape: TreeShape) -> tuple[TreeShape, int]:
    """The shape a sampled tree is grown to, and its frontier f. Every expanded node keeps all its
    top_k drawn children (recursive rejection sampling needs them all, and no value-based cut), so
    max_nodes bounds the growth instead: f is the largest f <= top_k with
    top_k + (depth - 1) f top_k <= max_nodes; the depth is cut where even f = 1 overflows (and
    top_k to max_nodes)."""
    top_k = min(shape.top_k, shape.max_nodes)
    depth = min(shape.depth, shape.max_nodes // top_k)
    frontier = (shape.max_nodes - top_k) // ((depth - 1) * top_k) if depth > 1 else 1
    return replace(shape, depth=depth, top_k=top_k), min(frontier, top_k)


def draw_children(log_probs: torch.Tensor, count: int, generator: torch.Generator | None) -> torch.Tensor:
    """`count` tokens drawn from q without replacement, in the order drawn: the top `count` of
    log q + Gumbel noise (Gumbel-top-k). log_probs [..., V] log q -> [..., count]. Where q has fewer
    than `count` tokens, the rest are tokens of q = 0 (never accepted)."""
    noise = torch.empty(log_probs.shape, dtype=torch.float64, device=log_probs.device).exponential_(generator=generator)
    keys = log_probs.double() - noise.clamp_min_(torch.finfo(noise.dtype).tiny).log()
    return keys.topk(count, dim=-1).indices


class TreeGrowth:
    """A dynamic tree, drafted depth by depth. `grow` takes the draft's log probabilities at the
    frontier (first the root alone) and adds top_k children of each frontier node as candidates,
    scored by path log probability (the sum along the path); the next frontier is the `frontier`
    best new candidates. The draft feeds each frontier but the last (`frontier_tokens`, `region`) in
    its own cache after the root: its fed slots are 0 the root, then the frontier per depth. `select`
    keeps the max_nodes best candidates: a path's score falls along it, so they include every kept
    node's parent (ties keep the shallower first).

    Greedy (`generator` None, see `for_drafting`): EAGLE-2's tree, the children are each node's
    top_k and the frontier top_k. Sampled: the children are drawn from q (`draw_children`), the
    shape is `sampled_growth`'s, so `select` keeps every candidate, and the tree carries each
    expanded node's q (`SampledChildren`).

    `vocabulary` [S]: the token ids the draft scores (a head over a subset; None: every id), the
    columns of what `grow` takes; drawing over them alone is cheaper and draws from the same q."""

    def __init__(
        self,
        shape: TreeShape,
        batch: int,
        device: torch.device,
        frontier: int | None = None,
        generator: torch.Generator | None = None,
        sampled: bool = False,
        vocabulary: torch.Tensor | None = None,
    ):
        self.shape = shape
        self.vocabulary = vocabulary
        self.frontier_size = frontier or shape.top_k
        self.device = device
        self.sampled, self.generator = sampled, generator
        self.probs: list[torch.Tensor] = []  # sampled: per depth [B, f, S], q at the frontier, in fed order
        self.tokens: list[torch.Tensor] = []  # per depth [B, c]
        self.scores: list[torch.Tensor] = []  # per depth [B, c]: path log probability
        self.parents: list[torch.Tensor] = []  # per depth [B, c]: parent candidate, counted from 1 (0: root)
        self.count = 0  # candidates so far
        self.frontier = torch.zeros(batch, 1, dtype=torch.long, device=device)  # candidates, from 1 (0: root)
        self.frontier_scores = torch.zeros(batch, 1, device=device)
        # the draft's cache: per fed slot, its ancestors among the fed slots (itself included)
        fed = 1 + (shape.depth - 1) * self.frontier_size
        self.fed_visible = torch.eye(fed, dtype=torch.bool, device=device).expand(batch, fed, fed).clone()
        self.fed_depths = torch.zeros(batch, fed, dtype=torch.long, device=device)
        self.fed_of = [torch.zeros(batch, 1, dtype=torch.long, device=device)]  # per candidate its fed slot, -1
        self.fed = 1  # fed slots so far: the root

    @classmethod
    def for_drafting(
        cls,
        shape: TreeShape,
        params: SamplingParams,
        batch: int,
        device: torch.device,
        generator: torch.Generator | None,
        vocabulary: torch.Tensor | None = None,
    ) -> TreeGrowth:
        """A draft's tree: EAGLE-2's when greedy, else children sampled from q (`sampled_growth`)."""
        if params.greedy:
            return cls(shape, batch, device, vocabulary=vocabulary)
        shape, frontier = sampled_growth(shape)
        return cls(shape, batch, device, frontier, generator, sampled=True, vocabulary=vocabulary)

    def grow(self, log_probs: torch.Tensor) -> None:
        """log_probs [B, f, S]: the draft's next-token log probabilities at the f frontier nodes, over
        the vocabulary's S tokens."""
        if self.sampled:
            columns = draw_children(log_probs, self.shape.top_k, self.generator)  # [B, f, k] in the order drawn
            values = log_probs.gather(-1, columns)
            self.probs.append(log_probs.softmax(dim=-1))  # exactly what the draws came from
        else:
            values, columns = log_probs.topk(self.shape.top_k, dim=-1)  # [B, f, k], most probable first
        tokens = columns if self.vocabulary is None else self.vocabulary[columns]
        batch = log_probs.shape[0]
        scores = (self.frontier_scores[..., None] + values).reshape(batch, -1)
        self.tokens.append(tokens.reshape(batch, -1))
        self.scores.append(scores)
        self.parents.append(self.frontier[..., None].expand_as(tokens).reshape(batch, -1))
        self.fed_of.append(torch.full_like(scores, -1, dtype=torch.long))
        best = scores.topk(min(self.frontier_size, scores.shape[1]), dim=-1, sorted=True)
        self.frontier = self.count + 1 + best.indices
        self.frontier_scores = best.values
        self.count += scores.shape[1]

    @property
    def local_frontier(self) -> torch.Tensor:
        """[B, k] the frontier as indices into the last depth's candidates."""
        return self.frontier - (self.count + 1 - self.tokens[-1].shape[1])

    @property
    def frontier_tokens(self) -> torch.Tensor:
        """[B, k] the tokens of the frontier, to be fed to the draft."""
        return self.tokens[-1].gather(1, self.local_frontier)

    @property
    def frontier_parents(self) -> torch.Tensor:
        """[B, k] the fed slot of each frontier node's parent (0: the root)."""
        fed_of = torch.cat(self.fed_of, dim=1)  # [B, count + 1]
        return fed_of.gather(1, torch.cat(self.parents, dim=1).gather(1, self.frontier - 1))

    def region(self, root: list[int]) -> Region:
        """Where the frontier goes in the draft's cache (after the fed slots, the root's at `root`);
        records the frontier as fed."""
        k, start = self.frontier.shape[1], self.fed
        parent_fed = self.frontier_parents
        rows = self.fed_visible.gather(1, parent_fed[..., None].expand(-1, -1, self.fed_visible.shape[2]))
        self.fed_visible[:, start : start + k] |= rows
        self.fed_depths[:, start : start + k].fill_(len(self.tokens))
        slots = start + torch.arange(k, device=self.device)
        self.fed_of[-1].scatter_(1, self.local_frontier, slots.expand_as(self.frontier))
        self.fed += k
        return Region(root, self.fed_depths[:, : self.fed], self.fed_visible[:, start : self.fed, : self.fed])

    def select(self) -> tuple[DraftTree, torch.Tensor]:
        """The tree of the max_nodes best candidates, and each of its slots' fed slot in the draft's
        cache [B, n + 1] (-1: not fed; the root's is 0). A sampled tree's fed slots are its expanded
        nodes, fed in the order their q was given to `grow`."""
        scores = torch.cat(self.scores, dim=1)  # [B, C], shallower candidates first
        n = min(self.shape.max_nodes, scores.shape[1])
        chosen = scores.sort(dim=1, descending=True, stable=True).indices[:, :n].sort(dim=1).values  # [B, n]
        slot_of = torch.zeros(scores.shape[0], scores.shape[1] + 1, dtype=torch.long, device=self.device)
        slot_of.scatter_(1, chosen + 1, torch.arange(1, n + 1, device=self.device).expand_as(chosen))
        parents = slot_of.gather(1, torch.cat(self.parents, dim=1).gather(1, chosen))
        fed_of = torch.cat(self.fed_of, dim=1)
        fed = torch.cat([fed_of[:, :1], fed_of.gather(1, chosen + 1)], dim=1)
        sampled = None
        if self.sampled:
            probs = torch.cat(self.probs, dim=1)
            # a frontier fed but not grown (drafting stopped there) has no children
            expanded = fed.masked_fill(fed >= probs.shape[1], -1)
            sampled = SampledChildren(probs, expanded, self.shape.top_k, self.vocabulary)
        tokens = torch.cat(self.tokens, dim=1).gather(1, chosen)
        return DraftTree(tokens, parents, len(self.tokens), sampled), fed  # as deep as it grew


def static_tree(log_probs: torch.Tensor, shape: TreeShape) -> DraftTree:
    """The static top-k tree over distributions that do not depend on the path (Medusa's heads, a
    block draft's positions): log_probs [B, d, V]; every node at depth i (the root's is 0) has the
    top_k tokens of log_probs[:, i] as children; the max_nodes most probable nodes (product of their
    probabilities along the path) are kept. Grown as EAGLE-2's tree with a frontier of
    max_nodes: a node outside the max_nodes best of its depth is not among the max_nodes best of all,
    and neither is any node below it."""
    depth = log_probs.shape[1]
    growth = TreeGrowth(replace(shape, depth=depth), len(log_probs), log_probs.device, frontier=shape.max_nodes)
    for i in range(depth):
        growth.grow(log_probs[:, i : i + 1].expand(-1, growth.frontier.shape[1], -1))
    return growth.select()[0]


def draft_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What a tree is grown by: log q, the warped draft distribution, when sampling; the plain
    softmax's when greedy (nothing is sampled from the draft either way). Over the logits' columns:
    all V, or a subset head's S, the columns `TreeGrowth(vocabulary=...)` takes."""
    if params.greedy:
        return logits.float().log_softmax(dim=-1)
    return sampling.warp(logits, params).log()


# ---------------------------------------------------------------- verification


def walk(tree: DraftTree, test) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the root, go to the first child of the current node that `test` passes, as long as one
    does. test(node [B], children [B, n] bool) -> (passed [B, n] bool, outcome at the node: [B, ...]).
    Returns (accepted nodes [B], path [B, depth + 1] slots from the root (the last one repeated past
    the end), the outcome at the node where each row stopped)."""
    batch, n = tree.tokens.shape
    node = torch.zeros(batch, dtype=torch.long, device=tree.tokens.device)
    walking = torch.ones(batch, dtype=torch.bool, device=node.device)
    path, outcome = [node], None
    order = torch.arange(1, n + 1, device=node.device)
    for _ in range(tree.depth + 1):  # the last step finds no children: the bonus token's node
        children = tree.parents == node[:, None]
        passed, node_outcome = test(node, children)
        passed = passed & children & walking[:, None]
        moves = passed.any(dim=1)
        stops = walking & ~moves
        shape = (-1,) + (1,) * (node_outcome.dim() - 1)
        outcome = node_outcome if outcome is None else torch.where(stops.view(shape), node_outcome, outcome)
        first = torch.where(passed, order, n + 1).min(dim=1).values  # the first child that passed
        node = torch.where(moves, first, node)
        walking = moves
        path.append(node)
    path = torch.stack(path[:-1], dim=1)
    return (path[:, 1:] != path[:, :-1]).sum(dim=1), path, outcome


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The longest root path whose every token is the target's argmax after its parent, then the
    target's argmax. target_logits [B, n + 1, V] -> (num_accepted [B], next_token [B], path [B, depth + 1])."""
    target_tokens = target_logits.argmax(dim=-1)  # [B, n + 1]

    def test(node, children):
        best = target_tokens.gather(1, node[:, None])  # [B, 1]
        return tree.tokens == best, best[:, 0]

    num_accepted, path, next_token = walk(tree, test)
    return num_accepted, next_token, path


def try_children(
    target_probs: torch.Tensor, tokens: torch.Tensor, children: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The test at one node per row. target_probs [B, V]: p, the warped target distribution after the
    node's path; tokens [B, n] the tree's; children [B, n] which nodes are this node's children, in
    order of draft probability. Returns (passed [B, n], leftover [B, V]): the walk takes the first
    child that passed; when none did, the token is drawn from the leftover p'.

    The rule (multi-candidate rejection sampling with deterministic candidates): p' starts as p. Try
    the children in order: accept child x with probability p'(x); on rejection set p'(x) = 0 and
    renormalise. If every child is rejected, draw from p' (p without the children, renormalised).
    The children are a top-k, not draws from q: q is one-hot on each, so the general test
    min(1, p'(x) / q(x)) is p'(x), and norm(max(0, p' - q)) zeroes x and renormalises.

    Why the output is distributed as p: for children x_1, x_2, ... with p(x_1) = a_1, ..., the first
    is emitted with probability a_1. The second is tried only after a rejection (probability 1 - a_1)
    and accepted with p'(x_2) = a_2 / (1 - a_1): in all, (1 - a_1) a_2 / (1 - a_1) = a_2. By induction,
    x_j is reached with probability 1 - a_1 - ... - a_(j-1), the mass p' has left, and accepted with
    a_j over that mass: a_j in all. After every child was rejected (probability 1 - sum a) a token y
    that is no child is drawn from p' with probability p(y) / (1 - sum a): p(y) in all. So every token
    comes out with probability p(x), exactly what drawing from p gives; and since each accepted token
    is distributed as the target's after its own path, the walk's tokens are the target's, one after
    another. Testing a later child against p (not p') under-samples it, and so does forgetting to
    renormalise p': tests/test_tree.py shows both fail the checks.

    Nothing above reads q: the argument holds for any children that are distinct tokens fixed before
    the node's uniforms are drawn. So a static tree whose distribution at a depth is not conditioned
    on the path above (Medusa's heads, a block draft's positions) and a trie of prompt lookup's
    matches are exact too; q decides only which children are tried, so how often one is accepted.
    Distinct they must be: a token that is two siblings is tried twice and comes out too often
    (tests/test_tree_drafters.py shows the checks catch it).

    Every row draws n uniforms per node whether or not it has n children (no host sync)."""
    mass = target_probs.gather(1, tokens).double() * children  # [B, n] p(x) of the children, 0 elsewhere
    tried = mass.cumsum(dim=1) - mass  # mass of the children tried before each: gone from p'
    kept = mass / (1 - tried).clamp_min(torch.finfo(mass.dtype).tiny)  # p'(x) at x's turn
    u = torch.rand(mass.shape, dtype=torch.float64, device=mass.device, generator=generator)
    # a child of p(x) = 0 never passes (u >= 0)
    passed = u < kept
    drafted = torch.zeros_like(target_probs).scatter_add_(1, tokens, children.to(target_probs.dtype))
    return passed, sampling.residual(target_probs, drafted)  # p with the children zeroed, renormalised


def recursive_rejection(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    tokens: torch.Tensor,
    children: torch.Tensor,
    count: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The test at one node per row when its children were drawn from q without replacement
    (`draw_children`). target_probs [B, V]: p; draft_probs [B, V]: q, the distribution the node's
    children were drawn from; tokens, children: as `try_children`, the children in the order drawn,
    at most `count` of them. Returns (passed [B, n], leftover [B, V]) as `try_children`.

    The rule (recursive rejection sampling, Jeon et al. 2024): p' = p, q' = q. For the children
    x_1, x_2, ... in the order drawn: accept x_i with probability min(1, p'(x_i) / q'(x_i)); on
    rejection set p' = norm(max(0, p' - q')), then remove x_i from q' and renormalise. If every child
    is rejected, draw from p'. A child of q'(x_i) = 0 (q had fewer tokens than children) never passes
    and changes neither p' nor q'.

    Why the output is distributed as p: x_1 ~ q' is the chain's test of one draft, which emits y
    with probability min(p'(y), q'(y)) when it accepts, and rejects with probability
    r = 1 - sum min(p', q'). Given x_1, the next child is a draw from q'' = q' without x_1,
    renormalised: exactly the next draw without replacement. So the rest of the walk is the same
    rule with p'' = norm(max(0, p' - q')) and q'', and by induction (the last step: a draw from p'')
    it emits p''; p'' does not depend on x_1, so in all the node emits
    min(p'(y), q'(y)) + r p''(y) = min(p', q') + max(0, p' - q') = p'(y). The order matters: testing
    x_i against q instead of q'' (drawn without replacement, tested as with), forgetting to
    renormalise q'', updating p' with q instead of q', or dropping children after looking at their
    values (EAGLE-2's final cut) each breaks it; tests/test_tree.py shows the checks catch them.

    Every row draws `count` uniforms per node whether or not it has children (no host sync)."""
    n = tokens.shape[1]
    slots = torch.arange(n, device=tokens.device)
    rank = children.long().cumsum(dim=1) - 1  # each child's place among its siblings
    p, q = target_probs.double(), draft_probs.double()
    passed = torch.zeros_like(children)
    u = torch.rand(len(tokens), count, dtype=torch.float64, device=tokens.device, generator=generator)
    for i in range(count):
        slot = torch.where(children & (rank == i), slots, n).min(dim=1).values  # [B]: the i-th child (n: none)
        x = tokens.gather(1, slot.clamp_max(n - 1)[:, None])  # [B, 1]
        p_x, q_x = p.gather(1, x)[:, 0], q.gather(1, x)[:, 0]
        drawn = (slot < n) & (q_x > 0)
        accept = drawn & (u[:, i] * q_x < p_x)
        passed |= accept[:, None] & (slots == slot[:, None])
        rejected = (drawn & ~accept)[:, None]
        p = torch.where(rejected, sampling.residual(p, q), p)
        if i + 1 < count:  # q' is read only by a later child
            q_without = q.scatter(1, x, 0.0)
            q = torch.where(
                rejected, q_without / q_without.sum(dim=1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny), q
            )
    return passed, p


def verify_sampled(
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The walk with the tree's rule at every node (warping only the nodes it visits):
    `recursive_rejection` where its children were drawn from q, else `try_children`; then a token
    drawn from the leftover where it stopped (p itself at a leaf: the bonus token).
    target_logits [B, n + 1, V] -> (num_accepted [B], next_token [B], path [B, depth + 1])."""
    rows = torch.arange(len(target_logits), device=target_logits.device)
    sampled = tree.sampled

    def test(node, children):
        p = sampling.warp(target_logits[rows, node], params)
        if sampled is None:
            return try_children(p, tree.tokens, children, generator)
        q = sampled.q(rows, node, target_logits.shape[-1])
        return recursive_rejection(p, q, tree.tokens, children, sampled.count, generator)

    num_accepted, path, leftover = walk(tree, test)
    return num_accepted, sampling.sample(leftover, generator), path
