"""Suffix decoding (Oliaro et al., arXiv 2411.04975; Snowflake's Arctic Inference, vLLM's `method:
suffix`): drafts what followed the context's longest matching suffix, in this request's own tokens
and in the answers of the run's earlier requests, scored by how often each continuation followed it.

- Each row keeps a trie of every substring of up to `max_tree_depth` tokens of its prompt and answer
  so far, with how often each occurred (a suffix tree cut at that depth), grown as tokens are
  verified. The run keeps one more over the answers of its last `max_cached_requests` requests
  (generate's prompt file, benchmark's prompts, a batch's rows), the oldest dropped first.
- Per block and row, every suffix of the context (shorter than max_tree_depth) that a trie holds is
  a match. A continuation's estimated probability is the product, along its path, of each token's
  count over its parent's. From each match, drafts grow the most probable continuations (a chain: the
  most frequent next token each step; a tree: best first, at most top_k children a node) while that
  estimate is at least `min_token_prob`, up to `max_spec_factor` x the match's length +
  `max_spec_offset` tokens and the block's length; the draft with the largest summed estimate over
  both tries and all match lengths is kept.
- A request never reads answers to its own prompt: they are out of the shared trie while a row with
  that prompt runs, so a benchmark's repeats and modes of one prompt (a serving engine never sees the
  same request twice) and verify-distribution's runs do not draft from their own earlier answers.

The drafts are deterministic, so q is one-hot and the exact rules apply (methods/context.py).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from itertools import count

import torch

from specdec_cli.decoding.drafter import Rows, States
from specdec_cli.decoding.params import TreeShape
from specdec_cli.methods.context import ContextDrafter
from specdec_cli.methods.registry import Built, Target


class Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, Node] = {}


class SuffixTrie:
    """How often every substring of up to `depth` tokens of the sequences added occurred."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node()

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Count (sign -1: uncount) every substring of `tokens` of up to `depth` tokens."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node()
                child.count += sign
                if child.count == 0:  # uncounted to nothing: so is everything below it
                    del node.children[token]
                    break
                node = child

    def matches(self, context: list[int]) -> list[Node]:
        """The nodes of the context's suffixes held here, shortest first (node i: the last i + 1 tokens),
        up to the first one missing."""
        found = []
        for length in range(1, min(self.depth, len(context))):
            node = self.root
            for token in context[len(context) - length :]:
                node = node.children.get(token)
                if node is None:
                    return found
            found.append(node)
        return found


class GrowingTrie(SuffixTrie):
    """The trie of one sequence, grown token by token; it knows its current suffixes' nodes."""

    def __init__(self, depth: int, tokens: list[int]):
        super().__init__(depth)
        self.suffixes: list[Node] = []  # the nodes of the sequence's suffixes of 1 .. depth - 1 tokens
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            grown = []
            for node in [self.root, *self.suffixes]:  # the substrings ending here, 1 .. depth tokens
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node()
                child.count += 1
                grown.append(child)
            self.suffixes = grown[: self.depth - 1]

    def matches(self, context: list[int]) -> list[Node]:
        """As SuffixTrie's, for the context this trie holds: its suffixes' nodes are at hand."""
        return self.suffixes[: len(context) - 1]


def ranked(node: Node) -> list[tuple[int, Node, float]]:
    """What followed `node`, most frequent first: (token, its node, its share of the node's occurrences)."""
    children = sorted(node.children.items(), key=lambda item: -item[1].count)
    return [(token, child, child.count / node.count) for token, child in children]


