"""Aggregation: pure functions of a benchmark record's runs, so `compare` and tests can use them too.
Speedup is Spec-Bench's: mean speculative decode tok/s over prompts / mean target-only decode tok/s."""

from __future__ import annotations

import statistics

from specdec_cli.bench.plan import HF, SPECDEC
from specdec_cli.bench.report import OVERALL, drafting_order, mode_label, rule_of
from specdec_cli.decoding.metrics import (
    StepRecord,
    acceptance_by_position,
    acceptance_rate,
    accepted_length_histogram,
    block_costs,
    conditional_acceptance_by_position,
    cost_ratio,
    draft_time_share,
    mean_accepted_length,
    median_and_spread,
    per_request_mean,
    per_token_acceptance,
    predicted_speedup,
    predicted_speedup_from_parts,
    speedup,
    vllm_counters,
    vllm_mean_acceptance_length,
)


def steps_of(run: dict) -> list[StepRecord]:
    return [StepRecord(*s) for rep in run["repeats"] for s in rep["steps"]]


def _group_tps(runs: list[dict], key: str) -> list[list[float]]:
    """Per repeat index, the per-prompt tokens/s (key: decode or end-to-end)."""
    repeats = min(len(r["repeats"]) for r in runs)
    return [[r["repeats"][i][key] for r in runs] for i in range(repeats)]


def _mean_tps(runs: list[dict], key: str) -> tuple[float, float, float]:
    """The mean over prompts per repeat: its median and range over repeats."""
    return median_and_spread([statistics.fmean(t) for t in _group_tps(runs, key)])


def summarize_mode(
    baseline: list[dict], speculative: list[dict], num_draft_tokens: int, tree: str | None = None
) -> dict:
    """The numbers of one table cell group: same prompts in both lists, same order. `num_draft_tokens`: the chain's
    length, or the depth of `tree` (its shape as --tree spells it); acceptance is then by depth.

    Tokens/s is the mean over prompts per repeat; its median and (min, max) over repeats are reported.
    Speedup is Spec-Bench's mean(spec tok/s) / mean(baseline tok/s), per repeat, then its median.
    Leviathan's prediction is a chain's: none for a tree; the prediction from measured parts is for
    both (block_costs, predicted_speedup_from_parts)."""
    base_tps = _group_tps(baseline, "tokens_per_second")
    spec_tps = _group_tps(speculative, "tokens_per_second")
    speedups = [speedup(b, s) for b, s in zip(base_tps, spec_tps)]
    # Spec-Bench excludes prefill from its speedup; the end-to-end one counts it (what a user waits for)
    end_to_end = [
        speedup(b, s)
        for b, s in zip(
            _group_tps(baseline, "end_to_end_tokens_per_second"),
            _group_tps(speculative, "end_to_end_tokens_per_second"),
        )
    ]
    base_steps = [s for r in baseline for s in steps_of(r)]
    spec_steps = [s for r in speculative for s in steps_of(r)]
    requests = [[StepRecord(*s) for s in rep["steps"]] for r in speculative for rep in r["repeats"]]
    # c per drafted token counts only the blocks that drafted: one where the n-gram drafter found no match
    # costs lookup time but drafts nothing (that time stays in draft_time_share)
    drafting = [s for s in spec_steps if s.drafted]
    drafted = sum(s.drafted for s in drafting)
    forward = sum(s.verify_seconds for s in base_steps) / len(base_steps) if base_steps else 0.0
    # none where no forward was timed (vLLM's steps carry counts only)
    c = cost_ratio(sum(s.draft_seconds for s in drafting) / drafted, forward) if drafted and forward else None
    alpha = per_token_acceptance(spec_steps)
    costs = block_costs(spec_steps, base_steps)
    return {
        "prompts": len(speculative),
        "num_draft_tokens": num_draft_tokens,
        "tree": tree,
        "baseline_tokens_per_second": _mean_tps(baseline, "tokens_per_second"),
        "speculative_tokens_per_second": _mean_tps(speculative, "tokens_per_second"),
        "speedup": median_and_spread(speedups),
        "end_to_end_speedup": median_and_spread(end_to_end),
        "mean_accepted_length": mean_accepted_length(spec_steps),
        "vllm_mean_acceptance_length": vllm_mean_acceptance_length(spec_steps),
        "per_request_mean_accepted_length": per_request_mean(requests, mean_accepted_length),
        "per_request_vllm_mean_acceptance_length": per_request_mean(requests, vllm_mean_acceptance_length),
        "acceptance_rate": acceptance_rate(spec_steps),
        "per_token_acceptance": alpha,
        "acceptance_by_position": acceptance_by_position(spec_steps, num_draft_tokens),
        "conditional_acceptance_by_position": conditional_acceptance_by_position(spec_steps, num_draft_tokens),
        "accepted_length_histogram": accepted_length_histogram(spec_steps),
        "vllm_counters": vllm_counters(spec_steps),
        "draft_time_share": draft_time_share(spec_steps),
        "cost_ratio": c,
        "predicted_speedup": (
            predicted_speedup(alpha, num_draft_tokens, c) if alpha is not None and c is not None and not tree else None
        ),
        "target_forward_seconds": forward or None,  # a target-only step: its forward and its token's choice
        "verification_cost": costs[0] if costs else None,
        "drafting_cost": costs[1] if costs else None,
        "predicted_speedup_from_parts": predicted_speedup_from_parts(spec_steps, costs) if costs else None,
        "greedy_identical": greedy_identical(baseline, speculative),
        "greedy_not_rounding": greedy_not_rounding(speculative),
        "baseline_prefill_seconds": _mean_prefill(baseline),
        "speculative_prefill_seconds": _mean_prefill(speculative),
    }


