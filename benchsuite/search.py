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
injected, so unit tests drive it with synthetic curves. `run_search` is the runner hook
(benchsuite.runner.run_search_task): it projects every N, launches llama-server for each proposed
N, measures one cell, stores one cell per N (extras: search_n, fits, projected_bytes, chosen) so
the report can draw the curve, and returns the engine options with the chosen N.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from benchsuite.errors import RunError, UserError

Objective = Callable[[int], "float | None"]
SearchGen = Generator[int, "float | None", "SearchOutcome"]


class SearchSettings(BaseModel):
    """`n_cpu_moe: {search: {...}}` (all optional; `n_cpu_moe: search` takes the defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_n: int = Field(0, ge=0)
    max_n: int | None = Field(
        None, ge=0
    )  # default: the model's layer count (all experts on the CPU)
    rel_tol: float = Field(
        0.02, ge=0.0
    )  # a step right must improve by more than this to continue
    metric: Literal["decode_tok_s_p50", "output_tok_s"] = "decode_tok_s_p50"
    margin_mib: int = Field(1024, ge=0)  # llama.cpp's default fit margin per device
    projection: Literal["auto", "benchsuite", "llama-fit-params"] = "auto"


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


def _outcome(
    values: Sequence[int], measured: Mapping[int, float | None], best: int | None
) -> SearchOutcome:
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


def parse_request(value: Any) -> SearchSettings:
    """`search` or `{search: {...}}` -> settings; anything else is a user error."""
    if value == "search":
        return SearchSettings()
    if isinstance(value, Mapping) and set(value) == {"search"}:
        body = value["search"] or {}
        if not isinstance(body, Mapping):
            raise UserError(
                "n_cpu_moe: {search: ...} must hold a mapping of search settings"
            )
        try:
            return SearchSettings.model_validate(dict(body))
        except ValidationError as exc:
            raise UserError(f"n_cpu_moe.search: {exc}") from None
    raise UserError(
        f"n_cpu_moe: expected an integer, 'search' or {{search: {{...}}}}, got {value!r}"
    )


# ---- runner hook --------------------------------------------------------------------------------


async def run_search(ctx: Any, task: Any) -> Mapping[str, Any]:
    """Search `task.option` of a llamacpp engine entry; returns its options with the chosen N.

    `ctx` is a benchsuite.runner.RunContext and `task` a benchsuite.plan.SearchTask.
    """
    from benchsuite import runner
    from benchsuite.engines import ADAPTERS
    from benchsuite.plan import make_server_spec, plan_cells, stable_id

    spec = task.spec
    adapter = ADAPTERS[spec.kind]
    if not hasattr(adapter, "projections"):
        raise UserError(
            f"engine {spec.name}: kind {spec.kind} has no {task.option} search"
        )
    settings = parse_request(spec.options[task.option])
    budget_bytes = adapter.vram_budget_bytes(spec)
    projections = adapter.projections(
        spec, settings
    )  # n -> Projection, every candidate N
    margin_bytes = settings.margin_mib * 2**20
    fits = {n: p.fits(budget_bytes, margin_bytes) for n, p in projections.items()}
    fitting = [n for n in sorted(projections) if fits[n]]

    def spec_for(n: int) -> Any:
        options = {**spec.options, task.option: n}
        return make_server_spec(
            spec.name, spec.kind, options, spec.fairness, spec.max_concurrency, spec.env
        )

    def search_cell(n: int) -> Any:
        s = spec_for(n)
        cells = plan_cells(ctx.plan.matrix, s, {**task.params, task.option: n})
        first = cells[0]
        same_class = [
            c
            for c in cells
            if (c.workload, c.prompt_class, c.repeat)
            == (first.workload, first.prompt_class, 0)
        ]
        cell = max(
            same_class, key=lambda c: c.concurrency
        )  # the objective is at the cell's concurrency
        cell_id = stable_id({"search_of": spec.server_id, "n": n, "cell": cell.cell_id})
        return s, dataclasses.replace(
            cell, cell_id=cell_id, params={**cell.params, "search_n": n}
        )

    results: dict[int, Any] = {}

    async def objective(n: int) -> float | None:
        s, cell = search_cell(n)
        stored = ctx.store.stored_cell(cell.cell_id)
        if stored is not None and stored.result.status == "ok":
            results[n] = stored.result  # resumed run: this N was measured already
        else:
            try:
                async with runner.launch_server(ctx, s) as server:
                    results[n] = await runner.measure_cell(
                        ctx, server, cell, store=False
                    )
            except runner.CELL_ERRORS as exc:
                results[n] = runner.failed_result(
                    ctx, cell, s, f"{type(exc).__name__}: {exc}"
                )
        r = results[n]
        value = getattr(r, settings.metric)
        return value if r.status == "ok" and value is not None else None

    gen = propose(fitting, settings.rel_tol)
    try:
        n = next(gen)
        while True:
            n = gen.send(await objective(n))
    except StopIteration as stop:
        outcome: SearchOutcome = stop.value

    for n in sorted(projections):
        s, cell = search_cell(n)
        p = projections[n]
        extras = {
            "search_n": n,
            "search_of": spec.server_id,
            "fits": fits[n],
            "projected_bytes": p.gpu_total_bytes + margin_bytes,
            "projection": dataclasses.asdict(p),
            "budget_bytes": budget_bytes,
            "chosen": n == outcome.best_n,
            "search_launches": outcome.launches,
            "linear_scan_launches": outcome.linear_scan_launches,
        }
        if n in results:
            r = results[n]
            ctx.store.write_cell(
                dataclasses.replace(r, extras={**r.extras, **extras}), []
            )
        elif not fits[n]:
            reason = (
                f"not launched: projected {p.gpu_total_bytes / 2**20:.1f} MiB + margin "
                f"{settings.margin_mib} MiB exceeds the {budget_bytes / 2**20:.1f} MiB budget"
            )
            base = runner.failed_result(ctx, cell, s, reason)
            ctx.store.write_cell(
                dataclasses.replace(base, status="invalid", extras=extras), []
            )
    ctx.store.record_server(
        spec.server_id,
        {
            "search": {
                "option": task.option,
                "settings": settings.model_dump(),
                "fitting": fitting,
                "measured": [dataclasses.asdict(m) for m in outcome.measurements],
                "best_n": outcome.best_n,
                "launches": outcome.launches,
                "linear_scan_launches": outcome.linear_scan_launches,
            }
        },
    )
    if outcome.best_n is None:
        if not fitting:
            raise RunError(
                f"engine {spec.name}: no {task.option} value fits the {budget_bytes / 2**30:.2f} GiB budget"
            )
        raise RunError(
            f"engine {spec.name}: every launch of the {task.option} search failed (see the logs)"
        )
    return {**spec.options, task.option: outcome.best_n}
