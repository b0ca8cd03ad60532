"""EAGLE drafts as other tools publish them, loaded as feature drafts (models/feature_draft.py's
`drafting`: `FeatureDrafter` runs them unchanged):

- `EAGLE` (EAGLE-1/2, SafeAILab layout): `fc` [H, 2H] (a bias unless the config says `"bias": false`)
  is the feature projection over [token embedding, state]; then Llama decoder layers, the first
  without its input norm, and no final norm (SafeAILab `eagle/model/cnets1.py`, vLLM
  `llama_eagle.py`). The state is the target's last hidden state after its final norm; the head is
  the target's.
- `EAGLE3` (SafeAILab `eagle/model/cnets.py`, SpecForge `llama3_eagle.py`, vLLM `llama_eagle3.py`):
  `fc` [H, 3 * H_target] fuses three raw target states (the tap fusion); the one `midlayer` reads
  [input_layernorm(embedding), hidden_norm(state)] (2H wide) in its attention, its residual is the
  state (its normed form with `norm_before_residual`); then `norm` and `lm_head` over a draft
  vocabulary mapped into the target's by `d2t` (target id = i + d2t[i]). Its later steps read its
  own output before `norm`, so `norm` moves into the head and the model's final norm is Identity.
  `specdec distill --format eagle3` trains this architecture and saves it in this layout
  (models/eagle3_draft.py).

The draft usually ships no embedding (it uses the target's) and no tokenizer (the target's).
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from specdec_cli.errors import SpecdecError
from specdec_cli.models.draft_folder import DraftFolder, Format
from specdec_cli.models.feature_draft import drafting
from specdec_cli.models.feature_parts import FEATURES, TAPS, SubsetHead
from specdec_cli.models.target_states import TARGET_LAYERS, check_states, from_outputs

# ---------------------------------------------------------------- shared checks and loading


def check_fits(folder: DraftFolder, kind: str, target: PreTrainedModel, config, state_width: int) -> None:
    """The draft's vocabulary and widths against the target's: `state_width` is the width of the
    target states it reads, and without an embedding of its own it needs the target's width."""
    vocab, width = target.get_output_embeddings().weight.shape[0], target.get_input_embeddings().weight.shape[1]
    if config.vocab_size != vocab:
        raise SpecdecError(
            f"{kind} draft {folder.path}: vocabulary mismatch, vocab_size {config.vocab_size} "
            f"but the target has {vocab} tokens"
        )
    if state_width != width or (config.hidden_size != width and "embed_tokens.weight" not in folder.names):
        reads = f" (target_hidden_size {state_width})" if state_width != config.hidden_size else ""
        raise SpecdecError(
            f"{kind} draft {folder.path}: hidden size mismatch, hidden_size {config.hidden_size}{reads} "
            f"but the target's is {width}"
        )


def fill(model: PreTrainedModel, weights: dict[str, torch.Tensor], renames: list[tuple[str, str]], what: str) -> None:
    """Load checkpoint tensors into a draft built on the meta device. `renames` are (checkpoint
    prefix, model prefix) pairs, first match wins. Every tensor must find its place with its
    shape, and a parameter left on the meta device is one the checkpoint lacks."""

    def rename(name: str, pairs) -> str:
        return next((to + name[len(fr) :] for fr, to in pairs if name.startswith(fr)), name)

    expected = model.state_dict()
    mapped = {rename(k, renames): v for k, v in weights.items()}
    unexpected = [k for k, v in weights.items() if rename(k, renames) not in expected]
    wrong = [
        f"{k} {list(v.shape)} (expected {list(expected[rename(k, renames)].shape)})"
        for k, v in weights.items()
        if rename(k, renames) in expected and v.shape != expected[rename(k, renames)].shape
    ]
    if unexpected or wrong:
        raise SpecdecError(f"{what}: tensors that do not fit, {', '.join((unexpected + wrong)[:3])}")
    model.load_state_dict(mapped, strict=False, assign=True)
    backwards = [(to, fr) for fr, to in renames]
    missing = [rename(k, backwards) for k, v in model.state_dict().items() if v.is_meta]
    if missing:
        raise SpecdecError(f"{what}: missing tensors {', '.join(missing[:4])}")


def build(config: LlamaConfig) -> LlamaForCausalLM:
    """A Llama model on the meta device (no memory, no init: every weight comes from the checkpoint
    or the target), with its rotary table computed for real."""
    config.tie_word_embeddings = False
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    model.lm_head = torch.nn.Identity()  # replaced by a head that reads the target's or its own rows
    return model


def with_dtype(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}


def llama_from(config: dict) -> LlamaConfig:
    """The draft's layers are Llama's in both EAGLE formats, whatever the target's architecture."""
    return LlamaConfig.from_dict({k: v for k, v in config.items() if k != "model_type"})


