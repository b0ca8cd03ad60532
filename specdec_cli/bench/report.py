"""Benchmark tables, built once as plain rows and rendered either as rich tables or as Markdown."""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from specdec_cli.display import environment_caption, fmt

OVERALL = "overall"  # the group of all prompts, beside each category

SPEEDUP_FORMULA = (
    "speedup = mean over prompts of speculative decode tok/s / mean over prompts of target-only "
    "decode tok/s (Spec-Bench)"
)
# what decode tok/s count, by the engine that ran the config
DECODE_TIMING = {
    "specdec": "decode excludes prefill",
    "vllm": "vLLM times each call whole, so its decode tok/s count prefill too",
}
LEVIATHAN = (
    "predicted = (1 - α^(γ+1)) / ((1 - α)(γc + 1)) (Leviathan et al. 2023), α = accepted / "
    "(accepted + rejections), c = draft s per draft token / target-only s per forward, both "
    "measured here; the formula takes a (γ+1)-token verification to cost one forward, so predicted "
    "above measured is that extra verification cost plus the loop's overhead. predicted from measured "
    "parts = (1 + mean accepted per block) / (verification cost + drafting cost per block, each in "
    "target-only 1-token forwards), for chains and trees alike. weights read per second = the target's "
    "weight bytes as its products read them / seconds of a target-only step, against the machine's read "
    "bandwidth (torch's sum over 512 MiB, the best of 7, measured in the run)"
)

PEER_FAIRNESS = (
    "Fair by construction: transformers generate() runs the same loaded models (same weights, dtype, "
    "device, threads) on the same encoded prompts with the same max_new_tokens, EOS ids, sampling "
    "settings, seed and warm-up, and nothing from the checkpoint's generation_config (repetition "
    "penalty and the like), which specdec does not apply either; with ignore_eos neither side has EOS "
    "ids: both sample EOS and carry on. Both sides are timed end-to-end (prefill + decode) because "
    "generate() does not time them apart. Each peer stands beside specdec's speculative run at the "
    "same temperature; hf target only is plain generate()."
)
LOOKUP_NOTE = (
    "hf prompt lookup is transformers' n-gram drafter, not specdec's: it copies what followed the "
    "earliest match of the longest suffix n-gram (max_n down to 1, ignoring min_n), specdec's what "
    "followed the most recent match, so drafts and acceptance differ."
)


@dataclass
class Report:
    title: str
    header: list[str]
    rows: list[list[str]]
    caption: str = ""


