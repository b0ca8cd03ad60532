"""Tiny random EAGLE-1/2 and EAGLE-3 checkpoints in the layouts their projects save (SafeAILab,
SpecForge, vllm-project/speculators), for a tiny target of LAYERS layers (tests/test_formats.py,
tests/test_host_syncs.py, tests/test_vllm.py)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

LAYERS = 8  # enough target layers for EAGLE-3's default taps (inputs of 2, L//2, L-3) to differ
TARGET = {"tiny": {"seed": 0, "num_layers": LAYERS}}
H, HEADS, KV_HEADS, FFN, EPS, VOCAB = 64, 4, 2, 128, 1e-6, 258  # the tiny target's sizes
HEAD_DIM = H // HEADS
DRAFT_VOCAB = 96


def llama_config(**extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        **extra,
    }


def random_layer(prefix: str, attention_width: int, gen: torch.Generator, scale: float = 1) -> dict[str, torch.Tensor]:
    """A decoder layer's tensors, as large as the tiny target's (std 0.3) times `scale`, norms near 1."""

    def rand(*shape, std=0.3):
        return torch.randn(*shape, generator=gen) * std * scale

    return {
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, attention_width),
        f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, attention_width),
        f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, attention_width),
        f"{prefix}self_attn.o_proj.weight": rand(H, HEADS * HEAD_DIM, std=0.1),
        f"{prefix}mlp.gate_proj.weight": rand(FFN, H),
        f"{prefix}mlp.up_proj.weight": rand(FFN, H),
        f"{prefix}mlp.down_proj.weight": rand(H, FFN, std=0.1),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(H, std=0.2 / scale),
    }


def eagle_checkpoint(seed: int = 1) -> tuple[dict, dict[str, torch.Tensor]]:
    """EAGLE-1/2 as SafeAILab saves it: fc [H, 2H] with its bias (the default), one layer without
    an input norm, no final norm, no head. Smaller weights than EAGLE-3's: nothing normalises its
    output before the target's head, and the test needs distributions that are not one-hot."""
    gen = torch.Generator().manual_seed(seed)
    weights = random_layer("layers.0.", H, gen, scale=0.3)
    weights["fc.weight"] = torch.randn(H, 2 * H, generator=gen) * 0.05
    weights["fc.bias"] = torch.randn(H, generator=gen) * 0.1
    return llama_config(), weights


def eagle3_checkpoint(
    seed: int = 2, layout: str = "specforge", qwen3: bool = False, fc_norm: bool = False, **config
) -> tuple[dict, dict[str, torch.Tensor]]:
    """EAGLE-3 as SpecForge saves it: fc [H, 3H], a midlayer whose q/k/v read 2H, its final norm,
    lm_head over a draft vocabulary of 96 tokens, d2t (target id = i + d2t[i]) and t2d. `layout`
    "speculators": as vllm-project/speculators saves an `Eagle3Speculator` (the layer's config in
    `transformer_layer_config`, `layers.0.*`, its own `embed_tokens`; speculators/models/eagle3).
    `qwen3`: a Qwen3 layer (q_norm, k_norm); `fc_norm`: EAGLE-3.1's norm of each tap (`fc_norm.{i}`)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    weights = random_layer(prefix, 2 * H, gen)
    weights[f"{prefix}input_layernorm.weight"] = 1 + torch.randn(H, generator=gen) * 0.2
    weights[f"{prefix}hidden_norm.weight"] = 1 + torch.randn(H, generator=gen) * 0.2
    if qwen3:
        for name in ("q_norm", "k_norm"):
            weights[f"{prefix}self_attn.{name}.weight"] = 1 + torch.randn(HEAD_DIM, generator=gen) * 0.2
    if fc_norm:
        for i in range(3):  # target states differ in scale by layer: each tap's norm evens them out
            weights[f"fc_norm.{i}.weight"] = 1 + torch.randn(H, generator=gen) * 0.2
    weights["fc.weight"] = torch.randn(H, 3 * H, generator=gen) * 0.1
    weights["norm.weight"] = 1 + torch.randn(H, generator=gen) * 0.2
    weights["lm_head.weight"] = torch.randn(DRAFT_VOCAB, H, generator=gen) * 0.3
    used = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values
    weights["d2t"] = used - torch.arange(DRAFT_VOCAB)
    weights["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, used, True)
    layer = llama_config(**({"model_type": "qwen3", "head_dim": HEAD_DIM} if qwen3 else {}))
    if layout != "speculators":
        flat = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB}
        return {**flat, **({"fc_norm": True} if fc_norm else {}), **config}, weights
    weights["embed_tokens.weight"] = torch.randn(VOCAB, H, generator=gen)  # its own, not the target's
    del layer["architectures"]
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.4.0",
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [1, 3, 5],  # layer inputs
        "norm_before_residual": True,
        "norm_before_fc": False,
        "fc_norm": fc_norm,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer,
        **config,
    }, weights


def write_folder(folder, config: dict, weights: dict[str, torch.Tensor]):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")
    return folder