def add_weight_read_rates(summary: list[dict], weight_bytes: int, bandwidth: float) -> None:
    """Each row's target-only forward as weight bytes read per second, and as a share of the machine's
    read bandwidth (bench/bandwidth.py)."""
    for row in summary:
        seconds = row.get("target_forward_seconds")
        rate = weight_bytes / seconds if seconds else None
        row["target_weight_read_bytes_per_second"] = rate
        row["target_weight_read_share"] = rate / bandwidth if rate else None


def greedy_identical(baseline: list[dict], speculative: list[dict]) -> int | None:
    """Prompts whose greedy speculative output equals the target-only output, token for token (None
    when sampled, under synthetic acceptance, or for records from before token ids were kept)."""
    if baseline[0]["temperature"] != 0 or "token_ids" not in baseline[0]["repeats"][0] or synthetic(speculative):
        return None
    return sum(b["repeats"][0]["token_ids"] == s["repeats"][0]["token_ids"] for b, s in zip(baseline, speculative))


def synthetic(runs: list[dict]) -> bool:
    """Whether these runs kept drafts by chance (a loop benchmark: their tokens are not the target's)."""
    return any(r.get("synthetic_acceptance") is not None for r in runs)


def greedy_not_rounding(speculative: list[dict]) -> int | None:
    """Prompts whose greedy output left the target alone's by more than rounding (bench/run.py's triage;
    None when sampled, or for records from before it)."""
    repeats = [r["repeats"][0] for r in speculative]
    if (
        speculative[0]["temperature"] != 0
        or synthetic(speculative)
        or any("greedy_divergence" not in rep for rep in repeats)
    ):
        return None
    return sum(rep["greedy_divergence"] is not None and not rep["greedy_divergence"]["rounding"] for rep in repeats)


def _mean_prefill(runs: list[dict]) -> float | None:
    values = [rep["prefill_seconds"] for r in runs for rep in r["repeats"]]
    return statistics.fmean(values) if values and None not in values else None


def _by_prompt(
    runs: list[dict],
    engine: str,
    temperature: float,
    num_draft_tokens: int,
    group: str = OVERALL,
    tree: str | None = None,
    rule: str = "token",
) -> dict[str, dict]:
    return {
        r["prompt_id"]: r
        for r in runs
        if (r["engine"], r["temperature"], r["num_draft_tokens"], r.get("tree"), rule_of(r))
        == (engine, temperature, num_draft_tokens, tree, rule)
        and group in (OVERALL, r["category"])
    }


def summarize(runs: list[dict], engine: str = SPECDEC) -> list[dict]:
    """One entry per (group, temperature, num_draft_tokens or tree, rule) of the engine that ran the config, group
    being each category and "overall"; prompts missing a mode (an interrupted run) are left out of that
    comparison."""
    out = []
    ran = [r for r in runs if r["engine"] == engine]
    categories = sorted({r["category"] for r in ran})
    for temperature in sorted({r["temperature"] for r in ran}):
        for num_draft_tokens, tree, rule in drafting_order(ran):
            for group in categories + [OVERALL]:
                base = _by_prompt(ran, engine, temperature, 0, group)
                spec = _by_prompt(ran, engine, temperature, num_draft_tokens, group, tree, rule)
                ids = [i for i in spec if i in base]
                if ids:
                    out.append(
                        {
                            "group": group,
                            "temperature": temperature,
                            "verification": rule,
                            **summarize_mode([base[i] for i in ids], [spec[i] for i in ids], num_draft_tokens, tree),
                        }
                    )
    return out


