"""Link and serial bounds of every paging or offload cell of a run, from stored data only: the cell's
engine counters (expert bytes copied host->device per generated token), the run's measured link
bandwidth (the run's facts: manifest `link_bandwidth`, matrix `linkbw: true`) and the same run's unpaged reference
cells (builtin `resident`, SGLang `unpaged`) with the same workload, routing, concurrency and prompt
class. All rates are aggregate output tok/s (output tokens / the cell's window, prefill included):

    compute_s_per_tok = 1 / reference output tok/s        (median over the reference's ok repeats)
    link_s_per_tok    = bytes_h2d_per_token / link_B_per_s
    link_bound_tok_s  = 1 / link_s_per_tok                 (the link alone, nothing else)
    roofline_tok_s    = 1 / max(compute_s_per_tok, link_s_per_tok)   (copies fully overlapped)
    serial_tok_s      = 1 / (compute_s_per_tok + link_s_per_tok)     (copies never overlapped)
    of_roofline = measured / roofline_tok_s;  of_serial = measured / serial_tok_s

A cell above its serial bound overlaps copies with compute (or prefetches); one far below its
roofline spends its time elsewhere (host overhead, waves). A bound that cannot be computed says why;
nothing is written as 0.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

import pandas as pd

from benchsuite.engines import traits_of
from benchsuite.report.fmt import number
from benchsuite.report.load import RunData

TITLE = "Link and serial bounds (paged, offload)"
BOUNDED_MODES = ("paged", "offload")
GB = 10**9
MATCH_KEYS = ("run_id", "engine_kind", "workload", "routing", "concurrency", "prompt_class")
COLUMNS = (
    "run_id", "configuration", "routing", "workload", "prompt_class", "concurrency", "repeat", "measured_tok_s",
    "bytes_per_token_mb", "link_gb_per_s", "link_bound_tok_s", "compute_tok_s", "roofline_tok_s", "serial_tok_s",
    "of_roofline", "of_serial", "limited_by", "note", "compute_cell_ids", "cell_id",
)  # fmt: skip
INTRO = (
    "<p>Each paged or offload cell against two bounds built from this run's own measurements: the link "
    "(expert bytes copied host->device per generated token, from the engine's counters, over the link bandwidth "
    "measured at the start of the run) and the compute of the same run's resident cell (same workload, routing, "
    "concurrency and prompt class). Roofline = copies fully overlapped with compute; serial = never overlapped. "
    "Rates are aggregate output tok/s. of_roofline / of_serial = measured / bound.</p>"
)


def _references(cells: pd.DataFrame) -> dict[tuple[Any, ...], tuple[float, list[str]]]:
    """Match key -> (median output tok/s, cell ids) of the ok unpaged reference cells."""
    found: dict[tuple[Any, ...], list[tuple[float, str]]] = {}
    for _, c in cells.iterrows():
        rate = number(c["output_tok_s"])
        if c["status"] == "ok" and c["mode"] == traits_of(str(c["engine_kind"])).reference_mode and rate:
            found.setdefault(tuple(c[k] for k in MATCH_KEYS), []).append((rate, str(c["cell_id"])))
    return {k: (statistics.median(r for r, _ in v), [i for _, i in v]) for k, v in found.items()}


def _bytes_per_token(cell: pd.Series) -> float | None:
    h2d = number(cell.get("bytes_h2d_per_token"))
    if h2d is not None:
        return h2d
    return number(cell.get("bytes_paged_per_token")) if cell["mode"] == "paged" else None  # runs before bytes_h2d


def _bounds(
    measured: float | None, per_token_bytes: float | None, link: float | None, compute: float | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"link_bound_tok_s": None, "roofline_tok_s": None, "serial_tok_s": None, "of_roofline": None,
                           "of_serial": None, "limited_by": None}  # fmt: skip
    if per_token_bytes is None or link is None:
        return out
    link_s = per_token_bytes / (link * GB)
    out["link_bound_tok_s"] = 1 / link_s if link_s > 0 else None
    if compute is None:
        return out
    compute_s = 1 / compute
    out["roofline_tok_s"] = 1 / max(compute_s, link_s)
    out["serial_tok_s"] = 1 / (compute_s + link_s)
    out["limited_by"] = "link" if link_s > compute_s else "compute"
    if measured is not None:
        out["of_roofline"] = measured / out["roofline_tok_s"]
        out["of_serial"] = measured / out["serial_tok_s"]
    return out


def _note(cell: pd.Series, per_token_bytes: float | None, link_why: str, compute: float | None) -> str:
    reasons = []
    if cell["status"] != "ok":
        reasons.append(f"cell {cell['status']}")
    if per_token_bytes is None:
        reasons.append("the engine reported no expert bytes copied")
    if link_why:
        reasons.append(link_why)
    if compute is None:
        reference = traits_of(str(cell["engine_kind"])).reference_mode or "resident"
        same = "the same workload, routing, concurrency and prompt class"
        reasons.append(f"no ok {reference} cell with {same} in this run")
    return "; ".join(reasons)


def roofline_table(cells: pd.DataFrame, runs: Iterable[RunData]) -> pd.DataFrame:
    """One row per paged or offload cell (every repeat), its bounds or why they are missing."""
    links = {run.run_id: run.facts.link for run in runs}
    references = _references(cells)
    rows = []
    bounded = cells[cells["mode"].isin(BOUNDED_MODES)].sort_values(
        ["run_id", "label", "routing", "prompt_class", "concurrency", "repeat"]
    )
    for _, c in bounded.iterrows():
        link, link_why = links.get(str(c["run_id"]), (None, "run not loaded"))
        compute, compute_ids = references.get(tuple(c[k] for k in MATCH_KEYS), (None, []))
        measured = number(c["output_tok_s"]) if c["status"] == "ok" else None
        per_token = _bytes_per_token(c)
        rows.append({
            "run_id": c["run_id"], "configuration": c["label"], "routing": c["routing"], "workload": c["workload"],
            "prompt_class": c["prompt_class"], "concurrency": int(c["concurrency"]), "repeat": int(c["repeat"]),
            "measured_tok_s": measured, "bytes_per_token_mb": None if per_token is None else per_token / 1e6,
            "link_gb_per_s": link, "compute_tok_s": compute, **_bounds(measured, per_token, link, compute),
            "note": _note(c, per_token, link_why, compute), "compute_cell_ids": " ".join(compute_ids),
            "cell_id": c["cell_id"],
        })  # fmt: skip
    return pd.DataFrame(rows, columns=list(COLUMNS))
