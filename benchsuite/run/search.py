"""Searches of one engine option against a GPU memory budget, driven through real launches.

Two knobs, one search: llama.cpp `--n-cpu-moe` N (the fastest N that fits) and the built-in
engine's paged `resident_experts` K (the largest K whose measured peak device memory fits, or the
fastest such K). The proposal generators live in benchsuite.run.search_propose; everything engine-specific
comes from the engine's adapter: `vram_budget_bytes(spec)` and `projections(spec, settings)` (value ->
a projection with `gpu_total_bytes`, `fits(budget, margin)` and a `source`), in its wing.

`run_search` is the runner's search hook (`run_context.SearchHook`, given to `run_plan` by the CLI;
the runner never imports this module): it projects every value, launches a server for each
proposed value and measures one cell, stores one cell per LAUNCHED value (extras: search_n = the
value, search_option, fits, projected_bytes, chosen; the cell's peak_device_memory_bytes) so the
report can draw the curve, records every candidate (ruled-out ones with their projection, never as
cells) under the search's server in the manifest, and returns the engine options with the chosen
value. `describe` turns that record into the CLI summary's lines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from benchsuite.config.plan import CellSpec, SearchTask
from benchsuite.engines.base import FIRST_SEARCH_OPTION, EngineOptions, Projection, ServerSpec, search_knob
from benchsuite.engines.search_settings import (
    NCpuMoeSettings,
    ResidentExpertsSettings,
    SearchSettings,
    SearchSettingsAny,
)
from benchsuite.errors import RunError, UserError
from benchsuite.records import CellResult
from benchsuite.results.server_facts import (
    CandidateOutcome,
    ObjectiveCell,
    SearchCandidate,
    SearchMeasurement,
    SearchRecord,
)
from benchsuite.run.context import RunContext
from benchsuite.run.search_propose import (
    Observation,
    SearchGen,
    SearchOutcome,
    drive,
    propose,
    propose_fastest,
    propose_largest,
)

__all__ = [
    "SearchSettings", "NCpuMoeSettings", "ResidentExpertsSettings", "parse_request", "Observation", "propose",
    "propose_largest", "propose_fastest", "drive", "run_search", "describe", "format_gb",
]  # fmt: skip


# ---- runner hook --------------------------------------------------------------------------------


def parse_request(value: Any, option: str = FIRST_SEARCH_OPTION) -> SearchSettingsAny:
    """`search` or `{search: {...}}` -> the option's settings (an option without its own knob takes the
    first's: the fastest fitting value); anything else is a user error."""
    return search_knob(option).parse(value)


class _Probe:
    """Launches one server per proposed value and measures its search cell (a resumed run reuses it)."""

    def __init__(self, ctx: RunContext, task: SearchTask, metric: str, budget_bytes: int,
                 guess_fits: Mapping[int, bool] | None) -> None:  # fmt: skip
        self.ctx, self.task, self.metric, self.budget_bytes = ctx, task, metric, budget_bytes
        self.guess_fits = guess_fits  # K without a measured peak (no GPU): fits by projection + overhead guess
        self.results: dict[int, CellResult] = {}  # value -> its search cell

    def spec_and_cell(self, n: int) -> tuple[ServerSpec, CellSpec]:
        """The candidate's server and its one cell (benchsuite.config.plan.search_cell)."""
        from benchsuite.config.plan import make_server_spec, plan_cells, search_cell, stable_id

        spec, option = self.task.spec, self.task.option
        s = make_server_spec(
            spec.name, spec.kind, spec.options.replaced(**{option: n}), spec.fairness, spec.max_concurrency, spec.env
        )
        cell = search_cell(plan_cells(self.ctx.plan.matrix, s, {**self.task.params, option: n}), option)
        cell_id = stable_id({"search_of": spec.server_id, "n": n, "cell": cell.cell_id})
        return s, dataclasses.replace(cell, cell_id=cell_id, params={**cell.params, "search_n": n})

    async def objective(self, n: int) -> Observation:
        from benchsuite.run.cell import CELL_ERRORS, failed_result, measure_cell
        from benchsuite.run.server_launch import launch_server

        s, cell = self.spec_and_cell(n)
        stored = self.ctx.store.stored_cell(cell.cell_id)
        if stored is not None and stored.result.status == "ok":
            self.results[n] = stored.result  # resumed run: this value was measured already
        else:
            try:
                async with launch_server(self.ctx, s) as server:
                    self.results[n] = await measure_cell(self.ctx, server, cell, store=False)
            except CELL_ERRORS as exc:
                self.results[n] = failed_result(self.ctx, cell, s, f"{type(exc).__name__}: {exc}")
        return self.observation(n)

    def observation(self, n: int) -> Observation:
        r = self.results[n]
        value = getattr(r, self.metric)
        peak = r.peak_device_memory_bytes
        if peak is not None:
            fits: bool | None = peak <= self.budget_bytes
        else:
            fits = None if self.guess_fits is None else self.guess_fits[n]
        return Observation(value=value if r.status == "ok" and value is not None else None, peak_bytes=peak, fits=fits)


