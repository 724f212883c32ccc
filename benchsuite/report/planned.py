"""The cells a run planned, each named: the manifest's `planned` record (benchsuite.results.manifest.Planned,
written once as the run starts: its servers, and its cells' ids in plan order) with each id's workload,
prompt class, concurrency and repeat derived again from the matrix the manifest records
(benchsuite.config.plan.cell_id_of, the formula the plan used). A manifest without `planned` (older than
it) plans nothing here. What the report makes of a planned cell with no stored result:
benchsuite.report.unmeasured.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from benchsuite.config.plan import cell_id_of
from benchsuite.results.manifest import Manifest


@dataclass(frozen=True)
class PlannedCell:
    cell_id: str
    server_id: str
    engine: str  # the matrix's engine entry
    kind: str
    params: Mapping[str, Any]  # the server's swept option values
    workload: str
    prompt_class: str
    concurrency: int
    repeat: int  # 0-based, as cells store it


@dataclass(frozen=True)
class PlannedCells:
    named: tuple[PlannedCell, ...] = ()  # plan order: server-major, as the matrix reads
    unnamed: tuple[str, ...] = ()  # planned ids the recorded matrix does not derive (none that `run` wrote)
    repeats: int = 0  # the matrix's repeats of each configuration

    def __len__(self) -> int:
        return len(self.named) + len(self.unnamed)


def read_planned(manifest: Manifest) -> PlannedCells:
    """The manifest's planned cells, named where the recorded matrix derives their ids."""
    planned = manifest.planned
    if not planned.cells:
        return PlannedCells()
    workloads: Mapping[str, Any] = manifest.matrix.get("workloads") or {}
    repeats = int(manifest.matrix.get("repeats") or 0)
    derived: dict[str, PlannedCell] = {}
    for (server_id, server), (name, workload) in itertools.product(planned.servers.items(), workloads.items()):
        points = itertools.product(
            workload.get("prompt_classes") or (), workload.get("concurrency") or (), range(repeats)
        )
        for prompt_class, concurrency, repeat in points:
            cell_id = cell_id_of(server_id, workload, prompt_class, concurrency, repeat)
            derived[cell_id] = PlannedCell(cell_id, server_id, server.engine, server.kind, server.params, str(name),
                                           str(prompt_class), int(concurrency), repeat)  # fmt: skip
    return PlannedCells(
        named=tuple(derived[c] for c in planned.cells if c in derived),
        unnamed=tuple(c for c in planned.cells if c not in derived),
        repeats=repeats,
    )
