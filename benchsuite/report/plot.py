"""The report's figure record and the plotly building blocks every figure section uses.

A `Figure` carries the cell ids it was drawn from; `HOVER` makes every point's hover name its cell
ids. Points are medians over ok repeats with min..max error bars (`spread_trace`, `metric_vs`);
one layout for all (`layout`), integer ticks where x is a count (`integer_ticks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go

from benchsuite.report.groups import Spread


@dataclass(frozen=True)
class Figure:
    anchor: str  # HTML id of the figure's div
    title: str
    figure: go.Figure
    caption: str
    cell_ids: tuple[str, ...]


def has_metric(groups: pd.DataFrame, metric: str) -> pd.Series:
    """Boolean mask: the configuration has an ok value (a Spread) for metric."""
    return pd.Series([s is not None for s in groups[metric]], index=groups.index, dtype=bool)


HOVER = "%{fullData.name}<br>x=%{x}<br>y=%{y:.4g}<br>cells: %{customdata}<extra></extra>"


def layout(fig: go.Figure, title: str, x_title: str, y_title: str) -> go.Figure:
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


def integer_ticks(fig: go.Figure, values: list[float]) -> go.Figure:
    """Ticks only at the measured integer x values (concurrency, K, N), never at 1.2 requests."""
    ticks = sorted({int(v) for v in values if v is not None})
    fig.update_xaxes(tickmode="array", tickvals=ticks, ticktext=[str(t) for t in ticks])
    return fig


def error_bars(spreads: list[Spread], scale: float) -> dict:
    return {
        "type": "data",
        "symmetric": False,
        "array": [(s.max - s.median) * scale for s in spreads],
        "arrayminus": [(s.median - s.min) * scale for s in spreads],
    }


def spread_trace(
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
        error_y=error_bars(spreads, scale),
        customdata=[" ".join(i) for i in ids],
        hovertemplate=HOVER,
    )


def metric_vs(
    groups: pd.DataFrame, metric: str, x_col: str, series_cols: list[str], scale: float = 1.0
) -> tuple[list[go.Scatter], list[str]]:
    traces: list[go.Scatter] = []
    all_ids: list[str] = []
    valid = groups[has_metric(groups, metric)] if len(groups) else groups
    valid = valid[valid[x_col].notna()] if len(valid) else valid
    for key, g in valid.groupby(series_cols, sort=True):
        g = g.sort_values(x_col)
        key = key if isinstance(key, tuple) else (key,)
        name = " · ".join(str(k) for k in key)
        ids = [list(i) for i in g["ok_cell_ids"]]
        traces.append(spread_trace(name, list(g[x_col]), list(g[metric]), ids, scale))
        all_ids.extend(i for sub in ids for i in sub)
    return traces, all_ids
