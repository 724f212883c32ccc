"""Plotly figures of the report. Each figure comes with the cell ids it was drawn from; every
point's hover names its cell ids, and the page links each figure to the raw cells table.

Points are medians over ok repeats with min..max error bars. Failed and invalid cells are never
drawn (they are listed in the failures table). Figures without any data are not drawn at all:
the page says which ones are absent and why.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go

from benchsuite.report.groups import Spread, is_synthetic, routing_label
from benchsuite.report.tables import prompt_classes, search_table


@dataclass(frozen=True)
class Figure:
    anchor: str  # HTML id of the figure's div
    title: str
    figure: go.Figure
    caption: str
    cell_ids: tuple[str, ...]


def _has(groups: pd.DataFrame, metric: str) -> pd.Series:
    """Boolean mask: the configuration has an ok value (a Spread) for metric."""
    return pd.Series([s is not None for s in groups[metric]], index=groups.index, dtype=bool)


_HOVER = "%{fullData.name}<br>x=%{x}<br>y=%{y:.4g}<br>cells: %{customdata}<extra></extra>"


def _layout(fig: go.Figure, title: str, x_title: str, y_title: str) -> go.Figure:
    fig.update_layout(
        title=title,
        xaxis_title=x_title,
        yaxis_title=y_title,
        template="plotly_white",
        height=430,
        margin={"l": 60, "r": 20, "t": 50, "b": 50},
        legend={"font": {"size": 10}},
        font={"family": "sans-serif"},
    )
    fig.update_xaxes(automargin=True)
    return fig


def _integer_ticks(fig: go.Figure, values: list[float]) -> go.Figure:
    """Ticks only at the measured integer x values (concurrency, K, N), never at 1.2 requests."""
    ticks = sorted({int(v) for v in values if v is not None})
    fig.update_xaxes(tickmode="array", tickvals=ticks, ticktext=[str(t) for t in ticks])
    return fig


def _error_bars(spreads: list[Spread], scale: float) -> dict:
    return {
        "type": "data",
        "symmetric": False,
        "array": [(s.max - s.median) * scale for s in spreads],
        "arrayminus": [(s.median - s.min) * scale for s in spreads],
    }


def _spread_trace(
    name: str,
    xs: list[float],
    spreads: list[Spread],
    ids: list[list[str]],
    scale: float = 1.0,
    mode: str = "lines+markers",
    text: list[str] | None = None,
) -> go.Scatter:
    return go.Scatter(
        name=name,
        x=xs,
        y=[s.median * scale for s in spreads],
        mode=mode,
        text=text,
        error_y=_error_bars(spreads, scale),
        customdata=[" ".join(i) for i in ids],
        hovertemplate=_HOVER,
    )


def _metric_vs(
    groups: pd.DataFrame, metric: str, x_col: str, series_cols: list[str], scale: float = 1.0
) -> tuple[list[go.Scatter], list[str]]:
    traces, all_ids = [], []
    valid = groups[_has(groups, metric)] if len(groups) else groups
    valid = valid[valid[x_col].notna()] if len(valid) else valid
    for key, g in valid.groupby(series_cols, sort=True):
        g = g.sort_values(x_col)
        key = key if isinstance(key, tuple) else (key,)
        name = " · ".join(str(k) for k in key)
        ids = [list(i) for i in g["ok_cell_ids"]]
        traces.append(_spread_trace(name, list(g[x_col]), list(g[metric]), ids, scale))
        all_ids.extend(i for sub in ids for i in sub)
    return traces, all_ids


def throughput_vs_concurrency(groups: pd.DataFrame) -> list[Figure]:
    out = []
    for metric, title, y in (
        ("decode_tok_s_p50", "Decode tok/s per request vs concurrency", "decode tok/s (per-request median)"),
        ("output_tok_s", "Aggregate output tok/s vs concurrency", "output tok/s (all requests)"),
    ):
        traces, ids = _metric_vs(groups, metric, "concurrency", ["label", "prompt_class"])
        if traces:
            fig = _integer_ticks(
                _layout(go.Figure(traces), title, "concurrent requests", y), [x for t in traces for x in t.x]
            )
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


def decode_vs_k(groups: pd.DataFrame, top_k: int | None) -> list[Figure]:
    paged = groups[(groups["mode"] == "paged") & groups["k"].notna() & _has(groups, "decode_tok_s_p50")]
    if paged.empty:
        return []
    traces, ids = [], []
    for (engine, conc, cls, routing), g in paged.groupby(
        ["engine", "concurrency", "prompt_class", "routing"], sort=True
    ):
        g = g.sort_values("k")
        text = [f"K//top_k={int(k) // top_k}" if top_k else "top_k not recorded" for k in g["k"]]
        engine_part = "paged" if engine == "paged" else f"{engine} · paged"
        name = f"{engine_part} · c={conc} · {cls}" + (f" · {routing_label(routing)}" if is_synthetic(routing) else "")
        group_ids = [list(i) for i in g["ok_cell_ids"]]
        traces.append(
            _spread_trace(
                name, list(g["k"]), list(g["decode_tok_s_p50"]), group_ids, text=text, mode="lines+markers+text"
            )
        )
        ids.extend(i for sub in group_ids for i in sub)
    fig = _layout(
        go.Figure(traces),
        "Decode tok/s vs resident experts K",
        "K (resident experts per layer)",
        "decode tok/s (per-request median)",
    )
    _integer_ticks(fig, list(paged["k"]) + ([int(c) * top_k for c in paged["concurrency"]] if top_k else []))
    fig.update_traces(textposition="middle right", textfont={"size": 9})
    caption = "Points are labelled with K // top_k, the batch that fits in one wave."
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
        caption += " top_k is not recorded in the manifest, so K // top_k cannot be marked."
    return [Figure("fig-decode-vs-k", "Decode tok/s vs K", fig, caption, tuple(ids))]


def ttft_short_long(groups: pd.DataFrame) -> list[Figure]:
    short, long = prompt_classes(groups)
    traces, ids = [], []
    for cls in (short, long):
        g = groups[(groups["prompt_class"] == cls) & _has(groups, "ttft_p50_s")]
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
                error_y=_error_bars(spreads, 1000.0),
                customdata=[" ".join(i) for i in group_ids],
                hovertemplate=_HOVER,
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
    fig = _layout(go.Figure(traces), title, "configuration", "TTFT p50 (ms)")
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
        if data.empty:
            continue
        traces = []
        for (label, cls, conc), g in data.groupby(["label", "prompt_class", "concurrency"], sort=True):
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
        fig = _layout(go.Figure(traces), title + " (requests.parquet, warmup excluded)", "", y)
        fig.update_layout(showlegend=False, height=640, xaxis_tickangle=-30, xaxis_tickfont={"size": 9})
        out.append(
            Figure(
                f"fig-requests-{col}",
                title,
                fig,
                "Every measured request is a point; its hover names its cell.",
                tuple(sorted(set(data["cell_id"]))),
            )
        )
    return out


def paging_figures(groups: pd.DataFrame, num_experts: int | None) -> list[Figure]:
    out = []
    specs = (
        ("miss_rate", "k", "concurrency", "Miss rate vs K", "K (resident experts)", "misses / expert activations"),
        (
            "bytes_paged_per_token",
            "k",
            "concurrency",
            "Bytes paged per token vs K",
            "K (resident experts)",
            "bytes paged / output token",
        ),
        (
            "waves_per_step",
            "concurrency",
            "k",
            "Waves per decode step vs concurrency",
            "concurrent requests",
            "waves per step",
        ),
        (
            "union_mean",
            "concurrency",
            "k",
            "Union of routed experts per layer vs concurrency",
            "concurrent requests",
            "distinct experts per layer-step",
        ),
    )
    for metric, x_col, series, title, x_title, y_title in specs:
        short_name = "c" if series == "concurrency" else "K"
        names = [
            f"{engine} · {short_name}={v} · {cls}" + (f" · {routing_label(r)}" if is_synthetic(r) else "")
            for engine, v, cls, r in zip(groups["engine"], groups[series], groups["prompt_class"], groups["routing"])
        ]
        traces, ids = _metric_vs(groups.assign(series=names), metric, x_col, ["series"])
        if not traces:
            continue
        fig = _integer_ticks(_layout(go.Figure(traces), title, x_title, y_title), [x for t in traces for x in t.x])
        if metric == "miss_rate" and num_experts:
            ks = sorted({float(k) for k in groups["k"].dropna()})
            fig.add_trace(
                go.Scatter(
                    name=f"random routing: 1 - K/{num_experts}",
                    x=ks,
                    y=[1 - k / num_experts for k in ks],
                    mode="lines",
                    line={"dash": "dash", "color": "grey"},
                    customdata=["formula"] * len(ks),
                    hovertemplate=_HOVER,
                )
            )
        out.append(
            Figure(
                f"fig-{metric.replace('_', '-')}",
                title,
                fig,
                "Engine paging counters over the measured window (median over repeats).",
                tuple(ids),
            )
        )
    return out


def search_curves(everything: pd.DataFrame) -> list[Figure]:
    """From the search table (benchsuite.report.search_section): measured cells and ruled-out N."""
    everything = everything[everything["N"].notna()]
    measured = everything[everything["decode_tok_s"].notna()]
    if measured.empty:
        return []
    fig = go.Figure()
    for (_run_id, engine, conc), g in measured.groupby(["run_id", "engine", "concurrency"], sort=True):
        name = f"{engine} · c={conc}"
        per_n = g.groupby("N", sort=True)
        ns = list(per_n.groups)
        ids = [" ".join(per_n.get_group(n)["cell_id"]) for n in ns]
        medians = [float(per_n.get_group(n)["decode_tok_s"].median()) for n in ns]
        fig.add_trace(
            go.Scatter(
                name=f"{name} · median over repeats",
                x=ns,
                y=medians,
                mode="lines+markers",
                customdata=ids,
                hovertemplate=_HOVER,
            )
        )
        fig.add_trace(
            go.Scatter(
                name=f"{name} · each cell",
                x=list(g["N"]),
                y=list(g["decode_tok_s"]),
                mode="markers",
                marker={"size": 6, "color": "grey", "symbol": "circle-open"},
                customdata=list(g["cell_id"]),
                hovertemplate=_HOVER,
            )
        )
        chosen_ns = sorted({int(n) for n in g.loc[g["chosen"], "N"]})
        if chosen_ns:
            fig.add_trace(
                go.Scatter(
                    name=f"{name} · chosen N",
                    x=chosen_ns,
                    y=[medians[ns.index(n)] for n in chosen_ns],
                    mode="markers",
                    marker={"symbol": "star", "size": 16, "color": "gold", "line": {"color": "black", "width": 1}},
                    customdata=[ids[ns.index(n)] for n in chosen_ns],
                    hovertemplate=_HOVER,
                )
            )
    fitting = everything[everything["fits"].eq(True)]
    if not fitting.empty:
        fig.add_vrect(
            x0=float(fitting["N"].min()) - 0.5,
            x1=float(fitting["N"].max()) + 0.5,
            fillcolor="green",
            opacity=0.08,
            line_width=0,
            annotation_text="projection fits VRAM",
            annotation_position="top left",
        )
    for lo, hi in _runs(sorted({int(n) for n in everything.loc[everything["fits"].eq(False), "N"]})):
        fig.add_vrect(
            x0=lo - 0.5,
            x1=hi + 0.5,
            fillcolor="red",
            opacity=0.08,
            line_width=0,
            annotation_text=f"N={lo}{'' if lo == hi else f'-{hi}'}: does not fit",
            annotation_position="top left",
        )
    _layout(
        fig,
        "llama.cpp --n-cpu-moe search: decode tok/s vs N",
        "N (layers whose experts stay on the CPU)",
        "decode tok/s",
    )
    _integer_ticks(fig, list(everything["N"]))
    caption = (
        "Green: N values whose memory projection fits the VRAM budget; red: N values that do not fit (not measured); "
        "star: the chosen N."
    )
    ids = tuple(i for i in everything["cell_id"] if i)  # ruled-out rows have no cell
    return [Figure("fig-search", "llama.cpp --n-cpu-moe search", fig, caption, ids)]


def _runs(ns: list[int]) -> list[tuple[int, int]]:
    """Sorted integers as (first, last) of each run of consecutive values."""
    out: list[tuple[int, int]] = []
    for n in ns:
        if out and n == out[-1][1] + 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
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
