"""Run every prompt in every mode of a plan: target-only and speculative through specdec's loop, and
the peers. Every prompt runs, for each temperature, once target-only (num_draft_tokens 0), once per
num_draft_tokens and tree, `repeats` times each with the same seed. A multi-turn prompt feeds each
mode's own answer back before the next turn, and all turns count (as in Spec-Bench): a prompt's numbers
are its turns' sums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from specdec_cli.bench.measure import BatchGenerate, Measure, Turn, TurnGenerator
from specdec_cli.bench.plan import SPECDEC, Mode, Plan
from specdec_cli.bench.prompts import Prompt
from specdec_cli.decoding import drift
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.metrics import StepRecord
from specdec_cli.pair import Pair

WARMUP_TOKENS = 32  # enough for one-time costs (allocations, thread pools); not the full length


def decoder_of(pair: Pair, mode: Mode, plan: Plan) -> SpeculativeDecoder:
    """The target alone (num_draft_tokens 0), a chain of num_draft_tokens draft tokens under the mode's rule,
    or a draft tree."""
    chain = None if mode.tree else mode.num_draft_tokens or None
    params = plan.params(mode.temperature)
    return pair.decoder(params, mode.num_draft_tokens > 0, chain, mode.tree, mode.verification)


def specdec_generator(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> TurnGenerator:
    decoder = decoder_of(pair, mode, plan)

    def generate(prompt_ids: list[int], seed: int) -> tuple[list[int], Measure]:
        r = decoder.generate(prompt_ids, max_new_tokens, seed, ignore_eos=plan.ignore_eos)
        return r.token_ids, Measure(len(r.token_ids), r.prefill_seconds, r.decode_seconds, r.steps, r.token_ids)

    return generate


def make_generator(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> TurnGenerator:
    if mode.engine != SPECDEC:
        from specdec_cli.bench.peers import hf_generator

        return hf_generator(
            pair, plan.params(mode.temperature), mode.engine, mode.num_draft_tokens, max_new_tokens, plan.ignore_eos
        )
    return specdec_generator(pair, mode, plan, max_new_tokens)


def run_prompt(pair: Pair, prompt: Prompt, generate: TurnGenerator, plan: Plan) -> Measure:
    """All turns of a prompt; each turn after the first sees the earlier turns and this run's answers."""
    total, history = Measure(), []
    for turn in prompt.turns:
        ids = pair.encode(turn, history=history)
        pair.check_fits(ids, plan.max_new_tokens)
        token_ids, measure = generate(ids, plan.seed)
        measure.turns = [Turn(ids, token_ids, measure.steps)]
        total.add(measure)
        answer = pair.tokenizer.decode(token_ids, skip_special_tokens=True)
        history += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    return total


# Called before each run with (prompt index, number of prompts, prompt, mode).
OnRun = Callable[[int, int, Prompt, Mode], None]


# Makes the generator of a mode: (pair, mode, plan, max_new_tokens) -> TurnGenerator
MakeGenerator = Callable[[Pair, Mode, Plan, int], TurnGenerator]


def run_benchmark(
    pair: Pair,
    prompts: list[Prompt],
    plan: Plan,
    on_run: OnRun | None = None,
    modes: list[Mode] | None = None,
    make: MakeGenerator = make_generator,
) -> tuple[list[dict], bool]:
    """Measure every prompt in every mode (default: the plan's). Returns (runs, partial): Ctrl-C stops
    early and keeps only the prompts measured in every mode, so baselines and speculative runs cover
    the same prompts."""
    modes = plan.modes() if modes is None else modes
    generators = {m: make(pair, m, plan, plan.max_new_tokens) for m in modes}
    runs: list[dict] = []
    try:
        if plan.warmup and prompts:
            first = Prompt(prompts[0].id, prompts[0].category, prompts[0].turns[:1])
            for mode in modes:  # short generations that pay one-time costs; not recorded
                warm = make(pair, mode, plan, min(WARMUP_TOKENS, plan.max_new_tokens))
                for _ in range(plan.warmup):
                    run_prompt(pair, first, warm, plan)
        for i, prompt in enumerate(prompts):
            prompt_runs, alone = [], None  # the greedy target-alone run
            for mode in modes:
                if on_run:
                    on_run(i, len(prompts), prompt, mode)
                measures = [run_prompt(pair, prompt, generators[mode], plan) for _ in range(plan.repeats)]
                if mode.engine == SPECDEC and mode.temperature == 0 and plan.synthetic_acceptance is None:
                    if mode.num_draft_tokens == 0:
                        alone = measures[0]
                    elif alone is not None:
                        triage_greedy(pair, alone, measures[0], mode.tree is not None)
                prompt_runs.append(
                    {
                        "prompt_id": prompt.id,
                        "category": prompt.category,
                        "temperature": mode.temperature,
                        "num_draft_tokens": mode.num_draft_tokens,
                        "tree": mode.tree.spec if mode.tree else None,
                        "verification": mode.verification,
                        "engine": mode.engine,
                        "synthetic_acceptance": plan.synthetic_acceptance if mode.num_draft_tokens else None,
                        "repeats": [m.to_dict() for m in measures],
                    }
                )
            runs += prompt_runs
    except KeyboardInterrupt:
        return runs, True
    return runs, False


