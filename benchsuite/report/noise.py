"""The machine's noise as the report reads it: which cells ran while other processes kept the machine
busy (extras["machine"], written by the runner with benchsuite.tools.machine.cell_noise), and the warning
that says so beside the numbers."""

from __future__ import annotations

from typing import Any

import pandas as pd

from benchsuite.tools.machine import BUSY_OTHER_CORES_FRACTION


def _noise(extras: Any) -> dict[str, Any]:
    record = extras.get("machine") if isinstance(extras, dict) else None
    return record if isinstance(record, dict) else {}


def busy_cells(cells: pd.DataFrame) -> set[str]:
    """Ids of the cells measured on a busy machine."""
    return {str(c) for c, e in zip(cells["cell_id"], cells["extras"]) if _noise(e).get("busy")}


def busy_warning(cells: pd.DataFrame) -> str | None:
    """One line for the report when some cells ran on a busy machine; None when none did (or none was recorded)."""
    busy = cells[cells["cell_id"].isin(busy_cells(cells))]
    recorded = sum(1 for e in cells["extras"] if _noise(e))
    if busy.empty:
        return None
    worst = max(_noise(e).get("other_cores") or 0.0 for e in busy["extras"])
    example = _noise(busy.iloc[0]["extras"]).get("busy_reason")
    return (
        f"BUSY MACHINE: {len(busy)} of {recorded} cells ran while other processes kept more than "
        f"{BUSY_OTHER_CORES_FRACTION:.0%} of the cores busy (up to {worst:.2f} cores; e.g. {busy.iloc[0]['cell_id']}: "
        f"{example}). Their numbers carry that machine's noise: rerun them on a quiet machine before trusting a small "
        f"difference."
    )


def load_text(extras: Any) -> str:
    """'load 1.20 -> 1.35, 2600 MHz, others 0.40 cores, ours 1.02 cores' for one cell; '' when not recorded."""
    noise = _noise(extras)
    if not noise:
        return ""
    before, after = noise.get("before") or {}, noise.get("after") or {}
    parts = []
    if before.get("load_1m") is not None and after.get("load_1m") is not None:
        parts.append(f"load {before['load_1m']:.2f} -> {after['load_1m']:.2f}")
    if after.get("cpu_mhz"):
        parts.append(f"{after['cpu_mhz']:.0f} MHz")
    if noise.get("other_cores") is not None:
        parts.append(f"others {noise['other_cores']:.2f} cores")
    if noise.get("own_cores") is not None:
        parts.append(f"ours {noise['own_cores']:.2f} cores")
    return ", ".join(parts)
