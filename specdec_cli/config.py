"""YAML run configs: schema, validation and command-line overrides.

Precedence is: command-line flag > YAML > the defaults below. Every section is a dataclass; a YAML
key that is not a field is an error that names it, and so is a value of the wrong type.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from specdec_cli.decoding.params import BatchSchedule, TreeShape
from specdec_cli.errors import SpecdecError, read_text


def builtin_configs() -> Path:
    """configs/ at the top of the repository, installed as specdec_cli.configs (pyproject.toml), so a
    wheel has them too; with a source tree on sys.path and nothing installed, that tree's configs/."""
    try:
        return Path(str(resources.files("specdec_cli.configs")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "configs"


BUILTIN_CONFIGS = builtin_configs()
DEFAULT_CONFIG = "smollm2-draft"  # name of a file in BUILTIN_CONFIGS
VERIFICATIONS = ("token", "block")  # speculation.verification
WEIGHTS = ("auto", "float", "int8", "int4")  # runtime.weights


@dataclass
class TinyModel:
    """A small randomly initialised Llama model with a byte-level tokenizer, for tests and smoke runs."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 4096
    init_std: float = 0.3  # larger than Llama's 0.02 so distributions are peaked, not near-uniform
    seed: int = 0
    noise: float = 0.0  # std of Gaussian noise added to every weight: a draft that partly agrees


@dataclass
class ModelSpec:
    """A checkpoint: exactly one of `checkpoint` (folder, hub id, .gguf file, built-in name) or `tiny`."""

    checkpoint: str | None = None
    tiny: TinyModel | None = None
    revision: str | None = None
    trust_remote_code: bool = False

    def describe(self) -> str:
        return self.checkpoint if self.checkpoint else f"tiny(seed={self.tiny.seed})"


@dataclass
class NgramSettings:
    """Prompt lookup: propose the tokens that followed the last earlier occurrence of the context's
    final n-gram, trying the longest n first."""

    max_n: int = 3
    min_n: int = 1


@dataclass
class LookupSettings(NgramSettings):
    """Prompt lookup ahead of a draft model. A lookup draft costs nothing but the wider verification,
    so its blocks may be longer than the model's: up to `num_draft_tokens` (None: the model's);
    sampled, they start at the model's length and double while lookup blocks are accepted whole."""

    num_draft_tokens: int | None = None


@dataclass
class SuffixSettings:
    """Suffix decoding (methods/suffix.py), its settings named as vLLM names its suffix_decoding_*
    ones. Alone, or ahead of a draft model as `lookup` is: then its blocks are up to
    `num_draft_tokens` long (None: the model's)."""

    max_tree_depth: int = 24  # longest substring counted; matches are shorter
    max_cached_requests: int = 10000  # earlier requests' answers drafted from (0: none, this request only)
    max_spec_factor: float = 1.0  # draft tokens per matched token
    max_spec_offset: float = 0.0  # draft tokens beyond that
    min_token_prob: float = 0.1  # drafts stop where a token's estimated probability falls below this
    num_draft_tokens: int | None = None


@dataclass
class RecyclingSettings:
    """Token recycling (methods/recycling.py): `candidates` next tokens kept per token."""

    candidates: int = 8


@dataclass
class DraftSpec(ModelSpec):
    """A draft model (as a ModelSpec), or a drafter without one: n-gram lookup, suffix decoding or
    token recycling. A draft model with `lookup` (or `suffix`) drafts by prompt lookup (suffix
    decoding) where that finds a continuation, and with the model elsewhere."""

    ngram: NgramSettings | None = None
    lookup: LookupSettings | None = None
    suffix: SuffixSettings | None = None
    recycling: RecyclingSettings | None = None

    @property
    def has_model(self) -> bool:
        return self.checkpoint is not None or self.tiny is not None


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k truncation
    top_p: float = 1.0  # 1 means no nucleus truncation
    seed: int = 0


def parse_tree(text: str) -> TreeShape:
    """ "4,3,16" -> TreeShape(depth=4, top_k=3, max_nodes=16), checked."""
    try:
        depth, top_k, max_nodes = (int(v) for v in text.split(","))
    except ValueError:
        raise SpecdecError(f"--tree: expected DEPTH,TOP_K,MAX_NODES (e.g. 4,3,16), got {text!r}") from None
    shape = TreeShape(depth, top_k, max_nodes)
    check_tree(shape)
    return shape


def check_tree(shape: TreeShape) -> None:
    if shape.depth < 1 or shape.top_k < 1:
        raise SpecdecError(f"tree depth and top_k must be >= 1, got depth {shape.depth}, top_k {shape.top_k}")
    if not shape.depth <= shape.max_nodes <= shape.candidates:
        raise SpecdecError(
            f"tree max_nodes must be at least its depth ({shape.depth}) and at most the nodes drafted, top_k + "
            f"(depth - 1) top_k^2 = {shape.candidates}; got {shape.max_nodes}"
        )


@dataclass
class Schedule:
    """Draft tokens per block by batch size, for greedy and for sampled decoding: lists of
    [first batch size, last batch size, draft tokens], inclusive ranges as vLLM's
    `num_speculative_tokens_per_batch_size` (decoding/params.py, BatchSchedule); 0 drafts nothing.
    A block never drafts more than the chain's own length. None: always the chain's length."""

    greedy: list | None = None
    sampled: list | None = None


@dataclass
class Speculation:
    num_draft_tokens: int = 4  # tokens drafted per target forward (a chain); the papers' gamma
    # a draft model stops drafting a block at the first token it gives less than this probability
    # (in every row of a batch): unlikely drafts are mostly rejected, and each costs a draft step and
    # a wider verification. 0: always num_draft_tokens. The output stays exact either way.
    confidence_threshold: float = 0.0
    # how sampled drafts are verified: "token", each on its own (Leviathan et al.), or "block", together
    # (Sun et al. 2025). Both are exact; block keeps at least as many drafts on average. Greedy drafts
    # are kept while they equal the target's argmax either way.
    verification: str = "token"
    tree: TreeShape | None = None  # None: a chain of num_draft_tokens
    schedule: Schedule | None = None  # a chain's draft tokens by batch size (None: num_draft_tokens)
    # a loop benchmark, never exact (benchmark only): after the rule has run, each draft is kept with this
    # probability given the ones before it were, whatever the target says (vLLM's synthetic rejection
    # sampling); None: the rule decides
    synthetic_acceptance: float | None = None


@dataclass
class Generation:
    max_new_tokens: int = 128
    ignore_eos: bool = False  # keep generating past EOS (fixed-length benchmarks)


@dataclass
class Runtime:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # auto | float | int8 | int4: the linear layers' weights as products read them (loading/quantized.py);
    # auto: as the target's checkpoint ships them (int4 from a 4-bit GGUF) on a CPU, else float
    weights: str = "auto"
    threads: int | None = None  # CPU threads for torch; None keeps torch's default
    # off | on | auto (on where the device is a GPU): decoding forwards replay CUDA graphs
    # (decoding/graphs.py); off by default: no GPU run has measured them yet (docs/engine.md)
    cuda_graphs: str = "off"
    # with --engine vllm: vLLM's tensor and pipeline parallel sizes (GPUs per model copy, vLLM's own launch)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass
class Config:
    target: ModelSpec
    draft: DraftSpec
    name: str = "run"
    sampling: Sampling = field(default_factory=Sampling)
    speculation: Speculation = field(default_factory=Speculation)
    generation: Generation = field(default_factory=Generation)
    runtime: Runtime = field(default_factory=Runtime)
    source: str | None = None  # where the config was read from; not a YAML key

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe_drafting(self) -> str:
        """Draft lengths for titles: the tree's shape, or the model's length, where its threshold cuts it,
        and prompt lookup's."""
        if self.speculation.tree:
            return self.speculation.tree.describe()
        threshold, lookup = self.speculation.confidence_threshold, self.draft.lookup or self.draft.suffix
        fewer = f" (fewer below confidence {threshold:g})" if threshold else ""
        by = "prompt lookup" if self.draft.lookup else "suffix decoding"
        by_lookup = f", up to {lookup.num_draft_tokens} by {by}" if lookup and lookup.num_draft_tokens else ""
        schedule = self.batch_schedule(greedy=self.sampling.temperature == 0)
        by_batch = f"; by batch size {schedule.describe()}" if schedule else ""
        return f"{self.speculation.num_draft_tokens} draft tokens{fewer}{by_lookup}{by_batch}"

    def batch_schedule(self, greedy: bool) -> BatchSchedule | None:
        """The schedule of draft tokens by batch size for greedy or sampled decoding (None: none)."""
        schedule = self.speculation.schedule
        entries = schedule and (schedule.greedy if greedy else schedule.sampled)
        return BatchSchedule.parse(entries) if entries is not None else None

    def describe_verification(self) -> str:
        """The verification rule, for titles beside the draft lengths."""
        return f"{self.speculation.verification} verification"


def cache_dir() -> Path:
    """Where specdec keeps converted checkpoints and vLLM's environment."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")).expanduser()


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`, building nested dataclasses."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [t for t in typing.get_args(tp) if t is not type(None)]
        if value is None:
            return None
        return _convert(value, options[0], where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise SpecdecError(f"config: `{where}` must be a mapping, got {type(value).__name__}")
        return _build(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise SpecdecError(f"config: `{where}` must be {_type_name(tp)}, got {value!r}")
    return value


def _build(cls: type, data: dict, where: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = sorted(str(k) for k in set(data) - fields)  # YAML keys may be numbers or null too
    if unknown:
        prefix = f"{where}." if where else ""
        names = ", ".join(f"`{prefix}{k}`" for k in unknown)
        raise SpecdecError(f"config: unknown key {names} (known: {', '.join(sorted(fields))})")
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name in fields
        and f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise SpecdecError(f"config: missing `{missing[0]}`" + (f" in `{where}`" if where else ""))
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def parse_config(data: Any, source: str | None = None) -> Config:
    if not isinstance(data, dict):
        raise SpecdecError("config: the top level must be a mapping with `target` and `draft`")
    config = _build(Config, data, "")
    config.source = source
    validate(config)
    return config


def find_config(name_or_path: str | None) -> Path:
    """A path as given, or a name looked up in ./configs/ and then among the built-in configs."""
    name = name_or_path or DEFAULT_CONFIG
    path = Path(name).expanduser()
    if path.is_file():
        return path
    for folder in (Path("configs"), BUILTIN_CONFIGS):
        candidate = folder / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    builtin = ", ".join(sorted(p.stem for p in BUILTIN_CONFIGS.glob("*.yaml")))
    raise SpecdecError(f"config not found: {name} (not a file, nor a name in ./configs/ or built in: {builtin})")


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (which it would read as the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                if key.value in seen:
                    raise yaml.MarkedYAMLError(problem=f"duplicate key {key.value!r}", problem_mark=key.start_mark)
                seen.add(key.value)
        return super().construct_mapping(node, deep)


def load_config(name_or_path: str | None) -> Config:
    path = find_config(name_or_path)
    try:
        data = yaml.load(read_text("config", path), Loader=UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SpecdecError(f"config {path}: malformed YAML{at}: {problem}") from None
    config = parse_config(data, source=str(path))
    for spec in (config.target, config.draft):
        local = spec.checkpoint and local_path(spec.checkpoint, path.parent)
        if local:
            spec.checkpoint = str(local)
    return config


def local_path(name: str, folder: Path) -> Path | None:
    """The path a checkpoint name means, relative to `folder` (a config's), or None for a name that is
    no path: a built-in name, or a hub id (`owner/name` where no `owner` folder is here or in the
    working directory). A name that exists there, starts with `.`, `/` or `~`, has more than one `/`
    or ends with `.gguf` is a path."""
    path = (folder / Path(name).expanduser()).resolve()
    owner = name.split("/")[0] if name.count("/") == 1 else None
    if (
        path.exists()
        or name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or name.endswith(".gguf")
        or owner
        and any((base / owner).is_dir() for base in (folder, Path.cwd()))
    ):
        return path
    return None


def apply_overrides(config: Config, overrides: dict[str, Any]) -> Config:
    """Set `section.key` values given on the command line. None means "flag not given"; 0 and False
    are real values and do override the YAML."""
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, key = dotted.split(".")
        setattr(getattr(config, section), key, value)
    validate(config)
    return config


MAX_DRAFT_TOKENS = 256  # tokens one target forward verifies, at most
INT_LIMIT = 2**62  # torch's sizes and seeds are 64-bit integers, and sums of two settings must stay so
TINY_PARAMETERS = 2**30  # a tiny model is for tests and smoke runs: 4 GiB in float32 at most
BYTE_VOCAB = 258  # the byte tokenizer's (loading/checkpoints.py), which tiny models use
TINY_SIZES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_position_embeddings")


def validate(config: Config) -> None:
    """Range checks that types alone do not catch. Runs after overrides, so flags are checked too."""
    check_sampling(config.sampling)
    check_speculation(config)
    if config.generation.max_new_tokens < 1:
        raise SpecdecError(f"max_new_tokens must be >= 1, got {config.generation.max_new_tokens}")
    check_runtime(config.runtime)
    check_sources(config)
    check_drafters(config.draft, config.speculation.tree)
    check_ints(config)  # the settings no check above bounds


def check_sampling(s: Sampling) -> None:
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise SpecdecError(f"temperature must be a finite number >= 0 (0 is greedy), got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise SpecdecError(f"top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise SpecdecError(f"top_k must be >= 0 (0 disables it), got {s.top_k}")


def check_speculation(config: Config) -> None:
    """Draft lengths (the chain's and those of the drafters ahead of a model), the threshold, the rule,
    the tree and the schedule."""
    draft, speculation = config.draft, config.speculation
    for name, tokens in (
        ("num_draft_tokens", speculation.num_draft_tokens),
        ("lookup num_draft_tokens", draft.lookup.num_draft_tokens if draft.lookup else None),
        ("suffix num_draft_tokens", draft.suffix.num_draft_tokens if draft.suffix else None),
    ):
        if tokens is not None and not 1 <= tokens <= MAX_DRAFT_TOKENS:
            raise SpecdecError(f"{name} must be between 1 and {MAX_DRAFT_TOKENS}, got {tokens}")
    if not 0 <= speculation.confidence_threshold < 1:
        raise SpecdecError(
            f"confidence_threshold must be in [0, 1) (0 always drafts), got {speculation.confidence_threshold}"
        )
    if speculation.verification not in VERIFICATIONS:
        raise SpecdecError(f"verification must be token or block, got {speculation.verification!r}")
    if speculation.tree:
        check_tree(speculation.tree)
    check_schedule(config)
    if speculation.tree and speculation.verification == "block":
        raise SpecdecError("block verification judges a chain; a tree has its own rule: set verification: token")
    synthetic = speculation.synthetic_acceptance
    if synthetic is not None and not (0 <= synthetic <= 1):  # also refuses NaN
        raise SpecdecError(f"synthetic_acceptance must be in [0, 1], got {synthetic}")
    if synthetic is not None and speculation.tree:
        raise SpecdecError("synthetic_acceptance draws a chain's acceptances; a tree has its own rule: drop one")


def check_runtime(r: Runtime) -> None:
    if r.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise SpecdecError(f"dtype must be auto, float32, bfloat16 or float16, got {r.dtype!r}")
    if r.cuda_graphs not in ("off", "on", "auto"):
        raise SpecdecError(f"cuda_graphs must be off, on or auto, got {r.cuda_graphs!r}")
    if r.weights not in WEIGHTS:
        raise SpecdecError(f"weights must be {', '.join(WEIGHTS[:-1])} or {WEIGHTS[-1]}, got {r.weights!r}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", r.device):
        raise SpecdecError(f"device must be auto, cpu, cuda or cuda:N, got {r.device!r}")
    cpus = os.cpu_count() or 1
    if r.threads is not None and not 1 <= r.threads <= cpus:
        raise SpecdecError(f"threads must be between 1 and {cpus} (the CPUs of this machine), got {r.threads}")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(r, name) < 1:
            raise SpecdecError(f"runtime.{name} must be >= 1, got {getattr(r, name)}")


def check_sources(config: Config) -> None:
    """Exactly one source for the target (a checkpoint or a tiny model) and for the draft."""
    for role, spec in (("target", config.target), ("draft", config.draft)):
        sources = [s for s in ("checkpoint", "tiny", "ngram", "recycling") if getattr(spec, s, None) is not None]
        allowed = (
            "`checkpoint`, `tiny`, `ngram`, `suffix` or `recycling`" if role == "draft" else "`checkpoint` or `tiny`"
        )
        if role == "draft" and spec.suffix is not None and not sources:
            sources = ["suffix"]  # suffix decoding alone
        if len(sources) != 1:
            raise SpecdecError(f"config: `{role}` needs exactly one of {allowed}, got {sources or 'none'}")
        if spec.checkpoint is not None and not spec.checkpoint.strip():
            raise SpecdecError(f"config: `{role}.checkpoint` is empty")
        if spec.tiny is not None:
            check_tiny(spec.tiny, f"{role}.tiny")


def check_drafters(draft: DraftSpec, tree: TreeShape | None) -> None:
    """The training-free drafters' settings, and which of them go together."""
    for name in ("ngram", "lookup"):
        sizes = getattr(draft, name)
        if sizes and not 1 <= sizes.min_n <= sizes.max_n:
            raise SpecdecError(f"{name} sizes need 1 <= min_n <= max_n, got {sizes.min_n}..{sizes.max_n}")
    if draft.lookup and not draft.has_model:
        raise SpecdecError("config: `draft.lookup` goes with a draft model (`checkpoint` or `tiny`)")
    if draft.suffix and draft.lookup:
        raise SpecdecError("config: one drafter ahead of a draft model: `draft.suffix` or `draft.lookup`")
    if draft.suffix and not draft.has_model and (draft.ngram or draft.recycling):
        raise SpecdecError(
            "config: `draft.suffix` drafts alone or ahead of a draft model, not with `ngram` or `recycling`"
        )
    check_suffix(draft.suffix)
    if draft.recycling and draft.recycling.candidates < 1:
        raise SpecdecError(f"recycling candidates must be >= 1, got {draft.recycling.candidates}")
    if draft.recycling and tree and tree.top_k > draft.recycling.candidates:
        raise SpecdecError(
            f"a token recycling tree takes its children from the {draft.recycling.candidates} candidates "
            f"kept per token: tree top_k {tree.top_k} is more"
        )


def longest_block(config: Config) -> int:
    """The most draft tokens a block of the config's chain drafts: the model's, or lookup's ahead of it."""
    ahead = config.draft.lookup or config.draft.suffix
    return max(config.speculation.num_draft_tokens, (ahead and ahead.num_draft_tokens) or 0)


def check_schedule(config: Config) -> None:
    schedule = config.speculation.schedule
    if schedule is None:
        return
    if config.speculation.tree:
        raise SpecdecError("speculation.schedule sets a chain's length by batch size: drop it or the tree")
    longest = longest_block(config)
    for mode in ("greedy", "sampled"):
        try:
            parsed = config.batch_schedule(mode == "greedy")
        except ValueError as exc:
            raise SpecdecError(f"speculation.schedule.{mode}: {exc}") from None
        if parsed and parsed.most > longest:
            raise SpecdecError(
                f"speculation.schedule.{mode}: {parsed.most} draft tokens is more than the chain's {longest} "
                "(num_draft_tokens): a schedule shortens blocks"
            )


def check_suffix(suffix: SuffixSettings | None) -> None:
    if suffix is None:
        return
    if suffix.max_tree_depth < 2:
        raise SpecdecError(
            f"suffix max_tree_depth must be >= 2 (a match and a token after it), got {suffix.max_tree_depth}"
        )
    if suffix.max_cached_requests < 0:
        raise SpecdecError(f"suffix max_cached_requests must be >= 0 (0: none), got {suffix.max_cached_requests}")
    if not (math.isfinite(suffix.max_spec_factor) and suffix.max_spec_factor >= 0):
        raise SpecdecError(f"suffix max_spec_factor must be a finite number >= 0, got {suffix.max_spec_factor}")
    if not math.isfinite(suffix.max_spec_offset):
        raise SpecdecError(f"suffix max_spec_offset must be a finite number, got {suffix.max_spec_offset}")
    if not 0 <= suffix.min_token_prob <= 1:
        raise SpecdecError(f"suffix min_token_prob must be in [0, 1], got {suffix.min_token_prob}")


def check_ints(settings: Any, where: str = "") -> None:
    """Every integer setting, however deep, within +-INT_LIMIT."""
    for f in dataclasses.fields(settings):
        value, key = getattr(settings, f.name), f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            check_ints(value, key)
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= INT_LIMIT:
            raise SpecdecError(f"`{key}` must be between -2**62 and 2**62, got {value}")


def check_tiny(tiny: TinyModel, where: str) -> None:
    """What transformers needs of a Llama config (it divides the width into heads of an even width,
    rotated in pairs, and the heads into key/value groups) and a finite init."""
    for name in TINY_SIZES:
        if getattr(tiny, name) < 1:
            raise SpecdecError(f"config: `{where}.{name}` must be >= 1, got {getattr(tiny, name)}")
    for whole, part in (("hidden_size", "num_heads"), ("num_heads", "num_kv_heads")):
        if getattr(tiny, whole) % getattr(tiny, part):
            raise SpecdecError(
                f"config: `{where}.{whole}` ({getattr(tiny, whole)}) must be a multiple of `{part}` "
                f"({getattr(tiny, part)})"
            )
    width, layer = tiny.hidden_size, 4 * tiny.hidden_size**2 + 3 * tiny.hidden_size * tiny.intermediate_size
    parameters = tiny.num_layers * layer + 2 * BYTE_VOCAB * width  # at most: k/v may be narrower
    if parameters > TINY_PARAMETERS:  # layer after small layer would be built until memory ran out
        raise SpecdecError(f"config: `{where}` is no tiny model: {parameters:.2g} parameters (at most 2**30)")
    if tiny.hidden_size // tiny.num_heads % 2:
        raise SpecdecError(
            f"config: `{where}` heads are {tiny.hidden_size // tiny.num_heads} wide (hidden_size / num_heads): "
            f"rotary embeddings need an even width"
        )
    if not 0 <= tiny.init_std <= 1:
        raise SpecdecError(f"config: `{where}.init_std` must be in [0, 1], got {tiny.init_std}")
    if not math.isfinite(tiny.noise) or tiny.noise < 0:
        raise SpecdecError(f"config: `{where}.noise` must be a finite number >= 0, got {tiny.noise}")
