"""The report's budget-search table: every candidate of every search (llama.cpp `--n-cpu-moe` N,
the built-in engine's paged K), launched ones (cells) and those the memory projection ruled out
(not cells: the manifest's `servers.<id>.search.candidates`, see benchsuite.run.search), one row per
candidate value (column N, whatever the option; column `option` names it).

Ruled-out rows carry the projection (projected bytes, with llama.cpp's margin where the search
rules out with one; the built-in K projection is a lower bound and has none) and status
`ruled out`; they never appear among failed or invalid cells. Launched rows carry the measured
peak device memory; one over the budget has status `over budget`. Runs stored before the search
recorded its candidates kept ruled-out values as `invalid` cells: those still read as cells.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from benchsuite.engines.base import FIRST_SEARCH_OPTION
from benchsuite.report.load import RunData
from benchsuite.report.tables import SEARCH_COLUMNS
from benchsuite.report.tables import search_table as cell_rows
from benchsuite.results.manifest import ServerRecord
from benchsuite.results.server_facts import ObjectiveCell
from benchsuite.run.search import format_gb

TITLE = "Budget searches (llama.cpp --n-cpu-moe N, paged K)"
INTRO = (
    "<p>One row per candidate value of each search (N: llama.cpp <code>--n-cpu-moe</code>; K: the paged "
    "engine's resident experts, column <code>option</code>). Launched candidates are cells (measured, over "
    "budget by their measured peak device memory, or failed); rows with status 'ruled out' were never "
    "launched: the memory projection (llama.cpp's with its margin; for K a lower bound: weights, KV and K "
    "slots) exceeds the budget.</p>"
)
RULED_OUT = "ruled out"


def ruled_out_rows(run_id: str, servers: Mapping[str, ServerRecord]) -> list[dict[str, Any]]:
    """One row per candidate a search of this run ruled out by its projection."""
    rows = []
    for server in servers.values():
        record = server.search
        if record is None:
            continue
        objective = record.objective_cell or ObjectiveCell()
        for c in record.candidates:
            if c.outcome != RULED_OUT:
                continue
            budget = record.budget_bytes or 0
            source = c.projection.get("source", "memory")
            # a record before margins were stored ruled out with one
            margin = "margin_bytes" not in record.model_fields_set or record.margin_bytes
            with_margin = " with the margin" if margin else ""
            projected = format_gb(c.projected_bytes)
            reason = f"{source} projection {projected} GB{with_margin} > budget {format_gb(budget)} GB"
            rows.append({
                "run_id": run_id, "engine": server.engine, "option": record.option or FIRST_SEARCH_OPTION,
                "workload": objective.workload, "prompt_class": objective.prompt_class,
                "concurrency": objective.concurrency, "N": c.n, "fits": False, "chosen": False,
                "decode_tok_s": None, "projected_bytes": c.projected_bytes, "peak_device_memory_bytes": None,
                "budget_bytes": record.budget_bytes, "search_launches": record.launches,
                "linear_scan_launches": record.linear_scan_launches, "status": RULED_OUT,
                "reason": f"{reason}; not launched", "cell_id": "",
            })  # fmt: skip
    return rows


def search_table(cells: pd.DataFrame, runs: Iterable[RunData]) -> pd.DataFrame:
    """Every candidate of every search: measured or failed cells, then the ruled-out values, by N."""
    launched = cell_rows(cells)
    ruled = [row for run in runs for row in ruled_out_rows(run.run_id, run.facts.records)]
    if not ruled:
        return launched
    frame = (
        pd.concat([launched, pd.DataFrame(ruled, columns=SEARCH_COLUMNS)], ignore_index=True)
        if len(launched)
        else pd.DataFrame(ruled, columns=SEARCH_COLUMNS)
    )
    frame["N"] = frame["N"].astype("Int64")
    return frame.sort_values(["run_id", "engine", "N"], kind="stable").reset_index(drop=True)
