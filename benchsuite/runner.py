"""The run loop: plan -> servers -> cells -> store, resumable.

Each server spec starts once (own process group, free port, log in <run>/logs/<server-id>.log; once
per repeat with `repeat_order: interleaved`) and runs all of its cells (workloads x prompt classes x
concurrencies x repeats); between cells its prefix cache is flushed where the adapter names a flush
path, and its counters are scraped before and after each cell, and so is the machine's noise (load
average, CPU clock, CPU time other processes took: extras["machine"],
benchsuite.machine.cell_noise). Every cell is written atomically as soon as it ends. A server that
fails to start, or dies, gets its cells recorded `failed` with the log tail; the rest of the matrix
continues. Servers always stop (try/finally), also on Ctrl-C and exceptions.

A search (the llama.cpp `--n-cpu-moe` search, benchsuite.search.run_search) is injected as the
`SearchHook` of the context: it receives the `RunContext` and a plan.SearchTask and returns the
engine's options object with the searched value set. Its building blocks here:
- `launch_server(ctx, spec)`: async context manager -> RunningServer (started, ready; stopped on exit);
- `measure_cell(ctx, server, cell, store=...)`: one measured cell -> CellResult;
- `plan.make_server_spec` / `plan.plan_cells` to build candidate specs and cells.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from benchsuite import canary, loadgen, metrics, paging
from benchsuite.engine_env import engine_environment, recorded
from benchsuite.engines import ADAPTERS, RUN_DIR_PLACEHOLDER
from benchsuite.engines.base import EngineAdapter, EngineConfigError, EngineOptions, ServerSpec
from benchsuite.errors import RunError, UserError
from benchsuite.machine import cell_noise, noise_snapshot
from benchsuite.manifest import build_manifest
from benchsuite.plan import CellSpec, Plan, SearchTask, resolve_search
from benchsuite.process import EngineProcess, free_port
from benchsuite.prompts_for_cells import PromptCache, cell_requests
from benchsuite.records import CellResult, RequestRecord
from benchsuite.store import RunStore, Writer, atomic_write_bytes, read_manifest, utc_now

DEFAULT_CELL_TIMEOUT_S = 3600.0
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # one request; a request past it is a failed record, the cell goes on
CANARY_MAX_CONCURRENCY = 4
CELL_ERRORS = (RunError, aiohttp.ClientError, asyncio.TimeoutError, OSError, EngineConfigError)


class RunEvents(Protocol):
    """What a progress display hears about; the runner never draws anything itself."""

    def server_starting(self, spec: ServerSpec, cells: int) -> None: ...

    def cell_started(self, cell: CellSpec) -> None: ...

    def cell_finished(self, cell: CellSpec, result: CellResult) -> None: ...


class SilentEvents:
    def server_starting(self, spec: ServerSpec, cells: int) -> None:
        pass

    def cell_started(self, cell: CellSpec) -> None:
        pass

    def cell_finished(self, cell: CellSpec, result: CellResult) -> None:
        pass


@dataclass
class RunContext:
    plan: Plan
    store: RunStore
    session: aiohttp.ClientSession
    events: RunEvents = field(default_factory=SilentEvents)
    cell_timeout_s: float = DEFAULT_CELL_TIMEOUT_S  # last resort: a hung engine fails its cell, not the whole run
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S  # per request: its record survives as a failure
    search: SearchHook | None = None  # runs the plan's searches (benchsuite.search.run_search)
    _prompts: PromptCache = field(default_factory=dict)


SearchHook = Callable[[RunContext, SearchTask], Awaitable[EngineOptions]]


@dataclass
class RunningServer:
    spec: ServerSpec
    adapter: EngineAdapter
    process: EngineProcess
    base_url: str
    argv: list[str]
    cells_measured: int = 0  # the first cell after a start carries the cold request
    hung: str | None = None  # why the server stopped answering; its later cells fail at once


@asynccontextmanager
async def launch_server(ctx: RunContext, spec: ServerSpec) -> AsyncIterator[RunningServer]:
    """Start one server (free port, own group, log kept), wait until ready, always stop it.

    Raises RunError (with the log tail) when the engine cannot start or crashes while starting.
    """
    adapter = ADAPTERS[spec.kind]
    adapter.validate(spec)
    prepare = getattr(adapter, "prepare", None)  # optional: build what the command line names
    if prepare is not None:
        prepare(spec)
    port = free_port()
    launch = adapter.launch_plan(spec, port)
    run_dir = str(ctx.store.run_dir.resolve())
    argv = [arg.replace(RUN_DIR_PLACEHOLDER, run_dir) for arg in launch.argv]
    adapter_env = {k: v.replace(RUN_DIR_PLACEHOLDER, run_dir) for k, v in launch.env.items()}
    env = engine_environment(os.environ, adapter_env, spec.env)  # the whole environment: nothing else leaks in
    base_url = f"http://127.0.0.1:{port}"
    ctx.store.record_server(
        spec.server_id,
        engine=spec.name,
        kind=spec.kind,
        options=spec.options.model_dump(mode="json"),
        resolved_options=_options_in_force(adapter, spec),
        fairness=dict(spec.fairness),
        max_concurrency=spec.max_concurrency,
        argv=argv,
        env=recorded(env),
        version=adapter.version(spec),
        started_utc=utc_now(),
        log=str(ctx.store.log_path(spec.server_id).relative_to(ctx.store.run_dir)),
    )
    process = EngineProcess(
        argv,
        env,
        ctx.store.log_path(spec.server_id),
        base_url + launch.health_path,
        launch.startup_timeout_s,
        inherit_env=False,
    )
    try:
        started_s = time.perf_counter()
        process.start()
        await process.wait_ready()
        startup_s = round(time.perf_counter() - started_s, 3)  # launch -> first 200 from health
        engine_startup = getattr(adapter, "startup_facts", None)  # the engine's own breakdown, if it reports one
        facts = await engine_startup(ctx.session, base_url) if engine_startup is not None else {}
        ctx.store.record_server(spec.server_id, startup_s=startup_s, startup_facts=facts)
        yield RunningServer(spec, adapter, process, base_url, argv)
    finally:
        process.stop()


async def measure_cell(ctx: RunContext, server: RunningServer, cell: CellSpec, *, store: bool = True) -> CellResult:
    """Flush, scrape, load, scrape, summarize one cell on a ready server; store it when asked.

    Never returns a made-up number: a cell whose engine died is `failed` with the log tail, a
    cell whose metrics cannot be computed is `invalid` (metrics.summarize says why). Each request
    has its own timeout (ctx.request_timeout_s), so a slow request is a failed record and the cell
    keeps its records; only a cell that outlasts ctx.cell_timeout_s as a whole (a last resort: its
    records are lost) raises TimeoutError and marks the server hung (`server.hung`).
    """
    try:
        return await asyncio.wait_for(_measure(ctx, server, cell, store), ctx.cell_timeout_s)
    except TimeoutError:
        server.hung = f"engine did not finish cell {cell.cell_id} within {ctx.cell_timeout_s:g} s"
        raise TimeoutError(server.hung) from None


async def _measure(ctx: RunContext, server: RunningServer, cell: CellSpec, store: bool) -> CellResult:
    adapter, spec, workload = server.adapter, server.spec, cell.workload_spec
    requests = cell_requests(ctx._prompts, adapter, spec, cell)
    flush_path = getattr(adapter, "flush_cache_path", None)
    if flush_path:
        async with ctx.session.post(server.base_url + flush_path) as resp:
            if resp.status != 200:
                raise RunError(f"POST {flush_path} answered HTTP {resp.status}; the prefix cache may be warm")
    # Warmups run first as their own load so the counters cover the measured requests only.
    warmups = [requests[i % len(requests)] for i in range(workload.warmup_requests)]
    cold_first = server.cells_measured == 0
    records: list[RequestRecord] = []
    if warmups:
        warm = await _load(ctx, server, cell, warmups, cold_first=cold_first, closed=True)
        records = [dataclasses.replace(r, warmup=True) for r in warm]
        cold_first = False
    before = await adapter.scrape(ctx.session, server.base_url)
    own_pids = [server.process.pid] if server.process.pid is not None else []
    noise_before = noise_snapshot(own_pids)
    measured = await _load(ctx, server, cell, requests, cold_first=cold_first, closed=False)
    noise = cell_noise(noise_before, noise_snapshot(own_pids))  # the machine around the measured requests
    records += [dataclasses.replace(r, request_index=r.request_index + len(warmups)) for r in measured]
    server.cells_measured += 1
    after = await adapter.scrape(ctx.session, server.base_url) if server.process.alive else None
    result = metrics.summarize(records, base=_base_result(ctx, spec, cell), max_error_rate=workload.max_error_rate)
    if before is not None and after is not None:
        result = dataclasses.replace(result, **paging.paging_delta(before, after))
    log_extras = _log_extras(adapter, spec, cell, ctx.store.log_path(spec.server_id))
    result = dataclasses.replace(result, extras={**result.extras, **log_extras, "machine": noise})
    if not server.process.alive:
        result = failed_result(ctx, cell, spec, _death_reason(server), base=result)
    if store:
        ctx.store.write_engine_metrics(cell.cell_id, {"before": before, "after": after})
        ctx.store.write_cell(result, records)
    return result


async def run_server_cells(ctx: RunContext, spec: ServerSpec, cells: Sequence[CellSpec]) -> list[CellResult]:
    """Start `spec` once and measure every unfinished cell; failures become `failed` cells."""
    todo = [c for c in cells if not ctx.store.finished(c.cell_id)]
    if not todo:
        return []
    ctx.events.server_starting(spec, len(todo))
    results: list[CellResult] = []
    started = False
    try:
        async with launch_server(ctx, spec) as server:
            started = True
            for cell in todo:
                ctx.events.cell_started(cell)
                if server.hung or not server.process.alive:
                    result = _store_failure(ctx, cell, spec, server.hung or _death_reason(server))
                else:
                    try:
                        result = await measure_cell(ctx, server, cell)
                    except CELL_ERRORS as exc:
                        if await _exited(server):  # a connection error is the symptom; the exit is the cause
                            reason = _death_reason(server)
                        else:
                            reason = f"{type(exc).__name__}: {exc}".rstrip(": ") + f"\n{server.process.log_tail()}"
                        result = _store_failure(ctx, cell, spec, reason.strip())
                results.append(result)
                ctx.events.cell_finished(cell, result)
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
    return results


async def run_search_task(ctx: RunContext, task: SearchTask) -> list[CellResult]:
    """Hand a search to the context's search hook, then run the workloads on the value it returns."""
    if ctx.search is None:
        raise RunError(f"engine {task.spec.name}: {task.option} asks for a search, and this run has no search hook")
    options = await ctx.search(ctx, task)
    spec, cells = resolve_search(ctx.plan, task, options)
    request = getattr(task.spec.options, task.option)
    ctx.store.record_server(spec.server_id, search={"option": task.option, "request": request})
    return await run_server_cells(ctx, spec, cells)


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
    async with client_session() as session:
        ctx = RunContext(plan, store, session, events or SilentEvents(), cell_timeout_s, request_timeout_s, search)
        return await execute(ctx)


