"""Continuous-batching scheduler over `MoeCausalLM`: requests, KV admission, steps, sampling.

The engine loop runs in ONE dedicated thread, back to back: plan a step, run it, sample, hand the
step's outputs to the event loop in one batch, plan the next. The HTTP side (tokenization, SSE
writes) runs on the asyncio event loop meanwhile; torch releases the GIL while the GPU works, so
the two overlap instead of waiting on each other (one thread hop per step, not two per step as a
worker thread per step would cost). Scheduler state (waiting queue, running set, KV reservations)
is guarded by one lock; the KV pool and the model are touched only by the engine thread.

A step is ONE model step over every running request: one token per decoding request, plus prompt
chunks of newly admitted requests up to `chunked_prefill_tokens` in total, so a long prompt stalls
the decoding requests for at most one step per chunk. New requests join between steps.

Sampling: a greedy request without logprobs reads back only its token id, the argmax the model
computed on the device (`StepLogits.greedy`, part of the captured decode graph); only rows that
need the whole distribution (seeded temperature / top-p draws, logprobs) travel to the host.

KV admission reserves `prompt + max_tokens` tokens per request (so a running request never runs
out of KV and nothing is ever preempted or truncated). `check_admissible` refuses requests that
could never fit; requests that fit the capacity but not the free space wait in FIFO order.
Aborted requests (client gone) leave the queue at once, or free their KV before the next step.
A failure of one request's sampling ends that request alone; a failed model step ends the
requests of that step, never the server.

Per-step host timing (`step_timing()`, logged every `TIMING_LOG_STEPS` steps at debug level): plan
(scheduling, under the lock), model (building the inputs and launching the step; for eager steps
the whole forward), wait (until the step's token ids are on the host: the device's remaining work),
sample and deliver (sampling, stop checks, handing outputs to the event loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
from paged_experts.server.sampling import TokenLogprob, sample_token, token_logprobs
from paged_experts.step import StepLogits

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
TIMING_LOG_STEPS = 256
PHASES = ("plan", "model", "wait", "sample_deliver")


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float
    queue: asyncio.Queue[RequestOutput]
    generator: torch.Generator | None
    seq: Any = None
    num_computed: int = 0  # tokens whose KV is stored
    generated: list[int] = field(default_factory=list)
    prompt_lps: list[TokenLogprob | None] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    abort_reason: str | None = None  # set when the consumer ends the request early
    finished: bool = False

    def reserved_tokens(self, block_size: int) -> int:
        """KV this request may ever hold, in whole blocks as the pool allocates them."""
        return -(-(len(self.prompt_ids) + self.params.max_tokens) // block_size) * block_size

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def greedy_only(self) -> bool:
        """Its next token is the argmax and it wants no logprobs: the device's argmax suffices."""
        return self.params.temperature == 0.0 and self.params.logprobs is None


@dataclass(frozen=True)
class _Work:
    """One request's part of a step: tokens to run and whether the last row yields a new token."""

    req: _Request
    token_ids: list[int]
    start_pos: int
    samples: bool
    all_logits: bool
    decode: bool = False  # one generated token fed back (not a prompt chunk)


@dataclass(frozen=True)
class _WorkResult:
    token_id: int | None
    token_lp: TokenLogprob | None
    prompt_lps: list[TokenLogprob]
    error: str | None = None  # this request's own failure (its sampling), not the step's


_Event = tuple[_Request, RequestOutput, FinishedRequest | None]


@dataclass(frozen=True)
class _Launched:
    """A step whose device work is queued: its token ids arrive in `ids` once `done` fires."""

    work: list[_Work]
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


