"""EAGLE-3 drafts that `specdec distill --format eagle3` trains and saves in the layout serving
engines load (methods/feature/eagle.py loads it back the same way):

- config.json: a Llama config of one layer (more with `--layers`: vLLM's EAGLE-3 runs later layers
  as plain Llama layers after the midlayer, `layers.1.*` ...; SGLang and SpecForge take one),
  `architectures: ["LlamaForCausalLMEagle3"]` (SpecForge and SGLang's class; vLLM maps it to its
  `Eagle3LlamaForCausalLM`), `vocab_size` the target's,
  `draft_vocab_size`, `target_hidden_size`, `norm_before_residual: false` (SGLang's midlayer has no
  other), `tie_word_embeddings: false` (SGLang would take the head from the embedding), rope both
  as `rope_parameters` (transformers 5) and as `rope_theta` / `rope_scaling` (what older readers
  take, as SpecForge's export mirrors them). The target states it reads, in both engines' counts:
  `eagle_config.eagle_aux_hidden_state_layer_ids`, layer OUTPUTS (SpecForge's trainer and SGLang
  read this one; SGLang captures the input of layer id + 1), and top-level
  `eagle_aux_hidden_state_layer_ids`, layer INPUTS = transformers' `hidden_states` indices (vLLM
  reads this one, `get_eagle3_aux_layers_from_config`, and captures `hidden_states + residual`
  before layer id).
- model.safetensors: `fc.weight` [H, 3H], `midlayer.*` (q/k/v reading 2H), `layers.{i}.*` for
  any later layers, `norm.weight`,
  `lm_head.weight` [draft vocab, H], `d2t` (int64, target id = i + d2t[i]) and `t2d` (bool
  [vocab]), in bfloat16 but the maps; no `embed_tokens` (the engines then use the target's: vLLM
  skips it when absent, SpecForge's SGLang export drops it).
- `INFO`: specdec's record of how it was distilled, not `DRAFT_INFO`, whose presence makes a folder
  a specdec draft.

Layout "speculators" (`--layout speculators`): the same draft as vllm-project/speculators saves an
`Eagle3Speculator`, the layout RedHatAI publishes EAGLE-3 drafts in and vLLM reads without a
`--speculative-config` method of its own: the layer's model config in `transformer_layer_config`, at
the top `speculators_model_type`, `draft_vocab_size`, `target_hidden_size`, the norms' switches
(`norm_before_residual` written out: vLLM takes an absent one as true) and
`eagle_aux_hidden_state_layer_ids` (layer inputs), and `speculators_config` (proposal method,
verifier); no top-level `model_type` (vLLM reads a config with one as a plain model). Tensors as
above with `layers.0.` for `midlayer.` (speculators/models/eagle3; vLLM's
transformers_utils/configs/speculators).

Layout as read in SpecForge (`specforge/modeling/draft/llama3_eagle.py`, `export/to_sglang.py`,
`algorithms/model_providers.py`), SGLang (`srt/models/llama_eagle3.py`, its model runner) and
vLLM (`model_executor/models/llama_eagle3.py`, `eagle3_utils.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from specdec_cli.errors import SpecdecError
from specdec_cli.loading.target_states import TARGET_LAYERS, check_states
from specdec_cli.methods.feature.draft import DRAFT_INFO, own_weights, starting_layers
from specdec_cli.methods.feature.eagle import EAGLE3_ARCHITECTURES, Eagle3Head, llama_from, make_eagle3
from specdec_cli.methods.feature.parts import TAPS, SubsetHead

INFO = "distill.json"
# in-memory names -> EAGLE-3's (own_weights of the draft that `init_eagle3` builds)
RENAMES = [
    (f"{TAPS}.", "fc."),
    ("model.layers.0.", "midlayer."),
    ("model.layers.", "layers."),  # layers after the first: plain Llama layers, as vLLM names them
    ("lm_head.norm.", "norm."),
    ("lm_head.subset.weight", "lm_head.weight"),
]


def check_taps(taps: tuple[int, ...], num_layers: int) -> None:
    """EAGLE-3 reads 3 target states that both engines capture: inputs of layers 1 .. L - 1 (the
    input of layer 0 would be layer -1's output in SpecForge's count, which it refuses, and
    transformers' `hidden_states[L]` is after the final norm, which no engine captures)."""
    check_states(
        taps, num_layers, f"--format eagle3: target layers {list(taps)}", lowest=1, highest=num_layers - 1, count=3
    )


def eagle3_config(target: PreTrainedModel, taps: tuple[int, ...], draft_vocab: int, num_layers: int = 1) -> dict:
    """config.json of the draft, as SpecForge writes it for a target's draft (plus the taps)."""
    text = target.config.get_text_config()
    width = target.get_input_embeddings().weight.shape[1]
    rope = dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": text.rope_theta})
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    taps = sorted(taps)
    return {
        "architectures": [EAGLE3_ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": width,
        "intermediate_size": text.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        "head_dim": getattr(text, "head_dim", None) or width // text.num_attention_heads,
        "hidden_act": getattr(text, "hidden_act", "silu"),
        "max_position_embeddings": text.max_position_embeddings,
        "rms_norm_eps": text.rms_norm_eps,
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": scaling if scaling.get("rope_type", "default") != "default" else None,
        "attention_bias": False,  # SGLang's midlayer has no q/k/v bias
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": target.get_output_embeddings().weight.shape[0],
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": width,
        "norm_before_residual": False,
        "bos_token_id": text.bos_token_id,
        "eos_token_id": text.eos_token_id,
        "pad_token_id": text.pad_token_id,
        "torch_dtype": "bfloat16",
        # vLLM: inputs of these layers; SpecForge / SGLang: outputs of these (eagle.eagle3_taps)
        "eagle_aux_hidden_state_layer_ids": taps,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in taps], "use_aux_hidden_state": True},
    }


