"""The report's figure record and the plotly building blocks every figure section uses.

A `Figure` carries the cell ids it was drawn from; `HOVER` makes every point's hover name its cell
ids. Points are medians over ok repeats with min..max error bars (`spread_trace`, `metric_vs`);
one layout for all (`layout`), integer ticks where x is a count (`integer_ticks`), a logarithmic axis
where values span a decade or more (`log_if_decades`), and one colour per mode (`family_colour`) so a
mode keeps its colour in every figure whatever the order of the traces; green and red are left to
meaning (win, loss, fits, does not fit), never to a mode.
"""

from __future__ import annotations

import math
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
        colorway=list(NEUTRAL_COLOURWAY),
    )
    fig.update_xaxes(automargin=True)
    return fig


def integer_ticks(fig: go.Figure, values: list[float]) -> go.Figure:
    """Ticks only at the measured integer x values (concurrency, K, N), never at 1.2 requests."""
    ticks = sorted({int(v) for v in values if v is not None})
    fig.update_xaxes(tickmode="array", tickvals=ticks, ticktext=[str(t) for t in ticks])
    return fig


DECADE = 10.0
_MODE_COLOURS = {
    "paged": "#1f77b4",
    "resident": "#9467bd",
    "offload": "#8c564b",
    "cpu-experts": "#17becf",
    "n-cpu-moe": "#ff7f0e",
    "gpu": "#e377c2",
}
_OTHER_COLOURS = ("#7f7f7f", "#bcbd22", "#393b79", "#843c39")
# traces not coloured by mode (one per concurrency, per prompt class) take these in turn: no green, no red
NEUTRAL_COLOURWAY = ("#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#e377c2", "#7f7f7f", "#bcbd22")


def family_colour(mode: str) -> str:
    """The colour of a mode in every figure (an unknown mode: one of the other colours, by its name)."""
    return _MODE_COLOURS.get(mode) or _OTHER_COLOURS[sum(map(ord, mode)) % len(_OTHER_COLOURS)]


_DASHES = ("solid", "dash", "dot", "dashdot", "longdash")


def colour_by_mode(traces: list, modes: list[str]) -> None:
    """Colour each trace by its configuration's mode (family_colour); configurations of one mode
    are told apart by dash, in trace order."""
    seen: dict[str, int] = {}
    for trace, mode in zip(traces, modes):
        nth = seen.get(mode, 0)
        seen[mode] = nth + 1
        if isinstance(trace, go.Scatter):
            trace.update(line={"color": family_colour(mode), "dash": _DASHES[nth % len(_DASHES)]},
                         marker={"color": family_colour(mode)})  # fmt: skip
        else:
            trace.update(marker={"color": family_colour(mode)}, line={"color": family_colour(mode)})


def spans_decades(values: list[float]) -> bool:
    """Positive values whose largest is at least DECADE times their smallest."""
    positive = [float(v) for v in values if v is not None and float(v) > 0]
    return bool(positive) and max(positive) >= DECADE * min(positive)


def log_if_decades(fig: go.Figure, values: list[float], axis: str, column: int | None = None) -> go.Figure:
    """Make `axis` ("x" or "y") logarithmic when its values span a decade or more, so one large value
    does not flatten the others; `column`: the subplot's column."""
    if not spans_decades(values):
        return fig
    where = {} if column is None else {"row": 1, "col": column}
    ticks = log_ticks([float(v) for v in values if v is not None and float(v) > 0])
    # ticks written in full (1, 2, 5, 10, 20, ...): plotly's own label minor log ticks "2", "3" (for 200, 300)
    text = [f"{int(t):,}" if t >= 1 else f"{t:g}" for t in ticks]
    (fig.update_xaxes if axis == "x" else fig.update_yaxes)(
        type="log", tickmode="array", tickvals=ticks, ticktext=text, **where
    )
    return fig


def log_ticks(values: list[float]) -> list[float]:
    """1-2-5 ticks covering the values (one step beyond them on each side)."""
    low, high = min(values), max(values)
    out = []
    for exponent in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1):
        out += [m * 10.0**exponent for m in (1, 2, 5)]
    below = max((t for t in out if t <= low), default=out[0])
    above = min((t for t in out if t >= high), default=out[-1])
    return [round(t, 12) for t in out if below <= t <= above]


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
