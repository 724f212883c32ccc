"""Plotly figures of the report. Each figure comes with the cell ids it was drawn from; every
point's hover names its cell ids, and the page links each figure to the raw cells table.

Points are medians over ok repeats with min..max error bars. Failed and invalid cells are never
drawn (they are listed in the failures table). Figures without any data are not drawn at all:
the page says which ones are absent and why.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from benchsuite.report.groups import is_synthetic, routing_label
from benchsuite.report.paging_figures import paging_figures
from benchsuite.report.plot import (
    HOVER,
    Figure,
    colour_by_mode,
    error_bars,
    has_metric,
    integer_ticks,
    layout,
    log_if_decades,
    metric_vs,
    spread_trace,
)
from benchsuite.report.search_figure import search_curves
from benchsuite.report.tables import prompt_classes, search_table


def throughput_vs_concurrency(groups: pd.DataFrame) -> list[Figure]:
    out = []
    for metric, title, y in (
        ("decode_tok_s_p50", "Decode tok/s per request vs concurrency", "decode tok/s (per-request median)"),
        ("output_tok_s", "Aggregate output tok/s vs concurrency", "output tok/s (all requests)"),
    ):
        traces, ids = metric_vs(groups, metric, "concurrency", ["label", "prompt_class"])
        colour_by_mode(traces, [_mode_of(groups, t.name.rsplit(" · ", 1)[0]) for t in traces])
        if traces:
            fig = integer_ticks(
                layout(go.Figure(traces), title, "concurrent requests", y), [x for t in traces for x in t.x]
            )
            log_if_decades(fig, [y for t in traces for y in t.y], "y")
            out.append(
                Figure(
                    f"fig-{metric}-vs-concurrency",
                    title,
                    fig,
                    "One line per engine, mode and setting; median over repeats, bars min..max.",
                    tuple(ids),
                )
            )
    return out


def _mode_of(frame: pd.DataFrame, label: str) -> str:
    """The mode of the configuration labelled `label` (its colour in every figure)."""
    found = frame[frame["label"] == label]
    return str(found["mode"].iloc[0]) if len(found) else ""


def decode_vs_k(groups: pd.DataFrame, top_k: int | None) -> list[Figure]:
    paged = groups[(groups["mode"] == "paged") & groups["k"].notna() & has_metric(groups, "decode_tok_s_p50")]
    if paged.empty:
        return []
    traces: list[go.Scatter | go.Bar] = []
    ids: list[str] = []
    for (engine, conc, cls, routing), g in paged.groupby(
        ["engine", "concurrency", "prompt_class", "routing"], sort=True
    ):
        g = g.sort_values("k")
        text = [f"K//top_k={int(k) // top_k}" for k in g["k"]] if top_k else None
        engine_part = "paged" if engine == "paged" else f"{engine} · paged"
        name = f"{engine_part} · c={conc} · {cls}" + (f" · {routing_label(routing)}" if is_synthetic(routing) else "")
        group_ids = [list(i) for i in g["ok_cell_ids"]]
        traces.append(
            spread_trace(
                name,
                list(g["k"]),
                list(g["decode_tok_s_p50"]),
                group_ids,
                text=text,
                mode="lines+markers+text" if text else "lines+markers",
            )
        )
        ids.extend(i for sub in group_ids for i in sub)
    fig = layout(
        go.Figure(traces),
        "Decode tok/s vs resident experts K",
        "K (resident experts per layer)",
        "decode tok/s (per-request median)",
    )
    integer_ticks(fig, list(paged["k"]) + ([int(c) * top_k for c in paged["concurrency"]] if top_k else []))
    fig.update_traces(textposition="middle right", textfont={"size": 9})
    caption = "Points are labelled with K // top_k, the batch that fits in one wave." if top_k else ""
    if top_k:
        for conc in sorted({int(c) for c in paged["concurrency"]}):
            fig.add_vline(
                x=conc * top_k,
                line_dash="dot",
                line_color="grey",
                annotation_position="bottom right",
                annotation_text=f"K={conc * top_k}: {conc} req/wave",
                annotation_font_size=9,
            )
        caption += (
            f" Dotted lines: the smallest K whose K // top_k (top_k={top_k}) fits each measured concurrency "
            "in one wave."
        )
    else:
        caption = "top_k is not recorded in the manifest, so K // top_k (the batch one wave holds) is not marked."
    return [Figure("fig-decode-vs-k", "Decode tok/s vs K", fig, caption, tuple(ids))]


def ttft_short_long(groups: pd.DataFrame) -> list[Figure]:
    short, long = prompt_classes(groups)
    traces: list[go.Scatter | go.Bar] = []
    ids: list[str] = []
    for cls in (short, long):
        g = groups[(groups["prompt_class"] == cls) & has_metric(groups, "ttft_p50_s")]
        if cls is None or g.empty:
            continue
        g = g.sort_values(["label", "concurrency"])
        xs = [f"{lab} · c={c}" for lab, c in zip(g["label"], g["concurrency"])]
        group_ids = [list(i) for i in g["ok_cell_ids"]]
        spreads = list(g["ttft_p50_s"])
        traces.append(
            go.Bar(
                name=f"{cls} prompts",
                x=xs,
                y=[s.median * 1000.0 for s in spreads],
                error_y=error_bars(spreads, 1000.0),
                customdata=[" ".join(i) for i in group_ids],
                hovertemplate=HOVER,
            )
        )
        ids.extend(i for sub in group_ids for i in sub)
    if not traces:
        return []
    title = (
        f"TTFT p50: {short} vs {long} prompts"
        if long
        else f"TTFT p50, {short} prompts (no long-prompt class was measured)"
    )
    fig = layout(go.Figure(traces), title, "configuration", "TTFT p50 (ms)")
    log_if_decades(fig, [y for t in traces for y in t.y], "y")
    fig.update_layout(barmode="group", height=600, xaxis_tickangle=-30, xaxis_tickfont={"size": 9})
    return [
        Figure(
            "fig-ttft-short-long",
            "TTFT p50 short vs long prompts",
            fig,
            "Median over repeats of each cell's TTFT p50; bars min..max.",
            tuple(ids),
        )
    ]


def request_distributions(cells: pd.DataFrame, samples: pd.DataFrame) -> list[Figure]:
    if samples.empty:
        return []
    joined = samples.merge(cells[["cell_id", "label", "prompt_class", "concurrency"]], on="cell_id")
    out = []
    for col, scale, title, y in (
        ("ttft_s", 1000.0, "Per-request TTFT", "TTFT (ms)"),
        ("decode_tok_s", 1.0, "Per-request decode rate", "decode tok/s"),
    ):
        data = joined[joined[col].notna()]
        caption = "Every measured request is a point; its hover names its cell."
        if col == "decode_tok_s" and "one_read" in data:
            # a stream read whole has a decode "rate" that is the client's parse time: it would flatten the rest
            one_read = data["one_read"].fillna(False).astype(bool)
            if one_read.any():
                n = int(one_read.sum())
                caption += (
                    f" Left out: {n} request{'s' if n != 1 else ''} that arrived (mostly) whole in one read, whose "
                    "decode the client could not time (their cells' decode figure says what stood in)."
                )
            data = data[~one_read]
        if data.empty:
            continue
        traces, modes = [], []
        for (label, cls, conc), g in data.groupby(["label", "prompt_class", "concurrency"], sort=True):
            modes.append(_mode_of(cells, label))
            traces.append(
                go.Box(
                    name=f"{label} · {cls} · c={conc}",
                    y=list(g[col] * scale),
                    boxpoints="all",
                    jitter=0.4,
                    pointpos=0,
                    marker={"size": 3},
                    customdata=list(g["cell_id"]),
                    hovertemplate="%{y:.4g}<br>cell: %{customdata}<extra></extra>",
                )
            )
        colour_by_mode(traces, modes)
        fig = layout(go.Figure(traces), title + " (requests.parquet, warmup excluded)", "", y)
        fig.update_layout(showlegend=False, height=640, xaxis_tickangle=-30, xaxis_tickfont={"size": 9})
        log_if_decades(fig, list(data[col] * scale), "y")
        out.append(
            Figure(
                f"fig-requests-{col}",
                title,
                fig,
                caption,
                tuple(sorted(set(data["cell_id"]))),
            )
        )
    return out


def all_figures(
    groups: pd.DataFrame,
    cells: pd.DataFrame,
    samples: pd.DataFrame,
    top_k: int | None,
    num_experts: int | None,
    search: pd.DataFrame | None = None,
) -> list[Figure]:
    return [
        *throughput_vs_concurrency(groups),
        *decode_vs_k(groups, top_k),
        *ttft_short_long(groups),
        *request_distributions(cells[cells["status"] == "ok"], samples),
        *paging_figures(groups, num_experts),
        *search_curves(search_table(cells) if search is None else search),
    ]


def missing_figures(figures: list[Figure]) -> list[str]:
    """Names of the standard figures that have no data in these runs."""
    present = {f.anchor for f in figures}
    expected = {
        "fig-decode_tok_s_p50-vs-concurrency": "decode tok/s vs concurrency (no ok cell has decode tok/s)",
        "fig-decode-vs-k": "decode tok/s vs K (no ok paged cell with a known K)",
        "fig-ttft-short-long": "TTFT short vs long prompts (no ok cell has TTFT)",
        "fig-requests-ttft_s": "per-request distributions (no measured request in requests.parquet)",
        "fig-miss-rate": "paging counters (no engine reported them)",
        "fig-search": "llama.cpp search curve (no cell carries search_n / fits / chosen)",
    }
    return [text for anchor, text in expected.items() if anchor not in present]