def llama_config(folder: DraftFolder) -> LlamaConfig:
    try:
        return llama_from(folder.config)
    except (TypeError, ValueError) as exc:
        raise SpecdecError(f"draft {folder.path}: config.json does not describe a Llama layer: {exc}") from None


def use_target_embedding(model: PreTrainedModel, target: PreTrainedModel, weights: dict) -> None:
    """The draft's own embedding when it ships one (what it was trained with), else the target's."""
    if "embed_tokens.weight" not in weights:
        model.model.embed_tokens = target.get_input_embeddings()


# ---------------------------------------------------------------- EAGLE-1/2


def is_eagle(folder: DraftFolder) -> bool:
    return "EagleLlamaForCausalLM" in folder.architectures  # vLLM's name for it


def has_eagle_tensors(folder: DraftFolder) -> bool:
    names = folder.names
    return "fc.weight" in names and any(n.startswith("layers.0.") for n in names)


def load_eagle(folder: DraftFolder, target: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    config = llama_config(folder)
    check_fits(folder, "eagle", target, config, config.hidden_size)
    weights = with_dtype(folder.weights, dtype)
    # SafeAILab builds fc with a bias unless the config says "bias": false (vLLM's loader, without);
    # the tensors decide, and a config that states one the tensors lack is refused
    bias = "fc.bias" in weights
    if folder.config.get("bias", bias) != bias:
        state = "lacks" if not bias else "has"
        raise SpecdecError(
            f"eagle draft {folder.path}: config says bias {folder.config['bias']} but it {state} fc.bias"
        )
    model = build(config)
    with torch.device("meta"):
        setattr(model, FEATURES, torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=bias))
    model.model.layers[0].input_layernorm = torch.nn.Identity()  # its input is fc's output as it is
    model.model.norm = torch.nn.Identity()  # no final norm: the head and the next step read the layer output
    use_target_embedding(model, target, weights)
    renames = [("fc.", f"{FEATURES}."), ("layers.", "model.layers."), ("embed_tokens.", "model.embed_tokens.")]
    fill(model, weights, renames, f"eagle draft {folder.path}")
    model.lm_head = target.get_output_embeddings()
    return model


# ---------------------------------------------------------------- EAGLE-3

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's taps of a target of `num_layers` layers: the inputs of layers 2, L // 2 and L - 3
    (low, middle, high)."""
    return (2, num_layers // 2, num_layers - 3)


def is_eagle3(folder: DraftFolder) -> bool:
    if "speculators_config" in folder.config:  # vLLM's speculators layout nests its config: not this one
        return False
    if any(a in EAGLE3_ARCHITECTURES for a in folder.architectures):
        return True
    return "draft_vocab_size" in folder.config or "eagle_config" in folder.config  # SafeAILab's training config


def has_eagle3_tensors(folder: DraftFolder) -> bool:
    return "speculators_config" not in folder.config and any(n.startswith("midlayer.") for n in folder.names)


class Eagle3Layer(LlamaDecoderLayer):
    """EAGLE-3's first layer: its input is [token embedding, state] side by side (2H wide); the
    attention reads both normalised, and the state (normalised with `norm_before_residual`) is the
    residual stream."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool):
        super().__init__(config, layer_idx=0)
        attention, width = self.self_attn, config.hidden_size
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attention, name)
            setattr(attention, name, torch.nn.Linear(2 * width, old.out_features, bias=old.bias is not None))
        self.hidden_norm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        embeddings, state = hidden_states.chunk(2, dim=-1)
        normed = self.hidden_norm(state)
        attended, _ = self.self_attn(torch.cat([self.input_layernorm(embeddings), normed], dim=-1), **kwargs)
        hidden = (normed if self.norm_before_residual else state) + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Fc(torch.nn.Linear):
    """EAGLE-3's `fc` over the raw target states side by side, read in its own dtype (a draft that
    `specdec distill` trains in float32 reads a bfloat16 target's states)."""

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return super().forward(states.to(self.weight.dtype))


class Eagle3Head(torch.nn.Module):
    """EAGLE-3's head: `norm` (Identity with `norm_output: false`), then `lm_head`'s rows: logits over
    the draft vocabulary (`subset`)."""

    def __init__(self, norm: torch.nn.Module, subset: SubsetHead):
        super().__init__()
        self.norm, self.subset = norm, subset

    @property
    def token_ids(self) -> torch.Tensor:
        return self.subset.token_ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.subset(self.norm(hidden))


def make_eagle3(model: LlamaForCausalLM, num_taps: int, state_width: int, norm_before_residual: bool) -> None:
    """Turn a one-layer Llama model into EAGLE-3's draft (on the device or meta context it is built
    in): the midlayer, `fc` as the tap fusion, no feature projection (the layer itself splits
    [embedding, state]). Its `norm` and head are the caller's: they form the `Eagle3Head`."""
    config = model.config
    model.model.layers[0] = Eagle3Layer(config, norm_before_residual)
    setattr(model, TAPS, Eagle3Fc(num_taps * state_width, config.hidden_size, bias=False))
    setattr(model, FEATURES, torch.nn.Identity())


