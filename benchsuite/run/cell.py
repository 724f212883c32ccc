"""One cell measured on a ready server: flush, warm up, scrape, load, scrape, summarize, store.
The server's peak device memory is sampled over all of it (benchsuite.tools.device_memory).

`measure_cell` never returns a made-up number: a cell whose engine died is `failed` with the log
tail, one whose metrics cannot be computed is `invalid` (metrics.summarize says why). `base_result`
is a cell's typed identity (K, N, mode, routing, the options in force) before any metric
(`cell_identity`: the same without a run context); `failed_result` marks one failed; `log_extras`
adds the engine log's facts and the adapter's flags.
`CELL_ERRORS` are the failures that fail one cell, not the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from benchsuite.config.plan import CellSpec
from benchsuite.engines import ADAPTERS
from benchsuite.engines.base import EngineAdapter, EngineConfigError, ServerSpec
from benchsuite.errors import RunError
from benchsuite.interrupt import stop_if_cancelled
from benchsuite.load import loadgen
from benchsuite.measure import metrics, paging
from benchsuite.records import CellResult, LoadRequest, RequestRecord
from benchsuite.run.cell_prompts import cell_requests
from benchsuite.run.context import RunContext
from benchsuite.run.server_launch import RunningServer, death_reason, options_in_force
from benchsuite.tools.device_memory import PeakSampler, read_s_within, sampler_record
from benchsuite.tools.machine import cell_noise, noise_snapshot

CELL_ERRORS = (RunError, aiohttp.ClientError, asyncio.TimeoutError, OSError, EngineConfigError)


async def measure_cell(ctx: RunContext, server: RunningServer, cell: CellSpec, *, store: bool = True) -> CellResult:
    """Flush, scrape, load, scrape, summarize one cell on a ready server; store it when asked.

    Never returns a made-up number: a cell whose engine died is `failed` with the log tail, a
    cell whose metrics cannot be computed is `invalid` (metrics.summarize says why). Each request
    has its own timeout (ctx.request_timeout_s), so a slow request is a failed record and the cell
    keeps its records; only a cell that outlasts ctx.cell_timeout_s as a whole (a last resort: its
    records are lost) raises TimeoutError and marks the server hung (`server.hung`).
    """
    try:
        result = await asyncio.wait_for(_measure(ctx, server, cell, store), ctx.cell_timeout_s)
    except TimeoutError:
        server.hung = f"engine did not finish cell {cell.cell_id} within {ctx.cell_timeout_s:g} s"
        raise TimeoutError(server.hung) from None
    stop_if_cancelled()  # Ctrl-C as the cell finished: its result is stored, the run stops here
    return result


async def _measure(ctx: RunContext, server: RunningServer, cell: CellSpec, store: bool) -> CellResult:
    # Device memory is sampled over the whole cell, warmups included (benchsuite.tools.device_memory).
    sampler = PeakSampler(ctx.device_reader, server.process.pid, server.memory_baseline_bytes)
    sampler.start()
    try:
        result, records, scrapes = await _measure_sampled(ctx, server, cell)
    finally:
        peak = await sampler.stop()
    # what the sampler did beside the requests, where it read at all (a GPU machine): its reads per cell, and each
    # request's share of them in its wait for the first token (one process, one perf_counter: the reads' clock)
    sampled = {"memory_sampler": sampler_record(peak, sampler.interval_s)} if peak.reads else {}
    result = dataclasses.replace(
        result,
        peak_device_memory_bytes=peak.peak_bytes,
        device_memory_method=peak.method,
        extras={**result.extras, **sampled},
    )
    records = with_sampler_reads(records, peak.reads)
    if store:
        ctx.store.write_engine_metrics(cell.cell_id, scrapes)
        ctx.store.write_cell(result, records)
    return result


async def _measure_sampled(
    ctx: RunContext, server: RunningServer, cell: CellSpec
) -> tuple[CellResult, list[RequestRecord], dict[str, Any]]:
    adapter, spec, workload = server.adapter, server.spec, cell.workload_spec
    requests = cell_requests(ctx.prompts, adapter, spec, cell)
    await _flush_prefix_cache(ctx, server)
    # Warmups run first as their own load so the counters cover the measured requests only; at least one per
    # stream of the cell (Workload.warmups_at), all streams at once: a server's first request goes alone
    # (cold), so its first cell sends one more, and the c after it still run together.
    cold_first = server.cells_measured == 0
    count = workload.warmups_at(cell.concurrency)
    warmups = [requests[i % len(requests)] for i in range(count + (1 if count and cold_first else 0))]
    records: list[RequestRecord] = []
    if warmups:
        warm = await _load(ctx, server, cell, warmups, cold_first=cold_first, closed=True)
        records = [dataclasses.replace(r, warmup=True) for r in warm]
        cold_first = False
        # the warm-ups sent measured prompts (the first c of them): with a prefix cache, those would be hits
        await _flush_prefix_cache(ctx, server)
    before = await adapter.scrape(ctx.session, server.base_url)
    own_pids = [server.process.pid] if server.process.pid is not None else []
    noise_before = noise_snapshot(own_pids)
    measured = await _load(ctx, server, cell, requests, cold_first=cold_first, closed=False)
    noise = cell_noise(noise_before, noise_snapshot(own_pids))  # the machine around the measured requests
    records += [dataclasses.replace(r, request_index=r.request_index + len(warmups)) for r in measured]
    server.cells_measured += 1
    after = await adapter.scrape(ctx.session, server.base_url) if server.process.alive else None
    result = metrics.summarize(records, base=base_result(ctx, spec, cell), max_error_rate=workload.max_error_rate)
    if before is not None and after is not None:
        result = dataclasses.replace(result, **paging.paging_delta(before, after))
    log_facts = log_extras(adapter, spec, cell, ctx.store.log_path(spec.server_id))
    result = dataclasses.replace(result, extras={**result.extras, **log_facts, "machine": noise})
    if not server.process.alive:
        result = failed_result(ctx, cell, spec, death_reason(server), base=result)
    return result, records, {"before": before, "after": after}


def with_sampler_reads(records: list[RequestRecord], reads: Sequence[tuple[float, float]]) -> list[RequestRecord]:
    """Each record with the sampler's read time inside its [sent, first token] (`sampler_read_s`). The reads and
    the load generator's times are both `time.perf_counter` readings of this process. No read timed (no GPU), or no
    first token: the record as it was (None, not 0)."""
    if not reads:
        return records
    return [
        r if r.t_first_token_s is None else
        dataclasses.replace(r, sampler_read_s=read_s_within(reads, r.t_sent_s, r.t_first_token_s))
        for r in records
    ]  # fmt: skip


async def _flush_prefix_cache(ctx: RunContext, server: RunningServer) -> None:
    """Empties the engine's prefix cache where it has a flush endpoint (each cell starts cold)."""
    flush_path = server.adapter.flush_cache_path
    if flush_path:
        async with ctx.session.post(server.base_url + flush_path) as resp:
            if resp.status != 200:
                raise RunError(f"POST {flush_path} answered HTTP {resp.status}; the prefix cache may be warm")


