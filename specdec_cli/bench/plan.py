"""What a benchmark runs: the modes (who generates, temperature, num_draft_tokens or tree), settings,
and the prompts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from specdec_cli.bench.prompts import Prompt, builtin_suite, load_prompts, select
from specdec_cli.bench.report import drafting_label, rule_label, temperature_label
from specdec_cli.config import VERIFICATIONS, Config
from specdec_cli.decoding.params import SamplingParams, TreeShape
from specdec_cli.errors import SpecdecError

SPECDEC, HF, VLLM = "specdec", "hf", "vllm"  # engines; HF alone is transformers' plain generate()
LLAMACPP = "llamacpp"  # llama.cpp through llama-cpp-python
HF_ASSISTED, HF_LOOKUP = "hf assisted", "hf prompt lookup"  # the hf peer's speculative engines
LLAMACPP_LOOKUP = "llamacpp prompt lookup"  # llama.cpp's speculative engine
PEERS = (HF, VLLM, LLAMACPP)
ENGINE_PEERS = (VLLM, LLAMACPP)  # peers in environments and processes of their own: an engine per num_draft_tokens
QUICK_LIMIT = 1  # prompts per category of the built-in suite when neither --prompts nor --limit is given


@dataclass(frozen=True)
class Mode:
    """What one run measures: who generates, at which temperature, with how many draft tokens (a
    chain's, or a tree's depth), verified by which rule."""

    temperature: float
    num_draft_tokens: int  # 0: target alone
    engine: str = SPECDEC
    tree: TreeShape | None = None  # a draft tree of this shape instead of a chain
    verification: str = "token"  # "block": a sampled chain verified as a block

    @property
    def label(self) -> str:
        who = "" if self.engine == SPECDEC else f"{self.engine} "
        tree = self.tree.spec if self.tree else None
        kind = (
            "target only"
            if self.num_draft_tokens == 0
            else f"speculative {drafting_label(self.num_draft_tokens, tree)}"
        )
        return f"{who}{kind}, {temperature_label(self.temperature)}{rule_label(self.verification)}"


@dataclass
class Plan:
    temperatures: list[float]
    num_draft_tokens_list: list[int]
    max_new_tokens: int
    repeats: int
    warmup: int
    ignore_eos: bool
    seed: int
    top_k: int
    top_p: float
    peer: str | None = None
    # the peer's speculative engine, chosen once the models are loaded (None: the peer runs the target alone)
    peer_engine: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # > 1: specdec also decodes prompts together
    trees: list[TreeShape] = field(default_factory=list)  # draft trees, measured beside the chains
    verifications: list[str] = field(default_factory=lambda: ["token"])  # the rules of the sampled chains
    engine: str = SPECDEC  # who runs the config: specdec's loop, or vLLM (--engine vllm)
    synthetic_acceptance: float | None = None  # a loop benchmark: drafts kept by chance (never exact)
    context_lengths: list[int] = field(default_factory=list)  # also after documents of these many tokens

    def params(self, temperature: float) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_k=self.top_k, top_p=self.top_p)

    def specdec_modes(self, temperature: float) -> list[Mode]:
        """The target alone, each chain (sampled: under each rule) and each tree at one temperature. Greedy
        verification is the same under both rules, and a tree has its own: they run once."""
        rules = self.verifications if temperature > 0 else ["token"]
        chains = [Mode(temperature, g, verification=rule) for g in self.num_draft_tokens_list for rule in rules]
        return [Mode(temperature, 0)] + chains + [Mode(temperature, shape.depth, tree=shape) for shape in self.trees]

    def batched(self, modes: list[Mode]) -> list[tuple[int, Mode]]:
        """(batch size, mode) for every batch size above 1 and each of `modes`."""
        return [(size, mode) for size in self.batch_sizes if size > 1 for mode in modes]

    def batch_modes(self) -> list[tuple[int, Mode]]:
        """specdec's batched runs: target-only, each num_draft_tokens and each tree per temperature, and the hf
        peer's plain batched generate() (transformers' speculative decoding refuses batches)."""
        return self.batched([m for t in self.temperatures for m in self.specdec_modes(t) + self.hf_alone(t)])

    def hf_alone(self, temperature: float) -> list[Mode]:
        return [Mode(temperature, 0, HF)] if self.peer == HF else []

    def modes(self) -> list[Mode]:
        """specdec's modes per temperature: the baseline first, then each num_draft_tokens and each tree, then the hf
        peer alone and its run of each num_draft_tokens. None when vLLM runs the config; vLLM's and llama.cpp's modes
        run apart, one engine at a time (engine_modes)."""
        if self.engine == VLLM:
            return []
        modes = []
        for t in self.temperatures:
            modes += self.specdec_modes(t) + self.hf_alone(t)
            modes += [Mode(t, g, self.peer_engine) for g in self.num_draft_tokens_list] if self.peer == HF else []
        return modes

    def engine_modes(self) -> dict[int, list[Mode]]:
        """The modes of vLLM (as the engine or the peer) or llama.cpp (the peer) by num_draft_tokens (an engine
        each; 0: the target alone), every temperature in each: every num_draft_tokens where vLLM runs the
        config, the peer's where it drafts."""
        if self.engine == VLLM:
            alone, drafting = VLLM, VLLM
        elif self.peer in ENGINE_PEERS:
            alone, drafting = self.peer, self.peer_engine
        else:
            return {}
        engines = {0: alone} | {g: drafting for g in self.num_draft_tokens_list if drafting}
        return {g: [Mode(t, g, engine) for t in self.temperatures] for g, engine in engines.items()}


