"""The run loop: plan -> servers -> cells -> store, resumable.

Each server spec starts once (own process group, free port, log in <run>/logs/<server-id>.log; once
per repeat with `repeat_order: interleaved`) and runs all of its cells (workloads x prompt classes x
concurrencies x repeats); between cells its prefix cache is flushed where the adapter names a flush
path, and its counters are scraped before and after each cell, and so is the machine's noise (load
average, CPU clock, CPU time other processes took: extras["machine"],
benchsuite.tools.machine.cell_noise), and the server's peak device memory is sampled over each cell (NVML,
opened once per run: benchsuite.tools.device_memory). Every cell is written atomically as soon as it ends.
A server that fails to start, or dies, gets its cells recorded `failed` with the log tail; the rest
of the matrix continues. Servers always stop (try/finally), also on Ctrl-C and exceptions.

Its parts: `run_context.RunContext` (what the stages share), `server_launch.launch_server` (one
server's life), `cell_measure.measure_cell` (one cell). A search (llama.cpp `--n-cpu-moe` N or the
built-in engine's paged K against a memory budget, benchsuite.run.search.run_search) is injected as the
`SearchHook` of the context: it receives the `RunContext` and a plan.SearchTask and returns the
engine's options object with the searched value set. Its building blocks are those parts:
- `server_launch.launch_server(ctx, spec)`: async context manager -> RunningServer (started, ready;
  stopped on exit);
- `cell_measure.measure_cell(ctx, server, cell, store=...)`: one measured cell -> CellResult;
- `plan.make_server_spec` / `plan.plan_cells` to build candidate specs and cells.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp

from benchsuite.checks import canary
from benchsuite.config.plan import CellSpec, Plan, SearchTask, resolve_search
from benchsuite.engines import ADAPTERS
from benchsuite.engines.base import EngineConfigError, ServerSpec
from benchsuite.errors import RunError, UserError
from benchsuite.measure import paging
from benchsuite.records import CellResult, LoadRequest
from benchsuite.results.manifest import build_manifest, planned_by_search
from benchsuite.results.server_facts import CanaryResult, SearchRecord
from benchsuite.results.store import RunStore, Writer, atomic_write_bytes
from benchsuite.results.stored_files import read_manifest
from benchsuite.run.cell import CELL_ERRORS, failed_result, measure_cell
from benchsuite.run.cell_prompts import cell_requests
from benchsuite.run.context import (
    DEFAULT_CELL_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    RunContext,
    RunEvents,
    SearchHook,
    SilentEvents,
)
from benchsuite.run.server_launch import RunningServer, death_reason, exited, launch_server
from benchsuite.tools import device_memory

CANARY_MAX_CONCURRENCY = 4


async def run_server_cells(ctx: RunContext, spec: ServerSpec, cells: Sequence[CellSpec]) -> list[CellResult]:
    """Start `spec` once and measure every unfinished cell; failures become `failed` cells."""
    return [result async for result in server_cells(ctx, spec, cells)]


async def server_cells(ctx: RunContext, spec: ServerSpec, cells: Sequence[CellSpec]) -> AsyncIterator[CellResult]:
    """One server's life: start `spec` once, measure every unfinished cell and yield each as it is
    stored (failures as `failed` cells); the server always stops. The local loop and a Ray task
    (benchsuite.run.ray_task) both run a server through here."""
    todo = [c for c in cells if not ctx.store.finished(c.cell_id)]
    if not todo:
        return
    ctx.events.server_starting(spec, len(todo))
    results: list[CellResult] = []
    started = False
    try:
        async with launch_server(ctx, spec) as server:
            started = True
            for cell in todo:
                ctx.events.cell_started(cell)
                if server.hung or not server.process.alive:
                    result = _store_failure(ctx, cell, spec, server.hung or death_reason(server))
                else:
                    try:
                        result = await measure_cell(ctx, server, cell)
                    except CELL_ERRORS as exc:
                        if await exited(server):  # a connection error is the symptom; the exit is the cause
                            reason = death_reason(server)
                        else:
                            reason = f"{type(exc).__name__}: {exc}".rstrip(": ") + f"\n{server.process.log_tail()}"
                        result = _store_failure(ctx, cell, spec, reason.strip())
                results.append(result)
                ctx.events.cell_finished(cell, result)
                yield result
            if not server.hung and server.process.alive:
                await _after_cells(ctx, server, todo)
    except (RunError, UserError, EngineConfigError, OSError) as exc:  # UserError: its port was taken
        if started:
            raise  # not a start failure (e.g. the store cannot write): stop the run
        # The server failed to start: every cell of it fails with the cause (log tail included).
        for cell in todo[len(results) :]:
            ctx.events.cell_started(cell)
            result = _store_failure(ctx, cell, spec, f"engine did not start: {exc}")
            results.append(result)
            ctx.events.cell_finished(cell, result)
            yield result
    if started:
        _add_optimal_hit_rates(ctx, spec, results)  # the stored cells are rewritten in place


def _add_optimal_hit_rates(ctx: RunContext, spec: ServerSpec, results: list[CellResult]) -> list[CellResult]:
    """Paged built-in cells: Belady's hit rate over each cell's steps from the routing trace the
    stopped server wrote (paging.replay_trace once, paging.optimal_hit_rate per cell), or the reason
    there is none in extras["hit_rate_optimal_note"]; the stored cells are rewritten in place."""
    replay = ADAPTERS[spec.kind].trace_replay(spec)
    if replay is None:
        return results
    trace_path = ctx.store.run_dir / replay.trace_file
    trace = optimal = None
    note = paging.NO_TRACE_NOTE
    if replay.recorded:
        note = f"record_routing was set and the server wrote no {trace_path.name} (it did not stop cleanly)"
    if trace_path.is_file() and any(r.miss_rate is not None for r in results):
        from paged_experts.routing.trace import read_trace  # numpy, only with a trace

        try:
            trace = read_trace(trace_path)
            k, keep, rows = replay.resident_experts, replay.prefill_keep, replay.staging_rows
            optimal, note = paging.replay_trace(trace, k, keep, staging_rows=rows), ""
        except (OSError, ValueError, KeyError) as exc:
            note = f"cannot replay {trace_path.name}: {exc}"
    out = []
    for result in results:
        if result.miss_rate is None:
            out.append(result)
            continue
        rate, why = None, note
        if trace is not None and optimal is not None:
            try:
                scrapes = json.loads(ctx.store.engine_metrics_path(result.cell_id).read_bytes())
                rate = paging.optimal_hit_rate(optimal, trace, scrapes["before"], scrapes["after"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                why = f"trace and counters do not line up: {exc}"
        extras = {**result.extras, "hit_rate_optimal_note": why} if why else result.extras
        result = dataclasses.replace(result, hit_rate_optimal=rate, extras=extras)
        ctx.store.update_cell(result)
        out.append(result)
    return out


async def run_search_task(ctx: RunContext, task: SearchTask) -> list[CellResult]:
    """Hand a search to the context's search hook, then run the workloads on the value it returns."""
    return [result async for result in search_cells(ctx, task)]


