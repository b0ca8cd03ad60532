"""EAGLE drafts as other tools publish them, loaded as feature drafts (methods/feature/draft.py's
`wire`: `FeatureDrafter` runs them unchanged):

- `EAGLE` (EAGLE-1/2, SafeAILab layout): `fc` [H, 2H] (a bias unless the config says `"bias": false`)
  is the feature projection over [token embedding, state]; then Llama decoder layers, the first
  without its input norm, and no final norm (SafeAILab `eagle/model/cnets1.py`, vLLM
  `llama_eagle.py`). The state is the target's last hidden state after its final norm; the head is
  the target's.
- `EAGLE3` (SafeAILab `eagle/model/cnets.py`, SpecForge `llama3_eagle.py`, vLLM `llama_eagle3.py`):
  `fc` [H, 3 * H_target] fuses three raw target states (the tap fusion); the `midlayer` reads
  [input_layernorm(embedding), hidden_norm(state)] (2H wide) in its attention, its residual is the
  state (its normed form with `norm_before_residual`); any later layers are plain Llama layers
  (`layers.1.*` ..., as vLLM runs them; SGLang takes one layer); then `norm` and `lm_head` over a draft
  vocabulary mapped into the target's by `d2t` (target id = i + d2t[i]). Its later steps read its
  own output before `norm`, so `norm` moves into the head and the model's final norm is Identity.
  `specdec distill --format eagle3` trains this architecture and saves it in this layout
  (methods/feature/eagle3_export.py).

The draft usually ships no embedding (it uses the target's) and no tokenizer (the target's).
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from specdec_cli.errors import SpecdecError
from specdec_cli.loading.draft_folder import DraftFolder, Format
from specdec_cli.loading.target_states import TARGET_LAYERS, check_states, from_outputs
from specdec_cli.methods.feature.draft import wire
from specdec_cli.methods.feature.parts import FEATURES, TAPS, SubsetHead

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


def llama_config(settings: dict, what: str) -> LlamaConfig:
    try:
        return llama_from(settings)
    except (TypeError, ValueError) as exc:
        raise SpecdecError(f"{what}: config.json does not describe a Llama layer: {exc}") from None


def use_target_embedding(model: PreTrainedModel, target: PreTrainedModel, weights: dict) -> None:
    """The draft's own embedding when it ships one (what it was trained with), else the target's."""
    if "embed_tokens.weight" not in weights:
        model.model.embed_tokens = target.get_input_embeddings()


# ---------------------------------------------------------------- EAGLE-1/2


def is_eagle(folder: DraftFolder) -> bool:
    return "EagleLlamaForCausalLM" in folder.architectures  # vLLM's name for it


def has_eagle_tensors(folder: DraftFolder) -> bool:
    names = folder.names
    return folder.speculators is None and "fc.weight" in names and any(n.startswith("layers.0.") for n in names)


def load_eagle(folder: DraftFolder, target: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    config = llama_config(folder.config, f"eagle draft {folder.path}")
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
# what a speculators EAGLE-3 config says at its top level, beside the layer's model config
# (`transformer_layer_config`); vLLM's `update_eagle3` reads these
SPECULATORS_KEYS = (
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "tie_word_embeddings",
)


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's taps of a target of `num_layers` layers: the inputs of layers 2, L // 2 and L - 3
    (low, middle, high)."""
    return (2, num_layers // 2, num_layers - 3)


def is_eagle3(folder: DraftFolder) -> bool:
    if folder.speculators is not None:
        return folder.speculators == "eagle3"
    if any(a in EAGLE3_ARCHITECTURES for a in folder.architectures):
        return True
    return "draft_vocab_size" in folder.config or "eagle_config" in folder.config  # SafeAILab's training config


def has_eagle3_tensors(folder: DraftFolder) -> bool:
    return folder.speculators is None and any(n.startswith("midlayer.") for n in folder.names)


def eagle3_settings(folder: DraftFolder) -> dict:
    """The draft's config as one flat dict. SafeAILab's and SpecForge's are flat; the speculators
    layout nests the layer's model config in `transformer_layer_config`, and vLLM reads an absent
    `norm_before_residual` there as true."""
    raw = folder.config
    if folder.speculators is None:
        return raw
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise SpecdecError(
            f"eagle3 draft {folder.path} (speculators layout): config.json has no transformer_layer_config"
        )
    return {**layer, "norm_before_residual": True, **{k: raw[k] for k in SPECULATORS_KEYS if k in raw}}


class Eagle3Layer(LlamaDecoderLayer):
    """EAGLE-3's first layer: its input is [token embedding, state] side by side (2H wide); the
    attention reads both normalised, and the state (normalised with `norm_before_residual`) is the
    residual stream. `qk_norm`: Qwen3's attention, q and k normalised per head."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool, qk_norm: bool = False):
        super().__init__(config, layer_idx=0)
        if qk_norm:
            self.self_attn = Qwen3Attention(config, layer_idx=0)
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
    `specdec distill` trains in float32 reads a bfloat16 target's states). EAGLE-3.1 normalises each
    state first (`fc_norm`: one norm per state, `fc_norm.{i}`); vLLM's `norm_before_fc` all of them
    at once (`input_norm`)."""

    def __init__(self, num_taps: int, state_width: int, width: int, eps: float, fc_norm=False, norm_before_fc=False):
        super().__init__(num_taps * state_width, width, bias=False)
        self.num_taps = num_taps
        self.fc_norm = (
            torch.nn.ModuleList(LlamaRMSNorm(state_width, eps=eps) for _ in range(num_taps)) if fc_norm else None
        )
        self.input_norm = LlamaRMSNorm(num_taps * state_width, eps=eps) if norm_before_fc else None

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        states = states.to(self.weight.dtype)
        if self.fc_norm is not None:
            states = torch.cat([norm(s) for norm, s in zip(self.fc_norm, states.chunk(self.num_taps, -1))], -1)
        if self.input_norm is not None:
            states = self.input_norm(states)
        return super().forward(states)


class Eagle3Head(torch.nn.Module):
    """EAGLE-3's head: `norm` (Identity where the state fed back is already normed, EAGLE-3.1's
    `norm_output`), then `lm_head`'s rows: logits over the draft vocabulary (`subset`)."""

    def __init__(self, norm: torch.nn.Module, subset: SubsetHead):
        super().__init__()
        self.norm, self.subset = norm, subset

    @property
    def token_ids(self) -> torch.Tensor:
        return self.subset.token_ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.subset(self.norm(hidden))


def make_eagle3(
    model: LlamaForCausalLM,
    num_taps: int,
    state_width: int,
    norm_before_residual: bool,
    qk_norm: bool = False,
    fc_norm: bool = False,
    norm_before_fc: bool = False,
) -> None:
    """Turn a Llama model into EAGLE-3's draft (on the device or meta context it is built in): its
    first layer the midlayer, `fc` as the tap fusion, no feature projection (the midlayer itself
    splits [embedding, state]); later layers stay Llama's. Its `norm` and head are the caller's:
    they form the `Eagle3Head`."""
    config = model.config
    model.model.layers[0] = Eagle3Layer(config, norm_before_residual, qk_norm)
    fusion = Eagle3Fc(num_taps, state_width, config.hidden_size, config.rms_norm_eps, fc_norm, norm_before_fc)
    setattr(model, TAPS, fusion)
    setattr(model, FEATURES, torch.nn.Identity())


def eagle3_taps(settings: dict, what: str, num_layers: int) -> tuple[list[int], str]:
    """The target `hidden_states` indices the draft reads (hs[i] is the input of layer i), and why."""
    given = settings.get("eagle_aux_hidden_state_layer_ids")
    nested = (settings.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
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
    check_states(taps, num_layers, f"{what}: {why} (hidden states {taps})", highest=num_layers - 1, count=len(taps))
    return sorted(taps), why  # every engine captures them in layer order, whatever order the config lists


def draft_head(
    what: str, settings: dict, weights: dict, target: PreTrainedModel, headless: torch.Tensor | None = None
) -> SubsetHead:
    """A draft's head over its vocabulary (EAGLE-3's and DFlash's as vLLM reads them): its own
    `lm_head` rows, over the target ids `d2t` maps them to (target id = i + d2t[i]). A checkpoint
    without an `lm_head` scores the whole vocabulary with `headless` rows, else the target's head
    (what vLLM and SGLang do with `draft_vocab_size` null or absent). Pops those tensors."""
    vocab, width = target.get_output_embeddings().weight.shape[0], settings.get("hidden_size")
    head, d2t = weights.pop("lm_head.weight", None), weights.pop("d2t", None)
    weights.pop("t2d", None)  # the inverse of d2t, as a mask; d2t says it all
    draft_vocab = settings.get("draft_vocab_size") or vocab
    if d2t is None and draft_vocab == vocab:
        d2t = torch.zeros(draft_vocab, dtype=torch.long)  # the full vocabulary: ids map to themselves
    if d2t is None or (head is None and draft_vocab != vocab):
        missing = "d2t" if d2t is None else f"lm_head.weight (for its draft vocabulary of {draft_vocab} tokens)"
        raise SpecdecError(f"{what}: missing tensors {missing}")
    token_ids = torch.arange(len(d2t)) + d2t.long()
    if len(d2t) != draft_vocab or (head is not None and head.shape != (draft_vocab, width)):
        rows = f"lm_head {list(head.shape)} and " if head is not None else ""
        raise SpecdecError(
            f"{what}: vocabulary mismatch, {rows}d2t [{len(d2t)}] for draft_vocab_size {draft_vocab} "
            f"and hidden size {width}"
        )
    if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab or len(token_ids.unique()) < len(d2t):
        raise SpecdecError(f"{what}: vocabulary mismatch, d2t maps outside the target's ids")
    return SubsetHead(target.get_output_embeddings().weight, token_ids, head if head is not None else headless)


def load_eagle3(folder: DraftFolder, target: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    settings = eagle3_settings(folder)
    what = f"eagle3 draft {folder.path}" + (" (speculators layout)" if folder.speculators else "")
    if (settings.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise SpecdecError(f"{what}: use_aux_hidden_state false (no target layer taps) is not supported")
    if settings.get("fc_norm") and settings.get("norm_before_fc"):
        raise SpecdecError(f"{what}: fc_norm and norm_before_fc exclude each other (vLLM refuses both)")
    config = llama_config(settings, what)
    state_width = settings.get("target_hidden_size") or config.hidden_size
    check_fits(folder, "eagle3", target, config, state_width)
    taps, why = eagle3_taps(settings, what, target.config.get_text_config().num_hidden_layers)
    weights = with_dtype(folder.weights, dtype)
    # SGLang's reading of `tie_word_embeddings` in a draft without `lm_head`: its head is the embedding
    tied = weights.get("embed_tokens.weight", target.get_input_embeddings().weight)
    subset = draft_head(what, settings, weights, target, tied if settings.get("tie_word_embeddings") else None)

    setattr(config, TARGET_LAYERS, taps)
    model = build(config)
    with torch.device("meta"):
        make_eagle3(
            model,
            len(taps),
            state_width,
            bool(settings.get("norm_before_residual", False)),
            qk_norm=settings.get("model_type") == "qwen3",  # vLLM's Eagle3Qwen3 for such a layer config
            fc_norm=bool(settings.get("fc_norm")),
            norm_before_fc=bool(settings.get("norm_before_fc")),
        )
    use_target_embedding(model, target, weights)
    renames = [
        ("fc_norm.", f"{TAPS}.fc_norm."),  # before `fc.`: names are mapped back first match too
        ("input_norm.", f"{TAPS}.input_norm."),
        ("fc.", f"{TAPS}."),
        ("midlayer.", "model.layers.0."),
        ("layers.", "model.layers."),  # the speculators layout's name for the midlayer; vLLM reads further layers
        ("norm.", "model.norm."),
        ("embed_tokens.", "model.embed_tokens."),
    ]
    fill(model, weights, renames, what)
    norm = model.model.norm
    if settings.get("norm_output"):  # EAGLE-3.1 (vLLM, SGLang, SpecForge): the normed output is fed back
        head_norm = torch.nn.Identity()
    else:  # the fed-back state is the output before `norm`: the norm belongs to the head
        head_norm, model.model.norm = norm, torch.nn.Identity()
    model.lm_head = Eagle3Head(head_norm, subset)
    # said aloud: a draft reading the wrong layers runs, but drafts badly
    print(f"specdec: eagle3 draft reads target hidden states {taps} ({why})", file=sys.stderr)
    return model


EAGLE = Format(
    claims=is_eagle,
    load=load_eagle,
    wire=wire,
    architectures=("EagleLlamaForCausalLM",),
    matches=has_eagle_tensors,
)
EAGLE3 = Format(
    claims=is_eagle3,
    load=load_eagle3,
    wire=wire,
    architectures=EAGLE3_ARCHITECTURES,
    matches=has_eagle3_tensors,
)
