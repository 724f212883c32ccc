"""The cells and searches a run planned, each named: the manifest's `planned` record
(benchsuite.results.manifest.Planned: the servers, cell ids in plan order and searches of every invocation,
merged as each resumed, and the server and cells of each search once it chose a value) with each id's
workload, prompt class, concurrency and repeat derived again from the matrix the manifest records
(benchsuite.config.plan.cell_id_of, the formula the plan used); and the planned searches that chose no value,
from what the run stored under each search's server (`_unresolved`). A manifest without `planned` (older
than it) plans nothing here. What the report makes of a planned cell with no stored result, or of a search
that chose nothing: benchsuite.report.unmeasured.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from benchsuite.config.plan import cell_id_of
from benchsuite.results.manifest import Manifest, PlannedSearch


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
class UnresolvedSearch:
    """A planned search that chose no value, so the cells of its value were never planned."""

    engine: str
    option: str
    params: Mapping[str, Any]  # its other swept values
    error: str | None  # why it chose none (servers.<id>.search_error); None: it never finished


@dataclass(frozen=True)
class PlannedCells:
    named: tuple[PlannedCell, ...] = ()  # plan order: server-major, as the matrix reads
    unnamed: tuple[str, ...] = ()  # planned ids the recorded matrix does not derive (none that `run` wrote)
    repeats: int = 0  # the matrix's repeats of each configuration
    recorded: bool = False  # the manifest has a `planned` record (False: older than it; nothing is said)
    invocations: int = 1  # the run's invocations (manifest.invocations), each of which planned some of it
    searches: int = 0  # the searches planned
    unresolved: tuple[UnresolvedSearch, ...] = ()  # those that chose no value, in plan order

    def __len__(self) -> int:
        return len(self.named) + len(self.unnamed)


def read_planned(manifest: Manifest) -> PlannedCells:
    """The manifest's planned cells, named where the recorded matrix derives their ids, and its planned
    searches that chose no value."""
    planned = manifest.planned
    if not (planned.cells or planned.servers or planned.searches):
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
        recorded=True,
        invocations=max(1, len(manifest.invocations)),
        searches=len(planned.searches),
        unresolved=tuple(u for s in planned.searches if (u := _unresolved(s, manifest)) is not None),
    )


def _unresolved(search: PlannedSearch, manifest: Manifest) -> UnresolvedSearch | None:
    """The search, unless it chose a value: a planned server names it as its search (the runner records the
    chosen server with its cells), or its whole record (run.search, written as it ends) names a best value.
    It chose none where its server records a search_error, or a whole record without a best value; else
    it never finished. A search recorded before its server id cannot be told from another: not judged."""
    if search.server_id is None:
        return None
    if any(s.search_of == search.server_id for s in manifest.planned.servers.values()):
        return None
    server = manifest.servers.get(search.server_id)
    record = server.search if server is not None else None
    finished = record is not None and record.launches is not None  # the whole record, not the chosen's pointer
    if finished and record is not None and record.best_n is not None:
        return None
    error = server.search_error if server is not None else None
    if error is None and finished:
        error = f"no {search.option} value chosen"
    return UnresolvedSearch(search.engine, search.option, search.params, error)