async def search_cells(ctx: RunContext, task: SearchTask) -> AsyncIterator[CellResult]:
    """A search on one machine (the context's search hook), then the workloads' cells on the value it
    returns, each yielded as it is stored (server_cells); RunError when no value was found."""
    if ctx.search is None:
        raise RunError(f"engine {task.spec.name}: {task.option} asks for a search, and this run has no search hook")
    options = await ctx.search(ctx, task)
    spec, cells = resolve_search(ctx.plan, task, options)
    ctx.store.record_server(spec.server_id, search=SearchRecord(option=task.option, request=task.request))
    ctx.store.record_planned(planned_by_search(task, spec, cells))  # so a stop before them is said
    async for result in server_cells(ctx, spec, cells):
        yield result


def open_store(plan: Plan, output_root: Path | None = None, *, write: Writer = atomic_write_bytes,
               new_run: bool = False) -> RunStore:  # fmt: skip
    """Lock, then create or resume <output_root>/<run-id> (the matrix's output_root unless given);
    `new_run` moves an existing run there aside first. Close the store to release the lock."""
    run_dir = Path(output_root or plan.matrix.matrix.output_root) / plan.run_id
    return RunStore.open(run_dir, build_manifest(plan), write=write, new_run=new_run)


def client_session() -> aiohttp.ClientSession:
    """The one HTTP session of a run (every caller that drives `execute` opens it here)."""
    # limit=0: the load generator sets the concurrency, not the pool. force_close: llama-server
    # answers "Keep-Alive" but closes the socket after each streamed response, so a pooled
    # connection fails the next request; a fresh loopback connection per request, for every engine.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))


