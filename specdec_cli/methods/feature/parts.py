"""What every feature draft (specdec's own, EAGLE-1's, EAGLE-3's) is run through: how it reads the
target's states and its tokens, and its head over a subset of the vocabulary. Apart from the
formats that build such drafts, so that methods/feature/drafter.py, which runs them, needs no format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

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
    """The target's LM head restricted to `token_ids`: logits over those ids alone [..., len(token_ids)],
    in their order (the drafter maps its draws back to the target's ids, and builds q over the whole
    vocabulary only for verification). `weight` gives the rows for `token_ids` when the draft has its
    own (EAGLE-3 drafts train theirs). Loading routes it as a linear layer (loading/decode_matmul.py)."""

    routed_as_linear = True
    bias = None

    def __init__(self, target_head: torch.Tensor, token_ids: torch.Tensor, weight: torch.Tensor | None = None):
        super().__init__()
        self.vocab_size = target_head.shape[0]
        # buffers, not parameters: frozen, and left out of the draft's state dict (stored by reference)
        self.register_buffer("token_ids", token_ids.to(target_head.device), persistent=False)
        if weight is not None:
            rows = weight.to(target_head.device)
        elif torch.equal(self.token_ids, torch.arange(self.vocab_size, device=target_head.device)):
            rows = target_head.detach()  # the whole head: no copy
        else:
            rows = target_head.detach()[self.token_ids]
        self.register_buffer("weight", rows, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


def head_vocabulary(draft: torch.nn.Module) -> torch.Tensor | None:
    """The target token ids a draft's logits are over, in order, where its head is a `SubsetHead`;
    None where they are over the whole vocabulary."""
    head = next((m for m in draft.modules() if isinstance(m, SubsetHead)), None)
    return None if head is None else head.token_ids
