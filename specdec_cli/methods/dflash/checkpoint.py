"""DFlash drafts (z-lab, `DFlashDraftModel`): a block diffusion draft that proposes a whole block
from one forward.

- Context: the target's hidden states at every verified token, the outputs of the layers
  `dflash_config.target_layer_ids` side by side, as `hidden_norm(fc(...))`. z-lab reads them as
  transformers' `hidden_states[id + 1]` (vLLM adds 1 to them too), so id i is layer i's output (and
  the last layer's id reads the state after the final norm, as z-lab trained it).
- Block: the target's embedding of [last token, MASK x (block_size - 1)] at the positions after the
  context.
- Decoder layers as its config describes them (`model_type` qwen3: per-head q_norm / k_norm; Llama-
  style layers, without them, are read too): each attends, not causally, to K/V of the context (the
  layer's k/v projections of the context, no input norm) and of the block. Context K/V depend on
  the context only, so they are computed once per token and kept; the block's are not.
- Logits: the target's head over `norm` of the block's outputs at positions 1.. (block_size - 1 drafts).
- Config: `block_size` and `num_target_layers` at the top level or, in newer z-lab configs, in
  `dflash_config` (read there first, as SGLang's `parse_dflash_draft_config` does).

Also read as vLLM reads them: vllm-project/speculators' layout (`dflash_settings`), and a draft's
own `embed_tokens` and `lm_head` over a draft vocabulary mapped by `d2t` (eagle.draft_head).
Not read (vLLM's extensions): sliding-window or causal layers, attention sinks, a separate mask
embedding; such checkpoints are refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from specdec_cli.errors import SpecdecError
from specdec_cli.loading.draft_folder import DraftFolder, Format, Wiring
from specdec_cli.loading.target_states import check_states, from_outputs
from specdec_cli.methods.dflash.drafter import BlockDrafter
from specdec_cli.methods.feature.eagle import draft_head, with_dtype
from specdec_cli.methods.feature.parts import SubsetHead

ARCHITECTURE = "DFlashDraftModel"


def recognise(folder: DraftFolder) -> bool:
    if folder.speculators is not None:
        return folder.speculators == "dflash"
    return ARCHITECTURE in folder.architectures or "dflash_config" in folder.config


def dflash_settings(folder: DraftFolder) -> dict:
    """The draft's config as z-lab writes it. The speculators layout (vllm-project/speculators'
    `DFlashSpeculator`) nests the layers' model config in `transformer_layer_config` and names the
    target states it reads `aux_hidden_state_layer_ids`, layer INPUTS (vLLM's `update_dflash` turns
    them into z-lab's layer outputs, id - 1); its `block_size` defaults to 8."""
    raw, where = folder.config, f"DFlash checkpoint {folder.path} (speculators layout)"
    if folder.speculators is None:
        return raw
    layer, aux = raw.get("transformer_layer_config"), raw.get("aux_hidden_state_layer_ids")
    if not isinstance(layer, dict) or not aux or not isinstance(raw.get("mask_token_id"), int):
        needs = "transformer_layer_config, aux_hidden_state_layer_ids and mask_token_id"
        raise SpecdecError(f"{where}: config needs {needs}")
    if raw.get("sample_from_anchor"):
        raise SpecdecError(f"{where}: sample_from_anchor (drafting the anchor position too) is not supported")
    if type(raw.get("target_hidden_size")) is int and raw["target_hidden_size"] != layer.get("hidden_size"):
        raise SpecdecError(f"{where}: target_hidden_size differs from the draft's hidden size, not supported")
    return {
        **layer,
        "block_size": raw.get("block_size", 8),
        "draft_vocab_size": raw.get("draft_vocab_size"),
        "dflash_config": {
            "target_layer_ids": [i - 1 if type(i) is int else i for i in aux],
            "mask_token_id": raw["mask_token_id"],
        },
    }


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, half-split ("neox") layout. x [B, heads, n, D]; cos, sin [B, n, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(torch.nn.Module):
    def __init__(self, config, qk_norm: bool):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        bias = getattr(config, "attention_bias", False)
        width = config.hidden_size
        self.q_proj = torch.nn.Linear(width, self.heads * self.head_dim, bias=bias)
        self.k_proj = torch.nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = torch.nn.Linear(self.heads * self.head_dim, width, bias=bias)
        self.q_norm = LlamaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = LlamaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def split(self, x: torch.Tensor, heads: int, norm: LlamaRMSNorm | None) -> torch.Tensor:
        x = x.unflatten(-1, (heads, self.head_dim))  # [B, n, heads, D]
        return (norm(x) if norm is not None else x).transpose(1, 2)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, H] -> K, V [B, kv_heads, n, D], K rotated to the positions of cos/sin."""
        keys = rotate(self.split(self.k_proj(x), self.kv_heads, self.k_norm), cos, sin)
        return keys, self.split(self.v_proj(x), self.kv_heads, None)

    def forward(self, x, cos, sin, context_kv, visible) -> torch.Tensor:
        """The block x [B, n, H] attends to all of itself and to the context keys that `visible`
        [B, T] marks in context_kv ([B, kv_heads, T, D] each)."""
        queries = rotate(self.split(self.q_proj(x), self.heads, self.q_norm), cos, sin)
        keys, values = self.keys_values(x, cos, sin)
        keys = torch.cat([context_kv[0], keys], dim=2)
        values = torch.cat([context_kv[1], values], dim=2)
        mask = torch.cat([visible, visible.new_ones(visible.shape[0], x.shape[1])], dim=1)[:, None, None]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class MLP(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        width, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = torch.nn.Linear(width, inner, bias=False)
        self.up_proj = torch.nn.Linear(width, inner, bias=False)
        self.down_proj = torch.nn.Linear(inner, width, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Layer(torch.nn.Module):
    def __init__(self, config, qk_norm: bool):
        super().__init__()
        self.self_attn = Attention(config, qk_norm)
        self.mlp = MLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, context_kv, visible) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_kv, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class VocabularyLogits(torch.nn.Module):
    """Logits over the target's whole vocabulary from a head over part of it, -inf at every id it
    does not score (vLLM's `compute_logits` for a draft vocabulary)."""

    def __init__(self, subset: SubsetHead):
        super().__init__()
        self.subset = subset
        self.whole = torch.equal(subset.token_ids.cpu(), torch.arange(subset.vocab_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = self.subset(hidden)
        if self.whole:
            return scores
        spread = scores.new_full((*scores.shape[:-1], self.subset.vocab_size), float("-inf"))
        return spread.index_copy_(-1, self.subset.token_ids, scores)


class DFlashDraft(torch.nn.Module):
    def __init__(self, config, target_layer_ids: list[int], qk_norm: bool, target_width: int):
        super().__init__()
        self.config = config
        self.block_size = int(config.block_size)
        self.target_layer_ids = list(target_layer_ids)
        # what the target hands over: the hidden states those layers output (loading/target_states.py)
        self.state_layers = tuple(from_outputs(target_layer_ids))
        self.fc = torch.nn.Linear(len(target_layer_ids) * target_width, config.hidden_size, bias=False)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = torch.nn.ModuleList(Layer(config, qk_norm) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)  # rope_parameters of the draft's config
        self.mask_token_id = 0
        # (embedding, head): the target's, or the draft's own, kept out of this module's state
        self.borrowed: tuple = ()

    @property
    def kv_shape(self) -> tuple[int, int]:
        attention = self.layers[0].self_attn
        return attention.kv_heads, attention.head_dim

    def context_kv(self, states: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The target's states [B, n, taps * H] at positions [B, n] -> each layer's K, V [B, kv, n, D]."""
        context = self.hidden_norm(self.fc(states.to(self.fc.weight.dtype)))
        cos, sin = self.rotary(context, positions)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """block_ids [B, block_size] at positions [B, block_size] -> logits [B, block_size - 1, V]
        (float32) for the block's positions 1.."""
        embedding, head = self.borrowed
        x = embedding(block_ids)
        cos, sin = self.rotary(x, positions)
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, cos, sin, kv, visible)
        return head(self.norm(x[:, 1:])).float()


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's choice when a config names none: evenly spaced from layer 1 to L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def load(folder: DraftFolder, target_model, dtype: torch.dtype) -> DFlashDraft:
    """The draft on the target's device in `dtype`, checked against the target (widths, vocabulary,
    layer ids), reading the target's embedding and head."""
    config, where = dflash_settings(folder), f"DFlash checkpoint {folder.path}"
    target = target_model.config.get_text_config()
    num_layers, width = target.num_hidden_layers, target.hidden_size
    embedding, head = target_model.get_input_embeddings(), target_model.get_output_embeddings()
    vocab_size = head.weight.shape[0]
    dflash = config.get("dflash_config") or {}

    refuse_variants(folder, config, dflash, where)
    block_size = dflash.get("block_size", config.get("block_size"))  # newer z-lab configs nest it
    if not isinstance(block_size, int) or block_size < 2:
        raise SpecdecError(f"{where}: config needs block_size >= 2 (found {block_size!r})")
    mask_token_id = dflash.get("mask_token_id", config.get("mask_token_id"))
    if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < embedding.weight.shape[0]:
        raise SpecdecError(
            f"{where}: dflash_config.mask_token_id {mask_token_id!r} is not a token of the target's "
            f"{embedding.weight.shape[0]}-token embedding"
        )
    trained_for = dflash.get("num_target_layers", config.get("num_target_layers"))
    if trained_for is not None and trained_for != num_layers:
        raise SpecdecError(f"{where}: made for a target of {trained_for} layers, this target has {num_layers}")
    if config.get("vocab_size") not in (None, vocab_size):
        raise SpecdecError(
            f"{where}: made for a vocabulary of {config['vocab_size']} tokens, the target's has {vocab_size}"
        )
    layer_ids = dflash.get("target_layer_ids") or default_layer_ids(num_layers, config.get("num_hidden_layers", 1))
    states = from_outputs(layer_ids)
    check_states(states, num_layers, f"{where}: target_layer_ids {list(layer_ids)} (hidden states {states})", lowest=1)
    settings = {k: v for k, v in config.items() if k != "model_type"} | {"block_size": block_size}
    try:
        draft_config = AutoConfig.for_model(config.get("model_type", "qwen3"), **settings)
    except (KeyError, ValueError, TypeError) as exc:
        raise SpecdecError(f"{where}: cannot read its config.json ({exc})") from None
    if draft_config.hidden_size != width:
        raise SpecdecError(
            f"{where}: hidden size {draft_config.hidden_size}, the target's is {width} (the draft reads the "
            f"target's embedding and head)"
        )
    tensors = with_dtype(folder.weights, dtype)
    # vLLM's reading of a draft's own embedding and head (the speculators layout ships both)
    own_embedding = tensors.pop("embed_tokens.weight", None)
    if own_embedding is not None:
        if own_embedding.shape != embedding.weight.shape:
            raise SpecdecError(
                f"{where}: embed_tokens.weight is {list(own_embedding.shape)}, the target's embedding "
                f"{list(embedding.weight.shape)}"
            )
        embedding = torch.nn.Embedding.from_pretrained(own_embedding.to(head.weight.device))
    logits = VocabularyLogits(draft_head(where, config, tensors, target_model))
    fc = tensors.get("fc.weight")
    if fc is not None and fc.shape != (width, len(layer_ids) * width):
        raise SpecdecError(
            f"{where}: fc.weight is {list(fc.shape)}, but {len(layer_ids)} target layers of width {width} "
            f"need [{width}, {len(layer_ids) * width}]"
        )
    qk_norm = any(k.endswith("self_attn.q_norm.weight") for k in tensors) or draft_config.model_type.startswith("qwen3")
    with torch.device("meta"):
        model = DFlashDraft(draft_config, layer_ids, qk_norm, width)
    check_tensors_fit(model.state_dict(), tensors, where)
    device = head.weight.device
    model.load_state_dict({k: v.to(device, dtype) for k, v in tensors.items()}, assign=True)
    model.rotary = LlamaRotaryEmbedding(draft_config).to(device)  # its buffers were made on meta
    model.mask_token_id = mask_token_id
    model.borrowed = (embedding, logits)
    return model.eval()


def refuse_variants(folder: DraftFolder, config: dict, dflash: dict, where: str) -> None:
    """Variants vLLM reads that this does not: refused rather than run as something else."""
    unsupported = [
        what
        for what, present in (
            ("sliding-window layers", "sliding_attention" in (config.get("layer_types") or [])),
            ("sliding-window layers", config.get("use_sliding_window") or dflash.get("use_swa")),
            ("causal attention", dflash.get("causal") or config.get("is_causal")),
            ("attention sink biases", dflash.get("attention_sink_bias")),
            ("interleaved RoPE", config.get("is_neox_style") is False),
            ("a separate mask embedding (mask_embedding.pt)", (folder.path / "mask_embedding.pt").is_file()),
        )
        if present
    ]
    if unsupported:
        raise SpecdecError(f"{where}: {', '.join(dict.fromkeys(unsupported))} not supported")


def check_tensors_fit(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], where: str) -> None:
    """The checkpoint's tensors are the module's, name for name and shape for shape."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise SpecdecError(
            f"{where}: tensors do not fit its config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    wrong = [k for k, v in expected.items() if tensors[k].shape != v.shape]
    if wrong:
        raise SpecdecError(
            f"{where}: {wrong[0]} is {list(tensors[wrong[0]].shape)}, its config says {list(expected[wrong[0]].shape)}"
        )


def wire(draft: DFlashDraft, vocab_size: int, confidence_threshold: float, graphs: bool) -> Wiring:
    """One forward drafts a block, reading the target's states at every verified token (eagerly)."""
    return Wiring(
        BlockDrafter(draft, vocab_size),
        draft.state_layers,
        f"blocks of {draft.block_size}, reads the target's hidden states {list(draft.state_layers)} "
        f"(outputs of layers {draft.target_layer_ids})",
    )


FORMAT = Format(claims=recognise, load=load, wire=wire, architectures=(ARCHITECTURE,))
