"""One row per drafting method: the draft key that selects it in a config, how it is described, the
module that builds its drafter for a loaded target, and what vLLM calls it. Adding a method is its
module (with a `build(settings, target) -> Built`) and a row here.

A config's draft names one method that drafts its blocks: a draft model (`checkpoint` or `tiny`, in
any format methods/formats.py recognises), `ngram`, `recycling`, or `suffix` alone. Beside a draft
model, `lookup` or `suffix` drafts ahead of it: where it finds a continuation in the context it drafts
that, the model elsewhere. Which keys may combine is config.py's to check.

Torch-free at import: a row names its module, imported when a drafter is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from specdec_cli.errors import SpecdecError

# specdec's draft formats (methods/formats.py; None: a causal LM) as vLLM's speculative methods
VLLM_METHODS = {None: "draft_model", "eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa", "dflash": "dflash"}


class Target(NamedTuple):
    """What building a drafter reads of the loaded target and the run."""

    model: Any  # the target, a transformers PreTrainedModel
    tokenizer: Any
    vocab_size: int  # rows of the target's LM head: the ids drafts are drawn from
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    weights: str  # float, int8 or int4: how a draft model's products read its weights
    graphs: bool  # whether decoding forwards replay CUDA graphs
    threshold: float  # the confidence threshold a draft model stops a block at


class Built(NamedTuple):
    """A method's drafter for the target, and what the pair needs to know about it."""

    drafter: Any  # a decoding.drafter.Drafter
    state_layers: tuple[int, ...] | None = None  # the target states it reads (None: the last, for none)
    description: str | None = None  # a draft model's format and what it reads, in words
    causal_draft: Any = None  # the draft model, where it is a causal LM drafting from tokens alone


@dataclass(frozen=True)
class Method:
    key: str  # the draft key that selects it
    title: str  # its name in messages
    module: str  # the module whose build(settings, target) makes its drafter
    settings: Callable[[Any], Any]  # the config's draft -> this method's settings (None: not selected)
    describe: Callable[[Any], str]  # its settings in a record's words
    vllm: Callable[[Any, int], dict] | None = None  # its settings, draft tokens -> vLLM's speculative_config
    engines_lookup: bool = False  # transformers' and llama.cpp's prompt lookup are this method

    def build(self, settings: Any, target: Target) -> Built:
        return importlib.import_module(self.module).build(settings, target)


def ngram_vllm(settings, num_draft_tokens: int) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": num_draft_tokens,
        "prompt_lookup_min": settings.min_n,
        "prompt_lookup_max": settings.max_n,
    }


def suffix_vllm(settings, num_draft_tokens: int) -> dict:
    """vLLM's suffix decoding (`method: suffix`, from the arctic-inference package) with specdec's settings."""
    if settings.max_spec_offset:
        raise SpecdecError("vLLM's suffix decoding has no max_spec_offset: set draft.suffix.max_spec_offset 0")
    return {
        "method": "suffix",
        "num_speculative_tokens": num_draft_tokens,
        "suffix_decoding_max_tree_depth": settings.max_tree_depth,
        "suffix_decoding_max_cached_requests": settings.max_cached_requests,
        "suffix_decoding_max_spec_factor": settings.max_spec_factor,
        "suffix_decoding_min_token_prob": settings.min_token_prob,
    }


def model_vllm(spec, num_draft_tokens: int) -> dict:
    """vLLM's method for the draft model's format (the folder is fetched to be read)."""
    from specdec_cli.loading.checkpoints import model_folder
    from specdec_cli.methods.formats import folder_format

    path = model_folder(spec, fetch=True)
    kind = folder_format(path)
    if kind not in VLLM_METHODS:
        raise SpecdecError(
            f"the draft {spec.describe()} ({kind} format) has no vLLM equivalent"
            + (": `specdec distill --format eagle3` writes one vLLM reads" if kind == "specdec" else "")
        )
    speculative = {"method": VLLM_METHODS[kind], "model": path, "num_speculative_tokens": num_draft_tokens}
    if kind is None:  # vLLM's draft model drafts its argmax unless told to sample, as specdec's does
        speculative["draft_sample_method"] = "probabilistic"
    return speculative


def ngram_words(settings) -> str:
    return f"n={settings.min_n}..{settings.max_n}"


MODEL = Method(
    key="checkpoint",
    title="a draft model",
    module="specdec_cli.methods.draft_model",
    settings=lambda draft: draft if draft.checkpoint is not None or draft.tiny is not None else None,
    describe=lambda spec: spec.describe(),
    vllm=model_vllm,
)
NGRAM = Method(
    key="ngram",
    title="n-gram lookup",
    module="specdec_cli.methods.ngram",
    settings=lambda draft: draft.ngram,
    describe=lambda s: f"ngram({ngram_words(s)})",
    vllm=ngram_vllm,
    engines_lookup=True,
)
RECYCLING = Method(
    key="recycling",
    title="token recycling",
    module="specdec_cli.methods.recycling",
    settings=lambda draft: draft.recycling,
    describe=lambda s: f"recycling(candidates={s.candidates})",
)
SUFFIX = Method(
    key="suffix",
    title="suffix decoding",
    module="specdec_cli.methods.suffix",
    settings=lambda draft: draft.suffix,
    describe=lambda s: f"suffix(depth={s.max_tree_depth})",
    vllm=suffix_vllm,
)
LOOKUP = Method(  # prompt lookup ahead of a draft model: draft.ngram's drafter with draft.lookup's settings
    key="lookup",
    title="prompt lookup",
    module="specdec_cli.methods.ngram",
    settings=lambda draft: draft.lookup,
    describe=lambda s: f"lookup({ngram_words(s)})",
)

# the first of these that a config's draft selects drafts its blocks (suffix alone only without a model)
DRAFTING = (NGRAM, RECYCLING, MODEL, SUFFIX)
AHEAD = (LOOKUP, SUFFIX)  # beside a draft model, the one set drafts ahead of it


def drafting(draft) -> tuple[Method, Any]:
    """The method that drafts the config's blocks (after the one ahead of it, if any), and its settings."""
    for method in DRAFTING:
        settings = method.settings(draft)
        if settings is not None:
            return method, settings
    raise SpecdecError("config: the draft names no drafting method")


def ahead(draft) -> tuple[Method, Any] | None:
    """The method drafting ahead of the config's draft model, and its settings; None where there is none."""
    if drafting(draft)[0] is not MODEL:
        return None
    return next(((m, s) for m in AHEAD if (s := m.settings(draft)) is not None), None)


def describe(draft) -> str:
    """The config's drafting in a record's words: "ngram(n=1..3)", "<checkpoint> after lookup(n=1..3)"."""
    method, settings = drafting(draft)
    words = method.describe(settings)
    lead = ahead(draft)
    if lead is None:
        return words
    method, settings = lead
    first = method.describe(settings)
    if settings.num_draft_tokens is not None:
        first = f"{first[:-1]}, up to {settings.num_draft_tokens} tokens)"
    return f"{words} after {first}"


def vllm_config(draft, num_draft_tokens: int) -> dict:
    """vLLM's speculative_config for the config's drafting; a SpecdecError where vLLM has no counterpart."""
    lead = ahead(draft)
    if lead is not None:
        method = lead[0]
        raise SpecdecError(f"vLLM has no equivalent of {method.title} ahead of a draft model (draft.{method.key})")
    method, settings = drafting(draft)
    if method.vllm is None:
        raise SpecdecError(f"vLLM has no {method.title} (draft.{method.key})")
    return method.vllm(settings, num_draft_tokens)
