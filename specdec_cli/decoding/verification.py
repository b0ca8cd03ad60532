"""The verification rules, one object each, chosen once per decoder: greedy chains, sampled chains
verified token by token or as a block, greedy trees and sampled trees. The functions they apply are
looked up in sampling.py and tree.py when called, so a check that replaces one there tests the loop.

A chain rule returns (num_accepted [B], next_token [B]); a tree rule also the accepted path's tree
slots [B, depth + 1]."""

from __future__ import annotations

import torch

from specdec_cli.decoding import sampling
from specdec_cli.decoding import tree as trees
from specdec_cli.decoding.params import SamplingParams


class ChainRule:
    name: str

    def verify(
        self,
        drafts: torch.Tensor,
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """drafts [B, g] (-1: not drafted), their q [B, g, V] (None when greedy or target-only), the
        target's logits after [last token, *drafts] [B, g + 1, V]."""
        raise NotImplementedError


class GreedyChain(ChainRule):
    """Accept while the draft equals the target's argmax."""

    name = "greedy"

    def verify(self, drafts, draft_probs, logits, params, generator):
        return sampling.verify_greedy(drafts, logits)


class SampledChain(ChainRule):
    """Warps the target's logits as the draft's were (`warp`); `accept` decides on the warped p and q."""

    warp = staticmethod(sampling.warp)

    def verify(self, drafts, draft_probs, logits, params, generator):
        target_probs = self.warp(logits, params)
        if draft_probs is None:  # target-only: nothing to test, sample from p
            draft_probs = target_probs[:, :0]
        return self.accept(drafts, draft_probs, target_probs, generator)

    def accept(self, drafts, draft_probs, target_probs, generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class TokenVerification(SampledChain):
    """Accept-or-resample, token by token (sampling.verify_sampled)."""

    name = "token"

    def accept(self, drafts, draft_probs, target_probs, generator):
        return sampling.verify_sampled(drafts, draft_probs, target_probs, generator)


class BlockVerification(SampledChain):
    """The drafts judged as a block (sampling.verify_block)."""

    name = "block"

    def accept(self, drafts, draft_probs, target_probs, generator):
        return sampling.verify_block(drafts, draft_probs, target_probs, generator)


class SyntheticAcceptance(ChainRule):
    """A loop benchmark, never exact (vLLM's synthetic rejection sampling): `rule` runs, so the block
    costs what it would, then each draft is kept with probability `rate` given the ones before it were,
    whatever the target says, and the target's own token follows the kept ones (greedy: its argmax;
    sampled: a draw from its warped distribution there)."""

    name = "synthetic"

    def __init__(self, rule: ChainRule, rate: float):
        self.rule, self.rate = rule, rate

    def verify(self, drafts, draft_probs, logits, params, generator):
        self.rule.verify(drafts, draft_probs, logits, params, generator)
        draws = torch.rand(drafts.shape, generator=generator, device=drafts.device)
        num_accepted = sampling.accepted_prefix_length((draws < self.rate) & (drafts >= 0))
        after = logits.gather(1, num_accepted[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]  # [B, V]
        if params.greedy:
            return num_accepted, after.argmax(dim=-1)
        return num_accepted, sampling.sample(sampling.warp(after, params), generator)


# a sampled chain's rules by the name speculation.verification gives them
SAMPLED_CHAIN_RULES: dict[str, type[SampledChain]] = {"token": TokenVerification, "block": BlockVerification}


class TreeRule:
    name: str

    def verify(
        self, tree: trees.DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The target's logits after [last token, *nodes] [B, n + 1, V]."""
        raise NotImplementedError


class GreedyTree(TreeRule):
    name = "tree greedy"

    def verify(self, tree, logits, params, generator):
        return trees.verify_greedy(tree, logits)


class SampledTree(TreeRule):
    name = "tree sampled"

    def verify(self, tree, logits, params, generator):
        return trees.verify_sampled(tree, logits, params, generator)


def chain_rule(params: SamplingParams, sampled_rule: str = "token") -> ChainRule:
    """Greedy chains' rule, or the sampled chains' rule named `sampled_rule`."""
    return GreedyChain() if params.greedy else SAMPLED_CHAIN_RULES[sampled_rule]()


def tree_rule(params: SamplingParams) -> TreeRule:
    return GreedyTree() if params.greedy else SampledTree()