def run_contexts(
    pair: Pair, contexts: list[tuple[int, list[Prompt], dict[str, int]]], plan: Plan, on_run: OnRun | None = None
) -> tuple[list[dict], bool]:
    """specdec's modes on each context length's prompts (bench/contexts.py: (length, prompts, their
    tokens)); each run's record says its context length and its prompt's tokens. Ctrl-C keeps the
    lengths and prompts finished in every mode."""
    modes = [m for m in plan.modes() if m.engine == SPECDEC]
    unwarmed = replace(plan, warmup=0)  # the prompts' own runs paid the one-time costs
    runs: list[dict] = []
    for length, prompts, tokens in contexts:
        done, partial = run_benchmark(pair, prompts, unwarmed, on_run, modes)
        runs += [{**r, "context_length": length, "prompt_tokens": tokens[r["prompt_id"]]} for r in done]
        if partial:
            return runs, True
    return runs, False


def triage_greedy(pair: Pair, alone: Measure, speculative: Measure, trees: bool) -> None:
    """Follow a greedy speculative run that left the target alone's tokens to its first differing token
    and class it (decoding/drift.py), in the speculative measure's record."""
    for turn, (ours, theirs) in enumerate(zip(alone.turns, speculative.turns)):
        found = drift.triage(
            pair.target,
            ours.prompt_ids,
            (ours.token_ids, ours.steps),
            (theirs.token_ids, theirs.steps),
            pair.dtype,
            pair.weights,
            trees,
        )
        if found is not None:
            speculative.greedy_divergence = {"turn": turn, **found.to_dict()}
            return


def locate_peer_divergences(pair: Pair, prompts: list[Prompt], runs: list[dict]) -> None:
    """Where a peer's greedy tokens leave specdec's target alone's, on single-turn prompts: the first
    differing token and, from specdec's own single-token forward there (replayed), the gap between its
    token and the peer's, beside the resolution, in the peer run's record (`greedy_divergence`). No
    verdict: a peer's arithmetic is its own, so only how close the two tokens were says anything."""
    alone = {
        r["prompt_id"]: r["repeats"][0]
        for r in runs
        if r["engine"] == SPECDEC and r["temperature"] == 0 and r["num_draft_tokens"] == 0
    }
    single_turn = {p.id: p.turns[0] for p in prompts if len(p.turns) == 1}
    for run in runs:
        ours = alone.get(run["prompt_id"])
        if run["engine"] == SPECDEC or run["temperature"] != 0 or ours is None or run["prompt_id"] not in single_turn:
            continue
        theirs = run["repeats"][0]
        position = drift.first_difference(ours["token_ids"], theirs["token_ids"])
        if position is None or position >= min(len(ours["token_ids"]), len(theirs["token_ids"])):
            continue  # the same tokens, or the same up to where one stopped
        steps = [StepRecord(*s) for s in ours["steps"]]
        ids = pair.encode(single_turn[run["prompt_id"]])
        logits = drift.replayed_logits(pair.target, ids, ours["token_ids"], steps, position)
        specdec_token, peer_token = ours["token_ids"][position], theirs["token_ids"][position]
        top = logits.topk(2).values
        theirs["greedy_divergence"] = {
            "position": position,
            "specdec_token": specdec_token,
            "peer_token": peer_token,
            "specdec_margin": float(top[0] - top[1]),
            "gap": float(logits[specdec_token] - logits[peer_token]),
            "resolution": drift.resolution(pair.dtype, pair.weights, float(logits.abs().max())),
        }