def chain(node: Node, budget: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation while its estimated probability stays >= min_prob: its tokens
    and their summed estimates."""
    tokens, prob, score = [], 1.0, 0.0
    while len(tokens) < budget and node.children:
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        prob *= child.count / node.count
        if prob < min_prob:
            break
        tokens.append(token)
        score += prob
        node = child
    return tokens, score


def tree(node: Node, shape: TreeShape, budget: int, min_prob: float) -> tuple[list[int], list[int], float]:
    """The most probable continuations as a tree, best first: tokens, parent slots, summed estimates."""
    tokens: list[int] = []
    parents: list[int] = []
    score, order = 0.0, count()
    frontier: list = []

    def expand(node: Node, slot: int, prob: float, depth: int) -> None:
        for token, child, share in ranked(node)[: shape.top_k]:
            heapq.heappush(frontier, (-prob * share, next(order), token, child, slot, depth + 1))

    expand(node, 0, 1.0, 0)
    while frontier and len(tokens) < min(budget, shape.max_nodes):
        negative, _, token, child, parent, depth = heapq.heappop(frontier)
        if -negative < min_prob:
            break
        tokens.append(token)
        parents.append(parent)
        score -= negative
        if depth < shape.depth:
            expand(child, len(tokens), -negative, depth)
    return tokens, parents, score


@dataclass
class CachedAnswer:
    prompt: tuple[int, ...]
    answer: list[int]
    counted: bool = field(default=False)  # in the shared trie now


class SuffixDrafter(ContextDrafter):
    """Settings as vLLM names its suffix_decoding_* ones: `max_tree_depth` the longest substring
    counted, `max_cached_requests` earlier answers drafted from (0: this request's only), a match of n
    tokens drafts up to `max_spec_factor` * n + `max_spec_offset` tokens, and only while each token's
    estimated probability stays at least `min_token_prob`."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        *,
        max_tree_depth: int,
        max_cached_requests: int,
        max_spec_factor: float,
        max_spec_offset: float,
        min_token_prob: float,
    ):
        super().__init__(vocab_size, device)
        self.max_tree_depth, self.max_cached_requests = max_tree_depth, max_cached_requests
        self.max_spec_factor, self.max_spec_offset, self.min_token_prob = (
            max_spec_factor,
            max_spec_offset,
            min_token_prob,
        )
        self.shared = SuffixTrie(max_tree_depth)  # the earlier requests' answers
        self.cached: deque[CachedAnswer] = deque()
        self.tries: list[GrowingTrie] = []  # one per row: its prompt and answer so far
        self.prompts: list[tuple[int, ...]] = []

    def start(self, prompts: Rows, max_tokens: int, target_states: States) -> None:
        self.retire(range(len(self.contexts)))  # the last batch's rows that ran to its end
        super().start(prompts, max_tokens, target_states)
        self.prompts = [tuple(prompt) for prompt in prompts]
        running = set(self.prompts)
        for entry in self.cached:  # answers to these prompts out of the shared trie, the others in
            if entry.counted == (entry.prompt in running):
                self.shared.add(entry.answer, -1 if entry.counted else 1)
                entry.counted = not entry.counted
        self.tries = [GrowingTrie(self.max_tree_depth, prompt) for prompt in prompts]

    def retire(self, rows) -> None:
        """The rows' answers into the shared cache (counted once no row with their prompt runs)."""
        running = {self.prompts[r] for r in range(len(self.prompts)) if r not in set(rows)}
        for row in rows:
            answer = self.contexts[row][len(self.prompts[row]) :]
            if not answer or not self.max_cached_requests:
                continue
            entry = CachedAnswer(self.prompts[row], answer)
            if entry.prompt not in running:
                self.shared.add(answer)
                entry.counted = True
            self.cached.append(entry)
            if len(self.cached) > self.max_cached_requests:
                oldest = self.cached.popleft()
                if oldest.counted:
                    self.shared.add(oldest.answer, -1)

    def commit(self, draft_ids: Rows, num_accepted: list[int], next_tokens: list[int], target_states: States) -> None:
        for trie, ids, accepted, token in zip(self.tries, draft_ids, num_accepted, next_tokens):
            trie.extend(ids[:accepted] + [token])
        super().commit(draft_ids, num_accepted, next_tokens, target_states)

    def keep(self, rows: list[int]) -> None:
        self.retire([r for r in range(len(self.contexts)) if r not in set(rows)])
        super().keep(rows)
        self.tries = [self.tries[r] for r in rows]
        self.prompts = [self.prompts[r] for r in rows]

    def budget(self, length: int, limit: int) -> int:
        """Draft tokens a match of `length` tokens earns (the block's `limit` at most)."""
        return min(limit, int(self.max_spec_factor * length + self.max_spec_offset + 1e-6))

    def best(self, row: int, draft, limit: int):
        """`draft(node, budget)` (a draft and its summed estimates last) from every suffix the row's own
        trie, then the shared one, holds: the highest-scoring, the longer match on a tie within a trie
        and the own trie's on a tie between them. A longer match is surer but leaves the trie, cut at
        max_tree_depth, less room to continue, so every length is tried (as Arctic Inference does)."""
        best = None
        for trie in (self.tries[row], self.shared):
            found = None
            for length, node in enumerate(trie.matches(self.contexts[row]), start=1):
                candidate = draft(node, self.budget(length, limit))
                if found is None or candidate[-1] >= found[-1]:
                    found = candidate
            if found is not None and (best is None or found[-1] > best[-1]):
                best = found
        return best

    def lookup(self, num_draft_tokens: int, row: int = 0) -> list[int]:
        best = self.best(row, lambda node, budget: chain(node, budget, self.min_token_prob), num_draft_tokens)
        return best[0] if best else []

    def lookup_tree(self, shape: TreeShape, row: int) -> tuple[list[int], list[int]]:
        def draft(node, budget):
            return tree(node, shape, budget, self.min_token_prob)

        best = self.best(row, draft, shape.max_nodes)
        return (best[0], best[1]) if best else ([], [])


def build(settings, target: Target) -> Built:
    """Suffix decoding with draft.suffix's limits; the blocks' length is the loop's."""
    limits = {k: v for k, v in vars(settings).items() if k != "num_draft_tokens"}
    return Built(SuffixDrafter(target.vocab_size, target.device, **limits))
