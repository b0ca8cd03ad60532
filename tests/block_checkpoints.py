"""Tiny random Medusa and DFlash checkpoints in the layouts their projects publish, for the tiny
target (tests/test_block_drafts.py, tests/test_drafter_contract.py), and the pair that drafts with one."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from specdec_cli.config import TinyModel, load_config
from specdec_cli.loading.checkpoints import build_tiny
from specdec_cli.pair import load_pair

TARGET = {"tiny": {"seed": 0, "num_layers": 2}}
HEADS, BLOCK_SIZE, MASK = 3, 4, 256  # 3 Medusa heads; DFlash blocks of 4 (3 drafts), MASK = <s>
# the std of Medusa's heads and the scale of DFlash's final norm: logits of std about 1.2, so drafts
# are accepted now and then at T=1 and each position's q is its own (the broken variant fails)
HEAD_STD, NORM = 0.15, 0.8
DFLASH_DRAFT_VOCAB = 192  # of the 258 tokens: what a speculators DFlash draft scores


def randn(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


# ---------------------------------------------------------------- tiny checkpoints


def medusa_weights(vocab: int, width: int, layers: int, seed: int = 1):
    """Per head: residual layers [(W, b)] and a head [V, H]. Heads of std HEAD_STD give logits of
    std about 1.2: peaked enough that each head drafts its own tokens, flat enough to be accepted."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [
        [(randn(gen, width, width, std=width**-0.5), randn(gen, width, std=0.1)) for _ in range(layers)]
        for _ in range(HEADS)
    ]
    heads = [randn(gen, vocab, width, std=HEAD_STD) for _ in range(HEADS)]
    return blocks, heads


def write_medusa_pt(folder, vocab=258, width=64, layers=1):
    """FasterDecoding's layout: medusa_lm_head.pt, {i}.{j}.linear.{weight,bias} and {i}.{layers}.weight."""
    folder.mkdir()
    blocks, heads = medusa_weights(vocab, width, layers)
    state = {}
    for i, (block, head) in enumerate(zip(blocks, heads)):
        for j, (weight, bias) in enumerate(block):
            state[f"{i}.{j}.linear.weight"], state[f"{i}.{j}.linear.bias"] = weight, bias
        state[f"{i}.{layers}.weight"] = head
    torch.save(state, folder / "medusa_lm_head.pt")
    # published configs under-count the heads (the original loader forces 5): the tensors decide
    config = {"medusa_num_heads": 2, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}
    (folder / "config.json").write_text(json.dumps(config))
    return blocks, heads, None