async def execute(ctx: RunContext) -> list[str]:
    """Every server of the plan, then every search; returns the searches that found no value.
    The tables are rebuilt whatever happens (also on Ctrl-C)."""
    problems: list[str] = []
    try:
        if ctx.plan.matrix.matrix.linkbw:
            await _measure_link(ctx)
        for spec, cells in _server_rounds(ctx.plan):
            await run_server_cells(ctx, spec, cells)
        for task in ctx.plan.searches:
            try:
                await run_search_task(ctx, task)
            except RunError as exc:  # no value fits or every launch failed: the rest of the run stands
                ctx.store.record_server(task.spec.server_id, search_error=str(exc))
                problems.append(str(exc))
    finally:
        ctx.store.rebuild_tables()
    return problems


def _server_rounds(plan: Plan) -> list[tuple[ServerSpec, tuple[CellSpec, ...]]]:
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
    from benchsuite.linkbw import probe_in_subprocess

    stored = read_manifest(ctx.store.run_dir).link_bandwidth or {}
    if stored.get("paging_gb_per_s"):
        return
    ctx.store.record_run(link_bandwidth=await asyncio.to_thread(probe_in_subprocess))


async def _load(
    ctx: RunContext,
    server: RunningServer,
    cell: CellSpec,
    requests: list[loadgen.LoadRequest],
    *,
    cold_first: bool,
    closed: bool,
) -> list[RequestRecord]:
    """One load phase of a cell: closed-loop warmups, or the measured requests as the workload says."""
    workload = cell.workload_spec
    spec = loadgen.LoadSpec(
        concurrency=cell.concurrency,
        arrival="closed" if closed else workload.arrival,
        rate_rps=None if closed else workload.rate_rps,
        seed=workload.seed,
        timeout_s=min(ctx.request_timeout_s, ctx.cell_timeout_s),  # no request outlives its cell
    )
    return await loadgen.run_load(
        server.base_url,
        requests,
        spec,
        cell_id=cell.cell_id,
        model_name=server.spec.model_name,
        extras=server.adapter.request_extras(server.spec),
        cold_first=cold_first,
        session=ctx.session,
    )


