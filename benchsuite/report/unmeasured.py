"""Cells a run planned and never measured: the run stopped before them (its machine was taken away, or
it was interrupted). The manifest's planned record is the source of truth (benchsuite.report.planned): a
planned cell with a stored result of any status counts as measured, a failed one included (reported as
failed, with its reason, and never again here). A run that measured everything it planned, or whose
manifest is older than `planned`, says nothing.

The header states, per engine kind and per engine entry that measured some of its cells, how many of
its planned cells were not measured (`kind_counts`, `statements`); "Not shown" lists them
(`not_measured_items`): one line per configuration, workload and prompt class, with the concurrencies
that miss the same repeats on one line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from benchsuite.report.load import RunData
from benchsuite.report.names import server_names
from benchsuite.report.planned import PlannedCell, PlannedCells

WHY = "the run stopped before them"
TITLE = "Planned cells not measured"


@dataclass(frozen=True)
class RunGaps:
    """One run's planned cells that have no stored result."""

    run_id: str
    planned: PlannedCells
    # (engine entry, kind) -> its planned cells: a stored cell's own engine, else the one the plan names
    planned_by_engine: Mapping[tuple[str, str], int]
    named: tuple[PlannedCell, ...]  # not measured, in plan order
    unnamed: tuple[str, ...]  # not measured, ids only (PlannedCells.unnamed)

    def __len__(self) -> int:
        return len(self.named) + len(self.unnamed)


def run_gaps(run: RunData) -> RunGaps:
    planned = run.facts.planned
    # cell id -> (engine entry, kind): as stored where the cell was measured, else as the plan names it
    stored = {
        str(cell_id): (str(engine), str(kind))
        for cell_id, engine, kind in zip(run.cells["cell_id"], run.cells["engine"], run.cells["engine_kind"])
    }
    engines = {**{c.cell_id: (c.engine, c.kind) for c in planned.named}, **stored}
    ids = [*(c.cell_id for c in planned.named), *planned.unnamed]
    return RunGaps(
        run.run_id,
        planned,
        Counter(engines[i] for i in ids if i in engines),
        tuple(c for c in planned.named if c.cell_id not in stored),
        tuple(i for i in planned.unnamed if i not in stored),
    )


def kind_counts(gaps: Sequence[RunGaps]) -> dict[str, tuple[int, int]]:
    """Engine kind -> (its planned cells not measured, its planned cells), over the runs."""
    planned: Counter[str] = Counter()
    for g in gaps:
        for (_, kind), n in g.planned_by_engine.items():
            planned[kind] += n
    missing = Counter(c.kind for g in gaps for c in g.named)
    return {kind: (missing[kind], n) for kind, n in planned.items()}


def clause(missing: int, planned: int, whose: str = "") -> str:
    """'4 of 36 planned cells not measured (the run stopped before them)'; empty when none is missing."""
    return f"{missing} of {whose}{planned} planned cells not measured ({WHY})" if missing else ""


def statements(gaps: Sequence[RunGaps], cells: pd.DataFrame) -> list[str]:
    """The header's sentences below its engine kinds' (which count each kind's): one per engine entry that
    measured some cells and not all it planned (an entry with none is said by the header as not run),
    one per run with planned cells its recorded matrix does not name (so no engine is known)."""
    measured = set(cells["engine"])
    planned: Counter[tuple[str, str]] = Counter()
    for g in gaps:
        planned.update(g.planned_by_engine)
    missing = Counter((c.engine, c.kind) for g in gaps for c in g.named)
    out = [
        f"{engine} ({kind}): {clause(missing[engine, kind], n, 'its ')}."
        for (engine, kind), n in sorted(planned.items())
        if missing[engine, kind] and engine in measured
    ]
    out += [
        f"run {g.run_id}: {len(g.unnamed)} more planned {'cell' if len(g.unnamed) == 1 else 'cells'} not measured "
        f"({WHY}), which its recorded matrix does not name (ids under 'Not shown')."
        for g in gaps
        if g.unnamed
    ]
    return out


def not_measured_items(runs: Sequence[RunData], cells: pd.DataFrame) -> list[tuple[str, list[str]]]:
    """(line, its sub-lines) per run with planned cells not measured, for "Not shown"; `cells` annotated
    (report.groups.annotate_cells), for the names of configurations that measured some cells."""
    out = []
    for run in runs:
        gaps = run_gaps(run)
        if len(gaps):
            line = f"{TITLE}: {len(gaps)} of the {len(gaps.planned)} cells run {run.run_id} planned ({WHY})"
            out.append((line, _grouped(gaps, server_names(run.run_id, cells))))
    return out


def _grouped(gaps: RunGaps, names: Mapping[str, str]) -> list[str]:
    """The cells, one line per configuration, workload and prompt class in plan order; concurrencies
    that miss the same repeats share a line."""
    missing: dict[tuple[str, str, str], dict[int, list[int]]] = {}
    for cell in gaps.named:
        setup = missing.setdefault((cell.server_id, cell.workload, cell.prompt_class), {})
        setup.setdefault(cell.concurrency, []).append(cell.repeat)
    planned = {c.server_id: c for c in gaps.named}
    lines: list[str] = []
    for (server_id, workload, prompt_class), by_concurrency in missing.items():
        same: dict[tuple[int, ...], list[int]] = {}
        for concurrency, repeats in by_concurrency.items():
            same.setdefault(tuple(sorted(repeats)), []).append(concurrency)
        name = names.get(server_id) or _planned_name(planned[server_id])
        lines.extend(
            f"{name} · workload {workload} · prompt class {prompt_class} · concurrency "
            f"{', '.join(map(str, concurrencies))} · {_repeats(repeats, gaps.planned.repeats)}"
            for repeats, concurrencies in same.items()
        )
    if gaps.unnamed:
        lines.append(f"by id only (the recorded matrix does not derive them): {' '.join(gaps.unnamed)}")
    return lines


def _planned_name(cell: PlannedCell) -> str:
    """A configuration that measured no cell: its engine entry and swept values, as planned."""
    return " ".join([cell.engine, *(f"{key}={value}" for key, value in sorted(cell.params.items()))])


def _repeats(repeats: tuple[int, ...], of: int) -> str:
    """'repeat 2 (1 of 3)', 'repeats 0–2 (all 3)': 0-based, as the raw cells number them."""
    noun = "repeat" if len(repeats) == 1 else "repeats"
    share = f"all {of}" if len(repeats) == of else f"{len(repeats)} of {of}"
    return f"{noun} {_spans(repeats)} ({share})"


def _spans(values: tuple[int, ...]) -> str:
    """Sorted integers with runs of three or more as 'a–b': (0, 1, 2, 4) -> '0–2, 4'."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][-1] + 1:
            spans[-1].append(v)
        else:
            spans.append([v])
    return ", ".join(f"{s[0]}–{s[-1]}" if len(s) >= 3 else ", ".join(map(str, s)) for s in spans)