async def _drive_async(gen: SearchGen, objective: Callable[[int], Any]) -> SearchOutcome:
    try:
        n = next(gen)
        while True:
            n = gen.send(await objective(n))
    except StopIteration as stop:
        return stop.value


def _candidate(n: int, projection: Projection, fits: bool, margin_bytes: int, probe: _Probe) -> SearchCandidate:
    """Every key given, the unknown ones as None (a stored block writes the keys it was given)."""
    projected_bytes, as_dict = projection.gpu_total_bytes + margin_bytes, dataclasses.asdict(projection)
    if n not in probe.results:
        return SearchCandidate(n=n, outcome="not launched" if fits else "ruled out", projected_bytes=projected_bytes,
                               projection=as_dict, value=None, cell_id=None, peak_device_memory_bytes=None)  # fmt: skip
    obs, result = probe.observation(n), probe.results[n]
    outcome: CandidateOutcome = "failed" if obs.value is None else ("over budget" if obs.fits is False else "measured")
    return SearchCandidate(n=n, outcome=outcome, projected_bytes=projected_bytes, projection=as_dict, value=obs.value,
                           cell_id=result.cell_id, peak_device_memory_bytes=obs.peak_bytes)  # fmt: skip


def _generator(option: str, settings: SearchSettingsAny, fitting: Sequence[int], guess_bytes: Mapping[int, int],
               budget_bytes: int) -> SearchGen:  # fmt: skip
    """The search each knob gets: N hill-climbs over what fits; K brackets the largest that fits."""
    if isinstance(settings, ResidentExpertsSettings):
        if settings.objective == "fastest":
            return propose_fastest(fitting, guess_bytes, budget_bytes, settings.rel_tol)
        return propose_largest(fitting, guess_bytes, budget_bytes)
    return propose(fitting, settings.rel_tol)


def _margins(settings: SearchSettingsAny) -> tuple[int, int]:
    """(bytes added to a projection to rule a value out, bytes added to guess a launch's peak).
    llama.cpp's published rule counts an N only when projection + its margin fits, so both are the
    margin; the built-in engine's K projection is a lower bound, ruled out with no margin, its
    overhead guessed until a launch measures it."""
    if isinstance(settings, ResidentExpertsSettings):
        return 0, settings.overhead_mib * 2**20
    return settings.margin_mib * 2**20, settings.margin_mib * 2**20


async def run_search(ctx: RunContext, task: SearchTask) -> EngineOptions:
    """Search `task.option` of an engine entry; returns its options with the chosen value.

    Only launched candidates become cells; every candidate, ruled out ones with their projection, is
    recorded in the manifest under the search's server (`search.candidates`).
    """
    from benchsuite.engines import ADAPTERS

    spec, settings = task.spec, task.settings
    adapter = ADAPTERS[spec.kind]
    budget_bytes = adapter.vram_budget_bytes(spec)
    projections = adapter.projections(spec, settings) if budget_bytes is not None else None  # value -> projection
    if budget_bytes is None or projections is None:
        raise UserError(f"engine {spec.name}: kind {spec.kind} has no {task.option} search")
    margin_bytes, guess_margin_bytes = _margins(settings)
    fitting = [n for n in sorted(projections) if projections[n].fits(budget_bytes, margin_bytes)]
    guess_bytes = {n: projections[n].gpu_total_bytes + guess_margin_bytes for n in projections}
    by_guess = {n: b <= budget_bytes for n, b in guess_bytes.items()}
    probe = _Probe(ctx, task, settings.metric, budget_bytes,
                   by_guess if isinstance(settings, ResidentExpertsSettings) else None)  # fmt: skip
    gen = _generator(task.option, settings, fitting, guess_bytes, budget_bytes)
    outcome = await _drive_async(gen, probe.objective)
    candidates = [_candidate(n, projections[n], n in fitting, margin_bytes, probe) for n in sorted(projections)]
    for c in candidates:
        if c.cell_id is None:
            continue
        r = probe.results[c.n]
        extras = {
            "search_n": c.n, "search_option": task.option, "search_of": spec.server_id, "fits": c.n in fitting,
            "projected_bytes": c.projected_bytes, "projection": c.projection, "budget_bytes": budget_bytes,
            "chosen": c.n == outcome.best_n, "search_outcome": c.outcome,
            "search_launches": outcome.launches, "linear_scan_launches": outcome.linear_scan_launches,
        }  # fmt: skip
        ctx.store.write_cell(dataclasses.replace(r, extras={**r.extras, **extras}), [])
    record = SearchRecord(
        option=task.option, settings=settings.model_dump(), budget_bytes=budget_bytes,
        margin_bytes=margin_bytes, guess_margin_bytes=guess_margin_bytes,
        objective_cell=_objective_cell(probe, fitting or sorted(projections)),
        fitting=fitting, measured=[SearchMeasurement(**dataclasses.asdict(m)) for m in outcome.measurements],
        best_n=outcome.best_n, launches=outcome.launches, linear_scan_launches=outcome.linear_scan_launches,
        candidates=candidates,
        # how a launch's fit was decided: its measured peak, or (no GPU: no peak) its projection + the guess
        fit_by="peak device memory" if any(m.peak_bytes is not None for m in outcome.measurements)
        else "projection (no device memory measured)",
    )  # fmt: skip
    ctx.store.record_server(spec.server_id, engine=spec.name, kind=spec.kind, search=record)
    if outcome.best_n is None:
        if not fitting:
            raise RunError(f"engine {spec.name}: no {task.option} value fits the {format_gb(budget_bytes)} GB budget")
        if any(c.outcome == "over budget" for c in candidates):
            raise RunError(f"engine {spec.name}: every launched {task.option} value measured over the "
                           f"{format_gb(budget_bytes)} GB budget")  # fmt: skip
        raise RunError(f"engine {spec.name}: every launch of the {task.option} search failed (see the logs)")
    return spec.options.replaced(**{task.option: outcome.best_n})