async def run_plan(
    plan: Plan,
    store: RunStore,
    events: RunEvents | None = None,
    *,
    cell_timeout_s: float = DEFAULT_CELL_TIMEOUT_S,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    search: SearchHook | None = None,
) -> list[str]:
    """Run every unfinished cell of the plan into the store (the CLI's one library call);
    returns the problems that produced no cell (a search that found no value)."""
    reader = device_memory.open_reader()  # through the module: the tests' seam
    try:
        async with client_session() as session:
            ctx = RunContext(plan, store, session, events or SilentEvents(), cell_timeout_s, request_timeout_s, search,
                             device_reader=reader)  # fmt: skip
            return await execute(ctx)
    finally:
        if reader is not None:
            reader.close()


async def execute(ctx: RunContext) -> list[str]:
    """Every server of the plan, then every search; returns the searches that found no value.
    The tables are rebuilt whatever happens (also on Ctrl-C)."""
    problems: list[str] = []
    try:
        if ctx.plan.matrix.matrix.linkbw:
            await _measure_link(ctx)
        for spec, cells in server_rounds(ctx.plan):
            await run_server_cells(ctx, spec, cells)
        for task in ctx.plan.searches:
            try:
                await run_search_task(ctx, task)
            # no value fits, every launch failed, or the engine cannot run here (a library caller that
            # skipped the plan-time checks): the rest of the run stands
            except (RunError, EngineConfigError) as exc:
                ctx.store.record_server(task.spec.server_id, search_error=str(exc))
                problems.append(str(exc))
    finally:
        ctx.store.rebuild_tables()
    return problems


def server_rounds(plan: Plan) -> list[tuple[ServerSpec, tuple[CellSpec, ...]]]:
    """(server, its cells) per launch: one launch per server, or with `repeat_order: interleaved` one per
    server and repeat, repeat-major, so each repeat of a configuration meets the machine at another time."""
    if plan.matrix.matrix.repeat_order != "interleaved":
        return [(spec, plan.cells_of(spec.server_id)) for spec in plan.servers]
    rounds = []
    for repeat in range(plan.matrix.matrix.repeats):
        for spec in plan.servers:
            rounds.append((spec, tuple(c for c in plan.cells_of(spec.server_id) if c.repeat == repeat)))
    return rounds


async def _measure_link(ctx: RunContext) -> None:
    """The run's link probe (matrix `linkbw: true`), before the first server while the GPU is idle;
    a resumed run keeps a figure it already has and retries a probe that failed."""
    from benchsuite.tools.linkbw import probe_in_subprocess

    stored = read_manifest(ctx.store.run_dir).link_bandwidth
    if stored is not None and stored.paging_gb_per_s:
        return
    ctx.store.record_run(link_bandwidth=await asyncio.to_thread(probe_in_subprocess))


def _store_failure(ctx: RunContext, cell: CellSpec, spec: ServerSpec, reason: str) -> CellResult:
    result = failed_result(ctx, cell, spec, reason)
    ctx.store.write_cell(result, [])
    return result


async def _after_cells(ctx: RunContext, server: RunningServer, cells: Sequence[CellSpec]) -> None:
    """On a live server after its cells, before it stops: the adapter's `after_cells` hook (e.g.
    SGLang's routing capture) and, when the matrix asks, the leak canary. Both go to the manifest's
    server entry; neither marks a cell failed (a canary failure is shown in the report instead)."""
    spec, adapter = server.spec, server.adapter

    def requests() -> list[LoadRequest]:  # built only by a hook that needs them (prompts may read a tokenizer)
        sent = (r for c in cells for r in cell_requests(ctx.prompts, adapter, spec, c))
        return list({(r.prompt_class, r.prompt_id): r for r in sent}.values())

    try:
        facts = await adapter.after_cells(ctx.session, spec, server.base_url, ctx.store.run_dir, requests)
    except (*CELL_ERRORS, ValueError) as exc:
        facts = {"after_cells_error": f"{type(exc).__name__}: {exc}"}
    if facts:
        ctx.store.record_server(spec.server_id, facts=facts)
    if ctx.plan.matrix.matrix.canary:
        try:
            report = await canary.run_canary(
                server.base_url, rounds=1, concurrency=min(CANARY_MAX_CONCURRENCY, spec.max_concurrency),
                max_tokens=16, extras=adapter.request_extras(spec),
            )  # fmt: skip
            result = CanaryResult.model_validate(report.to_dict())
        except (*CELL_ERRORS, ValueError) as exc:  # not run to the end: no verdict, the reason kept
            result = CanaryResult(error=f"{type(exc).__name__}: {exc}")
        ctx.store.record_server(spec.server_id, canary=result)
