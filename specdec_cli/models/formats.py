"""Draft checkpoints in the formats other tools publish, recognised from the folder itself (its
config.json and tensor names, as serving engines do) and loaded against the target.

`FORMATS` maps a format's name to how to recognise a folder of it and how to load one: the first
format whose config.json it is loads it, else (a config that does not say) the first whose tensor
names it holds, read from the headers of the weight files alone (`WEIGHTS`). The EAGLE formats load as feature drafts
(models/feature_draft.py) that `FeatureDrafter` runs unchanged:

- `eagle` (EAGLE-1/2, SafeAILab layout): `fc` [H, 2H] (a bias unless the config says `"bias": false`)
  is the feature projection over [token embedding, state]; then Llama decoder layers, the first
  without its input norm, and no final norm (SafeAILab `eagle/model/cnets1.py`, vLLM
  `llama_eagle.py`). The state is the target's last hidden state after its final norm; the head is
  the target's.
- `eagle3` (SafeAILab `eagle/model/cnets.py`, SpecForge `llama3_eagle.py`, vLLM `llama_eagle3.py`):
  `fc` [H, 3 * H_target] fuses three raw target states (the tap fusion); the one `midlayer` reads
  [input_layernorm(embedding), hidden_norm(state)] (2H wide) in its attention, its residual is the
  state (its normed form with `norm_before_residual`); then `norm` and `lm_head` over a draft
  vocabulary mapped into the target's by `d2t` (target id = i + d2t[i]). Its later steps read its
  own output before `norm`, so `norm` moves into the head and the model's final norm is Identity.
  `specdec distill --format eagle3` trains this architecture and saves it in this layout
  (models/eagle3_draft.py).

The draft usually ships no embedding (it uses the target's) and no tokenizer (the target's). Weights
load from safetensors; a pickle (`WEIGHTS`) only with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import pickle
import re
import sys
import zipfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from specdec_cli.errors import SpecdecError
from specdec_cli.models import dflash, medusa
from specdec_cli.models.feature_draft import (
    DRAFT_INFO,
    FEATURES,
    TAPS,
    TARGET_LAYERS,
    SubsetHead,
    eagle3_layers,
    load_draft,
)

DRAFT_FORMAT = "specdec_draft_format"  # config key set on every loaded draft: the format's name
# Where a checkpoint's tensors are, tier by tier as transformers looks: the shards an index lists, else
# every top-level file of the tier. Pickles: transformers' (SafeAILab's EAGLE drafts use its name too)
# and FasterDecoding Medusa's; any other pickle beside them (training_args.bin, optimizer.pt) is never
# opened, as unpickling it may be slow, refused, or both.
WEIGHTS = (
    ("model.safetensors.index.json", ("*.safetensors",)),
    ("pytorch_model.bin.index.json", ("pytorch_model*.bin", "medusa_lm_head.pt")),
)


def index_files(index: Path) -> list[str] | None:
    """The shard files a sharded checkpoint's index lists (None: no index)."""
    if not index.is_file():
        return None
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise SpecdecError(f"{index}: cannot read: {exc}") from None
    shards = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(shards, dict) or not all(isinstance(f, str) and "/" not in f for f in shards.values()):
        raise SpecdecError(f"{index}: no weight_map of tensor names to files in its folder")
    return sorted(set(shards.values()))


def tier_files(path: Path, index: str, patterns: tuple[str, ...]) -> list[Path]:
    listed = index_files(path / index)
    if listed is None:
        return sorted({p for pattern in patterns for p in path.glob(pattern)})
    missing = [name for name in listed if not (path / name).is_file()]
    if missing:
        raise SpecdecError(f"{path}: {index} lists {missing[0]}, which is not there")
    return [path / name for name in listed]


def weight_files(path: Path) -> list[Path]:
    return next((files for tier in WEIGHTS if (files := tier_files(path, *tier))), [])


@dataclass
class DraftFolder:
    """A checkpoint folder: its config.json and, read when first asked for, its tensors."""

    path: Path
    config: dict

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])

    @cached_property
    def files(self) -> list[Path]:
        return weight_files(self.path)

    @cached_property
    def names(self) -> dict[str, str]:
        """Each tensor's name and the file holding it, from safetensors headers and memory-mapped
        pickles (no tensor is read). A name in two files is refused: which copy would be meant?"""
        where = {}
        for file in self.files:
            for name in tensor_names(file):
                if name in where:
                    raise SpecdecError(f"{self.path}: tensor {name} is in both {where[name]} and {file.name}")
                where[name] = file.name
        return where

    @cached_property
    def weights(self) -> dict[str, torch.Tensor]:
        if not self.names:
            patterns = ", ".join(p for _, tier in WEIGHTS for p in tier)
            raise SpecdecError(f"draft {self.path}: no weights (no tensors in {patterns})")
        return {k: v for file in self.files for k, v in read_tensors(file).items()}


@contextmanager
def unreadable(file: Path):
    """A truncated or corrupt safetensors file: one line, not a traceback."""
    try:
        yield
    except SafetensorError as exc:
        raise SpecdecError(f"{file}: not a readable safetensors file (truncated or corrupt?): {exc}") from None


def tensor_names(file: Path) -> list[str]:
    if file.suffix == ".safetensors":
        with unreadable(file), safe_open(file, framework="pt") as f:
            return list(f.keys())
    return list(load_pickle(file))


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        with unreadable(file):
            return load_file(file)
    return load_pickle(file)