def _objective_cell(probe: _Probe, ns: Sequence[int]) -> ObjectiveCell | None:
    if not ns:
        return None
    _, cell = probe.spec_and_cell(ns[0])
    return ObjectiveCell(workload=cell.workload, prompt_class=cell.prompt_class, concurrency=cell.concurrency)


# ---- the stored record, in words (the CLI summary; the report has its own table) ----------------

GB = 10**9  # vram_budget_gb is decimal gigabytes


def format_gb(n_bytes: float) -> str:
    """Decimal GB, with enough digits for an emulated sub-GB budget."""
    value = n_bytes / GB
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def describe(engine: str, record: SearchRecord) -> list[str]:
    """A search's stored record (manifest `servers.<id>.search`) as summary lines: the choice, then
    the candidates by outcome, ruled-out ones with their projection (never as cells)."""
    candidates = record.candidates
    if not candidates:
        return []
    budget, margin = record.budget_bytes or 0, record.margin_bytes or 0
    best = record.best_n
    option = record.option or FIRST_SEARCH_OPTION
    knob = search_knob(option)
    letter = knob.letter
    value = next((c.value for c in candidates if c.n == best), None)
    metric = record.settings.get("metric", "objective")
    head = (
        f"search {option} of {engine}: best {letter}={best} ({metric} {value:.1f})"
        if best is not None and value is not None
        else f"search {option} of {engine}: no value chosen"
    )
    scan = record.linear_scan_launches
    lines = [
        f"{head} after {record.launches} launches (a scan of every fitting {letter}: {scan}); "
        + f"budget {format_gb(budget)} GB"
        + (f", margin {margin / 2**20:.0f} MiB" if margin else "")
    ]
    by_outcome: dict[str, list[SearchCandidate]] = {}
    for c in candidates:
        by_outcome.setdefault(c.outcome, []).append(c)
    ruled = by_outcome.get("ruled out", [])
    if ruled:
        lo, hi = min(c.projected_bytes for c in ruled), max(c.projected_bytes for c in ruled)
        source = ruled[0].projection.get("source", "the")
        with_margin = " with the margin" if margin else ""
        lines.append(
            f"  ruled out by the {source} projection, never launched: {_ranges([c.n for c in ruled], letter)} "
            f"(projected {format_gb(lo)}-{format_gb(hi)} GB{with_margin} > {format_gb(budget)} GB)"
        )
    measured = by_outcome.get("measured", [])
    if measured:
        lines.append("  measured: " + ", ".join(_measured(c, letter, best) for c in measured))
    if by_outcome.get("over budget"):
        lines.append("  measured over the budget: " + ", ".join(_measured(c, letter, best)
                                                                for c in by_outcome["over budget"]))  # fmt: skip
    if by_outcome.get("failed"):
        lines.append(
            f"  launched and failed (reasons in cells.csv): {_ranges([c.n for c in by_outcome['failed']], letter)}"
        )
    if (record.fit_by or "").startswith("projection") and knob.by_peak_memory:
        lines.append("  no device memory measured (no GPU): a launched K fits by its projection + the overhead guess")
    if by_outcome.get("not launched"):
        skipped = _ranges([c.n for c in by_outcome["not launched"]], letter)
        lines.append(f"  not launched (the projection fits; the search did not need them): {skipped}")
    return lines


def _measured(c: SearchCandidate, letter: str, best: int | None) -> str:
    peak = c.peak_device_memory_bytes
    memory = f", peak {format_gb(peak)} GB" if peak is not None else ""
    return f"{letter}={c.n} {c.value:.1f}{memory}" + (" (best)" if c.n == best else "")


def _ranges(ns: Sequence[int], letter: str = "N") -> str:
    """[0, 1, 2, 5, 7, 8] -> 'N=0-2, 5, 7-8'."""
    parts: list[str] = []
    values = sorted(ns)
    start = prev = values[0]
    for n in [*values[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return f"{letter}=" + ", ".join(parts)
