"""The machines a run measured on, where a run used several (`benchsuite run --ray`): its cells grouped
by node, and the caveat when one setup's cells come from different kinds of machine.

A node is a key of the manifest's `nodes` (the Ray node id; its facts as benchsuite.tools.machine recorded
them on that node), named in each cell (`CellResult.node`). A run without --ray has no nodes: its
cells were all measured on the manifest's `machine`, and nothing here applies. The kind of machine is
what decides a figure beyond the engine: the CPU model and its logical cores, and each GPU's name and
memory; two nodes of one kind measure alike, a ratio across kinds compares machines as well.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from benchsuite.report.load import RunData
from benchsuite.tools.machine import machine_kind

TITLE = "Nodes (cells by the machine that measured them)"
INTRO = (
    "<p>This run was spread over several machines (<code>benchsuite run --ray</code>): each row is one node, "
    "its kind of machine (CPU, cores, GPUs) and the cells it measured. A ratio between cells measured on "
    "different kinds of machine compares the machines as well; the first screen says where that happens.</p>"
)
COLUMNS = ("run_id", "node", "host", "machine", "servers", "cells", "ok", "failed")


def node_label(node: str, facts: Mapping[str, Any]) -> str:
    return f"{facts.get('hostname') or '?'} [{node[:8]}]"


def _nodes_of(cells: pd.DataFrame) -> list[str]:
    """The Ray nodes the cells name; none for a frame without the column (cells of a run stored before
    `run --ray`, or built by hand)."""
    if "node" not in cells:
        return []
    return [str(n) for n in dict.fromkeys(cells["node"]) if isinstance(n, str) and n]


def nodes_table(cells: pd.DataFrame, runs: Iterable[RunData]) -> pd.DataFrame:
    """One row per node of each run that used more than one; empty when none did."""
    rows = []
    for run in runs:
        mine = cells[cells["run_id"] == run.run_id]
        used = _nodes_of(mine)
        if len(used) < 2:
            continue
        for node in used:
            facts = run.facts.nodes.get(node, {})
            at = mine[mine["node"] == node]
            rows.append({
                "run_id": run.run_id, "node": node_label(node, facts), "host": facts.get("address") or "",
                "machine": machine_kind(facts) if facts else "not recorded", "servers": at["server_id"].nunique(),
                "cells": len(at), "ok": int((at["status"] == "ok").sum()),
                "failed": int((at["status"] == "failed").sum()),
            })  # fmt: skip
    return pd.DataFrame(rows, columns=list(COLUMNS))


def mixed_machines_caveat(cells: pd.DataFrame, nodes: Mapping[str, Mapping[str, Any]]) -> str | None:
    """One setup's cells measured on more than one kind of machine: each kind with its configurations."""
    used = _nodes_of(cells)
    if len(used) < 2:
        return None
    kinds: dict[str, set[str]] = {}
    for node in used:
        facts = nodes.get(node) or {}
        kind = machine_kind(facts) if facts else f"unrecorded machine of node {node[:8]}"
        labels = cells.loc[cells["node"] == node, "label" if "label" in cells else "engine"]
        kinds.setdefault(kind, set()).update(str(v) for v in labels)
    if len(kinds) < 2:
        return None
    shown = "; ".join(f"{kind}: {', '.join(sorted(labels))}" for kind, labels in kinds.items())
    return (
        f"Measured on different kinds of machine ({shown}): a ratio between these cells compares the machines "
        "as well as the engines."
    )
