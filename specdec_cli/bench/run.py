"""Run every prompt in every mode of a plan: target-only and speculative through specdec's loop, and
the peers. Every prompt runs, for each temperature, once target-only (gamma 0) and once per gamma,
`repeats` times each with the same seed. A multi-turn prompt feeds each mode's own answer back before
the next turn, and all turns count (as in Spec-Bench): a prompt's numbers are its turns' sums.
"""

from __future__ import annotations

from typing import Callable

from specdec_cli.bench.measure import Measure, TurnGenerator
from specdec_cli.bench.plan import SPECDEC, Mode, Plan
from specdec_cli.bench.prompts import Prompt
from specdec_cli.models.pair import Pair

WARMUP_TOKENS = 32  # enough for one-time costs (allocations, thread pools); not the full length


def specdec_generator(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> TurnGenerator:
    decoder = pair.decoder(plan.params(mode.temperature), speculative=mode.gamma > 0,
                           num_draft_tokens=mode.gamma or None)

    def generate(prompt_ids: list[int], seed: int) -> tuple[list[int], Measure]:
        r = decoder.generate(prompt_ids, max_new_tokens, seed, ignore_eos=plan.ignore_eos)
        return r.token_ids, Measure(len(r.token_ids), r.prefill_seconds, r.decode_seconds, r.steps, r.token_ids)

    return generate


def make_generator(pair: Pair, mode: Mode, plan: Plan, max_new_tokens: int) -> TurnGenerator:
    if mode.engine != SPECDEC:
        from specdec_cli.bench.peers import hf_generator
        return hf_generator(pair, plan.params(mode.temperature), mode.engine, mode.gamma, max_new_tokens,
                            plan.ignore_eos)
    return specdec_generator(pair, mode, plan, max_new_tokens)


def run_prompt(pair: Pair, prompt: Prompt, generate: TurnGenerator, plan: Plan) -> Measure:
    """All turns of a prompt; each turn after the first sees the earlier turns and this run's answers."""
    total, history = Measure(), []
    for turn in prompt.turns:
        ids = pair.encode(turn, history=history)
        pair.check_fits(ids, plan.max_new_tokens)
        token_ids, measure = generate(ids, plan.seed)
        total.add(measure)
        answer = pair.tokenizer.decode(token_ids, skip_special_tokens=True)
        history += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    return total


# Called before each run with (prompt index, number of prompts, prompt, mode).
OnRun = Callable[[int, int, Prompt, Mode], None]


def run_benchmark(pair: Pair, prompts: list[Prompt], plan: Plan, on_run: OnRun | None = None
                  ) -> tuple[list[dict], bool]:
    """Measure every prompt in every mode. Returns (runs, partial): Ctrl-C stops early and keeps only
    the prompts measured in every mode, so baselines and speculative runs cover the same prompts."""
    modes = plan.modes()
    generators = {m: make_generator(pair, m, plan, plan.max_new_tokens) for m in modes}
    runs: list[dict] = []
    try:
        if plan.warmup and prompts:
            first = Prompt(prompts[0].id, prompts[0].category, prompts[0].turns[:1])
            for mode in modes:  # short generations that pay one-time costs; not recorded
                warm = make_generator(pair, mode, plan, min(WARMUP_TOKENS, plan.max_new_tokens))
                for _ in range(plan.warmup):
                    run_prompt(pair, first, warm, plan)
        for i, prompt in enumerate(prompts):
            prompt_runs = []
            for mode in modes:
                if on_run:
                    on_run(i, len(prompts), prompt, mode)
                measures = [run_prompt(pair, prompt, generators[mode], plan) for _ in range(plan.repeats)]
                prompt_runs.append({"prompt_id": prompt.id, "category": prompt.category,
                                    "temperature": mode.temperature, "gamma": mode.gamma, "engine": mode.engine,
                                    "repeats": [m.to_dict() for m in measures]})
            runs += prompt_runs
    except KeyboardInterrupt:
        return runs, True
    return runs, False