def eagle3_taps(folder: DraftFolder, num_layers: int) -> tuple[list[int], str]:
    """The target `hidden_states` indices the draft reads (hs[i] is the input of layer i), and why."""
    config = folder.config
    given = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if given:  # vLLM / speculators: layer i's hidden state is the input of layer i
        taps, why = list(given), f"eagle_aux_hidden_state_layer_ids {given}, inputs of those layers as vLLM counts"
    elif nested:  # SpecForge trains through SGLang, which captures the output of layer i (the input of i + 1)
        taps = from_outputs(nested)
        why = (
            f"eagle_config.eagle_aux_hidden_state_layer_ids {nested}, outputs of those layers as SpecForge/SGLang count"
        )
    else:
        taps = list(eagle3_layers(num_layers))
        why = "the config names no layers: EAGLE-3's default, the inputs of layers 2, L//2, L-3"
    # no engine captures the state after the final norm (hidden state L)
    check_states(
        taps, num_layers, f"eagle3 draft {folder.path}: {why} (hidden states {taps})", highest=num_layers - 1, count=3
    )
    return sorted(taps), why  # every engine captures them in layer order, whatever order the config lists


def load_eagle3(folder: DraftFolder, target: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    raw = folder.config
    if (raw.get("eagle_config") or {}).get("use_aux_hidden_state") is False or raw.get("fc_norm"):
        raise SpecdecError(f"eagle3 draft {folder.path}: use_aux_hidden_state false or fc_norm are not supported")
    config = llama_config(folder)
    state_width = raw.get("target_hidden_size") or config.hidden_size
    check_fits(folder, "eagle3", target, config, state_width)
    taps, why = eagle3_taps(folder, target.config.get_text_config().num_hidden_layers)
    weights = with_dtype(folder.weights, dtype)
    head, d2t = weights.pop("lm_head.weight", None), weights.pop("d2t", None)
    weights.pop("t2d", None)  # the inverse of d2t, as a mask; d2t says it all
    draft_vocab = raw.get("draft_vocab_size") or config.vocab_size
    if d2t is None and draft_vocab == config.vocab_size:
        d2t = torch.zeros(draft_vocab, dtype=torch.long)  # the full vocabulary: ids map to themselves
    if head is None or d2t is None:
        raise SpecdecError(f"eagle3 draft {folder.path}: missing tensors {'lm_head.weight' if head is None else 'd2t'}")
    token_ids = torch.arange(len(d2t)) + d2t.long()
    if head.shape != (draft_vocab, config.hidden_size) or len(d2t) != draft_vocab:
        raise SpecdecError(
            f"eagle3 draft {folder.path}: vocabulary mismatch, lm_head {list(head.shape)} and d2t "
            f"[{len(d2t)}] for draft_vocab_size {draft_vocab} and hidden size {config.hidden_size}"
        )
    if int(token_ids.min()) < 0 or int(token_ids.max()) >= config.vocab_size or len(token_ids.unique()) < len(d2t):
        raise SpecdecError(f"eagle3 draft {folder.path}: vocabulary mismatch, d2t maps outside the target's ids")

    setattr(config, TARGET_LAYERS, taps)
    model = build(config)
    with torch.device("meta"):
        make_eagle3(model, len(taps), state_width, bool(raw.get("norm_before_residual", False)))
    use_target_embedding(model, target, weights)
    renames = [
        ("fc.", f"{TAPS}."),
        ("midlayer.", "model.layers.0."),
        ("layers.", "model.layers."),  # vLLM also reads further, plain layers
        ("norm.", "model.norm."),
        ("embed_tokens.", "model.embed_tokens."),
    ]
    fill(model, weights, renames, f"eagle3 draft {folder.path}")
    # the fed-back state is the output before `norm`: the norm belongs to the head
    norm, model.model.norm = model.model.norm, torch.nn.Identity()
    if raw.get("norm_output") is False:  # SpecForge's option: logits from the un-normed output
        norm = torch.nn.Identity()
    model.lm_head = Eagle3Head(norm, SubsetHead(target.get_output_embeddings().weight, token_ids, head))
    # said aloud: a draft reading the wrong layers runs, but drafts badly
    print(f"specdec: eagle3 draft reads target hidden states {taps} ({why})", file=sys.stderr)
    return model


EAGLE = Format(
    claims=is_eagle,
    load=load_eagle,
    drafting=drafting,
    architectures=("EagleLlamaForCausalLM",),
    matches=has_eagle_tensors,
)
EAGLE3 = Format(
    claims=is_eagle3,
    load=load_eagle3,
    drafting=drafting,
    architectures=EAGLE3_ARCHITECTURES,
    matches=has_eagle3_tensors,
)