def _options_in_force(adapter: EngineAdapter, spec: ServerSpec) -> dict[str, Any]:
    """The options a server runs with: the adapter's `resolved_options` hook (defaults that depend on
    the device, mode or concurrency resolved), else the options object as validated."""
    resolve = getattr(adapter, "resolved_options", None)
    return dict(resolve(spec)) if resolve is not None else spec.options.model_dump(mode="json")


def _base_result(ctx: RunContext, spec: ServerSpec, cell: CellSpec) -> CellResult:
    placement = spec.options.placement()  # typed K, N, mode and routing: the report reads these fields
    return CellResult(
        cell_id=cell.cell_id,
        run_id=ctx.plan.run_id,
        engine=cell.engine,
        engine_kind=spec.kind,
        mode=placement.mode,
        server_id=cell.server_id,
        params=dict(cell.params),
        workload=cell.workload,
        prompt_class=cell.prompt_class,
        concurrency=cell.concurrency,
        repeat=cell.repeat,
        status="ok",
        routing=placement.routing,
        resident_experts=placement.resident_experts,
        n_cpu_moe=placement.n_cpu_moe,
        options=_options_in_force(ADAPTERS[spec.kind], spec),
    )


def failed_result(
    ctx: RunContext, cell: CellSpec, spec: ServerSpec, reason: str, base: CellResult | None = None
) -> CellResult:
    """`base` (or a fresh result of the cell) marked failed with `reason`."""
    return dataclasses.replace(base or _base_result(ctx, spec, cell), status="failed", reason=reason)


