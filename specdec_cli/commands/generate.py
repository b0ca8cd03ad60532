"""`specdec generate`: one prompt streamed, or a prompt file decoded in batches."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from specdec_cli import display, records
from specdec_cli.bench.prompts import Prompt
from specdec_cli.config import Config
from specdec_cli.decoding.engine import GenerationResult, combined
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.loading.checkpoints import load_tokenizer
from specdec_cli.loading.tokens import encode_prompt
from specdec_cli.methods import registry
from specdec_cli.pair import Pair, dtype_name, load_pair_showing, resolve_device, resolve_dtype


def load(cfg: Config) -> Pair:
    pair = load_pair_showing(cfg)
    if pair.drafter.reads_target_states:
        # which format, and which target states it reads: a wrong guess runs, but drafts badly
        display.stderr.print(f"Draft: {pair.draft_description}")
    return pair


def title(cfg: Config, extra: str = "") -> str:
    mode = "greedy" if cfg.sampling.temperature == 0 else "sampled"
    return f"{cfg.name}: {cfg.describe_drafting()}, {cfg.describe_verification()}, {mode}{extra}"


def generate_one(cfg: Config, text: str, raw: bool, run: records.Run) -> None:
    """Stream the answer (accepted draft tokens in green), then the statistics."""
    pair = load(cfg)
    prompt_ids = pair.encode(text, raw=raw)
    pair.check_fits(prompt_ids, cfg.generation.max_new_tokens)
    # with --json the stream only collects tokens, so Ctrl-C can still save what was generated
    stream = display.TokenStream(pair.tokenizer, None if run.as_json else display.stdout)
    decoder = pair.decoder(SamplingParams.from_config(cfg.sampling))
    record = {
        **records.header("generate", cfg, pair.describe()),
        "draft": pair.draft_description,
        "prompt": text,
        "raw": raw,
        "prompt_ids": prompt_ids,
        "seed": cfg.sampling.seed,
    }
    try:
        result = decoder.generate(
            prompt_ids,
            cfg.generation.max_new_tokens,
            cfg.sampling.seed,
            ignore_eos=cfg.generation.ignore_eos,
            on_tokens=stream,
        )
    except KeyboardInterrupt:
        record.update(partial=True, token_ids=stream.token_ids, text=stream.text)
        stream.close()
        display.stderr.print(run.write("generate", cfg.name, record))
        raise
    stream.close()
    stats = result.stats(decoder.num_draft_tokens)
    record.update(text=stream.text, token_ids=result.token_ids, stats=stats, steps=[vars(s) for s in result.steps])
    table = display.generation_table(stats, record["environment"], title(cfg))
    run.finish("generate", cfg.name, record, lambda: display.stderr.print(table))


def generate_many(cfg: Config, prompts: list[Prompt], raw: bool, batch_size: int, run: records.Run) -> None:
    """Decode the prompts' first turns `batch_size` at a time; print each answer, then a table with
    a row per prompt and one overall. Ctrl-C keeps the finished batches in a partial record."""
    pair = load(cfg)
    encoded = [pair.encode(p.turns[0], raw=raw) for p in prompts]
    for ids in encoded:
        pair.check_fits(ids, cfg.generation.max_new_tokens)
    if any(len(p.turns) > 1 for p in prompts):
        display.stderr.print("Multi-turn prompts: only their first turn is generated (benchmark runs all turns).")
    decoder = pair.decoder(SamplingParams.from_config(cfg.sampling))
    record = {
        **records.header("generate", cfg, pair.describe()),
        "draft": pair.draft_description,
        "raw": raw,
        "seed": cfg.sampling.seed,
        "batch_size": batch_size,
    }
    batches: list[list[GenerationResult]] = []
    partial = False
    with display.progress() as bar:
        task = bar.add_task(f"generating in batches of {batch_size}", total=len(prompts))
        try:
            for start in range(0, len(prompts), batch_size):
                # a seed per batch (seed + its first row): the same command draws the same tokens again
                batches.append(
                    decoder.generate_batch(
                        encoded[start : start + batch_size],
                        cfg.generation.max_new_tokens,
                        cfg.sampling.seed + start,
                        ignore_eos=cfg.generation.ignore_eos,
                    )
                )
                bar.update(task, advance=len(batches[-1]))
        except KeyboardInterrupt:
            partial = True
    results = [r for rows in batches for r in rows]
    overall = combined(batches).stats(decoder.num_draft_tokens) if batches else None
    record.update(partial=partial)
    report_many(
        cfg, record, prompts, encoded, results, overall, pair.tokenizer, decoder.num_draft_tokens, run, batch_size
    )
    if partial:
        display.stderr.print("Interrupted: the record holds the finished batches (partial: true).")
        raise KeyboardInterrupt


def report_many(
    cfg: Config,
    record: dict,
    prompts: list[Prompt],
    encoded: list[list[int]],
    results: list[GenerationResult],
    overall: dict | None,
    tokenizer: PreTrainedTokenizerBase,
    num_draft_tokens: int,
    run: records.Run,
    batch_size: int | None,
) -> None:
    """Each prompt's answer, then a table with a row per prompt and one overall; the record gets the
    rows. `batch_size`: specdec's batches (None: the engine batched the prompts itself)."""
    rows = [
        {
            "prompt_id": p.id,
            "category": p.category,
            "prompt": p.turns[0],
            "prompt_ids": ids,
            "text": tokenizer.decode(r.token_ids, skip_special_tokens=True),
            "token_ids": r.token_ids,
            "stats": r.stats(num_draft_tokens),
        }
        for p, ids, r in zip(prompts, encoded, results)
    ]
    record.update(rows=rows, stats=overall)

    def show() -> None:
        for row in rows:
            display.stdout.print(f"[bold]── {row['prompt_id']} ({row['category']})[/]")
            display.stdout.print(row["text"], markup=False)
        if overall:
            batches = f", batches of {batch_size}" if batch_size else ""
            display.stderr.print(display.batch_table(rows, overall, record["environment"], title(cfg, batches)))

    run.finish("generate", cfg.name, record, show)


