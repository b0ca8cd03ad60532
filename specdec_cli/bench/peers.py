"""Peers measured in the same run as specdec (`--peer hf`): transformers' generate() with the target
alone, and with transformers' counterpart of the config's drafter: prompt lookup for an n-gram drafter,
assisted generation for a draft model. Where transformers cannot run the config's draft (a feature
draft, or a draft whose LM head differs in size from the target's), its prompt lookup stands in.

How it is kept fair is report.PEER_FAIRNESS, printed under the peer table with the notes below.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import transformers
from transformers import GenerationConfig

from specdec_cli.bench.measure import BatchGenerate, Measure, TurnGenerator
from specdec_cli.bench.plan import HF_ASSISTED, HF_LOOKUP
from specdec_cli.bench.report import LOOKUP_NOTE, PEER_FAIRNESS
from specdec_cli.config import NgramSettings
from specdec_cli.decoding.engine import GenerationResult
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.methods import registry
from specdec_cli.pair import Pair


def hf_peer_engine(pair: Pair) -> tuple[str, str | None]:
    """The hf peer's speculative engine for this pair, and why it is not the config's drafter (None
    when it is)."""
    if registry.drafting(pair.config.draft)[0].engines_lookup:
        return HF_LOOKUP, None
    if pair.lookup is not None:
        why = "it has no counterpart of specdec's prompt lookup ahead of a draft"
    elif pair.causal_draft is not None:
        # transformers compares the configs' vocab_size and then wants two tokenizers (another algorithm)
        target_rows, draft_rows = (
            m.config.get_text_config().vocab_size for m in (pair.target.model, pair.causal_draft)
        )
        if target_rows == draft_rows:
            return HF_ASSISTED, None
        why = (
            f"the draft's LM head has {draft_rows} rows and the target's {target_rows} (specdec pads or cuts "
            f"the draft's logits, transformers refuses)"
        )
    elif pair.drafter.reads_target_states:
        why = "the draft reads the target's hidden states"  # EAGLE-style, Medusa, DFlash
    else:
        why = f"it has no counterpart of specdec's {registry.describe(pair.config.draft)}"
    return HF_LOOKUP, (
        f"transformers' assisted generation cannot run this draft: {why}; the hf peer runs "
        f"plain generate() and transformers' prompt lookup instead."
    )


def peer_caption(engine: str, note: str | None) -> str:
    return " ".join([PEER_FAIRNESS] + ([LOOKUP_NOTE] if engine == HF_LOOKUP else []) + ([note] if note else []))


@contextmanager
def generation_configs(configs: dict[torch.nn.Module, GenerationConfig]):
    """Give models these generation configs for one call. generate() fills every setting the config it
    is passed leaves unset from the model's own generation_config (a checkpoint's repetition_penalty,
    no_repeat_ngram_size, top_k...), greedy too; specdec applies none of them."""
    saved = {model: model.generation_config for model in configs}
    try:
        for model, config in configs.items():
            model.generation_config = config
        yield
    finally:
        for model, config in saved.items():
            model.generation_config = config


def plain_settings(pair: Pair, params: SamplingParams, max_new_tokens: int, ignore_eos: bool) -> dict:
    """generate()'s settings for what specdec runs: its length, EOS ids and warp, and nothing else."""
    # ignore_eos: no EOS ids at all, so the peer samples EOS and carries on as specdec does
    # (min_new_tokens would mask EOS instead, sampling from another distribution)
    eos = [] if ignore_eos else sorted(pair.eos_token_ids)
    settings = {
        "max_new_tokens": max_new_tokens,
        "eos_token_id": eos or None,
        "pad_token_id": eos[0] if eos else 0,
        "do_sample": not params.greedy,
    }
    if not params.greedy:
        # explicit values even when they disable a warper: generate() fills unset ones with its own
        # defaults (top_k 50), which would sample from a different distribution than specdec
        settings.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    return settings


def hf_generator(
    pair: Pair, params: SamplingParams, engine: str, num_draft_tokens: int, max_new_tokens: int, ignore_eos: bool
) -> TurnGenerator:
    """generate() as `engine` runs it: plain (num_draft_tokens 0), with prompt lookup, or with the draft model."""
    transformers.utils.logging.set_verbosity_error()  # assisted generate() warns about its own internal calls
    model = pair.target.model
    settings = plain_settings(pair, params, max_new_tokens, ignore_eos)
    configs, extra = {model: GenerationConfig()}, {}
    if num_draft_tokens and engine == HF_LOOKUP:
        max_n = (pair.config.draft.ngram or NgramSettings()).max_n
        settings.update(prompt_lookup_num_tokens=num_draft_tokens, max_matching_ngram_size=max_n)
    elif num_draft_tokens and engine == HF_ASSISTED:
        assistant = pair.causal_draft
        # the assistant's knobs come from its own generation config: always num_draft_tokens tokens, never stop early
        configs[assistant] = GenerationConfig(
            num_assistant_tokens=num_draft_tokens,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )
        extra["assistant_model"] = assistant
    config = GenerationConfig(**settings)

    def generate(prompt_ids: list[int], seed: int) -> tuple[list[int], Measure]:
        torch.manual_seed(seed)
        input_ids = torch.tensor([prompt_ids], device=pair.device)
        start = time.perf_counter()
        with torch.inference_mode(), generation_configs(configs):
            output = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, **extra
            )
        if pair.device.type == "cuda":
            torch.cuda.synchronize(pair.device)
        seconds = time.perf_counter() - start
        new = output[0, len(prompt_ids) :].tolist()
        return new, Measure(len(new), None, seconds, token_ids=new)

    return generate


def hf_batch_generator(pair: Pair, params: SamplingParams, max_new_tokens: int, ignore_eos: bool) -> BatchGenerate:
    """Plain batched generate() of the target (its assisted generation and prompt lookup refuse batches):
    prompts left-padded, each row's answer cut after its EOS. Its time is the whole call (prefill too)."""
    model = pair.target.model
    settings = plain_settings(pair, params, max_new_tokens, ignore_eos)
    config, eos = GenerationConfig(**settings), set(settings["eos_token_id"] or [])

    def generate(prompts: list[list[int]], seed: int) -> list[GenerationResult]:
        torch.manual_seed(seed)
        width = max(map(len, prompts))
        pad = settings["pad_token_id"]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=pair.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=pair.device)
        start = time.perf_counter()
        with torch.inference_mode(), generation_configs({model: GenerationConfig()}):
            output = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        if pair.device.type == "cuda":
            torch.cuda.synchronize(pair.device)
        seconds = time.perf_counter() - start
        rows = []
        for prompt, row in zip(prompts, output[:, width:].tolist()):
            ends = [i for i, t in enumerate(row) if t in eos]
            rows.append(GenerationResult(prompt, row[: ends[0] + 1] if ends else row, decode_seconds=seconds))
        return rows

    return generate
