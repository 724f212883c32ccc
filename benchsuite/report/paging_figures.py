"""The report's paging figures: miss rate and bytes paged per token against K, waves and the union of
routed experts per step against concurrency, from the engine's counters (benchsuite.measure.paging); and the
table of each paged cell's realized hit rate beside the offline optimum for its own routing
(`hit_rate_optimal`, from the routing trace its server recorded).

The miss-rate figure carries the random-routing line 1 - K/E where E is known.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from benchsuite.report.groups import is_synthetic, routing_label
from benchsuite.report.names import short_name as config_name
from benchsuite.report.plot import HOVER, Figure, integer_ticks, layout, metric_vs

HIT_RATE_TITLE = "Realized vs optimal hit rate"
HIT_RATE_NOTE = (
    "hit_rate = 1 - miss_rate (the engine's counters over the cell); hit_rate_optimal = Belady's hit rate over "
    "the same steps, replayed from the routing trace the server recorded (record_routing: true); of_optimal = "
    "hit_rate / hit_rate_optimal. A blank optimum says why in `note`."
)


# A cell gets its optimum (or the reason for none) once its server has stopped: a cell without either was
# stored before that step existed, or its run stopped (killed, or its folder copied) before the server did.
NO_OPTIMUM_NOTE = "no optimum recorded: the run stopped before this cell's server did, or predates hit_rate_optimal"


def hit_rate_table(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per paged cell with paging counters: realized and optimal hit rate, their ratio, and
    why the optimum is missing (no trace, or a trace that did not line up with the counters)."""
    columns = ["configuration", "K", "concurrency", "prompt_class", "repeat", "hit_rate", "hit_rate_optimal",
               "of_optimal", "note", "cell_id"]  # fmt: skip
    if not len(cells) or "miss_rate" not in cells:
        return pd.DataFrame(columns=columns)
    paged = cells[(cells["mode"] == "paged") & cells["miss_rate"].notna()]
    rows = []
    for _, c in paged.iterrows():
        optimal = c.get("hit_rate_optimal")
        optimal = None if optimal is None or pd.isna(optimal) else float(optimal)
        hit = 1.0 - float(c["miss_rate"])
        extras = c.get("extras") if isinstance(c.get("extras"), dict) else {}
        note = "" if optimal is not None else extras.get("hit_rate_optimal_note", NO_OPTIMUM_NOTE)
        rows.append({
            "configuration": c.get("label", c["engine"]), "K": c.get("resident_experts"),
            "concurrency": int(c["concurrency"]), "prompt_class": c["prompt_class"], "repeat": c.get("repeat"),
            "hit_rate": hit, "hit_rate_optimal": optimal,
            "of_optimal": hit / optimal if optimal else None, "note": note, "cell_id": c["cell_id"],
        })  # fmt: skip
    return pd.DataFrame(rows, columns=columns)


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
        # a K series is named by what each configuration is (short_name: no "K=None" for one without K)
        names = [
            f"{row['engine']} · c={row['concurrency']} · {row['prompt_class']}"
            + (f" · {routing_label(row['routing'])}" if is_synthetic(row["routing"]) else "")
            if series == "concurrency"
            else f"{config_name(row)} · {row['prompt_class']}"
            for _, row in groups.iterrows()
        ]
        traces, ids = metric_vs(groups.assign(series=names), metric, x_col, ["series"])
        if not traces:
            continue
        fig = integer_ticks(layout(go.Figure(traces), title, x_title, y_title), [x for t in traces for x in t.x])
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
                    hovertemplate=HOVER,
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