def _end_to_end_speedup(baseline: dict[str, dict], speculative: list[dict]) -> float | None:
    """Speculative end-to-end tok/s over the same engine's target-only run of the same prompts, per
    repeat as Spec-Bench's speedup, then the median; None for a target-only run or without a baseline."""
    if not speculative[0]["num_draft_tokens"] or not all(r["prompt_id"] in baseline for r in speculative):
        return None
    base = [baseline[r["prompt_id"]] for r in speculative]
    key = "end_to_end_tokens_per_second"
    return median_and_spread([speedup(b, s) for b, s in zip(_group_tps(base, key), _group_tps(speculative, key))])[0]


def _decode_tps(runs: list[dict], peer_runs: list[dict]) -> tuple[float, float, float] | None:
    """Decode tok/s of `runs` (median and range over repeats), where `peer_runs` timed prefill apart."""
    if any(rep.get("prefill_seconds") is None for r in peer_runs for rep in r["repeats"]):
        return None
    return _mean_tps(runs, "tokens_per_second")


def _acceptance(runs: list[dict], num_draft_tokens: int) -> dict:
    """specdec's acceptance numbers of speculative runs (None: target-only, or a peer that records no steps)."""
    steps = [s for r in runs for s in steps_of(r)]
    drafted = num_draft_tokens and any(s.drafted for s in steps)
    return {
        "mean_accepted_length": mean_accepted_length(steps) if drafted else None,
        "acceptance_by_position": acceptance_by_position(steps, num_draft_tokens) if drafted else None,
    }


def summarize_peers(runs: list[dict]) -> list[dict]:
    """Per peer mode, the peer beside specdec's speculative run of the same prompts at the same temperature:
    the same num_draft_tokens, or each num_draft_tokens for the peer's target-only run, under each rule
    specdec measured. As end-to-end tokens/s (prefill + decode), because transformers' generate() does not
    time them apart; each side's speedup over its own target-only run, and its acceptance in specdec's
    definitions where the peer reports its steps (vLLM)."""
    out = []
    key = "end_to_end_tokens_per_second"
    chains = sorted(
        {
            (r["temperature"], r["num_draft_tokens"], rule_of(r))
            for r in runs
            if r["engine"] == SPECDEC and not r.get("tree")
        }
    )
    for temperature, num_draft_tokens, engine in sorted(
        {(r["temperature"], r["num_draft_tokens"], r["engine"]) for r in runs if r["engine"] != SPECDEC}
    ):
        peers = _by_prompt(runs, engine, temperature, num_draft_tokens)
        # the peer's target alone: its engine's first word ("hf prompt lookup" -> "hf")
        peer_base = _by_prompt(runs, engine.split()[0], temperature, 0)
        # specdec's chains beside this peer mode: its num_draft_tokens, or every one beside the peer's target alone
        beside = [(g, rule) for t, g, rule in chains if t == temperature and g and num_draft_tokens in (0, g)]
        for specdec_num_draft_tokens, rule in beside:
            ours = _by_prompt(runs, SPECDEC, temperature, specdec_num_draft_tokens, rule=rule)
            ids = [i for i in peers if i in ours]
            if ids:
                ours_runs, peer_runs = [ours[i] for i in ids], [peers[i] for i in ids]
                peer_acceptance, our_acceptance = (
                    _acceptance(peer_runs, num_draft_tokens),
                    _acceptance(ours_runs, specdec_num_draft_tokens),
                )
                out.append(
                    {
                        "engine": engine,
                        "temperature": temperature,
                        "num_draft_tokens": num_draft_tokens,
                        "specdec_num_draft_tokens": specdec_num_draft_tokens,
                        "specdec_verification": rule,
                        "prompts": len(ids),
                        "specdec_tokens_per_second": _mean_tps(ours_runs, key),
                        "peer_tokens_per_second": _mean_tps(peer_runs, key),
                        "specdec_end_to_end_speedup": _end_to_end_speedup(
                            _by_prompt(runs, SPECDEC, temperature, 0), ours_runs
                        ),
                        "peer_end_to_end_speedup": _end_to_end_speedup(peer_base, peer_runs),
                        # decode alone where the peer times prefill apart (llama.cpp; transformers and vLLM do not)
                        "specdec_decode_tokens_per_second": _decode_tps(ours_runs, peer_runs),
                        "peer_decode_tokens_per_second": _decode_tps(peer_runs, peer_runs),
                        "peer_mean_accepted_length": peer_acceptance["mean_accepted_length"],
                        "specdec_mean_accepted_length": our_acceptance["mean_accepted_length"],
                        "peer_acceptance_by_position": peer_acceptance["acceptance_by_position"],
                        "specdec_acceptance_by_position": our_acceptance["acceptance_by_position"],
                        "greedy_identical": greedy_identical(ours_runs, peer_runs),
                        "greedy_near_ties": greedy_near_ties(peer_runs),
                    }
                )
    return out


