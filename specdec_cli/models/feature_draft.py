"""A distilled draft (made by `specdec distill`): a feature draft in the manner of EAGLE (Li et al.
2024). Beside each token it reads the target's last hidden state at the token before, so a decoder
layer or two can predict what the 30-layer target will say next far better than a small model that
sees tokens only. Its parts:

- `TAPS` (drafts that read several target layers, as EAGLE-3 does): each layer's state
  RMS-normalised, one linear map of them all to the draft's width, and a norm; drafts without it
  read the target's last state (after its final norm) as it is.
- `FEATURES`: a linear map of [token embedding, hidden state] to the width of its layers.
- A few decoder layers of the target's architecture and width, and a final norm; their output is
  both its next-token prediction (through the head) and the state it reads beside its own next
  draft token, where the target's state does not exist yet.
- Input embedding: the target's, shared by reference.
- LM head: the target's head rows for a subset of the vocabulary (`SubsetHead`), also by reference.
  A small draft's cost is mostly its head, so scoring 8k tokens instead of 49k makes it several
  times cheaper, and the engine stays exact: the other tokens get logit -inf, q is still a
  distribution over the target's vocabulary, and the draft simply never proposes them.

The folder holds config.json, model.safetensors (the draft's own weights and `TOKEN_IDS`, the
subset), the target's tokenizer and `DRAFT_INFO` (what it was distilled for, and how).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from specdec_cli.errors import SpecdecError
from specdec_cli.models.decode_matmul import linear

DRAFT_INFO = "specdec-draft.json"
EMBEDDING = "model.embed_tokens.weight"  # borrowed from the target, never stored
TOKEN_IDS = "specdec.token_ids"  # the target token ids the draft's head scores
FEATURES = "feature_projection"  # the draft's module that reads [embedding, hidden state]
TAPS = "tap_fusion"  # the draft's module that fuses the target layers it reads into one state
# config key: which of the target's hidden states the draft reads, as indices into transformers'
# `hidden_states` (0 the embedding output, i the input of layer i, -1 the last, after the final norm)
TARGET_LAYERS = "specdec_target_layers"
LAST = (-1,)


def is_feature_draft(model: torch.nn.Module) -> bool:
    return hasattr(model, FEATURES)


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's taps of a target of `num_layers` layers: the inputs of layers 2, L // 2 and L - 3
    (low, middle, high)."""
    return (2, num_layers // 2, num_layers - 3)


def target_layers(draft: PreTrainedModel) -> tuple[int, ...]:
    return tuple(getattr(draft.config, TARGET_LAYERS, None) or LAST)


class TapFusion(torch.nn.Module):
    """[..., taps * width] target states -> [..., width]. Each tap is RMS-normalised first: the
    residual stream's scale grows by orders of magnitude through the layers. The output norm puts
    the result on the scale of the draft's own states, which take its place at later draft steps."""

    def __init__(self, width: int, taps: int, eps: float):
        super().__init__()
        self.width, self.eps = width, eps
        self.linear = torch.nn.Linear(taps * width, width, bias=False)
        self.norm = torch.nn.RMSNorm(width, eps=eps)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        taps = states.unflatten(-1, (-1, self.width))
        normed = torch.nn.functional.rms_norm(taps, (self.width,), eps=self.eps).flatten(-2)
        return self.norm(self.linear(normed.to(self.linear.weight.dtype)))


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


def borrow_from_target(draft: PreTrainedModel, target: PreTrainedModel, token_ids: torch.Tensor) -> None:
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = SubsetHead(target.get_output_embeddings().weight, token_ids)


def add_feature_projection(draft: PreTrainedModel) -> torch.nn.Linear:
    """The projection, and the tap fusion when the draft's config names several target layers."""
    width = draft.config.hidden_size
    projection = torch.nn.Linear(2 * width, width, bias=False)
    setattr(draft, FEATURES, projection)
    if target_layers(draft) != LAST:
        setattr(draft, TAPS, TapFusion(width, len(target_layers(draft)), draft.config.rms_norm_eps))
    return projection


def check_target_layers(layers: tuple[int, ...], target_config) -> None:
    count = target_config.num_hidden_layers
    wrong = [i for i in layers if not (0 <= i <= count or i == -1)]
    if wrong or not layers:
        raise SpecdecError(
            f"target layer ids {list(layers)} do not fit a target of {count} layers "
            f"(0 .. {count} are the inputs of its layers and its last state; -1 is the last)"
        )


def starting_layers(target_config, num_layers: int, init_layers: tuple[int, ...] | None) -> list[int]:
    """The target layers a new draft's layers are copied from (default: evenly spaced)."""
    count = target_config.num_hidden_layers
    chosen = list(init_layers) if init_layers else spaced_layers(count, num_layers)
    if len(chosen) != num_layers or not all(0 <= i < count for i in chosen):
        raise SpecdecError(f"init layers {chosen}: need {num_layers} ids of the target's {count} layers")
    return chosen


def init_draft(
    target: PreTrainedModel,
    num_layers: int,
    token_ids: torch.Tensor,
    taps: tuple[int, ...] = LAST,
    init_layers: tuple[int, ...] | None = None,
    zero_features: bool = False,
) -> PreTrainedModel:
    """A feature draft for a Llama-style target (`model.layers`, `model.norm`) reading the target's
    hidden states `taps`: its layers copied from the target's `init_layers` (default: evenly spaced,
    first and last included) and its final norm, trainable in float32. The projection starts as
    embedding + scaled state, or with `zero_features` as the embedding alone (the copied layers
    then start as a token-only draft); the embedding and the head subset borrowed and frozen."""
    config = target.config.__class__.from_dict(target.config.to_dict())
    check_target_layers(taps, config)
    chosen = starting_layers(config, num_layers, init_layers)
    setattr(config, TARGET_LAYERS, list(taps))
    config.num_hidden_layers = num_layers
    config.layer_types = None  # re-derived for the new depth where the architecture uses it
    config.tie_word_embeddings = False  # the draft's head is a subset, not its embedding
    draft = AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa"
    ).float()  # training passes boolean masks
    with torch.no_grad():
        for mine, theirs in zip(draft.model.layers, chosen):
            mine.load_state_dict(target.model.layers[theirs].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        # embedding + state, the state scaled to the embedding's size: the final norm's output is
        # far larger than the embedding (SmolLM2's is), and would drown the token at the start of training
        width = config.hidden_size
        scale = rms(target.get_input_embeddings().weight) / rms(target.model.norm.weight)
        state = torch.zeros(width, width) if zero_features else scale * torch.eye(width)
        add_feature_projection(draft).weight.copy_(torch.cat([torch.eye(width), state], dim=1))
        if hasattr(draft, TAPS):
            getattr(draft, TAPS).norm.weight.copy_(target.model.norm.weight)
    draft.to(device=target.device)
    borrow_from_target(draft, target, token_ids)
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def rms(tensor: torch.Tensor) -> float:
    return tensor.float().pow(2).mean().sqrt().item()


def spaced_layers(total: int, count: int) -> list[int]:
    """`count` evenly spaced indices of `total` layers, the first and the last among them."""
    return [round(i * (total - 1) / max(count - 1, 1)) for i in range(count)]


def own_weights(draft: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {k: v for k, v in draft.state_dict().items() if k != EMBEDDING}


def save_draft(draft: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path, info: dict) -> None:
    """The draft's own weights in bfloat16 (half the size; drafts run in bf16 or get upcast)."""
    weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in own_weights(draft).items()}
    weights[TOKEN_IDS] = draft.lm_head.token_ids.cpu()
    draft.config.save_pretrained(out)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    (out / DRAFT_INFO).write_text(json.dumps(info, indent=2) + "\n")


def load_draft(
    folder: Path, weights: dict[str, torch.Tensor], target: PreTrainedModel, dtype: torch.dtype
) -> PreTrainedModel:
    """The draft in `folder`, whose tensors (formats.DraftFolder's) are `weights`, for `target`."""
    config = AutoConfig.from_pretrained(folder)
    weights = dict(weights)
    token_ids = weights.pop(TOKEN_IDS, None)
    embedding = target.get_input_embeddings().weight
    if (
        token_ids is None
        or embedding.shape != (config.vocab_size, config.hidden_size)
        or int(token_ids.max()) >= target.get_output_embeddings().weight.shape[0]
    ):
        trained_for = json.loads((folder / DRAFT_INFO).read_text()).get("target", "another target")
        raise SpecdecError(f"draft {folder} was distilled for {trained_for}: this target does not fit it")
    check_target_layers(tuple(getattr(config, TARGET_LAYERS, None) or LAST), target.config)
    model = AutoModelForCausalLM.from_config(config)
    add_feature_projection(model)
    model.to(dtype)
    borrow_from_target(model, target, token_ids)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False, assign=True)
    if unexpected or set(missing) != {EMBEDDING}:
        raise SpecdecError(
            f"draft {folder}: weights do not match its config "
            f"(missing {sorted(set(missing) - {EMBEDDING})[:3]}, unexpected {unexpected[:3]})"
        )
    return model
