"""The figure a user comes for: speed against device memory, one per setup (run, workload, prompt class),
shown on the first screen under the verdict.

- left: decode tok/s of one stream (c=1, else the lowest concurrency measured); right: output tok/s of
  all streams at the highest concurrency measured; each against the configuration's device memory at
  that concurrency (report.budget.device_figure: the peak NVML figure, else the older per-engine
  figures; the largest over its ok cells, as a budget must hold the worst repeat);
- one point per configuration (median over ok repeats, bars min..max), coloured by its mode, named by
  what it is (report.names);
- the run's GPU memory budget as a vertical line where the run had one, the configurations over it
  (no contenders on the first screen) drawn hollow;
- the frontier: configurations no other configuration beats on both axes (as fast or faster with as
  little memory or less, and strictly better on one), joined by a step line: the best speed
  available at each memory size;
- an axis is logarithmic where its values span a decade or more (plot.log_if_decades).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from benchsuite.report.budget import device_figure
from benchsuite.report.groups import Spread
from benchsuite.report.names import short_name
from benchsuite.report.plot import Figure, family_colour, log_if_decades, spans_decades

GB = 1e9
ANCHOR = "fig-speed-memory"
MISSING = "speed against device memory (no ok cell measured device memory: a CPU run, or an engine that reports none)"


@dataclass(frozen=True)
class Point:
    name: str
    mode: str
    family: str  # the legend's name: mode (engine kind)
    memory_gb: float
    speed: Spread
    cell_ids: tuple[str, ...]
    memory_figure: str = "peak"  # which figure (report.budget.device_figure): a peak, or a fallback's name


def _memory_gb(cells: pd.DataFrame, ids: list[str]) -> tuple[float, str] | None:
    """The largest device memory of the cells, and which figure it is."""
    found = [device_figure(c) for _, c in cells[cells["cell_id"].isin(ids)].iterrows()]
    measured = [f for f in found if f is not None]
    if not measured:
        return None
    memory_bytes, figure = max(measured)
    return memory_bytes / GB, "peak" if figure.startswith("peak") else figure


def _points(rows: pd.DataFrame, cells: pd.DataFrame, metric: str) -> list[Point]:
    out = []
    for _, row in rows.iterrows():
        found = _memory_gb(cells, list(row["ok_cell_ids"]))
        if row[metric] is None or found is None:
            continue
        memory, figure = found
        family = f"{row['mode']} ({row['engine_kind']})"
        ids = tuple(row["ok_cell_ids"])
        out.append(Point(short_name(row), str(row["mode"]), family, memory, row[metric], ids, figure))
    return sorted(out, key=lambda p: (p.memory_gb, -p.speed.median, p.name))


def frontier(points: list[Point]) -> list[Point]:
    """The points not beaten on both axes, by memory ascending (each faster than every one before it)."""
    out: list[Point] = []
    for p in sorted(points, key=lambda p: (p.memory_gb, -p.speed.median)):
        if not out or p.speed.median > out[-1].speed.median:
            out.append(p)
    return out


def _panel(fig: go.Figure, points: list[Point], column: int, shown_modes: set[str], budget_gb: float | None) -> None:
    for p in points:
        over = budget_gb is not None and p.memory_gb > budget_gb  # no contender: drawn hollow
        fig.add_trace(
            go.Scatter(
                x=[p.memory_gb],
                y=[p.speed.median],
                mode="markers+text",
                text=[p.name],
                textposition="top center",
                textfont={"size": 9},
                marker={"size": 9, "color": family_colour(p.mode), "symbol": "circle-open" if over else "circle"},
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": [p.speed.max - p.speed.median],
                    "arrayminus": [p.speed.median - p.speed.min],
                },
                name=p.family,
                legendgroup=p.family,
                showlegend=p.family not in shown_modes,
                customdata=[" ".join(p.cell_ids)],
                hovertemplate=f"{p.name}<br>%{{x:.3g}} GB<br>%{{y:.4g}} tok/s<br>cells: %{{customdata}}<extra></extra>",
            ),
            row=1,
            col=column,
        )
        shown_modes.add(p.family)
    best = frontier(points)
    fig.add_trace(
        go.Scatter(
            x=[p.memory_gb for p in best],
            y=[p.speed.median for p in best],
            mode="lines",
            line={"shape": "hv", "color": "black", "width": 1, "dash": "dot"},
            name="frontier (not beaten on both axes)",
            legendgroup="frontier",
            showlegend=column == 1,
            hoverinfo="skip",
        ),
        row=1,
        col=column,
    )


SYNTHETIC_SUFFIX = " (synthetic routing)"


def _common_suffix(drawn: list[tuple[list[Point], str]]) -> str:
    """ " (synthetic routing)" when every point carries it (said once in the title instead), else ""."""
    names = [p.name for points, _ in drawn for p in points]
    return SYNTHETIC_SUFFIX if names and all(n.endswith(SYNTHETIC_SUFFIX) for n in names) else ""


def _padded_range(values: list[float], log: bool) -> list[float]:
    """The x range with room for the points' labels at both ends (a label centred on the last point)."""
    low, high = min(values), max(values)
    if log:
        return [math.log10(low) - 0.12, math.log10(high) + 0.12]
    pad = max((high - low) * 0.12, 0.5)
    return [max(low - pad, 0.0), high + pad]


