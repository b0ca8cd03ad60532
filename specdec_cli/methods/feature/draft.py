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
  times cheaper, and the engine stays exact: q is still a distribution over the target's
  vocabulary, zero outside the subset, and the draft simply never proposes those tokens.

The folder holds config.json, model.safetensors (the draft's own weights and `TOKEN_IDS`, the
subset), the target's tokenizer and `DRAFT_INFO` (what it was distilled for, and how): `FORMAT`
recognises it by that file, loads it and drafts with it. What every feature draft is run through
(its projection, head, reading of the target's states) is in methods/feature/parts.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from specdec_cli.errors import SpecdecError
from specdec_cli.loading.draft_folder import DraftFolder, Format, Wiring
from specdec_cli.loading.target_states import LAST, TARGET_LAYERS, check_states, target_layers
from specdec_cli.methods.feature.drafter import FeatureDrafter
from specdec_cli.methods.feature.parts import FEATURES, TAPS, SubsetHead

DRAFT_INFO = "specdec-draft.json"
EMBEDDING = "model.embed_tokens.weight"  # borrowed from the target, never stored
TOKEN_IDS = "specdec.token_ids"  # the target token ids the draft's head scores


class TapFusion(torch.nn.Module):
    """[..., taps * width] target states -> [..., width]. Each tap is RMS-normalised first: the
    residual stream's scale grows by orders of magnitude through the layers. The output norm puts
    the result on the scale of the draft's own states, which take its place at later draft steps."""

    def __init__(self, width: int, taps: int, eps: float):
        super().__init__()
        self.width, self.eps = width, eps
        self.linear = torch.nn.Linear(taps * width, width, bias=False)
        self.norm = LlamaRMSNorm(width, eps=eps)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        taps = states.unflatten(-1, (-1, self.width))
        # LlamaRMSNorm without its weight: torch's rms_norm also normalises in float32
        normed = torch.nn.functional.rms_norm(taps, (self.width,), eps=self.eps).flatten(-2)
        return self.norm(self.linear(normed.to(self.linear.weight.dtype)))


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
    """A feature draft reads any of the target's hidden states (loading/target_states.py), -1 the last."""
    check_states(layers, target_config.num_hidden_layers, f"target layer ids {list(layers)}", last=True)


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


def load(folder: DraftFolder, target: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """The draft in `folder` for `target`."""
    config = AutoConfig.from_pretrained(folder.path)
    weights = dict(folder.weights)
    token_ids = weights.pop(TOKEN_IDS, None)
    embedding = target.get_input_embeddings().weight
    if (
        token_ids is None
        or embedding.shape != (config.vocab_size, config.hidden_size)
        or int(token_ids.max()) >= target.get_output_embeddings().weight.shape[0]
    ):
        trained_for = json.loads((folder.path / DRAFT_INFO).read_text()).get("target", "another target")
        raise SpecdecError(f"draft {folder.path} was distilled for {trained_for}: this target does not fit it")
    check_target_layers(tuple(getattr(config, TARGET_LAYERS, None) or LAST), target.config)
    model = AutoModelForCausalLM.from_config(config)
    add_feature_projection(model)
    model.to(dtype)
    borrow_from_target(model, target, token_ids)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False, assign=True)
    if unexpected or set(missing) != {EMBEDDING}:
        raise SpecdecError(
            f"draft {folder.path}: weights do not match its config "
            f"(missing {sorted(set(missing) - {EMBEDDING})[:3]}, unexpected {unexpected[:3]})"
        )
    return model


def wire(draft: PreTrainedModel, vocab_size: int, confidence_threshold: float, graphs: bool) -> Wiring:
    """A feature draft (specdec's or EAGLE's) drafts token by token, reading the target states its
    config names; its layer's forwards replay CUDA graphs with `graphs`."""
    states = target_layers(draft)
    read = "last hidden state" if states == LAST else f"hidden states {list(states)}"
    return Wiring(FeatureDrafter(draft, vocab_size, confidence_threshold, graphs), states, f"reads the target's {read}")


FORMAT = Format(claims=lambda folder: (folder.path / DRAFT_INFO).is_file(), load=load, wire=wire)
