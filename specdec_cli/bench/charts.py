"""Charts of benchmark records, as PNG and SVG: one column of panels per record, so `compare` sets two
runs side by side on the same y scales. matplotlib is imported only when a chart is drawn, so
`specdec --help` and runs with --no-record never load it."""

from __future__ import annotations

import io
import math

from specdec_cli.bench.report import OVERALL, drafting_order, mode_label, rule_of, temperature_label, verification

CHART_FILES = ("chart.png", "chart.svg")


def _modes(rows: list[dict]) -> list[tuple[float, int, str | None, str]]:
    """(temperature, num_draft_tokens, tree, rule) of each speculative mode of the rows, in the tables' order."""
    measured = {_key(r) for r in rows}  # block verification exists only at temperatures above 0
    temperatures = sorted({r["temperature"] for r in rows})
    return [(t, *mode) for t in temperatures for mode in drafting_order(rows) if (t, *mode) in measured]


def _key(row: dict) -> tuple[float, int, str | None, str]:
    return row["temperature"], row["num_draft_tokens"], row.get("tree"), rule_of(row)


def _label(key: tuple[float, int, str | None, str]) -> str:
    return mode_label(dict(zip(("temperature", "num_draft_tokens", "tree", "verification"), key)))


def _colours(record: dict) -> dict[tuple, str]:
    """One colour per mode, the same in every panel of a record, so one legend names them."""
    return {key: f"C{i % 10}" for i, key in enumerate(_modes(record["summary"] + (record.get("batch_summary") or [])))}


def _first(value) -> float:
    """A [median, min, max] as its median, a missing figure as NaN (a gap in the chart)."""
    value = value[0] if isinstance(value, list | tuple) else value
    return math.nan if value is None else value


def _nothing(ax, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="gray")


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:  # beside the panel, hiding nothing
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))


