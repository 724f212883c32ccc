"""OpenAI-compatible aiohttp server over the paged-expert runtime; `python -m paged_experts.server`.

Owns the app (routes, start-up and shutdown) and the operational endpoints: `/v1/models`,
`/health` (200 only once the model is loaded and the engine runs; 503 while loading or after a
failed load), `/metrics` (Prometheus text), `/server_info` (resolved configs, versions, routing
label) and `POST /flush_cache` (200 no-op: this engine has no prefix cache, as SGLang's endpoint
does when the cache is disabled). The generation endpoints live in `api_handlers`.

The socket opens first and the model loads in a worker thread, so readiness can be polled; a
failed load exits the process with status 1. Once loaded (graphs captured, layers compiled) and before
`/health` answers 200, the process's heap is frozen for the garbage collector (`gc_pauses.freeze_heap`;
`--disable-gc-freeze` leaves it) and given back at shutdown. Binds 127.0.0.1 unless told otherwise. Connections
go through `connections` (read timeouts, the cap, half-close); the POST routes check
`Expect: 100-continue` against the body limit before answering "100 Continue". Ctrl-C at any
moment ends with one line on stderr and status 130.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch
from aiohttp import web

from paged_experts.server import gc_pauses
from paged_experts.server.connections import (
    KEEPALIVE_TIMEOUT_S,
    AcceptErrorLog,
    ConnectionGuard,
    ConnectionLimits,
    GuardedSite,
    default_max_connections,
    raise_open_file_limit,
)
from paged_experts.server.handlers import STATE_KEY, ServerState, chat_completions, completions, error_middleware
from paged_experts.server.launch import Serving, load_serving, parse_args
from paged_experts.server.metrics import EngineGauges, ServerMetrics
from paged_experts.server.options import ServeOptions
from paged_experts.server.protocol import ApiError
from paged_experts.server.threads import default_cpu_threads

log = logging.getLogger("paged_experts.server")

Loader = Callable[[ServeOptions, ServerMetrics], Serving]
MAX_BODY_BYTES = 64 * 1024 * 1024
CONNECTIONS_KEY = web.AppKey("connections", ConnectionGuard)


async def health(request: web.Request) -> web.Response:
    problem = request.app[STATE_KEY].not_ready_reason()
    if problem is not None:
        return web.json_response({"status": problem}, status=503)
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    serving = state.ready()
    cfg = state.config
    entry = {
        "id": cfg.model_name,
        "object": "model",
        "created": state.started_s,
        "owned_by": "paged_experts",
        "root": cfg.model_path,
        "max_model_len": serving.engine.kv_capacity_tokens,
        "routing": cfg.routing_label,
        "routing_synthetic": cfg.routing_source is not None,
    }
    return web.json_response({"object": "list", "data": [entry]})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    serving = state.serving
    if serving is None:
        gauges, counters = EngineGauges(0, 0, 0, state.config.max_total_tokens), None
    else:
        engine = serving.engine
        # snapshot between steps: a forward in flight is still adding to the counters
        counters = await engine.between_steps(serving.model.counters.snapshot)
        gauges = EngineGauges(
            engine.num_running, engine.num_waiting, engine.kv_used_tokens, engine.kv_capacity_tokens,
            engine.timer.decode_steps, engine.timer.decode_tokens, engine.timer.decode_step_s,
            engine.timer.decode_model_s, engine.timer.steps, dict(engine.timer.phase_s),
            *gpu_memory(serving.runtime.device),
        )  # fmt: skip
    guard = request.app.get(CONNECTIONS_KEY)
    connections = None if guard is None else guard.counts()
    text = state.metrics.render(gauges, counters, state.config.routing_source is not None, connections)
    return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})


def gpu_memory(device: str) -> tuple[int, int]:
    """(peak bytes the caching allocator reserved, graph pools included; bytes in use on the device
    by every process, its context included: what a card of that size would need) on CUDA, else 0s."""
    if device != "cuda":
        return 0, 0
    free, total = torch.cuda.mem_get_info()
    return torch.cuda.max_memory_reserved(), total - free


async def server_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    serving = state.ready()
    return web.json_response(serving.info())


async def flush_cache(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.ready()
    return web.json_response({"flushed": True, "prefix_cache": False})


async def expect_within_limits(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue`: the declared body is checked before the client is told to send it
    (aiohttp's default handler says "100 Continue" to any size). Refusals close the connection:
    the client holds its body back, so nothing is left to read."""
    expect = request.headers.get("Expect", "")
    if expect.lower() != "100-continue":
        refusal = ApiError(417, None, f"Expect: {expect!r} is not supported (only 100-continue)")
    else:
        state = request.app[STATE_KEY]
        try:
            limit = state.preparer().limits.max_body_bytes
        except ApiError as not_ready:
            refusal = not_ready
        else:
            size = request.content_length
            if size is None or size <= limit:
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0  # the interim response is not part of the answer's size
                return None
            refusal = ApiError(413, "body", f"body: {size} bytes exceed the limit of {limit} bytes")
    response = web.json_response(refusal.body(), status=refusal.status)
    response.force_close()
    return response