def _concurrencies(rows: pd.DataFrame) -> tuple[int, int]:
    measured = sorted({int(c) for c in rows["concurrency"]})
    return measured[0], measured[-1]


def speed_memory_figures(
    groups: pd.DataFrame, cells: pd.DataFrame, first: tuple[tuple[str, str, str], ...] = ()
) -> list[Figure]:
    """One figure per setup with at least one configuration whose device memory was measured; the setups
    in `first` (those the first screen has a verdict for, in its order) lead."""
    out = []
    setups = dict(iter(groups.groupby(["run_id", "workload", "prompt_class"], sort=True)))
    ordered = [k for k in first if k in setups] + [k for k in setups if k not in first]
    for number, key in enumerate(ordered):
        setup = setups[key]
        low, high = _concurrencies(setup)
        panels = [
            (setup[setup["concurrency"] == low], "decode_tok_s_p50", f"decode tok/s, c={low}"),
            (setup[setup["concurrency"] == high], "output_tok_s", f"output tok/s, all streams, c={high}"),
        ]
        if high == low:
            panels = panels[:1]
        drawn = [(_points(rows, cells, metric), title) for rows, metric, title in panels]
        drawn = [(points, title) for points, title in drawn if points]
        if not drawn:
            continue
        suffix = _common_suffix(drawn)
        if suffix:
            drawn = [([replace(p, name=p.name[: -len(suffix)]) for p in points], t) for points, t in drawn]
        fig = make_subplots(rows=1, cols=len(drawn), subplot_titles=[t for _, t in drawn], horizontal_spacing=0.08)
        shown: set[str] = set()
        budget = next((float(b) for b in setup_budgets(cells, key) if b), None)
        for column, (points, title) in enumerate(drawn, start=1):
            _panel(fig, points, column, shown, budget / GB if budget else None)
            peaks = all(p.memory_figure == "peak" for p in points)
            axis = "peak device memory (GB)" if peaks else "device memory (GB; not all peaks, see below)"
            fig.update_xaxes(title_text=axis, row=1, col=column)
            fig.update_yaxes(title_text=title, row=1, col=column)
            memory = [p.memory_gb for p in points] + ([budget / GB] if budget else [])
            log_if_decades(fig, memory, "x", column)
            fig.update_xaxes(range=_padded_range(memory, spans_decades(memory)), row=1, col=column)
            log_if_decades(fig, [p.speed.median for p in points], "y", column)
            if budget:
                fig.add_vline(
                    x=budget / GB,
                    line_dash="dash",
                    line_color="firebrick",
                    annotation_text=f"budget {budget / GB:.3g} GB",
                    annotation_font_size=10,
                    row=1,
                    col=column,
                )
        run_id, workload, prompt_class = key
        title = f"Speed against device memory: {run_id} · {workload} · {prompt_class} prompts{suffix}"
        fig.update_layout(
            title=title, template="plotly_white", height=470, margin={"l": 60, "r": 20, "t": 70, "b": 50},
            legend={"font": {"size": 10}}, font={"family": "sans-serif"},
        )  # fmt: skip
        ids = sorted({i for points, _ in drawn for p in points for i in p.cell_ids})
        others = sorted(
            {f"{p.name}: {p.memory_figure}" for points, _ in drawn for p in points if p.memory_figure != "peak"}
        )
        caption = (
            "One point per configuration: median over ok repeats, bars min..max; memory is the largest device "
            "memory of its cells. Up and to the left is better; the dotted step line joins the configurations "
            "no other beats on both axes."
            + (
                " No peak was measured for some points; their memory is another figure, not comparable with a "
                f"peak: {'; '.join(others)}."
                if others
                else ""
            )
            + (
                " The dashed line is the run's GPU memory budget; hollow points are over it (no contenders)."
                if budget
                else " This run declared no budget."
            )
        )
        out.append(Figure(f"{ANCHOR}-{number}", title, fig, caption, tuple(ids)))
    return out


def setup_budgets(cells: pd.DataFrame, key: tuple[str, str, str]) -> list[float]:
    """The budgets (bytes) the setup's cells carry (one per run; none where the run declared none)."""
    if "budget_bytes" not in cells:
        return []
    mine = cells[(cells["run_id"] == key[0]) & (cells["workload"] == key[1]) & (cells["prompt_class"] == key[2])]
    return sorted({float(b) for b in mine["budget_bytes"] if b is not None and pd.notna(b)})
