"""Load a config's target and drafter onto a device, check they can work together, encode prompts."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import specdec_cli
from specdec_cli import display
from specdec_cli.config import Config, ModelSpec
from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.drafter import Drafter
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.decoding.verification import SyntheticAcceptance, chain_rule
from specdec_cli.errors import SpecdecError
from specdec_cli.loading.checkpoints import check_embedding, load_model, shipped_weights
from specdec_cli.loading.decode_matmul import PROCESS_CHOICE, weight_bytes
from specdec_cli.loading.quantized import KINDS as QUANTIZED
from specdec_cli.loading.target_states import LAST
from specdec_cli.loading.tokens import encode_prompt, eos_token_ids
from specdec_cli.methods import registry
from specdec_cli.methods.context import ContextDrafter
from specdec_cli.methods.formats import load_format
from specdec_cli.methods.lookup import LookupFirstDrafter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SpecdecError(f"device {name} requested but CUDA is not available (torch {torch.__version__})")
    device = torch.device(name)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise SpecdecError(
            f"device {name} requested but this machine has {torch.cuda.device_count()} CUDA "
            f"device(s): cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    # auto: bf16 on CUDA, where it is sure to be fast; float32 on CPUs, also those with bf16 units, where
    # greedy output then stays identical to the target alone's (docs/experiments, 2026-12-03 dtypes)
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def resolve_weights(name: str, device: torch.device, target: ModelSpec) -> str:
    """runtime.weights as the products take them, for the target and its draft: auto is as the target's
    checkpoint ships (int4 from a GGUF of 4-bit types) on a CPU, float elsewhere; int8 and int4 run
    torch's CPU kernels."""
    if name in QUANTIZED and device.type != "cpu":
        raise SpecdecError(f"weights: {name} runs on a CPU (torch's quantized CPU kernels); on {device} use float")
    if name == "auto":
        return shipped_weights(target) if device.type == "cpu" else "float"
    return name


