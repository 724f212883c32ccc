"""The report's `--n-cpu-moe` search figure: decode tok/s against N for each searched engine and
concurrency (median over repeats and each cell), the chosen N starred, and the N values whose
memory projection fits (green) or does not (red, never measured) shaded. Its rows come from the
search table (benchsuite.report.search_section).
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from benchsuite.report.plot import HOVER, Figure, integer_ticks, layout


def search_curves(everything: pd.DataFrame) -> list[Figure]:
    """From the search table (benchsuite.report.search_section): measured cells and ruled-out N."""
    everything = everything[everything["N"].notna()]
    measured = everything[everything["decode_tok_s"].notna()]
    if measured.empty:
        return []
    fig = go.Figure()
    for (_run_id, engine, conc), g in measured.groupby(["run_id", "engine", "concurrency"], sort=True):
        _add_curve(fig, f"{engine} · c={conc}", g)
    _add_fit_bands(fig, everything)
    layout(
        fig,
        "llama.cpp --n-cpu-moe search: decode tok/s vs N",
        "N (layers whose experts stay on the CPU)",
        "decode tok/s",
    )
    integer_ticks(fig, list(everything["N"]))
    caption = (
        "Green: N values whose memory projection fits the VRAM budget; red: N values that do not fit (not measured); "
        "star: the chosen N."
    )
    ids = tuple(i for i in everything["cell_id"] if i)  # ruled-out rows have no cell
    return [Figure("fig-search", "llama.cpp --n-cpu-moe search", fig, caption, ids)]


def _add_curve(fig: go.Figure, name: str, g: pd.DataFrame) -> None:
    """One searched engine and concurrency: the median over repeats per N, each cell, the chosen N starred."""
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
            hovertemplate=HOVER,
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
            hovertemplate=HOVER,
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
                hovertemplate=HOVER,
            )
        )


def _add_fit_bands(fig: go.Figure, everything: pd.DataFrame) -> None:
    """Green over the N range whose projection fits, red over each run of N that does not."""
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


def _runs(ns: list[int]) -> list[tuple[int, int]]:
    """Sorted integers as (first, last) of each run of consecutive values."""
    out: list[tuple[int, int]] = []
    for n in ns:
        if out and n == out[-1][1] + 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return out
