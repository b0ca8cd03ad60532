"""What specdec's config means in vLLM: the engine's arguments, its speculative_config, its sampling,
and its per-request speculative decoding metrics as specdec's step records."""

from __future__ import annotations

from specdec_cli.config import Config, DraftSpec
from specdec_cli.decoding.engine import GenerationResult
from specdec_cli.decoding.metrics import StepRecord
from specdec_cli.decoding.params import BatchSchedule, SamplingParams
from specdec_cli.errors import SpecdecError
from specdec_cli.loading.checkpoints import model_folder
from specdec_cli.methods import registry


def vllm_schedule(cfg: Config, temperatures: list[float]) -> BatchSchedule | None:
    """The config's draft tokens by batch size at these temperatures: one vLLM engine serves them all,
    so they must share one schedule."""
    schedules = {cfg.batch_schedule(greedy=t == 0) for t in temperatures}
    if len(schedules) > 1:
        raise SpecdecError(
            "vLLM takes one speculation.schedule for every temperature: give `greedy` and `sampled` the same "
            "ranges, or run greedy and sampled apart"
        )
    return schedules.pop()


def speculative_config(draft: DraftSpec, num_draft_tokens: int, schedule: BatchSchedule | None = None) -> dict:
    """vLLM's speculative_config for the config's draft drafting `num_draft_tokens` tokens per block (by batch size
    where a schedule says so: vLLM's `num_speculative_tokens_per_batch_size`); a draft vLLM has no
    counterpart of is a SpecdecError that says so."""
    speculative = registry.vllm_config(draft, num_draft_tokens)
    if schedule is not None:
        speculative["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in schedule.ranges]
    return speculative


def engine_settings(cfg: Config, dtype: str, speculative: dict | None) -> dict:
    """vllm.LLM's arguments: the config's target in `dtype`; prompts arrive as token ids (specdec's chat
    template), so vLLM loads no tokenizer, and no generation_config defaults (specdec applies none)."""
    settings = {
        "model": model_folder(cfg.target),
        "dtype": dtype,
        "seed": cfg.sampling.seed,
        "skip_tokenizer_init": True,
        "generation_config": "vllm",
        "disable_log_stats": False,  # get_metrics() counts only with stats on
        "trust_remote_code": cfg.target.trust_remote_code,
        "tensor_parallel_size": cfg.runtime.tensor_parallel_size,
        "pipeline_parallel_size": cfg.runtime.pipeline_parallel_size,
    }
    if cfg.target.revision:
        settings["revision"] = cfg.target.revision
    if speculative:
        settings.update(speculative_config=speculative, per_request_spec_decode_metrics="detailed")
    return settings


def sampling(params: SamplingParams, seed: int, max_tokens: int, eos_token_ids: set[int], ignore_eos: bool) -> dict:
    """vllm.SamplingParams' arguments for specdec's sampling; specdec's EOS ids are the stop tokens."""
    return {
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "seed": seed,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "stop_token_ids": [] if ignore_eos else sorted(eos_token_ids),
    }


def vllm_steps(spec_decode: dict | None, new_tokens: int) -> list[StepRecord]:
    """A request's target forwards as specdec's step records, from vLLM's per-step drafted and accepted
    counts (its verification steps; it lists no step that drafted nothing). Every forward emits its
    accepted drafts and one token, so the forwards that drafted nothing (prefill's, an n-gram miss) are
    the tokens left over; the last step gives back what the token limit or EOS cut off."""
    spec_decode = spec_decode or {}
    pairs = list(zip(spec_decode.get("per_step_drafted", []), spec_decode.get("per_step_accepted", [])))
    steps = [StepRecord(drafted, accepted, accepted + 1, 0.0, 0.0) for drafted, accepted in pairs]
    left = new_tokens - sum(s.emitted for s in steps)
    if left < 0:
        last = steps[-1]
        steps[-1] = StepRecord(last.drafted, last.accepted, last.emitted + left, 0.0, 0.0)
    return steps + [StepRecord(0, 0, 1, 0.0, 0.0)] * max(left, 0)


def generation_results(
    prompts: list[list[int]], reply: dict, eos_token_ids: set[int], ignore_eos: bool
) -> list[GenerationResult]:
    """The worker's reply to one call as specdec's results, a row per prompt; every row's time is the
    call's, end to end (vLLM schedules the rows together and does not time prefill apart)."""
    results = []
    for ids, output in zip(prompts, reply["outputs"]):
        tokens = output["token_ids"]
        stop = "eos" if tokens and tokens[-1] in eos_token_ids and not ignore_eos else "length"
        steps = vllm_steps(output["spec_decode"], len(tokens))
        results.append(GenerationResult(ids, tokens, steps, decode_seconds=reply["seconds"], stop_reason=stop))
    return results


def environment(cfg: Config, dtype: str, version: str, device: str) -> dict:
    """A record's `environment` for a run in vLLM: its version and build, dtype and parallel layout. No data
    parallel size: vllm.LLM refuses data_parallel_size > 1 in one process (it takes vLLM's own
    multi-process launch), so a config runs as one model copy."""
    return {
        "engine": "vllm",
        "vllm": version,
        "vllm_device": device,
        "dtype": dtype,
        "tensor_parallel_size": cfg.runtime.tensor_parallel_size,
        "pipeline_parallel_size": cfg.runtime.pipeline_parallel_size,
    }