def create_app(config: ServeOptions, loader: Loader = load_serving) -> web.Application:
    """The app; the model loads in a worker thread when the app starts (see `ServerState.loaded`)."""
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    state = ServerState(config)
    app[STATE_KEY] = state
    app.router.add_post("/v1/completions", completions, expect_handler=expect_within_limits)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_within_limits)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)  # SGLang's older name
    app.router.add_post("/flush_cache", flush_cache, expect_handler=expect_within_limits)

    async def start(app: web.Application) -> None:
        state.loaded = asyncio.get_running_loop().create_future()
        state.load_task = asyncio.create_task(_load(state, loader))

    async def stop(app: web.Application) -> None:
        await _shutdown(state)

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


async def _load(state: ServerState, loader: Loader) -> None:
    t0 = time.perf_counter()
    try:
        serving = await asyncio.to_thread(loader, state.config, state.metrics)
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.exception("loading the model failed")
        assert state.loaded is not None
        state.loaded.set_exception(RuntimeError(state.load_error))
        return
    if state.config.gc_freeze:  # loaded and warmed, not yet ready: no request's objects among them
        t_freeze = time.perf_counter()
        frozen = gc_pauses.freeze_heap()
        state.gc_frozen = True
        serving.startup_s["gc_freeze_s"] = time.perf_counter() - t_freeze
        log.info("garbage collector: %d objects frozen in %.3f s (full collections skip them)", frozen,
                 serving.startup_s["gc_freeze_s"])  # fmt: skip
    state.serving = serving
    state.engine_task = asyncio.create_task(serving.engine.run())
    state.engine_task.add_done_callback(_log_engine_end)
    log.info("model loaded in %.1f s: %s", time.perf_counter() - t0, json.dumps(_summary(serving)))
    assert state.loaded is not None
    state.loaded.set_result(None)


def _log_engine_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the engine loop stopped: %r; /health now answers 503", task.exception())


def _summary(serving: Serving) -> dict[str, object]:
    info = serving.info()
    keys = ("served_model_name", "runtime", "kv", "engine", "routing", "layer_placements", "experts", "startup_s")
    return {k: info[k] for k in keys}


async def _shutdown(state: ServerState) -> None:
    if state.load_task is not None and not state.load_task.done():
        # the load thread cannot be interrupted; wait so its resources are released in order
        await asyncio.wait([state.load_task])
    serving = state.serving
    if serving is None:
        return
    serving.engine.close()
    if state.engine_task is not None:
        state.engine_task.cancel()
        await asyncio.gather(state.engine_task, return_exceptions=True)
    for close in serving.closers:  # each one, whatever the one before it raised (a routing trace's write among them)
        try:
            close()
        except Exception:
            log.exception("closing %r failed", close)
    state.close()  # the tokenizer threads
    state.serving = None
    if state.gc_frozen:  # the model's objects back to the collector (an in-process server: tests)
        gc_pauses.release_heap()
        state.gc_frozen = False


def connection_limits(config: ServeOptions) -> ConnectionLimits:
    open_files = raise_open_file_limit()
    safe = default_max_connections(open_files)
    cap = config.max_connections or safe
    if cap > safe:
        log.warning("--max-connections %d exceeds what an open-file limit of %d leaves safe (%d): raise `ulimit -n`",
                    cap, open_files, safe)  # fmt: skip
    return ConnectionLimits(cap, config.header_timeout, config.body_timeout, KEEPALIVE_TIMEOUT_S, open_files)


async def serve(config: ServeOptions, interrupted_early: Callable[[], bool] = lambda: False) -> int:
    """Runs until SIGINT/SIGTERM; returns the process exit status. `interrupted_early`: whether a
    SIGINT came before the loop's handlers were in (`python -m paged_experts.server` notes it)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if interrupted_early():
        stop.set()
    app = create_app(config)
    guard = ConnectionGuard(connection_limits(config))
    app[CONNECTIONS_KEY] = guard
    loop.set_exception_handler(AcceptErrorLog(guard))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = GuardedSite(runner, config.host, config.port, guard)
    await site.start()
    limits = guard.limits
    log.info(
        "listening on http://%s:%d, loading %s (connections <= %d at an open-file limit of %d; header timeout "
        "%g s, body timeout %g s, keep-alive %g s)",
        config.host, config.port, config.model_path, limits.max_connections, limits.open_file_limit,
        limits.header_timeout_s, limits.body_timeout_s, limits.keepalive_timeout_s,
    )  # fmt: skip
    state = app[STATE_KEY]
    assert state.loaded is not None
    stopped = asyncio.ensure_future(stop.wait())
    either: set[asyncio.Future[Any]] = {state.loaded, stopped}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("shutting down")  # the cleanup waits for a load in progress to finish
        await runner.cleanup()
        return 0
    if state.loaded.exception() is not None:
        await runner.cleanup()
        return 1
    graph_bs = list(range(1, config.cuda_graph_max_bs + 1))
    log.info(
        "ready: http://%s:%d model=%s routing=%s expert_kernel=%s cuda_graph_bs=%s",
        config.host, config.port, config.model_name, config.routing_label, config.expert_kernel, graph_bs or "off",
    )  # fmt: skip
    await stopped
    log.info("shutting down")
    await runner.cleanup()
    return 0


def main(argv: Sequence[str] | None = None, interrupted_early: Callable[[], bool] = lambda: False) -> int:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(config.cpu_threads or default_cpu_threads())
    log.info("config %s", json.dumps(asdict(config)))
    try:
        return asyncio.run(serve(config, interrupted_early))
    except KeyboardInterrupt:  # before the signal handlers are installed, or while asyncio.run winds down
        return interrupted()


def interrupted() -> int:
    print("paged_experts.server: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
