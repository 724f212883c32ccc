"""The report's budget-search figures, one per searched option (llama.cpp `--n-cpu-moe` N, the
paged engine's K): decode tok/s against the value for each searched engine and concurrency (median
over repeats and each cell), the chosen value starred, launches measured over the budget crossed,
and the values whose memory projection fits (green) or does not (red, never measured) shaded. Its
rows come from the search table (benchsuite.report.search_section).
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from benchsuite.engines.base import FIRST_SEARCH_OPTION, SEARCH_KNOBS
from benchsuite.report.plot import HOVER, Figure, integer_ticks, layout


def search_curves(everything: pd.DataFrame) -> list[Figure]:
    """From the search table (benchsuite.report.search_section): measured cells and ruled-out values,
    one figure per searched option."""
    everything = everything[everything["N"].notna()]
    options = everything["option"].fillna(FIRST_SEARCH_OPTION) if "option" in everything else None
    figures = []
    for knob in SEARCH_KNOBS.values():
        rows = everything if options is None else everything[options == knob.option]
        figure = _option_figure(rows, knob.figure_id, knob.title, knob.letter, knob.axis)
        if figure is not None:
            figures.append(figure)
    return figures


def _option_figure(everything: pd.DataFrame, fig_id: str, title: str, letter: str, axis: str) -> Figure | None:
    measured = everything[everything["decode_tok_s"].notna()]
    if measured.empty:
        return None
    fig = go.Figure()
    for (_run_id, engine, conc), g in measured.groupby(["run_id", "engine", "concurrency"], sort=True):
        _add_curve(fig, f"{engine} · c={conc}", g, letter)
    _add_fit_bands(fig, everything, letter)
    layout(fig, f"{title}: decode tok/s vs {letter}", axis, "decode tok/s")
    integer_ticks(fig, list(everything["N"]))
    caption = (
        f"Green: {letter} values whose memory projection fits the VRAM budget; red: {letter} values that do not fit "
        f"(not measured); cross: launched, its measured peak device memory over the budget; star: the chosen {letter}."
    )
    ids = tuple(i for i in everything["cell_id"] if i)  # ruled-out rows have no cell
    return Figure(fig_id, title, fig, caption, ids)


def _add_curve(fig: go.Figure, name: str, g: pd.DataFrame, letter: str) -> None:
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
    over = g[g["status"].eq("over budget")] if "status" in g else g.iloc[:0]
    if not over.empty:
        fig.add_trace(
            go.Scatter(
                name=f"{name} · measured over the budget",
                x=list(over["N"]),
                y=list(over["decode_tok_s"]),
                mode="markers",
                marker={"symbol": "x", "size": 12, "color": "red"},
                customdata=list(over["cell_id"]),
                hovertemplate=HOVER,
            )
        )
    chosen_ns = sorted({int(n) for n in g.loc[g["chosen"], "N"]})
    if chosen_ns:
        fig.add_trace(
            go.Scatter(
                name=f"{name} · chosen {letter}",
                x=chosen_ns,
                y=[medians[ns.index(n)] for n in chosen_ns],
                mode="markers",
                marker={"symbol": "star", "size": 16, "color": "gold", "line": {"color": "black", "width": 1}},
                customdata=[ids[ns.index(n)] for n in chosen_ns],
                hovertemplate=HOVER,
            )
        )


def _add_fit_bands(fig: go.Figure, everything: pd.DataFrame, letter: str) -> None:
    """Green over the range whose projection fits, red over each run of values that does not."""
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
            annotation_text=f"{letter}={lo}{'' if lo == hi else f'-{hi}'}: does not fit",
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