def write_medusa_vllm(folder, vocab=258, width=64, layers=2, token_map: torch.Tensor | None = None):
    """vLLM's layout: blocks.{i}.layers.{j}.{weight,bias}, lm_heads.{i}.weight, optional token_map."""
    folder.mkdir()
    blocks, heads = medusa_weights(vocab, width, layers)
    state = {f"lm_heads.{i}.weight": head for i, head in enumerate(heads)}
    for i, block in enumerate(blocks):
        for j, (weight, bias) in enumerate(block):
            state[f"blocks.{i}.layers.{j}.weight"], state[f"blocks.{i}.layers.{j}.bias"] = weight, bias
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": width,
        "vocab_size": vocab,
        "num_heads": HEADS,
        "num_hidden_layers": layers,
        "medusa_fc_bias": True,
    }
    if token_map is not None:  # full-vocabulary heads, of which the mapped rows are kept
        state["token_map"] = token_map
        config["truncated_vocab_size"] = len(token_map)
    save_file(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return blocks, heads, token_map


def write_dflash(folder, layers=1, qk_norm=False, head_dim=16, seed=2, layout="z-lab", **config_changes):
    """z-lab's layout with the tiny target's (Llama) layers, or Qwen3's with q_norm / k_norm. Large
    q/k weights make attention sharp, so the block's positions draft different tokens. `layout`
    "z-lab nested": `block_size` and `num_target_layers` in `dflash_config`, as newer z-lab configs
    write them; "speculators": vllm-project/speculators' `DFlashSpeculator` (the layers' config in
    `transformer_layer_config`, `aux_hidden_state_layer_ids` counting layer inputs, its own
    embedding and a head over a draft vocabulary mapped by `d2t`)."""
    folder.mkdir()
    gen = torch.Generator().manual_seed(seed)
    width, heads, kv_heads, inner = 64, 4, 2, 128
    tensors = {
        "fc.weight": randn(gen, width, 2 * width, std=(2 * width) ** -0.5),
        "hidden_norm.weight": 1 + randn(gen, width, std=0.1),
        "norm.weight": NORM * (1 + randn(gen, width, std=0.1)),
    }
    shapes = {
        "self_attn.q_proj": ((heads * head_dim, width), 5),
        "self_attn.k_proj": ((kv_heads * head_dim, width), 5),
        "self_attn.v_proj": ((kv_heads * head_dim, width), 2),
        "self_attn.o_proj": ((width, heads * head_dim), 2),
        "mlp.gate_proj": ((inner, width), 2),
        "mlp.up_proj": ((inner, width), 2),
        "mlp.down_proj": ((width, inner), 2),
    }
    for i in range(layers):
        for name, (shape, gain) in shapes.items():
            tensors[f"layers.{i}.{name}.weight"] = randn(gen, *shape, std=gain / shape[1] ** 0.5)
        for name in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"layers.{i}.{name}.weight"] = 1 + randn(gen, width, std=0.1)
        if qk_norm:
            for name in ("q_norm", "k_norm"):
                tensors[f"layers.{i}.self_attn.{name}.weight"] = 1 + randn(gen, head_dim, std=0.1)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3" if qk_norm else "llama",
        "hidden_size": width,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inner,
        "num_hidden_layers": layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500.0,  # not a default: the draft must read it
        "block_size": BLOCK_SIZE,
        "num_target_layers": 2,
        "vocab_size": 258,
        "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": MASK},
        **config_changes,
    }
    if layout == "z-lab nested":
        config["dflash_config"] |= {"block_size": config.pop("block_size"), "num_target_layers": 2}
        del config["num_target_layers"]
    if layout == "speculators":
        config, tensors = speculators_dflash(config, tensors, gen)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return tensors, config


def speculators_dflash(config: dict, tensors: dict, gen: torch.Generator) -> tuple[dict, dict]:
    """The same draft as vllm-project/speculators saves it (speculators/models/dflash), with its own
    embedding (the target's, perturbed) and, as speculators trains them, the target head's rows for
    192 of the 258 tokens."""
    target = build_tiny(TinyModel(**TARGET["tiny"]))
    used = torch.randperm(258, generator=gen)[:DFLASH_DRAFT_VOCAB].sort().values
    embedding = target.get_input_embeddings().weight.detach()
    tensors = {
        **tensors,
        "embed_tokens.weight": embedding + randn(gen, *embedding.shape, std=0.3 * float(embedding.std())),
        "lm_head.weight": target.get_output_embeddings().weight.detach()[used].clone(),
        "d2t": used - torch.arange(DFLASH_DRAFT_VOCAB),
        "t2d": torch.zeros(258, dtype=torch.bool).index_fill(0, used, True),
    }
    dflash = config.pop("dflash_config")
    layer = {k: v for k, v in config.items() if k not in ("architectures", "block_size", "num_target_layers")}
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.4.0",
        "block_size": config["block_size"],
        "mask_token_id": dflash["mask_token_id"],
        "aux_hidden_state_layer_ids": [i + 1 for i in dflash["target_layer_ids"]],  # layer inputs
        "draft_vocab_size": DFLASH_DRAFT_VOCAB,
        "target_hidden_size": 64,
        "sample_from_anchor": False,
        "speculators_config": {"algorithm": "dflash", "verifier": {"name_or_path": "tiny-target"}},
        "transformer_layer_config": layer,
    }, tensors


WRITERS = {
    "medusa-pt": write_medusa_pt,
    "medusa-vllm": write_medusa_vllm,
    "dflash": write_dflash,
    "dflash-nested": lambda folder: write_dflash(folder, layout="z-lab nested"),
    "dflash-speculators": lambda folder: write_dflash(folder, qk_norm=True, head_dim=32, layout="speculators"),
}


def pair_of(write_config, folder, num_draft_tokens=3, lookup=False):
    draft = {"checkpoint": str(folder), **({"lookup": {"max_n": 3, "min_n": 2}} if lookup else {})}
    config = write_config(
        {
            "target": TARGET,
            "draft": draft,
            "speculation": {"num_draft_tokens": num_draft_tokens},
            "runtime": {"device": "cpu", "dtype": "float32", "threads": 1},
        }
    )
    return load_pair(load_config(str(config)))