def generate_vllm(cfg: Config, prompts: list[Prompt], raw: bool, run: records.Run) -> None:
    """The config in vLLM (its own environment: setup-vllm) instead of specdec's loop: the prompts' first
    turns, encoded by specdec, in one call that vLLM schedules itself; the draft as its speculative_config.
    Times are the call's, end to end."""
    from specdec_cli.bench.vllm_peer import cpu_build_sampling
    from specdec_cli.vllm_engine.client import VllmWorker, vllm_python
    from specdec_cli.vllm_engine.settings import (
        engine_settings,
        environment,
        generation_results,
        sampling,
        speculative_config,
        vllm_schedule,
    )

    vllm_python()  # before any loading: one line when vLLM is not set up
    tokenizer, eos = load_tokenizer(cfg.target)
    encoded = [encode_prompt(tokenizer, p.turns[0], raw) for p in prompts]
    num_draft_tokens = cfg.speculation.num_draft_tokens
    speculative = speculative_config(cfg.draft, num_draft_tokens, vllm_schedule(cfg, [cfg.sampling.temperature]))
    dtype = dtype_name(resolve_dtype(cfg.runtime.dtype, resolve_device(cfg.runtime.device)))
    settings = engine_settings(cfg, dtype, speculative)
    params = SamplingParams.from_config(cfg.sampling)
    ignore_eos = cfg.generation.ignore_eos
    with display.stderr.status(f"Starting vLLM with {cfg.target.describe()} and {registry.describe(cfg.draft)}..."):
        worker = VllmWorker(settings)
    with worker, display.stderr.status(f"Generating {len(prompts)} answer(s) in vLLM..."):
        reply = worker.generate(
            encoded, sampling(params, cfg.sampling.seed, cfg.generation.max_new_tokens, eos, ignore_eos)
        )
    results = generation_results(encoded, reply, eos, ignore_eos)
    warning = cpu_build_sampling(worker.device, [params.temperature])
    if warning:
        display.stderr.print(f"Note: {warning}")
    record = {
        **records.header("generate", cfg, environment(cfg, dtype, worker.version, worker.device)),
        "engine": "vllm",
        "speculative_config": speculative,
        "raw": raw,
        "seed": cfg.sampling.seed,
    }
    overall = combined([results]).stats(num_draft_tokens)
    report_many(cfg, record, prompts, encoded, results, overall, tokenizer, num_draft_tokens, run, None)
