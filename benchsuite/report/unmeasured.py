"""Cells a run planned and never measured, and searches it planned that chose no value. The manifest's
planned record is the source of truth (benchsuite.report.planned): a planned cell with a stored result of
any status counts as measured, a failed one included (reported as failed, with its reason, and never again
here). A run that measured everything it planned and whose searches all chose a value, or whose manifest
is older than `planned`, says nothing.

Why a planned cell has no result: an invocation that plans a cell either stores it (ok, invalid or
failed: a server that never started fails its cells) or stops before it (interrupted, its machine taken
away), and a resumed invocation adds its plan to the record. So a planned cell without a result was
planned only by invocations that stopped before it: "the run stopped before them" when the run had one
invocation, "every invocation that planned them stopped before them" when it had several (some may not
have selected them, `--only`: the record does not say which planned what).

The planned count of an engine is its cells the record plans and every cell the run stored: each
stored cell was planned by some invocation, a search's launches (one cell per launched value, stored
as the search ends, never in the record: their number is the search's own) and cells of an invocation
older than the record included; so it counts what "ok cells" and "failed or invalid" count, and the
clause says how many search launches it holds.

The header states, per engine kind and per engine entry that measured some of its cells, how many of
its planned cells were not measured (`kind_gaps`, `engine_gaps`, `statements`), and per run the searches
that chose no value; "Not shown" lists them (`not_measured_items`): the cells one line per configuration,
workload and prompt class, with the concurrencies that miss the same repeats on one line; the searches one
line each.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from benchsuite.report.load import RunData
from benchsuite.report.names import server_names
from benchsuite.report.planned import PlannedCell, PlannedCells, UnresolvedSearch
from benchsuite.report.tables import is_search_launch

WHY = "the run stopped before them"
WHY_RESUMED = "every invocation that planned them stopped before them"
TITLE = "Planned cells not measured"
SEARCH_TITLE = "Planned searches that chose no value"

EngineKey = tuple[str, str]  # (engine entry, kind)


@dataclass(frozen=True)
class Gap:
    """Planned cells not measured, of an engine kind or entry."""

    missing: int = 0
    planned: int = 0
    launches: int = 0  # stored search launches among the planned (the ok and failed cells count them too)
    resumed: bool = False  # a run missing some of them had several invocations

    def __add__(self, other: Gap) -> Gap:
        return Gap(self.missing + other.missing, self.planned + other.planned, self.launches + other.launches,
                   self.resumed or other.resumed)  # fmt: skip

    def clause(self, whose: str = "") -> str:
        """'4 of 36 planned cells not measured (the run stopped before them)'; empty when none is missing."""
        if not self.missing:
            return ""
        launches = f" ({self.launches} of them search launches)" if self.launches else ""
        return f"{self.missing} of {whose}{self.planned} planned cells{launches} not measured ({why(self.resumed)})"


def why(resumed: bool) -> str:
    return WHY_RESUMED if resumed else WHY


@dataclass(frozen=True)
class RunGaps:
    """One run's planned cells that have no stored result, and its searches that chose no value."""

    run_id: str
    planned: PlannedCells
    # (engine entry, kind) -> its planned cells (the record's and the stored ones): a stored cell's own
    # engine, else the one the plan names; planned ids the matrix does not name and the run never stored
    # have no engine
    planned_by_engine: Mapping[EngineKey, int]
    launches_by_engine: Mapping[EngineKey, int]  # the stored search launches among them
    total: int  # the run's planned cells, with or without an engine
    named: tuple[PlannedCell, ...]  # not measured, in plan order
    unnamed: tuple[str, ...]  # not measured, ids only (PlannedCells.unnamed)

    @property
    def resumed(self) -> bool:
        return self.planned.invocations > 1

    def __len__(self) -> int:
        return len(self.named) + len(self.unnamed)


def run_gaps(run: RunData) -> RunGaps:
    planned = run.facts.planned
    if not planned.recorded:
        return RunGaps(run.run_id, planned, {}, {}, 0, (), ())
    # cell id -> (engine entry, kind): as stored where the cell was measured, else as the plan names it
    stored = {
        str(cell_id): (str(engine), str(kind))
        for cell_id, engine, kind in zip(run.cells["cell_id"], run.cells["engine"], run.cells["engine_kind"])
    }
    launches = [str(i) for i, extras in zip(run.cells["cell_id"], run.cells["extras"]) if is_search_launch(extras)]
    engines = {**{c.cell_id: (c.engine, c.kind) for c in planned.named}, **stored}
    ids = list(dict.fromkeys([*(c.cell_id for c in planned.named), *planned.unnamed, *stored]))
    return RunGaps(
        run.run_id,
        planned,
        Counter(engines[i] for i in ids if i in engines),
        Counter(stored[i] for i in launches),
        len(ids),
        tuple(c for c in planned.named if c.cell_id not in stored),
        tuple(i for i in planned.unnamed if i not in stored),
    )


