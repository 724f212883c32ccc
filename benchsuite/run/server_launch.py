"""One engine server's life inside a run: started in its own process group on a free port, its command
line, environment and start-up recorded in the manifest, ready, and always stopped.

`launch_server(ctx, spec)` is an async context manager -> `RunningServer`; `death_reason` and
`exited` say why a server that stopped answering is gone (its exit code and log tail).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from benchsuite.config.engine_env import engine_environment, recorded
from benchsuite.engines import ADAPTERS, RUN_DIR_PLACEHOLDER
from benchsuite.engines.base import EngineAdapter, ServerSpec
from benchsuite.results.store import utc_now
from benchsuite.run.context import RunContext
from benchsuite.run.process import EngineProcess, free_port
from benchsuite.tools.device_memory import baseline_bytes


@dataclass
class RunningServer:
    spec: ServerSpec
    adapter: EngineAdapter
    process: EngineProcess
    base_url: str
    argv: list[str]
    cells_measured: int = 0  # the first cell after a start carries the cold request
    hung: str | None = None  # why the server stopped answering; its later cells fail at once
    memory_baseline_bytes: int | None = None  # the GPUs' used memory before it started (device_memory)


@asynccontextmanager
async def launch_server(ctx: RunContext, spec: ServerSpec) -> AsyncIterator[RunningServer]:
    """Start one server (free port, own group, log kept), wait until ready, always stop it.

    Raises RunError (with the log tail) when the engine cannot start or crashes while starting.
    """
    adapter = ADAPTERS[spec.kind]
    adapter.validate(spec)
    adapter.prepare(spec)  # build what the command line names (a no-op for most engines)
    port = free_port()
    launch = adapter.launch_plan(spec, port)
    run_dir = str(ctx.store.run_dir.resolve())
    replay = adapter.trace_replay(spec)
    if replay is not None and replay.recorded:
        # a server of the same id before this one (a search's launch at the chosen value) left its trace: this
        # server's cells must be replayed over this server's trace or none (_add_optimal_hit_rates)
        (ctx.store.run_dir / replay.trace_file).unlink(missing_ok=True)
    argv = [arg.replace(RUN_DIR_PLACEHOLDER, run_dir) for arg in launch.argv]
    adapter_env = {k: v.replace(RUN_DIR_PLACEHOLDER, run_dir) for k, v in launch.env.items()}
    env = engine_environment(os.environ, adapter_env, spec.env)  # the whole environment: nothing else leaks in
    base_url = f"http://127.0.0.1:{port}"
    ctx.store.record_server(
        spec.server_id,
        engine=spec.name,
        kind=spec.kind,
        options=spec.options.model_dump(mode="json"),
        resolved_options=options_in_force(adapter, spec),
        fairness=spec.fairness.as_dict(),
        max_concurrency=spec.max_concurrency,
        argv=argv,
        env=recorded(env),
        version=adapter.version(spec),
        model=adapter.model_shape(spec),
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
    baseline = baseline_bytes(ctx.device_reader)  # before the start, for the device-delta fallback
    try:
        started_s = time.perf_counter()
        process.start()
        await process.wait_ready()
        startup_s = round(time.perf_counter() - started_s, 3)  # launch -> first 200 from health
        facts = await adapter.startup_facts(ctx.session, base_url)  # the engine's own breakdown, if it reports one
        ctx.store.record_server(spec.server_id, startup_s=startup_s, startup_facts=facts)
        yield RunningServer(spec, adapter, process, base_url, argv, memory_baseline_bytes=baseline)
    finally:
        process.stop(launch.stop_grace_s)  # not astop: it must finish even when this task is being cancelled


def options_in_force(adapter: EngineAdapter, spec: ServerSpec) -> dict[str, Any]:
    """The options a server runs with: the adapter's `resolved_options` hook (defaults that depend on
    the device, mode or concurrency resolved; by default the options object as validated)."""
    return dict(adapter.resolved_options(spec))


async def exited(server: RunningServer, wait_s: float = 1.0) -> bool:
    """Whether the engine has exited, waiting briefly: a killed process is reaped a moment after
    its sockets close, and the exit code says more than the client's connection error."""
    deadline = time.monotonic() + wait_s
    while server.process.alive and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not server.process.alive


def death_reason(server: RunningServer) -> str:
    return f"engine exited with code {server.process.returncode}; log tail:\n{server.process.log_tail()}"
