"""What every feature draft (specdec's own, EAGLE-1's, EAGLE-3's) is run through: how it reads the
target's states and its tokens, and its head over a subset of the vocabulary. Apart from the
formats that build such drafts, so that drafters/feature.py, which runs them, needs no format.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdec_cli.models.decode_matmul import linear

FEATURES = "feature_projection"  # the draft's module that reads [embedding, hidden state]
TAPS = "tap_fusion"  # the draft's module that fuses the target layers it reads into one state


def read_target(draft: PreTrainedModel, states: torch.Tensor) -> torch.Tensor:
    """The target's states as the draft reads them [..., width] (fused when it reads several layers)."""
    fusion = getattr(draft, TAPS, None)
    return states if fusion is None else fusion(states)


def feature_inputs(draft: PreTrainedModel, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The draft's input vectors: token j + 1's embedding beside the state at token j (the target's,
    through `read_target`, or the draft's own)."""
    embeddings = draft.get_input_embeddings()(input_ids)
    return getattr(draft, FEATURES)(torch.cat([embeddings, features.to(embeddings.dtype)], dim=-1))


class SubsetHead(torch.nn.Module):
    """The target's LM head restricted to `token_ids`; every other token gets logit -inf. `weight`
    gives the rows for `token_ids` when the draft has its own (EAGLE-3 drafts train theirs)."""

    def __init__(self, target_head: torch.Tensor, token_ids: torch.Tensor, weight: torch.Tensor | None = None):
        super().__init__()
        self.vocab_size = target_head.shape[0]
        # buffers, not parameters: frozen, and left out of the draft's state dict (stored by reference)
        self.register_buffer("token_ids", token_ids.to(target_head.device), persistent=False)
        rows = target_head.detach()[self.token_ids] if weight is None else weight.to(target_head.device)
        self.register_buffer("weight", rows, persistent=False)

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the subset only [..., len(token_ids)] (what training needs)."""
        return linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = self.scores(hidden)
        logits = scores.new_full((*scores.shape[:-1], self.vocab_size), float("-inf"))
        logits[..., self.token_ids] = scores
        return logits


def vocabulary_subset(draft: torch.nn.Module) -> torch.Tensor | None:
    """The token ids the draft's head scores, where that is a strict subset of the vocabulary."""
    head = next((m for m in draft.modules() if isinstance(m, SubsetHead)), None)
    return head.token_ids if head is not None and len(head.token_ids) < head.vocab_size else None
