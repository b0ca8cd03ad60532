"""llama.cpp as a benchmark's peer (`--peer llamacpp`): the target's GGUF file as it ships, in
llama-cpp-python's own environment and process (llamacpp_engine/), the target alone and with its
prompt lookup, on the same prompt ids and sampling as specdec's loop, an engine per num_draft_tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_cli.bench.measure import Measure, TurnGenerator
from specdec_cli.bench.plan import LLAMACPP_LOOKUP, Mode, Plan
from specdec_cli.bench.prompts import Prompt
from specdec_cli.bench.run import OnRun, run_benchmark
from specdec_cli.config import NgramSettings
from specdec_cli.decoding.metrics import StepRecord
from specdec_cli.llamacpp_engine.client import LlamacppWorker
from specdec_cli.loading.checkpoints import gguf_file
from specdec_cli.methods import registry
from specdec_cli.pair import Pair

CONTEXT = 4096  # llama.cpp's context: prompts and answers of a benchmark fit in it

LLAMACPP_FAIRNESS = (
    "llama.cpp runs in its own environment and process (llama-cpp-python {version}, built on this machine) "
    "from the target's GGUF file as it ships ({gguf}), with {threads} threads; its weight buffers: {buffers}. "
    "specdec runs its {weights} weights. Both get the same token ids (specdec's chat template), "
    "max_new_tokens, EOS ids, sampling settings and warm-up; llama.cpp's min_p and penalties are off and "
    "its random numbers its own (sampled tokens differ, their distribution does not). Both time the "
    "prompt but its last token apart, as prefill. llama.cpp's prompt lookup (llama-cpp-python's "
    "LlamaPromptLookupDecoding, n-grams up to max_n = {max_n}) samples the target at each drafted "
    "position and keeps drafts while they equal what it sampled, exact for a drafter without randomness. "
    "acc len is specdec's definition for both: tokens per target forward."
)


def llamacpp_peer_engine(pair: Pair) -> tuple[str, str | None]:
    """llama.cpp's speculative engine, and why it is not the config's drafter (None when it is)."""
    if registry.drafting(pair.config.draft)[0].engines_lookup:
        return LLAMACPP_LOOKUP, None
    return LLAMACPP_LOOKUP, (
        f"llama-cpp-python drafts by prompt lookup only, not by specdec's {registry.describe(pair.config.draft)}: the "
        f"llamacpp peer runs its target alone and its prompt lookup."
    )


def max_n(pair: Pair) -> int:
    return (pair.config.draft.ngram or pair.lookup or NgramSettings()).max_n


def engine_settings(pair: Pair, num_draft_tokens: int) -> dict:
    return {
        "gguf": str(gguf_file(pair.config.target)),
        "context": CONTEXT,
        "threads": torch.get_num_threads(),  # the runtime's, set at load
        "lookup_tokens": num_draft_tokens,
        "max_n": max_n(pair),
    }


def llamacpp_generator(
    worker: LlamacppWorker, pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int
) -> TurnGenerator:
    params = plan.params(mode.temperature)
    sampling = {"temp": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "min_p": 0.0}
    eos = [] if plan.ignore_eos else sorted(pair.eos_token_ids)

    def generate(prompt_ids: list[int], seed: int) -> tuple[list[int], Measure]:
        request = {"sampling": sampling, "seed": seed, "eos": eos, "max_new_tokens": max_new_tokens}
        reply = worker.generate(prompt_ids, request)
        tokens = reply["token_ids"]
        steps = [StepRecord(drafted, accepted, emitted, 0.0, 0.0) for drafted, accepted, emitted in reply["steps"]]
        return tokens, Measure(len(tokens), reply["prefill_seconds"], reply["decode_seconds"], steps, tokens)

    return generate


@dataclass
class LlamacppRuns:
    runs: list[dict]
    partial: bool
    version: str
    caption: str  # LLAMACPP_FAIRNESS filled in


def run_llamacpp(pair: Pair, prompts: list[Prompt], plan: Plan, on_run: OnRun | None = None) -> LlamacppRuns:
    """llama.cpp's modes of the plan, one worker per num_draft_tokens (0: the target alone)."""
    done, buffers = LlamacppRuns([], False, "", ""), {}
    for num_draft_tokens, modes in plan.engine_modes().items():
        settings = engine_settings(pair, num_draft_tokens)
        with LlamacppWorker(settings) as worker:

            def make(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> TurnGenerator:
                return llamacpp_generator(worker, pair, mode, plan, max_new_tokens)

            runs, done.partial = run_benchmark(pair, prompts, plan, on_run, modes, make)
            done.runs += runs
            done.version = worker.version
            buffers[f"γ={num_draft_tokens}" if num_draft_tokens else "target alone"] = worker.buffers
        if done.partial:
            break
    done.caption = LLAMACPP_FAIRNESS.format(
        version=done.version,
        gguf=settings["gguf"],
        threads=settings["threads"],
        buffers="; ".join(f"{engine} {kind}" for engine, kind in buffers.items()),
        weights=pair.describe()["weights"],
        max_n=settings["max_n"],
    )
    return done
