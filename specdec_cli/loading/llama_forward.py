"""A Llama model's decoding forward in fewer operator calls, computing what transformers' forward does.

On a CPU a small model's decoding step spends much of its time around the matrix products: module
calls, hooks, output recording, and the many small operations of each layer's norms and rotary
embedding. This forward reads the same modules' weights and runs the same arithmetic per element in
fewer calls: q/k/v and gate/up each as one product (decode_matmul.Siblings), the rotary embedding of
the queries and keys at once, RMSNorm as one call, the attention through the model's own attention
function over the same cache. Loading names it (`attach`) for models whose products are routed on a
CPU (`decode_matmul.MatmulChoice.route`) and whose classes are exactly transformers' Llama ones
(SmolLM2 and specdec's feature drafts among them), and the KV cache (decoding/cache.py) builds it over
the model, checked again, and calls it in place of transformers' forward; every other model runs
transformers' own. Tests check its logits and states against transformers' bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaModel,
    LlamaRMSNorm,
    eager_attention_forward,
)

from specdec_cli.decoding.cache import DECODING_FORWARD
from specdec_cli.loading.decode_matmul import SiblingForward, Siblings


def siblings_of(module: torch.nn.Module) -> Siblings | None:
    """The joint product of `module` and its sibling projections, or None where it takes its own."""
    forward = module.__dict__.get("forward")
    return forward.siblings if isinstance(forward, SiblingForward) else None


class Layer(NamedTuple):
    """One decoder layer's parts, looked up once (a module attribute costs a Python lookup each time)."""

    input_norm: tuple[torch.Tensor, float]  # RMSNorm's weight and epsilon
    qkv: Siblings
    attention: torch.nn.Module
    head_dim: int
    scaling: float
    out: Callable[[torch.Tensor], torch.Tensor]
    post_norm: tuple[torch.Tensor, float]
    gate_up: Siblings
    act: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]


class LlamaForward:
    """Called with the inputs CachedModel.step has; returns the logits (sliced by `keep` as transformers
    slices them) and, for `state_layers`, the hidden states side by side (indices into transformers'
    `hidden_states`: the embeddings, each layer's output, the last one after the final norm)."""

    @staticmethod
    def serves(model: torch.nn.Module) -> bool:
        """Whether `model` is transformers' Llama as it is (a draft format that replaces a norm, a layer
        or a forward runs transformers' own), with full attention and its products routed."""
        body = getattr(model, "model", None)
        if type(model) is not LlamaForCausalLM or type(body) is not LlamaModel or type(body.norm) is not LlamaRMSNorm:
            return False
        config = model.config
        if getattr(config, "sliding_window", None) or set(getattr(config, "layer_types", None) or ()) - {
            "full_attention"
        }:
            return False
        for layer in body.layers:
            expected = [
                (layer, LlamaDecoderLayer),
                (layer.self_attn, LlamaAttention),
                (layer.mlp, LlamaMLP),
                (layer.input_layernorm, LlamaRMSNorm),
                (layer.post_attention_layernorm, LlamaRMSNorm),
            ]
            if any(type(part) is not kind or "forward" in vars(part) for part, kind in expected):
                return False
            if siblings_of(layer.self_attn.q_proj) is None or siblings_of(layer.mlp.gate_proj) is None:
                return False
        return not any("forward" in vars(part) for part in (model, body, body.norm))

    def __init__(self, model: LlamaForCausalLM):
        config = self.config = model.config
        body = model.model
        self.embed, self.rotary, self.head = body.embed_tokens, body.rotary_emb, model.lm_head.forward
        self.final_norm = (body.norm.weight, body.norm.variance_epsilon)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.intermediate = config.intermediate_size
        self.layers = []
        for layer in body.layers[: config.num_hidden_layers]:
            attention, mlp = layer.self_attn, layer.mlp
            norms = [(n.weight, n.variance_epsilon) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
            self.layers.append(
                Layer(
                    norms[0],
                    siblings_of(attention.q_proj),
                    attention,
                    attention.head_dim,
                    attention.scaling,
                    attention.o_proj.forward,
                    norms[1],
                    siblings_of(mlp.gate_proj),
                    mlp.act_fn,
                    mlp.down_proj.forward,
                )
            )

    def __call__(self, ids, embeds, positions, mask, cache, keep, state_layers):
        x = self.embed(ids) if embeds is None else embeds
        batch, n = x.shape[:2]
        cos, sin = (part.unsqueeze(2) for part in self.rotary(x, position_ids=positions))  # [B, n, 1, dim]
        heads, queries_and_keys = self.heads, self.heads + self.kv_heads
        # looked up as transformers does, at each forward: the cache sets its own after loading
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        # SDPA turns a boolean mask into this additive one at every call: once here, for all layers
        mask = torch.zeros_like(mask, dtype=x.dtype).masked_fill_(~mask, float("-inf"))
        states = [x]
        for index, layer in enumerate(self.layers):
            joint = layer.qkv.joint(norm(x, *layer.input_norm)).view(batch, n, -1, layer.head_dim)
            rotated = joint[:, :, :queries_and_keys]  # [B, n, heads, dim]
            half = layer.head_dim // 2
            rotated = rotated * cos + torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1) * sin
            keys, values = cache.layers[index].update(
                rotated[:, :, heads:].transpose(1, 2), joint[:, :, queries_and_keys:].transpose(1, 2)
            )
            queries = rotated[:, :, :heads].transpose(1, 2)
            out, _ = attend(layer.attention, queries, keys, values, mask, dropout=0.0, scaling=layer.scaling)
            x = x + layer.out(out.reshape(batch, n, -1))
            both = layer.gate_up.joint(norm(x, *layer.post_norm))
            x = x + layer.down(layer.act(both[..., : self.intermediate]) * both[..., self.intermediate :])
            states.append(x)
        x = norm(x, *self.final_norm)
        states[-1] = x
        logits = self.head(slice_logits_to_keep(x, keep))
        if state_layers is None:
            return (logits,)
        return logits, torch.cat([states[i] for i in state_layers], dim=-1)


def norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """LlamaRMSNorm's forward (in float32, then times the weight in the input's dtype) as one normalising call."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, epsilon).to(x.dtype)


def attach(model: torch.nn.Module) -> None:
    """Name LlamaForward as a routed model's own forward, where it serves the model."""
    if LlamaForward.serves(model):
        setattr(model, DECODING_FORWARD, LlamaForward)
