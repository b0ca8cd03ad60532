"""The vllm peer (`--peer vllm`): the same prompts, as the same token ids, and the same sampling through
vLLM, the target alone and with the config's draft as vLLM's speculative_config, one engine (a worker
process, vllm_engine/) at a time. Its per-request metrics become specdec's step records, so the
summary's definitions apply to both sides."""

from __future__ import annotations

from specdec_cli.bench.measure import Measure, TurnGenerator
from specdec_cli.bench.plan import VLLM, Mode, Plan
from specdec_cli.bench.prompts import Prompt
from specdec_cli.bench.run import OnRun, run_benchmark
from specdec_cli.errors import SpecdecError
from specdec_cli.models.pair import Pair
from specdec_cli.vllm_engine.client import VllmWorker
from specdec_cli.vllm_engine.settings import engine_settings, sampling, speculative_config, vllm_steps

VLLM_FAIRNESS = (
    "vLLM runs in its own environment and process (its scheduler, kernels and build, its own random "
    "numbers: sampled tokens differ from specdec's, their distribution does not), loading the target from "
    "the same folder in the same dtype; it gets the same token ids (specdec's chat template), "
    "max_new_tokens, EOS ids, sampling settings and seed, and the same warm-up. Each call is timed end to "
    "end (prefill + decode), specdec's side too. vLLM's n-gram drafter is its own (longest match of "
    "prompt_lookup_max down to prompt_lookup_min tokens). acc len is specdec's definition for both: tokens "
    "per target forward, vLLM's taken from its per-request counts as new tokens / (new tokens - accepted "
    "drafts)."
)


def vllm_drafting(pair: Pair, gammas: list[int]) -> tuple[str | None, str | None]:
    """The vllm peer's speculative engine (None: the target alone) and why it cannot draft (None when it can)."""
    try:
        speculative_config(pair.config.draft, gammas[0])
    except SpecdecError as exc:
        return None, f"{exc}; the vllm peer runs the target alone."
    return VLLM, None


def vllm_generator(worker: VllmWorker, pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> TurnGenerator:
    params = plan.params(mode.temperature)

    def generate(prompt_ids: list[int], seed: int) -> tuple[list[int], Measure]:
        settings = sampling(params, seed, max_new_tokens, pair.eos_token_ids, plan.ignore_eos)
        reply = worker.generate([prompt_ids], settings)
        output = reply["outputs"][0]
        tokens = output["token_ids"]
        steps = vllm_steps(output["spec_decode"], len(tokens))
        return tokens, Measure(len(tokens), None, reply["seconds"], steps, tokens)

    return generate


def run_vllm(
    pair: Pair, prompts: list[Prompt], plan: Plan, on_run: OnRun | None = None
) -> tuple[list[dict], bool, str]:
    """Every vLLM mode of the plan, an engine per gamma. Returns (runs, partial, vLLM's version)."""
    runs, version = [], ""
    dtype = str(pair.dtype).removeprefix("torch.")
    for gamma, modes in plan.vllm_modes().items():
        speculative = speculative_config(pair.config.draft, gamma) if gamma else None
        with VllmWorker(engine_settings(pair.config, dtype, speculative)) as worker:
            version = worker.version

            def make(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> TurnGenerator:
                return vllm_generator(worker, pair, mode, plan, max_new_tokens)

            done, partial = run_benchmark(pair, prompts, plan, on_run, modes, make)
        runs += done
        if partial:
            return runs, True, version
    return runs, False, version
