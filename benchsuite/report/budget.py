"""The GPU memory budget a run compares its configurations at, and whether a configuration fits it.

The budget is the one the run declares: the budget its searches were given (llama.cpp `n_cpu_moe`,
built-in `resident_experts`: `servers.<id>.search.budget_bytes`, decimal GB in the matrix's
`vram_budget_gb`); a run with no such search has none, and every configuration counts. A
configuration fits when each of its cells' measured device memory is within the budget (a cell with
no figure says nothing against it). The figure is the same for every engine:
`peak_device_memory_bytes`, the peak over the cell of the device memory NVML attributes to the
server's processes (benchsuite.tools.device_memory: CUDA context, allocator caches, graph pools and the
synthetic router's tables included). Cells stored before that figure existed fall back to what
their engine reported then: the built-in engine's `gpu_memory_used_bytes` (the device's memory in
use after the cell) and llama.cpp's log breakdown (`self` per CUDA device: no CUDA context), two
different yardsticks, used only where the common one is missing; where the configurations of one
setup are judged by different figures, the report says so (`mixed_figures`, a caveat).
Measured memory against the budget, with no margin on either side.
The published comparison counts a llama.cpp N only when it fits, and paging only at a K that fits;
a configuration over the budget is shown, never a contender or a baseline.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from benchsuite.results.manifest import ServerRecord


def run_budget_bytes(servers: Mapping[str, ServerRecord]) -> int | None:
    """The budget of one run from its manifest's servers."""
    budgets = {r.search.budget_bytes for r in servers.values() if r.search is not None and r.search.budget_bytes}
    return min(budgets) if budgets else None


def device_bytes(cell: pd.Series) -> int | None:
    """The device memory a cell's configuration measured, by the rules above; None when unknown."""
    found = device_figure(cell)
    return None if found is None else found[0]


def device_figure(cell: pd.Series) -> tuple[int, str] | None:
    """(bytes, which figure) of a cell by the rules above: its peak (`device_memory_method`, e.g.
    nvml-per-process), else `gpu memory after the cell` or `llama.cpp log breakdown`; None when unknown."""
    peak = cell.get("peak_device_memory_bytes")
    if peak is not None and pd.notna(peak) and peak > 0:
        method = cell.get("device_memory_method")
        return int(peak), f"peak, {method}" if isinstance(method, str) and method else "peak"
    used = cell.get("gpu_memory_used_bytes")
    if used is not None and pd.notna(used) and used > 0:
        return int(used), "gpu memory after the cell"
    extras = cell.get("extras") if isinstance(cell.get("extras"), dict) else {}
    breakdown = (extras.get("engine_log") or {}).get("memory_breakdown_mib") or {}
    rows = [row.get("self") for device, row in breakdown.items() if "CUDA" in device and isinstance(row, dict)]
    gpu_mib = [m for m in rows if isinstance(m, int | float)]
    if not gpu_mib:
        return None
    return int(sum(gpu_mib) * 2**20), "llama.cpp log breakdown"


def mixed_figures(cells: pd.DataFrame) -> dict[str, list[str]]:
    """Which figure each configuration (`label`) with a budget was judged by, when they are not all
    the same figure (else {}): figure -> labels. Two yardsticks against one budget are no comparison."""
    if "budget_bytes" not in cells or "label" not in cells:
        return {}
    by_figure: dict[str, set[str]] = {}
    for _, cell in cells.iterrows():
        budget = cell.get("budget_bytes")
        found = device_figure(cell)
        if budget is None or pd.isna(budget) or found is None:
            continue
        by_figure.setdefault(found[1], set()).add(str(cell["label"]))
    return {k: sorted(v) for k, v in sorted(by_figure.items())} if len(by_figure) > 1 else {}


def over_budget(cells: pd.DataFrame) -> int | None:
    """The largest measured device memory of these cells when it exceeds their run's budget, else None."""
    worst = None
    for _, cell in cells.iterrows():
        budget, used = cell.get("budget_bytes"), device_bytes(cell)
        if budget is None or pd.isna(budget) or used is None or used <= budget:
            continue
        worst = max(worst or 0, used)
    return worst