def _store_failure(ctx: RunContext, cell: CellSpec, spec: ServerSpec, reason: str) -> CellResult:
    result = failed_result(ctx, cell, spec, reason)
    ctx.store.write_cell(result, [])
    return result


async def _exited(server: RunningServer, wait_s: float = 1.0) -> bool:
    """Whether the engine has exited, waiting briefly: a killed process is reaped a moment after
    its sockets close, and the exit code says more than the client's connection error."""
    deadline = time.monotonic() + wait_s
    while server.process.alive and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not server.process.alive


def _death_reason(server: RunningServer) -> str:
    return f"engine exited with code {server.process.returncode}; log tail:\n{server.process.log_tail()}"


def _log_extras(adapter: EngineAdapter, spec: ServerSpec, cell: CellSpec, log_path: Path) -> dict[str, Any]:
    """Facts from the engine log and the adapter's warnings for this cell (`flags`, always a list:
    empty means checked and nothing to say; adapters without the `cell_flags` hook give none)."""
    log_text = log_path.read_text(errors="replace")
    log_facts = adapter.parse_log(log_text)
    flags_hook = getattr(adapter, "cell_flags", None)
    extras: dict[str, Any] = {"flags": [str(f) for f in flags_hook(spec, log_text, cell)] if flags_hook else []}
    if log_facts:
        extras["engine_log"] = log_facts
    return extras


async def _after_cells(ctx: RunContext, server: RunningServer, cells: Sequence[CellSpec]) -> None:
    """On a live server after its cells, before it stops: the adapter's `after_cells` hook (e.g.
    SGLang's routing capture) and, when the matrix asks, the leak canary. Both go to the manifest's
    server entry; neither marks a cell failed (a canary failure is shown in the report instead)."""
    spec, adapter = server.spec, server.adapter
    hook = getattr(adapter, "after_cells", None)
    if hook is not None:
        try:
            sent = (r for c in cells for r in cell_requests(ctx._prompts, adapter, spec, c))
            requests = {(r.prompt_class, r.prompt_id): r for r in sent}
            facts = await hook(ctx, server, list(requests.values()))
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
            result: dict[str, Any] = report.to_dict()
        except (*CELL_ERRORS, ValueError) as exc:  # not run to the end: no verdict, the reason kept
            result = {"error": f"{type(exc).__name__}: {exc}"}
        ctx.store.record_server(spec.server_id, canary=result)
