"""The engine: one dedicated thread that runs the model over the scheduler's steps, and the hand-off
of their outputs to the asyncio event loop.

The thread works back to back: plan a step (server/scheduler.py, under the lock), run it, sample,
hand the step's outputs to the event loop in one batch, plan the next. The HTTP side (tokenization,
SSE writes) runs on the event loop meanwhile; torch releases the GIL while the device works, so the
two overlap instead of waiting on each other. The KV pool and the model are touched only by the
engine thread.

Sampling: a greedy request without logprobs reads back only its token id, the argmax the model
computed on the device (`StepLogits.greedy`, part of the captured decode graph); only rows that
need the whole distribution (seeded temperature / top-p draws, logprobs) travel to the host.

Overlap: when a step is all greedy decode tokens batched by the static decode step, the next
decode step of the same requests is launched before this one's tokens are read (its input tokens
taken from the device), so the host's per-step work overlaps the device's (SGLang's overlap
scheduler does the same); a token past a request's end that such a step computed is dropped.

A failure of one request's sampling ends that request alone; a failed model step ends the requests
of that step, never the server. Aborted requests leave the queue at once, or free their KV before
the next step. Per-step timing: server/step_timing.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from paged_experts.server.engine_types import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    AdmissionError,
    ChunkFactory,
    EngineConfig,
    FinishedRequest,
    KvPoolLike,
    ModelLike,
    RequestOutput,
    SamplingParams,
    StepLayoutHook,
)
from paged_experts.server.scheduler import Event, Request, RequestStream, Scheduler, Work, WorkResult, sample_work
from paged_experts.server.step_timing import StepTimer
from paged_experts.step import StepLogits, is_prompt_chunk

__all__ = [
    "FINISH_ABORT",
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "AdmissionError",
    "Engine",
    "EngineConfig",
    "FinishedRequest",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
]

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Launched:
    """A step whose device work is queued: its token ids arrive in `ids` once `done` fires."""

    work: list[Work]
    step: StepLogits
    ids: torch.Tensor  # [R] token ids on the host (pinned, filled by a non-blocking copy on CUDA)
    done: torch.cuda.Event | None  # recorded after that copy; None when `ids` is ready already
    t_plan: float  # perf_counter stamps: planning began, launch began, launch returned
    t_launch: float
    t_launched: float


def _start_readback(greedy: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Queues the copy of a step's argmax ids [R] to pinned host memory; the event marks its end.
    Queued right after the step, so a later step that reuses the graph's buffers runs after it."""
    if greedy.device.type != "cuda":
        return greedy, None
    host = torch.empty(greedy.shape, dtype=greedy.dtype, pin_memory=True)
    host.copy_(greedy, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


class Engine:
    """The scheduler. `step_hooks` receive each step's layout (request id, tokens) and
    `free_hooks` each freed KV sequence; both run in the engine thread, before a step."""

    def __init__(
        self,
        model: ModelLike,
        pool: KvPoolLike,
        make_chunk: ChunkFactory,
        config: EngineConfig,
        *,
        on_finish: Callable[[FinishedRequest], None] | None = None,
        step_hooks: Sequence[StepLayoutHook] = (),
        free_hooks: Sequence[Callable[[Any], None]] = (),
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model = model
        self.pool = pool
        self.config = config
        self._make_chunk = make_chunk
        self._on_finish = on_finish
        self._step_hooks = tuple(step_hooks)
        self._free_hooks = tuple(free_hooks)
        self._clock = clock
        self._scheduler = Scheduler(pool, config, clock, keep_freed=bool(free_hooks), timings=on_finish is not None)
        self._cv = threading.Condition()  # guards the scheduler; wakes the engine thread
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False  # close(): every request ends, for good
        self._stopping = False  # run() was cancelled: the thread ends, requests stay
        self.timer = StepTimer()
        self.overlapped_steps = 0  # steps launched while the previous one was still in flight

    # ---- admission -------------------------------------------------------------------------

    def check_admissible(
        self,
        prompt_len: int,
        max_tokens: int,
        prompt_field: str = "prompt",
        max_tokens_field: str | None = "max_tokens",
    ) -> None:
        """Raises AdmissionError if a request of this size could never run (see Scheduler)."""
        self._scheduler.check_admissible(prompt_len, max_tokens, prompt_field, max_tokens_field)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queues a request (call from the event loop); raises AdmissionError if it can never run."""
        self.check_admissible(len(prompt_ids), params.max_tokens)
        generator = None
        if params.temperature > 0.0:
            generator = torch.Generator()
            if params.seed is not None:
                generator.manual_seed(params.seed)
            else:
                generator.seed()
        req = Request(request_id, list(prompt_ids), params, self._clock(), asyncio.Queue(), generator)
        with self._cv:
            self._scheduler.add(req)
            self._cv.notify()
        return RequestStream(req, self.abort)

    def abort(self, request_id: str, reason: str = FINISH_ABORT) -> None:
        """Ends a request: at once if it still waits, else before the engine's next step (its KV
        is freed there, by the engine thread); the first reason given wins."""
        with self._cv:
            events = self._scheduler.abort(request_id, reason)
            self._cv.notify()
        self._deliver(events)

    # ---- state for metrics -----------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def kv_used_tokens(self) -> int:
        return self.pool.capacity_tokens - self.pool.free_tokens

    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    @property
    def steps(self) -> int:
        return self.timer.steps

    def step_timing(self) -> dict[str, float]:
        """Mean seconds per step of each host phase over the steps so far (server/step_timing.py)."""
        return self.timer.means()

    async def between_steps(self, fn: Callable[[], T]) -> T:
        """Runs `fn` in the engine thread between two steps (e.g. a counters snapshot, which reads
        device tallies); at once, here, when the engine thread is not running."""
        with self._cv:
            running = self._thread is not None and self._thread.is_alive() and not self._closed
            if running:
                fut: concurrent.futures.Future[T] = concurrent.futures.Future()
                self._calls.append((fn, fut))
                self._cv.notify()
        if not running:
            return fn()
        return await asyncio.wrap_future(fut)

    # ---- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """The engine loop; run it as a task and cancel it (or call close) to stop."""
        self._loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = self._loop.create_future()

        def main() -> None:
            error: BaseException | None = None
            try:
                self._thread_main()
            except BaseException as exc:  # noqa: BLE001 -- reported through the task (health answers 503)
                error = exc

            def finish() -> None:
                if ended.done():
                    return
                if error is not None:
                    ended.set_exception(error)
                else:
                    ended.set_result(None)

            self._call_in_loop(finish)

        with self._cv:
            self._stopping = False
        self._thread = threading.Thread(target=main, name="paged-experts-engine", daemon=True)
        self._thread.start()
        try:
            await asyncio.shield(ended)
        finally:
            # a cancelled task stops the thread after its step in flight; requests stay queued, so a
            # later run() carries on with them (close() is what ends them)
            with self._cv:
                self._stopping = True
                self._cv.notify()
            await asyncio.to_thread(self._thread.join)

    def close(self) -> None:
        events: list[Event] = []
        with self._cv:
            self._closed = True
            if self._thread is None or not self._thread.is_alive():  # no engine thread touches the pool
                events = self._scheduler.finish_all(FINISH_ABORT)
            self._cv.notify()
        self._deliver(events)

    def _thread_main(self) -> None:
        pending: _Launched | None = None  # a step launched on the device, its token ids not yet read
        while True:
            t0 = time.perf_counter()
            if pending is not None:
                # Overlap: launch the next decode step of the same requests (its input tokens are
                # the device-side argmax of the step in flight) before reading that step's tokens.
                with self._cv:
                    nxt = (
                        None
                        if (self._closed or self._stopping or self._calls)
                        else self._scheduler.continuation(pending.work)
                    )
                launched = self._launch(nxt, [], t0, token_source=pending.step.greedy) if nxt else None
                self.overlapped_steps += launched is not None
                self._complete(pending)
                pending = launched
                continue
            with self._cv:
                if self._closed or self._stopping:
                    events = self._scheduler.finish_all(FINISH_ABORT) if self._closed else []
                    calls, self._calls = self._calls, []
                    break
                events = self._scheduler.reap_aborted()
                self._scheduler.admit()
                work = self._scheduler.plan()
                calls, self._calls = self._calls, []
                if not work and not calls and not events:
                    self._cv.wait()
                    continue
                freed, self._scheduler.freed = self._scheduler.freed, []
            self._deliver(events)
            for fn, fut in calls:  # between steps: nothing is in flight
                _run_call(fn, fut)
            if not work:
                continue
            launched = self._launch(work, freed, t0)
            if launched is None:
                continue
            if self.config.overlap_schedule and self._continuable(launched):
                pending = launched  # read its tokens after the next step is launched
            else:
                self._complete(launched)
        self._deliver(events)
        for fn, fut in calls:
            _run_call(fn, fut)

    def _launch(
        self, work: list[Work], freed: list[Any], t0: float, token_source: torch.Tensor | None = None
    ) -> _Launched | None:
        """Runs the step's host work and queues its device work; the token ids are read later."""
        t1 = time.perf_counter()
        try:
            # free hooks run here, between steps, so they never race a step's routing state
            for seq in freed:
                for free_hook in self._free_hooks:
                    free_hook(seq)
            layout = [(w.req.request_id, len(w.token_ids)) for w in work]
            for hook in self._step_hooks:
                hook(layout)
            chunks = [self._make_chunk(w.req.seq, w.token_ids, w.start_pos, w.all_logits) for w in work]
            step = self._run_model(chunks, token_source)
            if step.prefill is not None:  # the host's side of a step with prompt chunks, for their requests
                for w in work:
                    if is_prompt_chunk(len(w.token_ids)):  # as the counters count one: not a decode token
                        w.req.prefill.add(step.prefill)
            ids, done = _start_readback(step.greedy)
        except Exception as exc:  # noqa: BLE001 -- a failed step ends its requests, never the server
            self._fail_step(work, exc)
            return None
        return _Launched(work, step, ids, done, t0, t1, time.perf_counter())

    def _complete(self, launched: _Launched) -> None:
        """Waits for a launched step's token ids, samples what needs the host, applies, delivers."""
        try:
            if launched.done is not None:
                launched.done.synchronize()
            check = getattr(self.model, "check_device", None)  # page-ins that did not land: the step fails
            if check is not None:
                check()
            greedy = launched.ids.tolist()  # [R] token ids
            t3 = time.perf_counter()
            results: list[WorkResult] = []
            first = 0
            for w, n in zip(launched.work, launched.step.rows):
                try:
                    results.append(sample_work(w, launched.step, first, n, greedy[first + n - 1]))
                except Exception as exc:  # noqa: BLE001 -- one request's sampling failure ends that request only
                    results.append(WorkResult(None, None, [], error=f"{type(exc).__name__}: {exc}"))
                first += n
        except Exception as exc:  # noqa: BLE001 -- the device step failed: its requests end, the server stays
            self._fail_step(launched.work, exc)
            return
        with self._cv:
            events = self._scheduler.apply(launched.work, results)
        self._deliver(events)
        decode = len(launched.work) if all(w.decode for w in launched.work) else None
        self.timer.record((launched.t_plan, launched.t_launch, launched.t_launched, t3, time.perf_counter()), decode)

    def _fail_step(self, work: list[Work], exc: Exception) -> None:
        log.exception("engine step failed", exc_info=exc)
        with self._cv:
            error = f"{type(exc).__name__}: {exc}"
            events = [e for w in work if (e := self._scheduler.finish(w.req, FINISH_ERROR, error=error))]
        self._deliver(events)

    def _continuable(self, launched: _Launched) -> bool:
        """A step the next one may overlap: every chunk one decode token of a greedy request
        without logprobs, batched by the static decode step (its argmax stays on the device)."""
        graphs = getattr(self.model, "decode_graphs", None)
        if graphs is None or not launched.work:
            return False
        if not all(w.decode and w.req.greedy_only for w in launched.work):
            return False
        return graphs.accepts([self._make_chunk(w.req.seq, w.token_ids, w.start_pos, False) for w in launched.work])

    def _run_model(self, chunks: list[Any], token_source: torch.Tensor | None = None) -> StepLogits:
        run_step = getattr(self.model, "run_step", None)
        if run_step is not None:
            return run_step(chunks, token_source=token_source) if token_source is not None else run_step(chunks)
        rows = self.model.forward(chunks)  # a model without device logits (tests' fakes): fp32 CPU rows
        logits = torch.cat(rows) if rows else torch.empty(0, 0)
        return StepLogits(logits, logits.argmax(dim=-1) if rows else torch.empty(0, dtype=torch.long),
                          tuple(r.shape[0] for r in rows))  # fmt: skip

    # ---- the event loop side -------------------------------------------------------------------

    def _deliver(self, events: list[Event]) -> None:
        """Hands a step's outputs to the event loop in one hop (or directly, on the loop thread)."""
        if events:
            self._call_in_loop(lambda: self._publish(events))

    def _publish(self, events: list[Event]) -> None:
        for req, out, done in events:
            req.queue.put_nowait(out)
            if done is not None and self._on_finish is not None:
                self._on_finish(done)

    def _call_in_loop(self, fn: Callable[[], Any]) -> None:
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            fn()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(fn)


def _run_call(fn: Callable[[], Any], fut: concurrent.futures.Future[Any]) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 -- handed to the awaiting coroutine
        fut.set_exception(exc)