def engine_gaps(gaps: Sequence[RunGaps]) -> dict[EngineKey, Gap]:
    """(engine entry, kind) -> its planned cells not measured, its planned cells and the search launches
    among them, summed over the runs."""
    out: dict[EngineKey, Gap] = {}
    for g in gaps:
        missing = Counter((c.engine, c.kind) for c in g.named)
        for engine, n in g.planned_by_engine.items():
            gap = Gap(missing[engine], n, g.launches_by_engine.get(engine, 0), g.resumed and missing[engine] > 0)
            out[engine] = out[engine] + gap if engine in out else gap
    return out


def kind_gaps(gaps: Sequence[RunGaps]) -> dict[str, Gap]:
    """Engine kind -> the sum of its entries' gaps (engine_gaps)."""
    out: dict[str, Gap] = {}
    for (_, kind), gap in engine_gaps(gaps).items():
        out[kind] = out[kind] + gap if kind in out else gap
    return out


def statements(gaps: Sequence[RunGaps], cells: pd.DataFrame) -> list[str]:
    """The header's sentences below its engine kinds' (which count each kind's): one per engine entry that
    measured some cells and not all it planned (an entry with none is said by the header as not run),
    one per run with planned cells its recorded matrix does not name (so no engine is known), and one per
    run and kind of reason for its planned searches that chose no value."""
    measured = set(cells["engine"])
    out = [
        f"{engine} ({kind}): {gap.clause('its ')}."
        for (engine, kind), gap in sorted(engine_gaps(gaps).items())
        if gap.missing and engine in measured
    ]
    out += [
        f"run {g.run_id}: {_count(len(g.unnamed), 'more planned cell')} not measured "
        f"({why(g.resumed)}), which its recorded matrix does not name (ids under 'Not shown')."
        for g in gaps
        if g.unnamed
    ]
    out += [line for g in gaps for line in _search_statements(g)]
    return out


def _search_statements(g: RunGaps) -> list[str]:
    """One sentence for the run's planned searches that never finished, one for those that chose no value."""
    out = []
    stopped = [s for s in g.planned.unresolved if s.error is None]
    failed = [s for s in g.planned.unresolved if s.error is not None]
    for searches, what, why_not in ((stopped, "not finished", _search_why(g.resumed, len(stopped))),
                                    (failed, "chose no value", "why under 'Not shown'")):  # fmt: skip
        if searches:
            whose = "its" if len(searches) == 1 else "their"
            out.append(
                f"run {g.run_id}: {_count(len(searches), 'planned search', 'planned searches')} {what} "
                f"({_searches(searches)}): {whose} cells were never planned ({why_not})."
            )
    return out


def _count(n: int, noun: str, plural: str = "") -> str:
    """'1 more planned cell', '3 more planned cells'; `plural` where it is not the noun and an s."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def _search_name(search: UnresolvedSearch) -> str:
    """'paged-fp8: resident_experts search', with the entry's other swept values where it has some."""
    values = "".join(f" {key}={value}" for key, value in sorted(search.params.items()))
    return f"{search.engine}{values}: {search.option} search"


def _searches(searches: Iterable[UnresolvedSearch]) -> str:
    return "; ".join(_search_name(s) for s in searches)


def _search_why(resumed: bool, n: int) -> str:
    """Why planned searches did not finish: every invocation that planned them stopped before they chose."""
    it, them = ("it", "it") if n == 1 else ("they", "them")
    if resumed:
        return f"every invocation that planned {them} stopped before {it} chose a value"
    return f"the run stopped before {it} chose a value"


def not_measured_items(runs: Sequence[RunData], cells: pd.DataFrame) -> list[tuple[str, list[str]]]:
    """(line, its sub-lines) per run with planned cells not measured, and per run with planned searches that
    chose no value, for "Not shown"; `cells` annotated (report.groups.annotate_cells), for the names of
    configurations that measured some cells."""
    out = []
    for run in runs:
        gaps = run_gaps(run)
        if len(gaps):
            line = f"{TITLE}: {len(gaps)} of the {gaps.total} cells run {run.run_id} planned ({why(gaps.resumed)})"
            out.append((line, _grouped(gaps, server_names(run.run_id, cells))))
        unresolved = gaps.planned.unresolved
        if unresolved:
            line = (
                f"{SEARCH_TITLE}: {len(unresolved)} of the {gaps.planned.searches} searches run {run.run_id} "
                "planned, so the cells of the value each would choose were never planned"
            )
            out.append((line, [_search_item(gaps, s) for s in unresolved]))
    return out


def _search_item(gaps: RunGaps, search: UnresolvedSearch) -> str:
    if search.error is None:
        return f"{_search_name(search)}: not finished ({_search_why(gaps.resumed, 1)})"
    return f"{_search_name(search)}: {search.error}"


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