class RequestStream:
    """The async stream of one request's outputs; `abort()` frees its KV (client gone)."""

    def __init__(self, engine: Engine, req: _Request) -> None:
        self._engine = engine
        self._req = req
        self.request_id = req.request_id
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._req.queue.get()
        if out.finish_reason is not None:
            self.finished = True
        return out

    def abort(self, reason: str = FINISH_ABORT) -> None:
        """Ends the request early: FINISH_ABORT (client gone) or FINISH_STOP (a stop string)."""
        if not self.finished:
            self._engine.abort(self.request_id, reason)


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
        self._freed: list[Any] = []  # sequences freed since the last step, for free_hooks
        self._clock = clock
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._by_id: dict[str, _Request] = {}
        self._reserved_tokens = 0
        self._cv = threading.Condition()  # guards the scheduler state above; wakes the engine thread
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False  # close(): every request ends, for good
        self._stopping = False  # run() was cancelled: the thread ends, requests stay
        self.steps = 0
        self._phase_s = dict.fromkeys(PHASES, 0.0)
        self._timed_steps = 0
        # steps whose every chunk is one decode token: what in-engine decode speed is measured over
        self.decode_steps = 0
        self.decode_tokens = 0
        self.decode_step_s = 0.0  # plan through deliver
        self.decode_model_s = 0.0  # model launch + the wait for its token ids
        self._last_done = 0.0  # when the last completed step handed off its outputs
        self.overlapped_steps = 0  # steps launched while the previous one was still in flight

    # ---- admission -------------------------------------------------------------------------

    def check_admissible(
        self,
        prompt_len: int,
        max_tokens: int,
        prompt_field: str = "prompt",
        max_tokens_field: str | None = "max_tokens",
    ) -> None:
        """Raises AdmissionError naming the field to change: `max_tokens_field`, or the prompt's
        when that is None (the client sent no max_tokens, so the prompt alone leaves no room)."""
        capacity = self.pool.capacity_tokens
        if prompt_len < 1:
            raise AdmissionError(prompt_field, f"{prompt_field}: must contain at least one token")
        if prompt_len > capacity:
            raise AdmissionError(
                prompt_field, f"{prompt_field}: {prompt_len} tokens exceed the KV capacity of {capacity} tokens"
            )
        limit = self.config.max_context_tokens
        for total, what in ((capacity, "the KV capacity"), (limit, "the model's context length")):
            if total is None or prompt_len + max_tokens <= total:
                continue
            if max_tokens_field is None:
                raise AdmissionError(
                    prompt_field,
                    f"{prompt_field}: {prompt_len} tokens leave no room for a generated token "
                    f"in {what} of {total} tokens",
                )
            raise AdmissionError(
                max_tokens_field,
                f"{max_tokens_field}: prompt ({prompt_len} tokens) + {max_tokens_field} ({max_tokens}) exceed {what} "
                f"of {total} tokens; lower {max_tokens_field} to at most {total - prompt_len}",
            )

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
        req = _Request(request_id, list(prompt_ids), params, self._clock(), asyncio.Queue(), generator)
        with self._cv:
            if request_id in self._by_id:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._by_id[request_id] = req
            self._waiting.append(req)
            self._cv.notify()
        return RequestStream(self, req)

    def abort(self, request_id: str, reason: str = FINISH_ABORT) -> None:
        """Ends a request: at once if it still waits, else before the engine's next step (its KV
        is freed there, by the engine thread); the first reason given wins."""
        events: list[_Event] = []
        with self._cv:
            req = self._by_id.get(request_id)
            if req is None or req.finished or req.abort_reason is not None:
                return
            req.abort_reason = reason
            if req in self._waiting:
                self._waiting.remove(req)
                events += [e for e in (self._finish(req, reason),) if e is not None]
            self._cv.notify()
        self._deliver(events)

    # ---- state for metrics -----------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_used_tokens(self) -> int:
        return self.pool.capacity_tokens - self.pool.free_tokens

    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    @property
    def timed_steps(self) -> int:
        return self._timed_steps

    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent in each host phase over every step so far (module docstring)."""
        return dict(self._phase_s)

    def step_timing(self) -> dict[str, float]:
        """Mean seconds per step of each host phase (module docstring) over the steps so far."""
        n = self._timed_steps
        out = {f"{phase}_s": (total / n if n else 0.0) for phase, total in self._phase_s.items()}
        out["steps"] = float(n)
        return out

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
            self._call_in_loop(
                lambda: ended.done() or (ended.set_exception(error) if error else ended.set_result(None))
            )

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
        events: list[_Event] = []
        with self._cv:
            self._closed = True
            if self._thread is None or not self._thread.is_alive():  # no engine thread touches the pool
                events = [e for r in list(self._waiting) + list(self._running) if (e := self._finish(r, FINISH_ABORT))]
                self._waiting.clear()
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
                    nxt = None if (self._closed or self._stopping) else self._continuation(pending)
                launched = self._launch(nxt, [], t0, token_source=pending.step.greedy) if nxt else None
                self.overlapped_steps += launched is not None
                self._complete(pending)
                pending = launched
                continue
            with self._cv:
                if self._closed or self._stopping:
                    events = []
                    if self._closed:
                        events = [
                            e for r in list(self._waiting) + list(self._running) if (e := self._finish(r, FINISH_ABORT))
                        ]
                        self._waiting.clear()
                    calls, self._calls = self._calls, []
                    break
                events = self._reap_aborted()
                self._admit()
                work = self._plan()
                calls, self._calls = self._calls, []
                if not work and not calls and not events:
                    self._cv.wait()
                    continue
                freed, self._freed = self._freed, []
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
        self, work: list[_Work], freed: list[Any], t0: float, token_source: torch.Tensor | None = None
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
            greedy = launched.ids.tolist()  # [R] token ids
            t3 = time.perf_counter()
            results: list[_WorkResult] = []
            first = 0
            for w, n in zip(launched.work, launched.step.rows):
                try:
                    results.append(self._result(w, launched.step, first, n, greedy[first + n - 1]))
                except Exception as exc:  # noqa: BLE001 -- one request's sampling failure ends that request only
                    results.append(_WorkResult(None, None, [], error=f"{type(exc).__name__}: {exc}"))
                first += n
        except Exception as exc:  # noqa: BLE001 -- the device step failed: its requests end, the server stays
            self._fail_step(launched.work, exc)
            return
        with self._cv:
            self.steps += 1
            events = self._apply(launched.work, results)
        self._deliver(events)
        self._record_timing(launched, t3, time.perf_counter())

    def _fail_step(self, work: list[_Work], exc: Exception) -> None:
        log.exception("engine step failed", exc_info=exc)
        with self._cv:
            events = [e for w in work if (e := self._finish(w.req, FINISH_ERROR, error=f"{type(exc).__name__}: {exc}"))]
        self._deliver(events)

    def _record_timing(self, launched: _Launched, t3: float, t4: float) -> None:
        t0, t1, t2 = launched.t_plan, launched.t_launch, launched.t_launched
        for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            self._phase_s[phase] += max(dt, 0.0)
        self._timed_steps += 1
        # A step's share of the engine's time: from its planning (or the previous step's end, when it
        # was launched while that one ran) to its outputs handed off.
        span = t4 - max(t0, self._last_done)
        self._last_done = t4
        if all(w.decode for w in launched.work):
            self.decode_steps += 1
            self.decode_tokens += len(launched.work)
            self.decode_step_s += span
            self.decode_model_s += t3 - t1
        if self._timed_steps % TIMING_LOG_STEPS == 0 and log.isEnabledFor(logging.DEBUG):
            log.debug("engine step timing (mean over %d steps): %s", self._timed_steps, self.step_timing())

    def _continuable(self, launched: _Launched) -> bool:
        """A step the next one may overlap: every chunk one decode token of a greedy request
        without logprobs, batched by the static decode step (its argmax stays on the device)."""
        graphs = getattr(self.model, "decode_graphs", None)
        if graphs is None or not launched.work:
            return False
        if not all(w.decode and w.req.greedy_only for w in launched.work):
            return False
        return graphs.accepts([self._make_chunk(w.req.seq, w.token_ids, w.start_pos, False) for w in launched.work])

    def _continuation(self, pending: _Launched) -> list[_Work] | None:
        """The next decode step of the requests in flight, planned before their tokens are read
        (under the lock); None when the scheduler must see those tokens first: a request may reach
        its max_tokens, was aborted, or waiting requests could be admitted now."""
        if self._calls or self._admissible():
            return None
        nxt = []
        for w in pending.work:
            req = w.req
            if req.finished or req.abort_reason is not None or len(req.generated) + 2 > req.params.max_tokens:
                return None
            nxt.append(_Work(req, [0], w.start_pos + 1, True, False, decode=True))  # token: the device argmax
        return nxt

    def _admissible(self) -> bool:
        if not self._waiting or len(self._running) >= self.config.max_running_requests:
            return False
        return (
            self._reserved_tokens + self._waiting[0].reserved_tokens(self.pool.block_size) <= self.pool.capacity_tokens
        )

    def _reap_aborted(self) -> list[_Event]:
        """Running requests whose client ended them: finished here, their KV freed (engine thread)."""
        return [e for r in list(self._running) if r.abort_reason is not None and (e := self._finish(r, r.abort_reason))]

    def _admit(self) -> None:
        capacity = self.pool.capacity_tokens
        while self._waiting and len(self._running) < self.config.max_running_requests:
            req = self._waiting[0]
            # FIFO: a large request at the head waits for room rather than being overtaken forever
            reserve = req.reserved_tokens(self.pool.block_size)
            if self._reserved_tokens + reserve > capacity:
                break
            self._waiting.popleft()
            req.seq = self.pool.new_sequence()
            self._reserved_tokens += reserve
            self._running.append(req)

    def _plan(self) -> list[_Work]:
        work: list[_Work] = []
        prefill_budget = self.config.chunked_prefill_tokens
        for req in self._running:
            if not req.prefilling:
                pos = len(req.prompt_ids) + len(req.generated) - 1
                work.append(_Work(req, [req.generated[-1]], pos, True, False, decode=True))
            elif prefill_budget > 0:
                start = req.num_computed
                end = min(len(req.prompt_ids), start + prefill_budget)
                prefill_budget -= end - start
                done = end == len(req.prompt_ids)
                all_logits = req.params.prompt_logprobs is not None
                work.append(_Work(req, req.prompt_ids[start:end], start, done, all_logits))
        return work

    def _run_model(self, chunks: list[Any], token_source: torch.Tensor | None = None) -> StepLogits:
        run_step = getattr(self.model, "run_step", None)
        if run_step is not None:
            return run_step(chunks, token_source=token_source) if token_source is not None else run_step(chunks)
        rows = self.model.forward(chunks)  # a model without device logits (tests' fakes): fp32 CPU rows
        logits = torch.cat(rows) if rows else torch.empty(0, 0)
        return StepLogits(logits, logits.argmax(dim=-1) if rows else torch.empty(0, dtype=torch.long),
                          tuple(r.shape[0] for r in rows))  # fmt: skip

    def _result(self, w: _Work, step: StepLogits, first: int, n: int, greedy_id: int) -> _WorkResult:
        params = w.req.params
        prompt_lps: list[TokenLogprob] = []
        cpu_rows: torch.Tensor | None = None
        if w.all_logits:
            cpu_rows = step.logits[first : first + n].to("cpu", torch.float32)  # [n, V]
            # row i predicts prompt token start_pos + i + 1; the last row of the final chunk
            # predicts the first generated token instead.
            targets = w.req.prompt_ids[w.start_pos + 1 : w.start_pos + len(w.token_ids) + 1]
            if targets:
                prompt_lps = token_logprobs(cpu_rows[: len(targets)], targets, params.prompt_logprobs or 0)
        if not w.samples:
            return _WorkResult(None, None, prompt_lps)
        if w.req.greedy_only:
            return _WorkResult(greedy_id, None, prompt_lps)
        last = cpu_rows[-1] if cpu_rows is not None else step.logits[first + n - 1].to("cpu", torch.float32)  # [V]
        token = (
            greedy_id
            if params.temperature == 0.0
            else sample_token(last, params.temperature, params.top_p, w.req.generator)
        )
        token_lp = None
        if params.logprobs is not None:
            token_lp = token_logprobs(last[None, :], [token], params.logprobs)[0]
        return _WorkResult(token, token_lp, prompt_lps)

    def _apply(self, work: list[_Work], results: list[_WorkResult]) -> list[_Event]:
        now = self._clock()
        events: list[_Event] = []
        for w, res in zip(work, results):
            req = w.req
            if req.finished:  # ended while this step was in flight (an overlapped step's extra token)
                continue
            if req.abort_reason is not None:
                events.append(self._finish(req, req.abort_reason))
                continue
            if res.error is not None:
                events.append(self._finish(req, FINISH_ERROR, error=res.error))
                continue
            req.num_computed += len(w.token_ids)
            req.prompt_lps.extend(res.prompt_lps)
            if res.token_id is None:
                continue
            req.generated.append(res.token_id)
            req.token_times_s.append(now)
            reason = self._finish_reason(req, res.token_id)
            prompt_lps = None
            if len(req.generated) == 1 and req.params.prompt_logprobs is not None:
                prompt_lps = (None, *req.prompt_lps)
            lps = (res.token_lp,) if res.token_lp is not None else ()
            events.append((req, RequestOutput((res.token_id,), lps, prompt_lps, None), None))
            if reason is not None:
                events.append(self._finish(req, reason))
        return [e for e in events if e is not None]

    def _finish_reason(self, req: _Request, token: int) -> str | None:
        params = req.params
        if not params.ignore_eos and token in self.config.eos_token_ids:
            return FINISH_STOP
        if token in params.stop_token_ids:
            return FINISH_STOP
        if len(req.generated) >= params.max_tokens:
            return FINISH_LENGTH
        return None

    def _finish(self, req: _Request, reason: str, error: str | None = None) -> _Event | None:
        """Ends a request (under the lock; its KV freed by the caller's thread, which is the engine
        thread or, for a request that never got KV, any); returns the event to deliver (None when
        it had ended already). Freeing while an overlapped step still writes this sequence's next KV
        row is safe: the device runs steps in order, so a later owner of those blocks writes after."""
        if req.finished:
            return None
        req.finished = True
        if req.seq is not None:
            self.pool.free(req.seq)
            if self._free_hooks:
                self._freed.append(req.seq)
            req.seq = None
            self._reserved_tokens -= req.reserved_tokens(self.pool.block_size)
        if req in self._running:
            self._running.remove(req)
        self._by_id.pop(req.request_id, None)
        done = None
        if self._on_finish is not None:
            first = req.token_times_s[0] if req.token_times_s else None
            done = FinishedRequest(
                request_id=req.request_id,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(req.generated),
                arrival_s=req.arrival_s,
                first_token_s=first,
                token_times_s=tuple(req.token_times_s),
                finish_s=self._clock(),
                finish_reason=reason,
            )
        return req, RequestOutput((), (), None, reason, error), done

    # ---- the event loop side -------------------------------------------------------------------

    def _deliver(self, events: list[_Event]) -> None:
        """Hands a step's outputs to the event loop in one hop (or directly, on the loop thread)."""
        if events:
            self._call_in_loop(lambda: self._publish(events))

    def _publish(self, events: list[_Event]) -> None:
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