def init_eagle3(
    target: PreTrainedModel,
    token_ids: torch.Tensor,
    taps: tuple[int, ...],
    num_layers: int = 1,
    init_layers: tuple[int, ...] | None = None,
    zero_features: bool = False,
) -> PreTrainedModel:
    """An EAGLE-3 draft of `num_layers` layers for a Llama-style target reading its hidden states
    `taps`, trainable in float32, built as `eagle.load_eagle3` builds a loaded one. Its start mirrors
    specdec's own draft's: its layers are the target layers `init_layers` (default: evenly spaced),
    the first one's q/k/v reading the normed embedding and state both through that layer's map
    (embedding + state), both its input norms the layer's; `fc` passes the deepest tap (or nothing
    with `zero_features`: a token-only start); `norm` is the target's final norm and `lm_head` the
    target head's rows of `token_ids` (trained here, unlike specdec's draft, which borrows them)."""
    config = llama_from(eagle3_config(target, taps, len(token_ids), num_layers))
    setattr(config, TARGET_LAYERS, sorted(taps))
    sources = starting_layers(target.config, num_layers, init_layers)
    draft = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    make_eagle3(draft, len(taps), config.hidden_size, norm_before_residual=False)
    width = config.hidden_size
    with torch.no_grad():
        for index, source in enumerate(sources):
            theirs = target.model.layers[source].state_dict()
            for name, mine in draft.model.layers[index].state_dict().items():
                if name == "hidden_norm.weight":
                    name = "input_layernorm.weight"
                tensor = theirs.get(name)
                if (
                    index == 0
                    and tensor is not None
                    and name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))
                ):
                    tensor = tensor.repeat(1, 2)  # the midlayer's same map of the embedding and the state
                if tensor is not None and tensor.shape == mine.shape:  # where the target's layer has it
                    mine.copy_(tensor)
        fc = getattr(draft, TAPS).weight
        fc.zero_()
        if not zero_features:
            fc[:, -width:] = torch.eye(width)
        norm = draft.model.norm
        norm.weight.copy_(target.model.norm.weight)
    draft.model.norm = torch.nn.Identity()  # the fed-back state is the output before `norm`
    draft.to(device=target.device)
    draft.model.embed_tokens = target.get_input_embeddings()
    draft.model.embed_tokens.weight.requires_grad_(False)
    subset = SubsetHead(target.get_output_embeddings().weight, token_ids)
    rows = subset.weight.float().clone()  # trained: never the target head itself
    del subset.weight
    subset.weight = torch.nn.Parameter(rows)  # EAGLE-3 drafts train their head's rows
    draft.lm_head = Eagle3Head(norm.to(target.device), subset)
    return draft


def eagle3_weights(draft: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The draft's own weights under EAGLE-3's names, in bfloat16, with `d2t` and `t2d`."""

    def rename(name: str) -> str:
        for mine, theirs in RENAMES:
            if name.startswith(mine):
                return theirs + name[len(mine) :]
        raise SpecdecError(f"eagle3 export: the draft has a tensor EAGLE-3 has no name for, {name}")

    weights = {rename(k): v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in own_weights(draft).items()}
    token_ids = draft.lm_head.token_ids.cpu().long()
    weights["d2t"] = token_ids - torch.arange(len(token_ids))
    weights["t2d"] = torch.zeros(draft.lm_head.subset.vocab_size, dtype=torch.bool).index_fill(0, token_ids, True)
    return weights


def speculators_config(config: dict, target: PreTrainedModel, target_name: str) -> dict:
    """`eagle3_config` as vllm-project/speculators writes an `Eagle3SpeculatorConfig`."""
    top = ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids")
    layer = {k: v for k, v in config.items() if k not in (*top, "architectures", "eagle_config")}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        **{k: config[k] for k in top},
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": target_name, "architectures": list(target.config.architectures or [])},
        },
        "transformer_layer_config": layer,
    }


def save_eagle3(draft: PreTrainedModel, target: PreTrainedModel, out: Path, info: dict, layout: str) -> None:
    """config.json, model.safetensors and `INFO` in `layout` (specforge or speculators); no tokenizer
    (EAGLE-3 drafts use the target's)."""
    out.mkdir(parents=True, exist_ok=True)
    taps = tuple(getattr(draft.config, TARGET_LAYERS))
    config = eagle3_config(target, taps, len(draft.lm_head.token_ids), draft.config.num_hidden_layers)
    weights = eagle3_weights(draft)
    if layout == "speculators":
        config = speculators_config(config, target, info["target"])
        weights = {k.replace("midlayer.", "layers.0.", 1): v for k, v in weights.items()}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / DRAFT_INFO).unlink(missing_ok=True)  # a specdec draft saved here before would be read instead
    (out / INFO).write_text(json.dumps(info, indent=2) + "\n")
