"""The report's `--n-cpu-moe` search table: the launched candidates (cells) and those the memory
projection ruled out (not cells: the manifest's `servers.<id>.search.candidates`, see
benchsuite.search), one row per candidate N.

Ruled-out rows carry the projection (projected bytes with the margin, the budget) and status
`ruled out`; they never appear among failed or invalid cells. Runs stored before the search
recorded its candidates kept ruled-out values as `invalid` cells: those still read as cells.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

from benchsuite.manifest import Manifest
from benchsuite.report.load import RunData
from benchsuite.report.tables import search_table as cell_rows
from benchsuite.search import format_gb

RULED_OUT = "ruled out"


def ruled_out_rows(run_id: str, manifest: Manifest) -> list[dict[str, Any]]:
    """One row per candidate a search of this run ruled out by its projection."""
    rows = []
    for server in manifest.servers.values():
        record = server.search or {}
        objective = record.get("objective_cell") or {}
        for c in record.get("candidates") or []:
            if c.get("outcome") != RULED_OUT:
                continue
            budget = record.get("budget_bytes")
            source = (c.get("projection") or {}).get("source", "memory")
            projected = c["projected_bytes"]
            over = f"{format_gb(projected)} GB with the margin > budget {format_gb(budget)} GB"
            reason = f"{source} projection {over}; not launched"
            rows.append({
                "run_id": run_id, "engine": server.engine, "workload": objective.get("workload"),
                "prompt_class": objective.get("prompt_class"), "concurrency": objective.get("concurrency"),
                "N": int(c["n"]), "fits": False, "chosen": False, "decode_tok_s": None, "projected_bytes": projected,
                "budget_bytes": budget, "search_launches": record.get("launches"),
                "linear_scan_launches": record.get("linear_scan_launches"), "status": RULED_OUT, "reason": reason,
                "cell_id": "",
            })  # fmt: skip
    return rows


def search_table(cells: pd.DataFrame, runs: Iterable[RunData]) -> pd.DataFrame:
    """Every candidate of every search: measured or failed cells, then the ruled-out values, by N."""
    launched = cell_rows(cells)
    ruled = [row for run in runs for row in ruled_out_rows(run.run_id, run.manifest)]
    if not ruled:
        return launched
    frame = (
        pd.concat([launched, pd.DataFrame(ruled, columns=launched.columns)], ignore_index=True)
        if len(launched)
        else pd.DataFrame(ruled)
    )
    frame["N"] = frame["N"].astype("Int64")
    return frame.sort_values(["run_id", "engine", "N"], kind="stable").reset_index(drop=True)