def temperature_label(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"T={temperature:g}"


def spread(values: list[float] | tuple[float, float, float], spec: str = ".1f") -> str:
    """median (min-max), the range only when repeats differ."""
    median, low, high = values
    return f"{median:{spec}}" if low == high else f"{median:{spec}} ({low:{spec}}–{high:{spec}})"


def drafting_label(num_draft_tokens: int, tree: str | None) -> str:
    """A chain's length or a tree's shape (as --tree spells it)."""
    return f"tree {tree}" if tree else f"γ={num_draft_tokens}"


def rule_of(row: dict) -> str:
    """The verification rule of a run or summary row (rows from before it was recorded: token)."""
    return row.get("verification") or "token"


def rule_label(rule: str) -> str:
    """A mode's label names the rule where it is block; token is the default one."""
    return ", block" if rule == "block" else ""


def mode_label(row: dict) -> str:
    """A summary row's mode; a batch row of a peer engine (vLLM's) starts with its name."""
    drafting = drafting_label(row["num_draft_tokens"], row.get("tree"))
    who = "" if row.get("engine", "specdec") == "specdec" else f"{row['engine']} "
    return f"{who}{temperature_label(row['temperature'])}, {drafting}{rule_label(rule_of(row))}"


def drafting_order(rows: list[dict]) -> list[tuple[int, str | None, str]]:
    """The (num_draft_tokens, tree, rule) of the rows' speculative modes, once each: chains by length (token, then
    block), then trees."""
    modes = {(r["num_draft_tokens"], r.get("tree"), rule_of(r)) for r in rows if r["num_draft_tokens"]}
    return sorted(modes, key=lambda mode: (mode[1] is not None, mode[0], mode[1] or "", mode[2] == "block"))


def category_report(
    summary: list[dict], draft: str, rule: str, note: str | None = None, engine: str = "specdec"
) -> Report:
    """Per category and overall, one row per (category, num_draft_tokens or tree), greedy and sampled side by
    side. Medians only; the ranges over repeats are in the overall table. `draft`: what drafted;
    `rule`: how its sampled drafts were verified; `note`: what the caption says about the engine
    that ran the config, `engine`."""
    temperatures = sorted({r["temperature"] for r in summary})
    header = ["category", "γ"]
    for t in temperatures:
        name = temperature_label(t)
        header += [f"{name} base tok/s", f"{name} spec tok/s", f"{name} speedup", f"{name} acc len", f"{name} acc rate"]
    rows = []
    by_key = {(r["group"], r["num_draft_tokens"], r.get("tree"), rule_of(r), r["temperature"]): r for r in summary}
    groups = sorted({r["group"] for r in summary} - {OVERALL}) + [OVERALL]
    for group in groups:
        for num_draft_tokens, tree, mode_rule in drafting_order(summary):
            cells = [group, (f"tree {tree}" if tree else str(num_draft_tokens)) + rule_label(mode_rule)]
            for t in temperatures:
                r = by_key.get((group, num_draft_tokens, tree, mode_rule, t))
                cells += (
                    ["n/a"] * 5
                    if r is None
                    else [
                        f"{r['baseline_tokens_per_second'][0]:.1f}",
                        f"{r['speculative_tokens_per_second'][0]:.1f}",
                        f"{r['speedup'][0]:.2f}×",
                        fmt(r["mean_accepted_length"]),
                        fmt(r["acceptance_rate"], ".0%"),
                    ]
                )
            rows.append(cells)
    caption = (
        f"Draft: {draft}. γ = num_draft_tokens, tokens drafted per block (with lookup ahead of a model: the model's); "
        f"tree D,K,N = a draft tree of depth D, top-k K, N nodes verified per block; block = sampled drafts "
        f"verified as a block (Sun et al. 2025), else token by token. "
        f"{SPEEDUP_FORMULA}; {DECODE_TIMING[engine]}. acc len = mean accepted length: tokens per target "
        f"forward, incl. the bonus/recovered token (target-only = 1). acc rate = accepted / drafted."
    ) + (f" {note}" if note else "")
    return Report(f"Speedup by category, {rule}", header, rows, caption)


def detail_report(summary: list[dict], rule: str) -> Report:
    """Every overall number, one column per (temperature, num_draft_tokens)."""
    overall = [r for r in summary if r["group"] == OVERALL]
    metrics = [
        ("prompts", lambda r: str(r["prompts"])),
        ("target-only decode tok/s", lambda r: spread(r["baseline_tokens_per_second"])),
        ("speculative decode tok/s", lambda r: spread(r["speculative_tokens_per_second"])),
        ("measured speedup (decode, as Spec-Bench)", lambda r: spread(r["speedup"], ".2f") + "×"),
        ("end-to-end speedup (prefill included)", lambda r: fmt(_value(r.get("end_to_end_speedup")), ".2f", "×")),
        ("predicted speedup (Leviathan)", lambda r: fmt(r["predicted_speedup"], ".2f", "×")),
        ("predicted speedup (measured parts)", lambda r: fmt(r.get("predicted_speedup_from_parts"), ".2f", "×")),
        ("mean accepted length, pooled: all tokens / all target forwards", lambda r: fmt(r["mean_accepted_length"])),
        ("  per-request mean: each prompt's, averaged", lambda r: fmt(r.get("per_request_mean_accepted_length"))),
        (
            "mean acceptance length as vLLM, pooled: 1 + accepted / drafting blocks",
            lambda r: fmt(r.get("vllm_mean_acceptance_length")),
        ),
        (
            "  per-request mean (as SpecForge averages)",
            lambda r: fmt(r.get("per_request_vllm_mean_acceptance_length")),
        ),
        ("acceptance rate (accepted / drafted)", lambda r: fmt(r["acceptance_rate"], ".1%")),
        ("per-token acceptance α", lambda r: fmt(r["per_token_acceptance"], ".3f")),
        ("acceptance by draft position", lambda r: " ".join(fmt(p, ".2f") for p in r["acceptance_by_position"])),
        (
            "acceptance by position, given the ones before",
            lambda r: " ".join(fmt(p, ".2f") for p in r.get("conditional_acceptance_by_position") or []) or "n/a",
        ),
        (
            "blocks by accepted drafts (0 1 2 ...)",
            lambda r: " ".join(map(str, r.get("accepted_length_histogram") or [])),
        ),
        ("time drafting (vs verifying)", lambda r: fmt(r["draft_time_share"], ".1%")),
        ("target-only forward: weights read per second", _weight_read_rate),
        ("cost ratio c", lambda r: fmt(r["cost_ratio"], ".3f")),
        ("verification cost per block (1-token forwards)", lambda r: fmt(r.get("verification_cost"))),
        ("drafting cost per block (1-token forwards)", lambda r: fmt(r.get("drafting_cost"))),
        ("greedy output = target-only's", _greedy_identity),
        (
            "prefill s per prompt, base / spec",
            lambda r: f"{fmt(r['baseline_prefill_seconds'], '.3f')} / {fmt(r['speculative_prefill_seconds'], '.3f')}",
        ),
    ]
    rows = [[name] + [cell(r) for r in overall] for name, cell in metrics]
    return Report(f"Overall, {rule}", ["metric"] + [mode_label(r) for r in overall], rows, LEVIATHAN)


def _greedy_identity(r: dict) -> str:
    """Prompts with the target alone's greedy tokens, and how the others left them (bench/run.py's triage)."""
    if r.get("greedy_identical") is None:
        return "n/a"
    line = f"{r['greedy_identical']}/{r['prompts']} prompts"
    bugs = r.get("greedy_not_rounding")
    differing = r["prompts"] - r["greedy_identical"]
    if bugs is None or not differing:
        return line
    rounding = [f"{differing - bugs} by rounding"] if differing > bugs else []
    return "; ".join([line, *rounding, *([f"{bugs} NOT by rounding (a bug)"] if bugs else [])])


def _weight_read_rate(row: dict) -> str:
    rate = row.get("target_weight_read_bytes_per_second")
    if rate is None:
        return "n/a"
    return f"{rate / 1e9:.1f} GB/s, {row['target_weight_read_share']:.0%} of the machine's"


def _positions(rates: list[float | None] | None) -> str:
    return "n/a" if not rates else " ".join(fmt(p, ".2f") for p in rates)


def _sides(row: dict, name: str, cell) -> str:
    """The peer's and specdec's value of `name`, as "peer / specdec"."""
    return f"{cell(row.get(f'peer_{name}'))} / {cell(row.get(f'specdec_{name}'))}"


def _peer_greedy(r: dict) -> str:
    """Prompts with specdec's greedy tokens, and how many of the others first differ at a near-tie of specdec's."""
    if r["greedy_identical"] is None:
        return "n/a"
    near = r.get("greedy_near_ties")
    return f"{r['greedy_identical']}/{r['prompts']}" + (f" ({near} differ at near-ties)" if near else "")


def peer_report(peers: list[dict], caption: str) -> Report:
    rows = [
        [
            temperature_label(r["temperature"]),
            f"{r['engine']} target only" if r["num_draft_tokens"] == 0 else f"{r['engine']} γ={r['num_draft_tokens']}",
            f"γ={r['specdec_num_draft_tokens']}{rule_label(r.get('specdec_verification', 'token'))}",
            str(r["prompts"]),
            spread(r["peer_tokens_per_second"]),
            spread(r["specdec_tokens_per_second"]),
            f"{r['specdec_tokens_per_second'][0] / r['peer_tokens_per_second'][0]:.2f}×"
            if r["peer_tokens_per_second"][0]
            else "n/a",
            _sides(r, "end_to_end_speedup", lambda x: fmt(x, ".2f", "×")),
            _sides(r, "decode_tokens_per_second", lambda x: "n/a" if x is None else f"{x[0]:.1f}"),
            _sides(r, "mean_accepted_length", fmt),
            _sides(r, "acceptance_by_position", _positions),
            _peer_greedy(r),
        ]
        for r in peers
    ]
    header = [
        "temperature",
        "peer",
        "specdec",
        "prompts",
        "peer tok/s",
        "specdec tok/s",
        "specdec / peer",
        "speedup peer / specdec",
        "decode tok/s peer / specdec",
        "acc len peer / specdec",
        "acceptance by position peer / specdec",
        "same greedy tokens",
    ]
    return Report("Peers (end-to-end tok/s, prefill + decode)", header, rows, caption)


BATCH_NOTE = (
    "Per batch size: the prompts in consecutive batches of that size, target alone and speculative "
    "through the same loop. total tok/s = all new tokens / all decode wall time; per sequence = "
    "total / batch size; speedup = speculative total / target-only total at that batch size. "
    "verify / plain forward = a batch x (num_draft_tokens + 1)-token verification forward against a batch x 1 "
    "target-only forward. greedy = alone: prompts whose greedy speculative tokens equal their target-only tokens "
    "decoded alone. hf generate(): with --peer hf, transformers' plain batched generate() of the target (its assisted "
    "generation and prompt lookup refuse batches), timed whole, beside specdec's speculative tok/s end to end "
    "(prefill included). crossover = the smallest measured batch size whose speedup is below 1."
)
VLLM_BATCH_NOTE = (
    "vllm rows: at batch size B, B prompts go to vLLM in one llm.generate call and its scheduler batches "
    "them continuously (prefill interleaved with decoding, a finished row leaving the batch), where "
    "specdec's rows decode in lockstep; the call is timed whole, so vLLM's total tok/s counts prefill and "
    "specdec's does not. Each engine's speedup is over its own target alone at that batch size, and "
    "greedy = alone compares with its own batch-1 tokens. vLLM times no forward apart: verify / plain "
    "forward and drafting are n/a."
)


def _forward_cost(row: dict) -> str:
    """ms of a verification forward / ms of a target-only forward at the same batch size."""
    verify, plain = row.get("verification_forward_seconds"), row.get("target_forward_seconds")
    if not verify or not plain:
        return "n/a"
    return f"{1000 * verify:.0f} / {1000 * plain:.0f} ms ({verify / plain:.2f}×)"


def _peer(row: dict) -> str:
    if not row.get("peer_tokens_per_second"):
        return "n/a"
    return f"{spread(row['peer_tokens_per_second'])} ({spread(row['speculative_end_to_end_tokens_per_second'])})"


def batch_report(rows: list[dict], rule: str) -> Report:
    header = [
        "batch",
        "mode",
        "target-only tok/s",
        "speculative tok/s",
        "per sequence",
        "speedup",
        "acc len",
        "acc len (vLLM)",
        "acceptance by position",
        "drafting",
        "verify / plain forward",
        "greedy = alone",
        "hf generate() tok/s (specdec, end to end)",
        "crossover",
    ]
    table = [
        [
            str(r["batch_size"]),
            mode_label(r),
            spread(r["baseline_tokens_per_second"]),
            spread(r["speculative_tokens_per_second"]),
            spread(r["speculative_tokens_per_second_per_sequence"]),
            spread(r["speedup"], ".2f") + "×",
            fmt(r["mean_accepted_length"]),
            fmt(r["vllm_mean_acceptance_length"]),
            " ".join(fmt(p, ".2f") for p in r["acceptance_by_position"]),
            fmt(r["draft_time_share"], ".0%"),
            _forward_cost(r),
            "n/a" if r.get("greedy_identical") is None else str(r["greedy_identical"]),
            _peer(r),
            "none measured" if r["crossover_batch_size"] is None else f"batch {r['crossover_batch_size']}",
        ]
        for r in rows
    ]
    vllm = any(r.get("engine") == "vllm" for r in rows)
    return Report(f"Batch sizes, {rule}", header, table, BATCH_NOTE + (f" {VLLM_BATCH_NOTE}" if vllm else ""))


def context_report(rows: list[dict], rule: str) -> Report:
    header = [
        "context",
        "prompt tokens",
        "mode",
        "target-only tok/s",
        "speculative tok/s",
        "speedup",
        "acc len",
        "acceptance by position",
        "target-only forward",
        "verification (1-token forwards)",
        "greedy output = target-only's",
    ]
    table = [
        [
            str(r["context_length"]),
            f"{r['prompt_tokens']:.0f}",
            mode_label(r),
            f"{r['baseline_tokens_per_second'][0]:.1f}",
            f"{r['speculative_tokens_per_second'][0]:.1f}",
            f"{r['speedup'][0]:.2f}×",
            fmt(r["mean_accepted_length"]),
            " ".join(fmt(p, ".2f") for p in r["acceptance_by_position"]),
            "n/a" if not r["target_forward_seconds"] else f"{1000 * r['target_forward_seconds']:.1f} ms",
            fmt(r.get("verification_cost")),
            _greedy_identity(r),
        ]
        for r in rows
    ]
    return Report(f"By context length, {rule}", header, table, CONTEXT_NOTE)


CONTEXT_NOTE = (
    "Per context length: each prompt's first turn after a document of real text (the prompt set's other "
    "turns, then the built-in suites') cut to bring the chat-templated prompt to about that many tokens. "
    "Speedup, acceptance and tok/s as in the tables above, over these prompts; target-only forward = one "
    "decoding step at that context; verification = a block's target forward in target-only forwards."
)


COMPARED = [
    ("target-only tok/s", "baseline_tokens_per_second"),
    ("speculative tok/s", "speculative_tokens_per_second"),
    ("speedup", "speedup"),
    ("mean accepted length", "mean_accepted_length"),
]
OVERALL_ONLY = [
    ("mean accepted length, per-request mean", "per_request_mean_accepted_length"),
    ("acceptance length as vLLM", "vllm_mean_acceptance_length"),
    ("acceptance length as vLLM, per-request mean", "per_request_vllm_mean_acceptance_length"),
    ("acceptance rate", "acceptance_rate"),
]


def compare_report(a: dict, b: dict, names: tuple[str, str]) -> Report:
    """Two records side by side: overall rows matched by (temperature, num_draft_tokens or tree, rule), batch-size
    rows by (batch size, temperature, num_draft_tokens or tree, rule) where both records measured batches."""

    def overall(record: dict) -> dict:
        return {
            (r["temperature"], r["num_draft_tokens"], r.get("tree"), rule_of(r)): r
            for r in record["summary"]
            if r["group"] == OVERALL
        }

    def batches(record: dict) -> dict:
        return {
            (
                r["batch_size"],
                r.get("engine", "specdec"),
                r["temperature"],
                r["num_draft_tokens"],
                r.get("tree"),
                rule_of(r),
            ): r
            for r in record.get("batch_summary", [])
            if r["batch_size"] > 1
        }

    rows = []
    for index, fields, label in (
        (overall, COMPARED + OVERALL_ONLY, mode_label),
        (batches, COMPARED, lambda r: f"batch {r['batch_size']}, {mode_label(r)}"),
    ):
        rows_b = index(b)
        for key, ra in index(a).items():
            if key in rows_b:
                for name, field in fields:
                    if field not in ra or field not in rows_b[key]:
                        continue  # a record from before the field was kept
                    va, vb = _value(ra[field]), _value(rows_b[key][field])
                    ratio = fmt(vb / va if va and vb is not None else None, ".2f", "×")
                    rows.append([label(ra), name, fmt(va, ".3f"), fmt(vb, ".3f"), ratio])
    return Report(
        "Compare",
        ["mode", "metric", names[0], names[1], "B / A"],
        rows,
        f"A: {a['name']} ({a['timestamp']}, {verification(a)}), B: {b['name']} ({b['timestamp']}, "
        f"{verification(b)}); tok/s and speedup are medians over repeats",
    )


def verification(record: dict) -> str:
    """The rules a record's sampled chains were verified by: its plan's, else (records from before a run
    measured several) the config's, else (from before the rule was configurable) token."""
    rules = record.get("settings", {}).get("verifications") or [
        record.get("config", {}).get("speculation", {}).get("verification", "token")
    ]
    synthetic = record.get("settings", {}).get("synthetic_acceptance")
    if synthetic is not None:
        return (
            f"SYNTHETIC acceptance {synthetic:g} after {' and '.join(rules)} verification "
            "(a loop benchmark: drafts kept by chance, the output is not the target's)"
        )
    return f"{' and '.join(rules)} verification"


def _value(x) -> float | None:
    return x[0] if isinstance(x, list | tuple) else x


def rich_table(report: Report) -> Table:
    table = Table(title=report.title, caption=report.caption or None, caption_justify="left")
    for i, name in enumerate(report.header):
        # row names (categories such as math_reasoning) stay whole; the numbers' columns give way
        table.add_column(name, justify="left" if i == 0 else "right", overflow="fold", no_wrap=i == 0)
    for row in report.rows:
        table.add_row(*row, style="bold" if row[0] == OVERALL else None)
    return table


def markdown(report: Report) -> str:
    lines = [
        f"## {report.title}",
        "",
        "| " + " | ".join(report.header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(report.header) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in report.rows]
    return "\n".join(lines + (["", report.caption] if report.caption else []) + [""])


def chart_links(charts: list[str]) -> list[str]:
    """Markdown showing the PNG chart and linking every chart file (none: no lines)."""
    if not charts:
        return []
    return [f"![charts]({charts[0]})", "", "Charts: " + ", ".join(f"[{name}]({name})" for name in charts), ""]


def markdown_document(record: dict, reports: list[Report], charts: list[str]) -> str:
    """A benchmark's or tune's report.md: its tables, below the chart files `charts` (written beside it)."""
    partial = " (partial: interrupted)" if record["partial"] else ""
    head = [
        f"# specdec {record['command']}: {record['name']}{partial}",
        "",
        f"{record['timestamp']}; {environment_caption(record['environment'])}",
        "",
        f"Settings: {record['settings']}",
        "",
        *chart_links(charts),
    ]
    return "\n".join(head) + "\n" + "\n".join(markdown(r) for r in reports)