def greedy_near_ties(peer_runs: list[dict]) -> int | None:
    """Prompts whose peer tokens left specdec's target alone's where specdec's own forward put the two
    tokens within its resolution (bench/run.py's locate_peer_divergences; None when sampled or not located)."""
    if peer_runs[0]["temperature"] != 0:
        return None
    found = [r["repeats"][0].get("greedy_divergence") for r in peer_runs]
    return sum(d is not None and d["gap"] < d["resolution"] for d in found)


def gate_failures(summary: list[dict], min_speedup: float | None, min_accept_length: float | None) -> list[str]:
    """Overall rows that miss a gate, as readable lines; every (temperature, num_draft_tokens or tree) must pass."""
    failures = []
    for row in (r for r in summary if r["group"] == OVERALL):
        mode = mode_label(row)
        measured = row["speedup"][0]
        if min_speedup is not None and measured < min_speedup:
            failures.append(f"speedup {measured:.2f} < {min_speedup:g} ({mode})")
        length = row["mean_accepted_length"]
        if min_accept_length is not None and (length is None or length < min_accept_length):
            failures.append(
                f"mean accepted length {length if length is None else f'{length:.2f}'} < {min_accept_length:g} ({mode})"
            )
    return failures


def inexact_runs(summary: list[dict]) -> list[str]:
    """Overall rows whose greedy output left the target alone's by more than rounding, as readable lines."""
    return [
        f"{row['greedy_not_rounding']} prompt(s) with {mode_label(row)}"
        + (f" after {row['context_length']} tokens of context" if "context_length" in row else "")
        for row in summary
        if row["group"] == OVERALL and row.get("greedy_not_rounding")
    ]


def summarize_contexts(context_runs: list[dict]) -> list[dict]:
    """Per context length, `summarize`'s overall rows over that length's runs, with the length and the
    prompts' mean tokens."""
    out = []
    for length in sorted({r["context_length"] for r in context_runs}):
        runs = [r for r in context_runs if r["context_length"] == length]
        tokens = statistics.fmean(r["prompt_tokens"] for r in runs)
        rows = [row for row in summarize(runs) if row["group"] == OVERALL]
        out += [{"context_length": length, "prompt_tokens": tokens, **row} for row in rows]
    return out