def _by_category(ax, record: dict, field: str) -> None:
    """Grouped bars: a group per category (overall last), a bar per (temperature, num_draft_tokens or tree), and
    a dashed line at 1, the target alone."""
    rows = record["summary"]
    if not rows:
        return _nothing(ax, "nothing measured")
    groups = sorted({r["group"] for r in rows} - {OVERALL}) + [OVERALL]
    modes, colours = _modes(rows), _colours(record)
    width = 0.8 / len(modes)
    for i, key in enumerate(modes):
        values = {r["group"]: _first(r[field]) for r in rows if _key(r) == key}
        xs = [g + (i - (len(modes) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [values.get(g, math.nan) for g in groups], width, color=colours[key], label=_label(key))
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")


def speedup_by_category(ax, record: dict) -> None:
    ax.set_title("Speedup by category (dashed: the target alone)")
    _by_category(ax, record, "speedup")
    _legend(ax)


def accepted_length_by_category(ax, record: dict) -> None:
    ax.set_title("Mean accepted length: tokens per target forward")
    _by_category(ax, record, "mean_accepted_length")


def acceptance_by_position(ax, record: dict) -> None:
    ax.set_title("Acceptance by draft position (by depth for trees)")
    overall = [r for r in record["summary"] if r["group"] == OVERALL]
    if not overall:
        return _nothing(ax, "nothing measured")
    colours = _colours(record)
    for row in overall:
        rates = [_first(p) for p in row["acceptance_by_position"]]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", color=colours[_key(row)])
    ax.set_xlabel("draft position / depth")
    ax.set_ylabel("kept when drafted")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)


def throughput_by_batch_size(ax, record: dict) -> None:
    """Total tok/s per batch size: each speculative mode, and the target alone once per temperature
    (gray); a red X where a mode first fell below the target alone (the crossover). The engine that ran
    the config only: a peer's batches are in the table."""
    ax.set_title("Throughput by batch size (X: crossover)")
    engine = record.get("engine", "specdec")
    rows = [r for r in record.get("batch_summary") or [] if r.get("engine", "specdec") == engine]
    if not any(r["batch_size"] > 1 for r in rows):
        return _nothing(ax, "no --batch-sizes")
    colours = _colours(record)
    for key in _modes(rows):
        mode = sorted((r for r in rows if _key(r) == key), key=lambda r: r["batch_size"])
        crossover = mode[0]["crossover_batch_size"]
        label = _label(key) + ("" if crossover is None else f": crossover at batch {crossover}")
        spec = {r["batch_size"]: _first(r["speculative_tokens_per_second"]) for r in mode}
        ax.plot(list(spec), list(spec.values()), marker="o", color=colours[key], label=label)
        if crossover is not None:
            ax.plot(crossover, spec[crossover], "X", color="red", markersize=11)
    for i, temperature in enumerate(sorted({r["temperature"] for r in rows})):
        # the target alone is the same run for every mode of a temperature: one line each
        base = {r["batch_size"]: r["baseline_tokens_per_second"] for r in rows if r["temperature"] == temperature}
        sizes = sorted(base)
        label = f"target alone, {temperature_label(temperature)}"
        ax.plot(sizes, [_first(base[s]) for s in sizes], linestyle=["--", ":", "-."][i % 3], color="gray", label=label)
    sizes = sorted({r["batch_size"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("total tok/s")
    ax.set_ylim(bottom=0)
    _legend(ax)


def _peer_label(row: dict) -> str:
    """A peer row's pairing: `T=1, γ=3 beside hf prompt lookup` (specdec's chain, the peer's mode)."""
    ours = mode_label({"temperature": row["temperature"], "num_draft_tokens": row["specdec_num_draft_tokens"]})
    return f"{ours} beside {row['engine']}" + ("" if row["num_draft_tokens"] else " (target alone)")


def beside_peers(ax, record: dict) -> None:
    """Per peer mode, specdec's end-to-end tokens/s and the peer's, side by side, each bar labelled
    with its speedup over its own engine's target alone."""
    ax.set_title("Beside the peer: end-to-end tok/s (labels: speedup over its own target alone)")
    rows = record.get("peers") or []
    width = 0.4
    for offset, side, colour in ((-width / 2, "specdec", "C0"), (width / 2, "peer", "C1")):
        values = [_first(r[f"{side}_tokens_per_second"]) for r in rows]
        bars = ax.bar([i + offset for i in range(len(rows))], values, width, color=colour, label=side)
        speedups = [_first(r[f"{side}_end_to_end_speedup"]) for r in rows]
        ax.bar_label(bars, [f"{x:.2f}x" if not math.isnan(x) else "" for x in speedups], fontsize="small")
    ax.set_xticks(range(len(rows)), [_peer_label(r) for r in rows], rotation=20, ha="right")
    ax.set_ylabel("tok/s")
    _legend(ax)


def peer_acceptance_by_position(ax, record: dict) -> None:
    """The peer's acceptance by position (dashed) beside specdec's (solid), where the peer reports its steps."""
    ax.set_title("Beside the peer: acceptance by draft position")
    rows = [r for r in record.get("peers") or [] if r["num_draft_tokens"] and r.get("peer_acceptance_by_position")]
    if not rows:
        return _nothing(ax, "the peer reports no acceptance")
    for i, row in enumerate(rows):
        for side, style in (("specdec", "-"), ("peer", "--")):
            rates = [_first(p) for p in row[f"{side}_acceptance_by_position"]]
            name = "specdec" if side == "specdec" else row["engine"]
            mode = {"temperature": row["temperature"], "num_draft_tokens": row["num_draft_tokens"]}
            label = f"{name}, {mode_label(mode)}"
            ax.plot(range(1, len(rates) + 1), rates, style, marker="o", color=f"C{i % 10}", label=label)
    ax.set_xlabel("draft position")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    _legend(ax)


def heading(record: dict) -> str:
    return f"{record['name']} ({record['timestamp']}, {verification(record)})"


def draw(columns: list[tuple[str, dict]]) -> dict[str, bytes]:
    """The chart files of records (column heading, record): a row per panel, a column per record,
    the y axis shared along each row. The batch panel only when some record measured batch sizes, the
    peer panels only when some record ran a peer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg: no display needed
    from matplotlib.figure import Figure

    panels = [speedup_by_category, accepted_length_by_category, acceptance_by_position]
    if any(r["batch_size"] > 1 for _, record in columns for r in record.get("batch_summary") or []):
        panels.append(throughput_by_batch_size)
    peers = [row for _, record in columns for row in record.get("peers") or []]
    if peers:
        panels.append(beside_peers)
    if any(row.get("peer_acceptance_by_position") for row in peers):  # vLLM reports its steps, transformers not
        panels.append(peer_acceptance_by_position)
    figure = Figure(figsize=(9 * len(columns), 3.6 * len(panels)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), len(columns), sharey="row", squeeze=False)
    for column, (title, record) in enumerate(columns):
        for row, panel in enumerate(panels):
            panel(axes[row][column], record)
        axes[0][column].set_title(f"{title}\n{axes[0][column].get_title()}")
    return _files(figure)


def _files(figure) -> dict[str, bytes]:
    import matplotlib

    files = {}
    for name in CHART_FILES:
        buffer = io.BytesIO()
        with matplotlib.rc_context({"svg.fonttype": "none"}):  # the SVG's words stay text: searchable, smaller
            figure.savefig(buffer, format=name.rsplit(".", 1)[1], dpi=110)
        files[name] = buffer.getvalue()
    return files


def draw_tuning(record: dict) -> dict[str, bytes]:
    """`specdec tune`'s chart: a panel per temperature, speedup over the target alone by batch size of
    the chosen draft tokens (measured, and as predicted) and of the config as it is."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    temperatures = sorted({c["temperature"] for c in record["choices"]})
    figure = Figure(figsize=(5 * len(temperatures), 3.8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(temperatures), sharey="row", squeeze=False)[0]
    for ax, temperature in zip(axes, temperatures):
        choices = [c for c in record["choices"] if c["temperature"] == temperature]
        choices.sort(key=lambda c: c["batch_size"])
        sizes = [c["batch_size"] for c in choices]
        lines = [
            ("tuned, measured", "C0", "-", [c["measured"].get(c["written"], math.nan) for c in choices]),
            ("tuned, predicted", "C0", "--", [c["predicted"][c["written"]] for c in choices]),
            ("config as it is", "C1", ":", [c["measured"].get(c["config_label"], math.nan) for c in choices]),
        ]
        for label, colour, style, values in lines:
            ax.plot(sizes, values, style, color=colour, marker="o", label=label)
        for size, c in zip(sizes, choices):
            label = "off" if c["written"] == "0" else c["written"]
            ax.annotate(label, (size, c["predicted"][c["written"]]), fontsize="small")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set(title=temperature_label(temperature), xlabel="batch size", ylabel="speedup over the target alone")
    _legend(axes[-1])
    figure.suptitle(f"{heading(record)}: speculation (labels: draft tokens, or tree) by batch size")
    return _files(figure)