def batch_generator(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> BatchGenerate:
    if mode.engine != SPECDEC:
        from specdec_cli.bench.peers import hf_batch_generator

        return hf_batch_generator(pair, plan.params(mode.temperature), max_new_tokens, plan.ignore_eos)
    decoder = decoder_of(pair, mode, plan)
    return lambda prompts, seed: decoder.generate_batch(prompts, max_new_tokens, seed, ignore_eos=plan.ignore_eos)


def run_batch(pair: Pair, prompts: list[Prompt], generate: BatchGenerate, plan: Plan, seed: int) -> dict:
    """One batch: the prompts decoded together, turn by turn (turn k of every prompt that has one, each
    row seeing its own earlier turns and answers). Wall times are the batch's; steps and tokens all rows'."""
    histories: list[list[dict]] = [[] for _ in prompts]
    total = {
        "blocks": 0,
        "new_tokens": 0,
        "prefill_seconds": 0.0,
        "decode_seconds": 0.0,
        "steps": [],
        "token_ids": [[] for _ in prompts],
    }
    for turn in range(max(len(p.turns) for p in prompts)):
        rows = [i for i, p in enumerate(prompts) if turn < len(p.turns)]
        encoded = [pair.encode(prompts[i].turns[turn], history=histories[i]) for i in rows]
        for ids in encoded:
            pair.check_fits(ids, plan.max_new_tokens)
        results = generate(encoded, seed)
        total["prefill_seconds"] += results[0].prefill_seconds
        total["decode_seconds"] += max(r.decode_seconds for r in results)
        total["blocks"] += max(len(r.steps) for r in results)  # target forwards of the batch
        for i, r in zip(rows, results):
            total["new_tokens"] += len(r.token_ids)
            total["token_ids"][i] += r.token_ids
            total["steps"] += [[s.drafted, s.accepted, s.emitted, s.draft_seconds, s.verify_seconds] for s in r.steps]
            answer = pair.tokenizer.decode(r.token_ids, skip_special_tokens=True)
            histories[i] += [
                {"role": "user", "content": prompts[i].turns[turn]},
                {"role": "assistant", "content": answer},
            ]
    return total


# Called before each batched run with (batch size, mode, first prompt index, number of prompts).
OnBatch = Callable[[int, Mode, int, int], None]


# Makes the batch generator of a mode: (pair, mode, plan, max_new_tokens) -> BatchGenerate
MakeBatchGenerator = Callable[[Pair, Mode, Plan, int], BatchGenerate]


def run_batches(
    pair: Pair,
    prompts: list[Prompt],
    plan: Plan,
    on_batch: OnBatch | None = None,
    batched: list[tuple[int, Mode]] | None = None,
    make: MakeBatchGenerator = batch_generator,
) -> tuple[list[dict], bool]:
    """Every (batch size, mode) of `batched` (default: the plan's batch sizes above 1 and specdec's
    modes): the prompts in consecutive batches of that size, target alone and speculative, `repeats`
    times each, after a short warm-up batch per mode. Returns (runs, partial): Ctrl-C stops early, and
    the summary compares only batches measured in both modes."""
    runs: list[dict] = []
    for size, mode in plan.batch_modes() if batched is None else batched:

        def heard(start: int, size: int = size, mode: Mode = mode) -> None:
            if on_batch:
                on_batch(size, mode, start, len(prompts))

        (done,), partial = run_rounds(pair, prompts, plan, size, [(mode, make)], heard)
        runs += done
        if partial:
            return runs, True
    return runs, False


def run_rounds(
    pair: Pair,
    prompts: list[Prompt],
    plan: Plan,
    size: int,
    entries: list[tuple[Mode, MakeBatchGenerator]],
    on_batch: Callable[[int], None] | None = None,
) -> tuple[list[list[dict]], bool]:
    """Each entry's batches of `size`, round by round: for each batch, repeat after repeat, every entry in
    turn, so that a machine whose speed drifts moves them alike (the summary sets repeat i of one against
    repeat i of another). After a short warm-up batch per entry; `on_batch` hears each batch's first
    prompt's index. Returns (each entry's runs, partial): Ctrl-C stops early, keeping the batches every
    entry finished."""
    runs: list[list[dict]] = [[] for _ in entries]
    try:
        generators = []
        for mode, make in entries:
            warm_up(pair, prompts[:size], make(pair, mode, plan, min(WARMUP_TOKENS, plan.max_new_tokens)), plan)
            generators.append(make(pair, mode, plan, plan.max_new_tokens))
        for start in range(0, len(prompts), size):
            if on_batch:
                on_batch(start)
            group = prompts[start : start + size]
            repeats: list[list[dict]] = [[] for _ in entries]
            for _ in range(plan.repeats):
                for done, generate in zip(repeats, generators):
                    done.append(run_batch(pair, group, generate, plan, plan.seed + start))
            for entry_runs, (mode, _), done in zip(runs, entries, repeats):
                entry_runs.append(batch_record(size, mode, group, done, plan))
    except KeyboardInterrupt:
        return runs, True
    return runs, False


def warm_up(pair: Pair, prompts: list[Prompt], generate: BatchGenerate, plan: Plan) -> None:
    """The plan's unmeasured warm-up batches: the prompts' first turns, short."""
    for _ in range(plan.warmup):
        run_batch(pair, [Prompt(p.id, p.category, p.turns[:1]) for p in prompts], generate, plan, plan.seed)


def batch_record(size: int, mode: Mode, group: list[Prompt], repeats: list[dict], plan: Plan) -> dict:
    return {
        "batch_size": size,
        "temperature": mode.temperature,
        "num_draft_tokens": mode.num_draft_tokens,
        "tree": mode.tree.spec if mode.tree else None,
        "verification": mode.verification,
        "engine": mode.engine,
        "synthetic_acceptance": plan.synthetic_acceptance if mode.num_draft_tokens else None,
        "prompt_ids": [p.id for p in group],
        "repeats": repeats,
    }
