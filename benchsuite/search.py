"""The llama.cpp `--n-cpu-moe` search: fewest launches to find the best N that fits the GPU.

The published baseline launched the server once per N (a linear scan). Here:
1. values that cannot fit are ruled out without a launch (benchsuite.engines.llamacpp.fit: llama.cpp's
   `llama-fit-params` projection on a GPU build, our GGUF-based projection on a CPU-only build);
2. the fitting range is searched with its usual shape in mind: fewer CPU layers is faster, so
   throughput drops as N grows past the smallest fitting N. `propose` starts there and steps right
   with doubling strides only while the objective improves by more than `rel_tol`;
3. the best point's neighbours are verified (measured); a better neighbour moves the best point
   and its neighbours are verified in turn (hill climbing to a measured local maximum).

`propose` is a generator (guidellm's adaptive-sweep shape): it yields the next N, is sent the
measured objective (None for a failed launch) and returns a `SearchOutcome`. The objective is
injected, so unit tests drive it with synthetic curves. `run_search` is the runner's search hook
(`run_context.SearchHook`, given to `run_plan` by the CLI; the runner never imports this module): it
projects every N, launches llama-server for each proposed
N and measures one cell, stores one cell per LAUNCHED N (extras: search_n, fits, projected_bytes,
chosen) so the report can draw the curve, records every candidate (ruled out ones with their
projection, never as cells) under the search's server in the manifest, and returns the engine
options with the chosen N. `describe` turns that record into the CLI summary's lines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from benchsuite.engines.base import EngineOptions
from benchsuite.errors import RunError, UserError
from benchsuite.search_settings import SearchSettings, parse_request

__all__ = ["SearchSettings", "parse_request", "propose", "drive", "run_search", "describe", "format_gb"]

Objective = Callable[[int], "float | None"]
SearchGen = Generator[int, "float | None", "SearchOutcome"]


@dataclass(frozen=True)
class Measurement:
    n: int
    value: float | None  # None: the launch or the cell failed; never counted as 0


@dataclass(frozen=True)
class SearchOutcome:
    best_n: int | None
    best_value: float | None
    measurements: tuple[Measurement, ...]  # launch order
    linear_scan_launches: int  # what one launch per fitting N would have cost

    @property
    def launches(self) -> int:
        return len(self.measurements)


def propose(candidates: Sequence[int], rel_tol: float = 0.02) -> SearchGen:
    """Yield N values to measure over the sorted fitting `candidates`; send back each objective."""
    values = sorted(set(candidates))
    measured: dict[int, float | None] = {}  # index into values -> objective

    def best_index() -> int | None:
        ok = [i for i, v in measured.items() if v is not None]
        return max(ok, key=lambda i: (measured[i], -i)) if ok else None

    # 1. Smallest fitting N that runs (a failed launch moves one to the right).
    start = None
    for i in range(len(values)):
        measured[i] = yield values[i]
        if measured[i] is not None:
            start = i
            break
    if start is None:
        return _outcome(values, measured, None)

    # 2. Step right with doubling strides while the objective improves by more than rel_tol.
    best, stride = start, 1
    while best + stride < len(values):
        j = best + stride
        if j not in measured:
            measured[j] = yield values[j]
        if _improves(measured[j], measured[best], rel_tol):
            best, stride = j, stride * 2
        else:
            break

    # 3. Verify neighbours of the best measured point until it is a measured local maximum.
    while True:
        b = best_index()
        assert b is not None
        todo = [i for i in (b - 1, b + 1) if 0 <= i < len(values) and i not in measured]
        if not todo:
            break
        for i in todo:
            measured[i] = yield values[i]
    return _outcome(values, measured, best_index())


def _improves(new: float | None, old: float | None, rel_tol: float) -> bool:
    """`new` beats `old` by more than the relative tolerance (a failed measurement never does)."""
    if new is None:
        return False
    if old is None:
        return True
    return new - old > rel_tol * abs(old)


def _outcome(values: Sequence[int], measured: Mapping[int, float | None], best: int | None) -> SearchOutcome:
    return SearchOutcome(
        best_n=values[best] if best is not None else None,
        best_value=measured[best] if best is not None else None,
        measurements=tuple(Measurement(values[i], v) for i, v in measured.items()),
        linear_scan_launches=len(values),
    )


def drive(gen: SearchGen, objective: Objective) -> SearchOutcome:
    """Run a proposal generator against a synchronous objective (tests, simulations)."""
    try:
        n = next(gen)
        while True:
            n = gen.send(objective(n))
    except StopIteration as stop:
        return stop.value


# ---- runner hook --------------------------------------------------------------------------------

CandidateOutcome = Literal["ruled out", "measured", "failed", "not launched"]


@dataclass(frozen=True)
class Candidate:
    """One candidate N as the run stores it (manifest `servers.<id>.search.candidates`)."""

    n: int
    # ruled out: the projection exceeds the budget, never launched (no cell); measured / failed: launched
    # (one cell); not launched: fits, but the search found its best point without it
    outcome: CandidateOutcome
    projected_bytes: int  # the projection's GPU total + the margin: what is compared with the budget
    projection: dict[str, Any]  # benchsuite.engines.llamacpp.fit.Projection as a dict
    value: float | None = None  # the objective of a measured N
    cell_id: str | None = None  # the stored cell of a launched N


class _Probe:
    """Launches one server per proposed N and measures its search cell (a resumed run reuses it)."""

    def __init__(self, ctx: Any, task: Any, metric: str) -> None:
        self.ctx, self.task, self.metric = ctx, task, metric
        self.results: dict[int, Any] = {}  # n -> CellResult

    def spec_and_cell(self, n: int) -> tuple[Any, Any]:
        """The candidate's server and its one cell: the first workload and class, repeat 0, at the
        highest concurrency (the objective is measured where the server will be loaded most)."""
        from benchsuite.plan import make_server_spec, plan_cells, stable_id

        spec, option = self.task.spec, self.task.option
        s = make_server_spec(
            spec.name, spec.kind, spec.options.replaced(**{option: n}), spec.fairness, spec.max_concurrency, spec.env
        )
        cells = plan_cells(self.ctx.plan.matrix, s, {**self.task.params, option: n})
        first = cells[0]
        same_class = [
            c for c in cells if (c.workload, c.prompt_class, c.repeat) == (first.workload, first.prompt_class, 0)
        ]
        cell = max(same_class, key=lambda c: c.concurrency)
        cell_id = stable_id({"search_of": spec.server_id, "n": n, "cell": cell.cell_id})
        return s, dataclasses.replace(cell, cell_id=cell_id, params={**cell.params, "search_n": n})

    async def objective(self, n: int) -> float | None:
        from benchsuite.cell_measure import CELL_ERRORS, failed_result, measure_cell
        from benchsuite.server_launch import launch_server

        s, cell = self.spec_and_cell(n)
        stored = self.ctx.store.stored_cell(cell.cell_id)
        if stored is not None and stored.result.status == "ok":
            self.results[n] = stored.result  # resumed run: this N was measured already
        else:
            try:
                async with launch_server(self.ctx, s) as server:
                    self.results[n] = await measure_cell(self.ctx, server, cell, store=False)
            except CELL_ERRORS as exc:
                self.results[n] = failed_result(self.ctx, cell, s, f"{type(exc).__name__}: {exc}")
        r = self.results[n]
        value = getattr(r, self.metric)
        return value if r.status == "ok" and value is not None else None


async def _drive_async(gen: SearchGen, objective: Callable[[int], Any]) -> SearchOutcome:
    try:
        n = next(gen)
        while True:
            n = gen.send(await objective(n))
    except StopIteration as stop:
        return stop.value


def _candidate(n: int, projection: Any, fits: bool, margin_bytes: int, result: Any, metric: str) -> Candidate:
    projected = {
        "n": n,
        "projected_bytes": projection.gpu_total_bytes + margin_bytes,
        "projection": dataclasses.asdict(projection),
    }
    if result is None:
        return Candidate(outcome="not launched" if fits else "ruled out", **projected)
    value = getattr(result, metric) if result.status == "ok" else None
    return Candidate(
        outcome="measured" if value is not None else "failed", value=value, cell_id=result.cell_id, **projected
    )


async def run_search(ctx: Any, task: Any) -> EngineOptions:
    """Search `task.option` of a llamacpp engine entry; returns its options with the chosen N.

    `ctx` is a benchsuite.run_context.RunContext and `task` a benchsuite.plan.SearchTask. Only launched
    candidates become cells; every candidate, ruled out ones with their projection, is recorded
    in the manifest under the search's server (`search.candidates`).
    """
    from benchsuite.engines import ADAPTERS

    spec = task.spec
    adapter = ADAPTERS[spec.kind]
    if not hasattr(adapter, "projections"):
        raise UserError(f"engine {spec.name}: kind {spec.kind} has no {task.option} search")
    settings = parse_request(getattr(spec.options, task.option))
    budget_bytes = adapter.vram_budget_bytes(spec)
    projections = adapter.projections(spec, settings)  # n -> Projection, every candidate N
    margin_bytes = settings.margin_mib * 2**20
    fitting = [n for n in sorted(projections) if projections[n].fits(budget_bytes, margin_bytes)]
    probe = _Probe(ctx, task, settings.metric)
    outcome = await _drive_async(propose(fitting, settings.rel_tol), probe.objective)
    candidates = [
        _candidate(n, projections[n], n in fitting, margin_bytes, probe.results.get(n), settings.metric)
        for n in sorted(projections)
    ]
    for c in candidates:
        if c.cell_id is None:
            continue
        r = probe.results[c.n]
        extras = {
            "search_n": c.n, "search_of": spec.server_id, "fits": c.n in fitting, "projected_bytes": c.projected_bytes,
            "projection": c.projection, "budget_bytes": budget_bytes, "chosen": c.n == outcome.best_n,
            "search_launches": outcome.launches, "linear_scan_launches": outcome.linear_scan_launches,
        }  # fmt: skip
        ctx.store.write_cell(dataclasses.replace(r, extras={**r.extras, **extras}), [])
    record = {
        "option": task.option, "settings": settings.model_dump(), "budget_bytes": budget_bytes,
        "margin_bytes": margin_bytes, "objective_cell": _objective_cell(probe, fitting or sorted(projections)),
        "fitting": fitting, "measured": [dataclasses.asdict(m) for m in outcome.measurements],
        "best_n": outcome.best_n, "launches": outcome.launches, "linear_scan_launches": outcome.linear_scan_launches,
        "candidates": [dataclasses.asdict(c) for c in candidates],
    }  # fmt: skip
    ctx.store.record_server(spec.server_id, engine=spec.name, kind=spec.kind, search=record)
    if outcome.best_n is None:
        if not fitting:
            raise RunError(f"engine {spec.name}: no {task.option} value fits the {budget_bytes / 2**30:.2f} GiB budget")
        raise RunError(f"engine {spec.name}: every launch of the {task.option} search failed (see the logs)")
    return spec.options.replaced(**{task.option: outcome.best_n})


def _objective_cell(probe: _Probe, ns: Sequence[int]) -> dict[str, Any] | None:
    if not ns:
        return None
    _, cell = probe.spec_and_cell(ns[0])
    return {"workload": cell.workload, "prompt_class": cell.prompt_class, "concurrency": cell.concurrency}


# ---- the stored record, in words (the CLI summary; the report has its own table) ----------------

GB = 10**9  # vram_budget_gb is decimal gigabytes


def format_gb(n_bytes: float) -> str:
    """Decimal GB, with enough digits for an emulated sub-GB budget."""
    value = n_bytes / GB
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def describe(engine: str, record: Mapping[str, Any]) -> list[str]:
    """A search's stored record (manifest `servers.<id>.search`) as summary lines: the choice, then
    the candidates by outcome, ruled-out ones with their projection (never as cells)."""
    candidates = record.get("candidates") or []
    if not candidates:
        return []
    budget, margin = record["budget_bytes"], record["margin_bytes"]
    best = record.get("best_n")
    option = record.get("option", "n_cpu_moe")
    value = next((c["value"] for c in candidates if c["n"] == best), None)
    metric = (record.get("settings") or {}).get("metric", "objective")
    head = (
        f"search {option} of {engine}: best N={best} ({metric} {value:.1f})"
        if best is not None
        else f"search {option} of {engine}: no value chosen"
    )
    scan = record["linear_scan_launches"]
    lines = [
        f"{head} after {record['launches']} launches (a scan of every fitting N: {scan}); "
        + f"budget {format_gb(budget)} GB, margin {margin / 2**20:.0f} MiB"
    ]
    by_outcome: dict[str, list[Mapping[str, Any]]] = {}
    for c in candidates:
        by_outcome.setdefault(c["outcome"], []).append(c)
    ruled = by_outcome.get("ruled out", [])
    if ruled:
        lo, hi = min(c["projected_bytes"] for c in ruled), max(c["projected_bytes"] for c in ruled)
        source = ruled[0]["projection"].get("source", "the")
        lines.append(
            f"  ruled out by the {source} projection, never launched: {_ranges([c['n'] for c in ruled])} "
            f"(projected {format_gb(lo)}-{format_gb(hi)} GB with the margin > {format_gb(budget)} GB)"
        )
    measured = by_outcome.get("measured", [])
    if measured:
        lines.append(
            "  measured: "
            + ", ".join(f"N={c['n']} {c['value']:.1f}" + (" (best)" if c["n"] == best else "") for c in measured)
        )
    if by_outcome.get("failed"):
        lines.append(f"  launched and failed (reasons in cells.csv): {_ranges([c['n'] for c in by_outcome['failed']])}")
    if by_outcome.get("not launched"):
        lines.append(f"  fit, not needed by the search: {_ranges([c['n'] for c in by_outcome['not launched']])}")
    return lines


def _ranges(ns: Sequence[int]) -> str:
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
    return "N=" + ", ".join(parts)