def _batch_groups(runs: list[dict], batch_runs: list[dict]) -> dict[tuple, list[dict]]:
    """(batch size, temperature, num_draft_tokens, engine, tree, rule) -> its runs; batch 1 from the per-prompt runs."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault(
            (1, r["temperature"], r["num_draft_tokens"], r["engine"], r.get("tree"), rule_of(r)), []
        ).append(r)
    for r in batch_runs:
        key = (
            r["batch_size"],
            r["temperature"],
            r["num_draft_tokens"],
            r.get("engine", SPECDEC),
            r.get("tree"),
            rule_of(r),
        )
        groups.setdefault(key, []).append(r)
    return groups


def _total_tps(runs: list[dict], end_to_end: bool = False) -> list[float]:
    """Per repeat: all tokens over all decode wall time (a batch's rows decode at the same time), or
    over all wall time with prefill (a peer's time is its whole call already)."""
    repeats = min(len(r["repeats"]) for r in runs)
    return [
        sum(r["repeats"][i]["new_tokens"] for r in runs)
        / max(
            sum(
                r["repeats"][i]["decode_seconds"] + (end_to_end and r["repeats"][i].get("prefill_seconds") or 0)
                for r in runs
            ),
            1e-9,
        )
        for i in range(repeats)
    ]


def _forward_seconds(runs: list[dict]) -> float | None:
    """Mean seconds of one target forward (a block: drafting excluded), over all batches and repeats."""
    # a prompt's own run has a step per forward; a batch's steps are its rows', so it counts its forwards
    blocks = [rep.get("blocks") if "prompt_ids" in r else len(rep["steps"]) for r in runs for rep in r["repeats"]]
    if None in blocks or not sum(blocks):  # a record from before batches counted their forwards
        return None
    seconds = sum(s.verify_seconds for r in runs for s in steps_of(r))
    return seconds / sum(blocks) if seconds else None  # none where no forward was timed (vLLM's)


def _rows_tokens(run: dict) -> dict[str, list[int]]:
    """Prompt id -> first repeat's tokens, for a per-prompt run or a batch."""
    tokens = run["repeats"][0]["token_ids"]
    return dict(zip(run["prompt_ids"], tokens)) if "prompt_ids" in run else {run["prompt_id"]: tokens}


def _greedy_identical(spec: list[dict], alone: list[dict]) -> int | None:
    """Prompts whose greedy speculative tokens at this batch size equal target-only tokens alone."""
    if not alone or not all("token_ids" in r["repeats"][0] for r in spec + alone) or synthetic(spec):
        return None  # a record from before token ids were kept
    reference = {k: v for r in alone for k, v in _rows_tokens(r).items()}
    ours = {k: v for r in spec for k, v in _rows_tokens(r).items()}
    return sum(reference.get(k) == v for k, v in ours.items()) if reference else None


def summarize_batches(runs: list[dict], batch_runs: list[dict]) -> list[dict]:
    """Per (batch size, temperature, num_draft_tokens or tree, rule): total tokens/s of the target alone and of
    speculative decoding at that batch size, their ratio, and acceptance; then, per (temperature,
    num_draft_tokens or tree), the smallest batch size whose speedup fell below 1 (None: none measured)."""
    groups = _batch_groups(runs, batch_runs)
    out = []
    # each engine's speculative modes against its own target alone: specdec's, and vLLM's (peer or engine)
    speculative = [k for k in groups if k[2] > 0]
    for size, temperature, num_draft_tokens, engine, tree, rule in sorted(
        speculative, key=lambda k: (k[3] != SPECDEC, k[:4], k[4] or "", k[5])
    ):
        base, spec = (
            groups.get((size, temperature, 0, engine, None, "token")),
            groups[(size, temperature, num_draft_tokens, engine, tree, rule)],
        )
        peer = groups.get((size, temperature, 0, HF, None, "token")) if engine == SPECDEC else None
        if not base:
            continue
        base_tps, spec_tps = _total_tps(base), _total_tps(spec)
        steps = [s for r in spec for s in steps_of(r)]
        out.append(
            {
                "batch_size": size,
                "engine": engine,
                "temperature": temperature,
                "num_draft_tokens": num_draft_tokens,
                "tree": tree,
                "verification": rule,
                "baseline_tokens_per_second": median_and_spread(base_tps),
                "speculative_tokens_per_second": median_and_spread(spec_tps),
                "speculative_tokens_per_second_per_sequence": median_and_spread([t / size for t in spec_tps]),
                "speedup": median_and_spread([s / b for b, s in zip(base_tps, spec_tps)]),
                "mean_accepted_length": mean_accepted_length(steps),
                "vllm_mean_acceptance_length": vllm_mean_acceptance_length(steps),
                "acceptance_by_position": acceptance_by_position(steps, num_draft_tokens),
                "draft_time_share": draft_time_share(steps),
                # what a (batch x (num_draft_tokens + 1))-token verification costs against a batch x 1 forward
                "target_forward_seconds": _forward_seconds(base),
                "verification_forward_seconds": _forward_seconds(spec),
                "greedy_identical": (
                    _greedy_identical(spec, groups.get((1, 0.0, 0, engine, None, "token"), []))
                    if temperature == 0
                    else None
                ),
                # transformers' plain generate() at this batch size, timed whole: set beside specdec's end to end
                "speculative_end_to_end_tokens_per_second": median_and_spread(_total_tps(spec, end_to_end=True)),
                "peer_tokens_per_second": median_and_spread(_total_tps(peer)) if peer else None,
            }
        )
    for row in out:
        slower = [
            r["batch_size"]
            for r in out
            if (r["engine"], r["temperature"], r["num_draft_tokens"], r["tree"], r["verification"])
            == (row["engine"], row["temperature"], row["num_draft_tokens"], row["tree"], row["verification"])
            and r["speedup"][0] < 1
        ]
        row["crossover_batch_size"] = min(slower, default=None)
    return out