def load_pickle(file: Path) -> dict[str, torch.Tensor]:
    """Plain tensors only: `weights_only=True` refuses pickles that would run code or build objects.
    Memory-mapped (a zip archive, as torch.save writes since 1.6): only the tensors used are read."""
    try:
        data = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except pickle.UnpicklingError as exc:
        why = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(exc))
        raise SpecdecError(
            f"{file}: refused, it is not a pickle of plain tensors (specdec loads .bin/.pt files only "
            f"with torch.load(weights_only=True); convert it to safetensors)" + (f": {why[1]}" if why else "")
        ) from None
    except (RuntimeError, OSError, EOFError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SpecdecError(f"{file}: not a readable pickle (truncated or corrupt?): {reason}") from None
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise SpecdecError(f"{file}: not a mapping of tensor names to tensors")
    return data


@dataclass(frozen=True)
class Format:
    claims: Callable[[DraftFolder], bool]  # from config.json (or a file of its own): no tensor is read
    load: Callable[[DraftFolder, PreTrainedModel, torch.dtype], PreTrainedModel]
    architectures: tuple[str, ...] = ()  # the `architectures` names of its configs that transformers lacks
    # from the tensor names, for a config that does not say (EAGLE-1's is a plain Llama config)
    matches: Callable[[DraftFolder], bool] = lambda folder: False


def recognise(folder: DraftFolder) -> str | None:
    """The name of the folder's format: the first whose config it is, else the first whose tensor
    names it has (headers only), else None (a plain transformers checkpoint)."""
    for test in ("claims", "matches"):
        for name, fmt in FORMATS.items():
            if getattr(fmt, test)(folder):
                return name
    return None


def load_format(
    path: Path, target: PreTrainedModel | None, dtype: torch.dtype, remote_code: bool = False
) -> PreTrainedModel | None:
    """The draft in `path` loaded for `target` when a format recognises the folder, else None (a
    plain transformers checkpoint). Config keys `DRAFT_FORMAT` and, for feature drafts,
    `TARGET_LAYERS` say what it is and which target states it reads. A draft whose architecture
    neither a format nor transformers knows is refused (unless its own code is trusted)."""
    if not (path / "config.json").is_file():
        return None
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SpecdecError(f"{path / 'config.json'}: cannot read: {exc}") from None
    if not isinstance(config, dict):
        raise SpecdecError(f"{path / 'config.json'}: not a JSON object")
    folder = DraftFolder(path, config)
    name = recognise(folder)
    if name is not None:
        if target is None:
            raise SpecdecError(f"{path} is a {name} draft: it can only be loaded as the draft of a target")
        model = FORMATS[name].load(folder, target, dtype)
        setattr(model.config, DRAFT_FORMAT, name)
        return model
    if target is not None and not remote_code:  # transformers would build it from `model_type`, half-loaded
        known = {a for fmt in FORMATS.values() for a in fmt.architectures}
        unknown = [a for a in folder.architectures if a not in known and not hasattr(transformers, a)]
        if unknown:
            raise SpecdecError(
                f"draft {path}: unknown architecture {unknown[0]} (specdec reads {', '.join(FORMATS)} drafts "
                f"and transformers' causal LMs)"
            )
    return None


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
    """EAGLE-3's head: `norm` (Identity with `norm_output: false`), then `lm_head`'s rows over the
    draft vocabulary put at their target ids (`subset`); `scores` gives the draft vocabulary's alone."""

    def __init__(self, norm: torch.nn.Module, subset: SubsetHead):
        super().__init__()
        self.norm, self.subset = norm, subset

    @property
    def token_ids(self) -> torch.Tensor:
        return self.subset.token_ids

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.subset.scores(self.norm(hidden))

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
        taps = [i + 1 if isinstance(i, int) else i for i in nested]
        why = (
            f"eagle_config.eagle_aux_hidden_state_layer_ids {nested}, outputs of those layers as SpecForge/SGLang count"
        )
    else:
        taps = list(eagle3_layers(num_layers))
        why = "the config names no layers: EAGLE-3's default, the inputs of layers 2, L//2, L-3"
    if len(taps) != 3 or len(set(taps)) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in taps):
        raise SpecdecError(
            f"eagle3 draft {folder.path}: layer ids out of range, {why} gives target hidden states {taps}; "
            f"a target of {num_layers} layers has 3 distinct ones among 0 .. {num_layers - 1}"
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


FORMATS: dict[str, Format] = {
    "specdec": Format(
        claims=lambda folder: (folder.path / DRAFT_INFO).is_file(),
        load=lambda folder, target, dtype: load_draft(folder.path, folder.weights, target, dtype),
    ),
    # block drafts (drafters/block.py, drafters/medusa.py)
    "dflash": Format(claims=dflash.recognise, load=dflash.load, architectures=(dflash.ARCHITECTURE,)),
    "medusa": Format(claims=medusa.recognise, load=medusa.load, architectures=("MedusaModel",)),
    "eagle3": Format(
        claims=is_eagle3, load=load_eagle3, architectures=EAGLE3_ARCHITECTURES, matches=has_eagle3_tensors
    ),
    "eagle": Format(
        claims=is_eagle, load=load_eagle, architectures=("EagleLlamaForCausalLM",), matches=has_eagle_tensors
    ),
}