def parse_list(text: str | None, kind: type, option: str) -> list | None:
    """ "1,2,4" -> [1, 2, 4]; None when the option was not given."""
    if text is None:
        return None
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SpecdecError(f"{option}: expected comma-separated {kind.__name__} values, got {text!r}") from None
    if not values:
        raise SpecdecError(f"{option}: no values given")
    return list(dict.fromkeys(values))  # drop repeats, keep order


def make_plan(
    cfg: Config,
    num_draft_tokens_list: list[int] | None,
    temperatures: list[float] | None,
    repeats: int,
    warmup: int,
    peer: str | None,
    batch_sizes: list[int] | None = None,
    trees: list[TreeShape] | None = None,
    verifications: list[str] | None = None,
    engine: str = SPECDEC,
    context_lengths: list[int] | None = None,
) -> Plan:
    """Defaults: the config's num_draft_tokens, and its tree if it has one (a chain and a tree side by side); greedy
    and the config's temperature (1.0 if the config is greedy); the config's verification rule. vLLM
    (engine) drafts chains and verifies token by token: a tree or block rule, asked for or in the
    config, is refused."""
    s = cfg.sampling
    plan = Plan(
        temperatures or list(dict.fromkeys([0.0, s.temperature or 1.0])),
        num_draft_tokens_list or [cfg.speculation.num_draft_tokens],
        cfg.generation.max_new_tokens,
        repeats,
        warmup,
        cfg.generation.ignore_eos,
        s.seed,
        s.top_k,
        s.top_p,
        peer,
        batch_sizes=sorted(set([1] + (batch_sizes or []))),  # batch 1 is always measured: the sizes compare to it
        trees=list(dict.fromkeys(trees or ([cfg.speculation.tree] if cfg.speculation.tree else []))),
        verifications=verifications or [cfg.speculation.verification],
        engine=engine,
        synthetic_acceptance=cfg.speculation.synthetic_acceptance,
        context_lengths=context_lengths or [],
    )
    check_plan(plan)
    return plan


def check_plan(plan: Plan) -> None:
    """Refuse, before any work, values out of range and what cannot run together."""
    if min(plan.num_draft_tokens_list) < 1:
        raise SpecdecError(f"--num-draft-tokens-list values must be >= 1, got {plan.num_draft_tokens_list}")
    if not all(math.isfinite(t) and t >= 0 for t in plan.temperatures):
        raise SpecdecError(f"--temperatures must be finite numbers >= 0 (0 is greedy), got {plan.temperatures}")
    if plan.engine == VLLM:
        if plan.context_lengths:
            raise SpecdecError("--context-lengths runs specdec's loop; with --engine vllm nothing runs in it")
        if plan.peer is not None:
            raise SpecdecError("--peer sets a peer beside specdec's loop; with --engine vllm nothing runs in it")
        if plan.trees or plan.verifications != ["token"]:
            raise SpecdecError(
                "--engine vllm drafts chains verified token by token: no tree, no block rule (--tree, "
                "--verification, or the config's speculation.tree and verification)"
            )
    if not set(plan.verifications) <= set(VERIFICATIONS):
        got = ",".join(plan.verifications)
        raise SpecdecError(f"--verification takes token, block or both (token,block), got {got}")
    if plan.repeats < 1 or plan.warmup < 0:
        raise SpecdecError("--repeats must be >= 1 and --warmup >= 0")
    if plan.peer is not None and plan.peer not in PEERS:
        raise SpecdecError(f"unknown --peer {plan.peer!r}; known: {', '.join(PEERS)}")
    if plan.batch_sizes[0] < 1:
        raise SpecdecError(f"--batch-sizes must be >= 1, got {plan.batch_sizes}")
    if plan.synthetic_acceptance is not None and (plan.peer or plan.engine != SPECDEC or plan.trees):
        raise SpecdecError(
            "--synthetic-acceptance measures specdec's own loop on chains: no --peer, --engine vllm or tree"
        )
    if plan.peer == LLAMACPP and len(plan.batch_sizes) > 1:
        raise SpecdecError(
            "--peer llamacpp decodes one prompt at a time (llama-cpp-python has no batches): batch size 1"
        )


def choose_prompts(path: Path | None, category: str | None, limit: int | None) -> list[Prompt]:
    if path is None:
        return select(builtin_suite(), category, limit or QUICK_LIMIT)
    return select(load_prompts(path), category, limit)