async def _load(
    ctx: RunContext,
    server: RunningServer,
    cell: CellSpec,
    requests: list[LoadRequest],
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


def base_result(ctx: RunContext, spec: ServerSpec, cell: CellSpec) -> CellResult:
    return cell_identity(ctx.plan.run_id, spec, cell, ctx.node)


def cell_identity(run_id: str, spec: ServerSpec, cell: CellSpec, node: str | None = None) -> CellResult:
    """A cell's typed identity before any metric (status ok): what a measurement, or a failure
    recorded without a server (a Ray node lost), starts from."""
    placement = spec.options.placement()  # typed K, N, mode and routing: the report reads these fields
    return CellResult(
        cell_id=cell.cell_id,
        run_id=run_id,
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
        options=options_in_force(ADAPTERS[spec.kind], spec),
        node=node,
    )


def failed_result(
    ctx: RunContext, cell: CellSpec, spec: ServerSpec, reason: str, base: CellResult | None = None
) -> CellResult:
    """`base` (or a fresh result of the cell) marked failed with `reason`."""
    return dataclasses.replace(base or base_result(ctx, spec, cell), status="failed", reason=reason)


def log_extras(adapter: EngineAdapter, spec: ServerSpec, cell: CellSpec, log_path: Path) -> dict[str, Any]:
    """Facts from the engine log and the adapter's warnings for this cell (`flags`, always a list:
    empty means checked and nothing to say; adapters without a `cell_flags` hook give none)."""
    log_text = log_path.read_text(errors="replace")
    log_facts = adapter.parse_log(log_text)
    extras: dict[str, Any] = {"flags": [str(f) for f in adapter.cell_flags(spec, log_text, cell)]}
    if log_facts:
        extras["engine_log"] = log_facts
    return extras
