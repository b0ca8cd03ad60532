"""Peers measured in the same run as specdec: transformers' own assisted generation (`--peer hf`).

How it is kept fair is report.PEER_FAIRNESS, printed under the peer table.
"""

from __future__ import annotations

import time

import torch
import transformers
from transformers import GenerationConfig

from specdec_cli.bench.measure import Measure, TurnGenerator
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.errors import SpecdecError
from specdec_cli.models.pair import Pair
from specdec_cli.decoding.params import SamplingParams

def hf_generator(pair: Pair, params: SamplingParams, gamma: int, max_new_tokens: int,
                 ignore_eos: bool) -> TurnGenerator:
    """generate() with an assistant model, or prompt lookup when the config drafts with n-grams;
    gamma 0 is plain generate() (target alone)."""
    transformers.utils.logging.set_verbosity_error()  # assisted generate() warns about its own internal calls
    model = pair.target.model
    eos = sorted(pair.eos_token_ids)
    settings = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": max_new_tokens if ignore_eos else 0,  # suppressing EOS until the limit = ignore it
        "eos_token_id": eos, "pad_token_id": eos[0] if eos else 0,
        "do_sample": not params.greedy,
    }
    if not params.greedy:
        # explicit values even when they disable a warper: generate() fills unset ones with its own
        # defaults (top_k 50), which would sample from a different distribution than specdec
        settings.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    extra = {}
    if gamma and isinstance(pair.drafter, NgramDrafter):
        settings.update(prompt_lookup_num_tokens=gamma, max_matching_ngram_size=pair.drafter.max_n)
    elif gamma and pair.drafter.reads_target_states:
        raise SpecdecError("--peer hf: transformers' assisted generation cannot run a feature draft (one that "
                           "reads the target's hidden states, as `specdec distill` makes); compare against a "
                           "config with a standalone draft model or an n-gram drafter")
    elif gamma:
        assistant = pair.drafter.model.model
        # transformers 5 reads the assistant's knobs from its own generation config
        assistant.generation_config.num_assistant_tokens = gamma
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0  # never stop drafting early
        extra["assistant_model"] = assistant
    config = GenerationConfig(**settings)

    def generate(prompt_ids: list[int], seed: int) -> tuple[list[int], Measure]:
        torch.manual_seed(seed)
        input_ids = torch.tensor([prompt_ids], device=pair.device)
        start = time.perf_counter()
        with torch.inference_mode():
            output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    generation_config=config, **extra)
        if pair.device.type == "cuda":
            torch.cuda.synchronize(pair.device)
        seconds = time.perf_counter() - start
        new = output[0, len(prompt_ids):].tolist()
        return new, Measure(len(new), None, seconds)

    return generate