@dataclass
class Pair:
    config: Config
    tokenizer: PreTrainedTokenizerBase
    target: CachedModel
    # the draft's own: a model, a feature draft, heads, a block draft, n-gram lookup, suffix decoding or
    # token recycling
    drafter: Drafter
    device: torch.device
    dtype: torch.dtype
    weights: str  # float, int8 or int4: how the target's and the draft's products read their weights
    draft_description: str | None = None  # the draft's format and the target states it reads
    lookup: ContextDrafter | None = None  # prompt lookup or suffix decoding ahead of the drafter
    causal_draft: PreTrainedModel | None = None  # the draft, where it is a causal LM drafting from tokens alone

    @property
    def eos_token_ids(self) -> set[int]:
        return eos_token_ids(self.target.model.generation_config, self.tokenizer)

    def decoder(
        self,
        params: SamplingParams,
        speculative: bool = True,
        num_draft_tokens: int | None = None,
        tree: TreeShape | None = None,
        verification: str | None = None,
    ) -> SpeculativeDecoder:
        """A chain of `num_draft_tokens`, a `tree` of that shape, or, given neither, the config's drafting;
        a chain's sampled drafts verified by `verification` (default: the config's rule)."""
        if tree is None and num_draft_tokens is None:
            tree = self.config.speculation.tree
        if tree is not None and speculative:  # lookup's tree where it finds a match, the model's elsewhere
            drafter = self.drafter if self.lookup is None else LookupFirstDrafter(self.lookup, self.drafter)
            return SpeculativeDecoder(self.target, drafter, params, tree.depth, self.eos_token_ids, tree)
        num_draft_tokens = self.config.speculation.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        drafter = self.drafter if speculative else None
        if speculative and self.lookup is not None:
            lookup_tokens = (self.config.draft.lookup or self.config.draft.suffix).num_draft_tokens
            if lookup_tokens is None:  # both sides draft the decoder's length
                drafter = LookupFirstDrafter(self.lookup, drafter)
            else:  # each side its own length; the decoder's is the longer
                drafter = LookupFirstDrafter(self.lookup, drafter, lookup_tokens, num_draft_tokens)
                num_draft_tokens = max(num_draft_tokens, lookup_tokens)
        rule = chain_rule(params, verification or self.config.speculation.verification)
        if speculative and self.config.speculation.synthetic_acceptance is not None:
            rule = SyntheticAcceptance(rule, self.config.speculation.synthetic_acceptance)
        schedule = self.config.batch_schedule(params.greedy)
        return SpeculativeDecoder(
            self.target, drafter, params, num_draft_tokens, self.eos_token_ids, rule=rule, schedule=schedule
        )

    def encode(self, prompt: str, raw: bool = False, history: list[dict] | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, raw, history)

    def check_fits(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        check_fits(prompt_ids, max_new_tokens, self.target.context_length)

    def describe(self) -> dict:
        """What a record needs to say about where and how it ran."""
        device = self.device
        float_cpu = device.type == "cpu" and self.weights == "float"
        return {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
            "dtype": dtype_name(self.dtype),
            "weights": self.weights,
            "threads": torch.get_num_threads(),
            "target_weight_bytes": weight_bytes(self.target.model),  # what a target forward's products read
            "cuda_graphs": self.target.graphed is not None,
            # which product served the CPU float matmuls (decode_matmul.py); None elsewhere and for quantized weights
            "decode_matmul": PROCESS_CHOICE.name(self.dtype) if float_cpu else None,
            "versions": {
                "specdec": specdec_cli.__version__,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
            },
        }


def load_pair_showing(config: Config) -> Pair:
    """load_pair behind a "Loading ..." line on stderr, as the commands load."""
    with display.stderr.status(f"Loading {config.target.describe()} and {registry.describe(config.draft)}..."):
        return load_pair(config)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32", as records and vLLM name it."""
    return str(dtype).removeprefix("torch.")


def check_fits(prompt_ids: list[int], max_new_tokens: int, context_length: int) -> None:
    if len(prompt_ids) + max_new_tokens > context_length:
        raise SpecdecError(
            f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({max_new_tokens}) "
            f"exceeds the target's context of {context_length} tokens"
        )


def cpu_name() -> str:
    """The CPU's model name as lscpu shows it (Linux), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_checkpoint(
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    target: PreTrainedModel | None = None,
    weights: str = "float",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """A target or a draft: in a draft format of methods/ (recognised from the folder), else
    transformers' checkpoint. `target` is given when loading a draft; `weights`: float, int8 or int4."""
    return load_model(spec, device, dtype, target, read_format=load_format, weights=weights)


def load_pair(config: Config) -> Pair:
    runtime = config.runtime
    if runtime.threads:
        torch.set_num_threads(runtime.threads)
    device = resolve_device(runtime.device)
    dtype = resolve_dtype(runtime.dtype, device)
    if runtime.cuda_graphs == "on" and device.type != "cuda":
        raise SpecdecError(f"cuda_graphs: on needs a CUDA device, and the device is {device}")
    graphs = runtime.cuda_graphs != "off" and device.type == "cuda"
    weights = resolve_weights(runtime.weights, device, config.target)
    model, tokenizer = load_checkpoint(config.target, device, dtype, weights=weights)
    check_embedding(model, tokenizer, f"target {config.target.describe()}")
    vocab_size = model.get_output_embeddings().out_features
    threshold = config.speculation.confidence_threshold
    parts = registry.Target(model, tokenizer, vocab_size, device, dtype, weights, graphs, threshold)
    method, settings = registry.drafting(config.draft)
    built = method.build(settings, parts)
    lead = registry.ahead(config.draft)
    lookup = lead[0].build(lead[1], parts).drafter if lead is not None else None
    if threshold and not built.drafter.stops_when_unsure:
        raise SpecdecError(
            "confidence_threshold applies to drafts that draft token by token (a draft model, a feature "
            "or EAGLE draft): this draft proposes its block at once"
        )
    target = CachedModel(model, vocab_size, built.state_layers or LAST, graphs)
    drafter, description, causal_draft = built.drafter, built.description, built.causal_draft
    return Pair(config, tokenizer, target, drafter, device, dtype, weights, description, lookup, causal_draft)
