"""Continuous-batching scheduler over `MoeCausalLM`: requests, KV admission, steps, sampling.

One engine loop runs as an asyncio task. All scheduler state (waiting queue, running set, KV
reservations) is touched only on the event loop thread; each step's `model.forward` plus sampling
runs in a worker thread (torch releases the GIL) so the HTTP side stays responsive.

A step is ONE `model.forward` over every running request: one token per decoding request, plus
prompt chunks of newly admitted requests up to `chunked_prefill_tokens` in total, so a long
prompt stalls the decoding requests for at most one step per chunk. New requests join between
steps.

KV admission reserves `prompt + max_tokens` tokens per request (so a running request never runs
out of KV and nothing is ever preempted or truncated). `check_admissible` refuses requests that
could never fit; requests that fit the capacity but not the free space wait in FIFO order.
Aborted requests (client gone) leave the queue at once or free their KV as soon as the step in
flight, if any, returns.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from paged_experts.server.sampling import TokenLogprob, sample_token, token_logprobs
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


@dataclass(frozen=True)
class _Work:
    """One request's part of a step: tokens to run and whether the last row yields a new token."""

    req: _Request
    token_ids: list[int]
    start_pos: int
    samples: bool
    all_logits: bool


@dataclass(frozen=True)
class _WorkResult:
    token_id: int | None
    token_lp: TokenLogprob | None
    prompt_lps: list[TokenLogprob]
    error: str | None = None  # this request's sampling or logprobs failed; it alone ends with FINISH_ERROR


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
    `free_hooks` each freed KV sequence; both run in the worker thread, before a forward."""

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
        self._in_step: set[str] = set()
        self._reserved_tokens = 0
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._closed = False
        self.steps = 0

    # ---- admission -------------------------------------------------------------------------

    def check_admissible(
        self, prompt_len: int, max_tokens: int, prompt_field: str = "prompt", max_tokens_field: str | None = "max_tokens"
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
                    f"{prompt_field}: {prompt_len} tokens leave no room for a generated token in {what} of {total} tokens",
                )
            raise AdmissionError(
                max_tokens_field,
                f"{max_tokens_field}: prompt ({prompt_len} tokens) + {max_tokens_field} ({max_tokens}) exceed {what} "
                f"of {total} tokens; lower {max_tokens_field} to at most {total - prompt_len}",
            )

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queues a request (call from the event loop); raises AdmissionError if it can never run."""
        if request_id in self._by_id:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.check_admissible(len(prompt_ids), params.max_tokens)
        generator = None
        if params.temperature > 0.0:
            generator = torch.Generator()
            if params.seed is not None:
                generator.manual_seed(params.seed)
            else:
                generator.seed()
        req = _Request(request_id, list(prompt_ids), params, self._clock(), asyncio.Queue(), generator)
        self._by_id[request_id] = req
        self._waiting.append(req)
        self._wake.set()
        return RequestStream(self, req)

    def abort(self, request_id: str, reason: str = FINISH_ABORT) -> None:
        """Ends a request now, or when the step in flight returns; the first reason given wins."""
        req = self._by_id.get(request_id)
        if req is None or req.finished or req.abort_reason is not None:
            return
        req.abort_reason = reason
        if req in self._waiting:
            self._waiting.remove(req)
            self._finish(req, reason)
        elif request_id not in self._in_step:
            self._finish(req, reason)
        self._wake.set()

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

    async def between_steps(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on the event loop while no step is in flight (e.g. a counters snapshot)."""
        async with self._step_lock:
            return fn()

    # ---- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """The engine loop; run it as a task and cancel it (or call close) to stop."""
        while not self._closed:
            self._admit()
            work = self._plan()
            if not work:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._in_step = {w.req.request_id for w in work}
            try:
                async with self._step_lock:
                    freed, self._freed = self._freed, []
                    results = await asyncio.to_thread(self._execute, work, freed)
            except Exception as exc:  # noqa: BLE001 -- a failed step ends its requests, never the server
                self._in_step = set()
                for w in work:
                    self._finish(w.req, FINISH_ERROR, error=f"{type(exc).__name__}: {exc}")
                continue
            self._in_step = set()
            self.steps += 1
            self._apply(work, results)

    def close(self) -> None:
        self._closed = True
        for req in list(self._waiting) + list(self._running):
            self._finish(req, FINISH_ABORT)
        self._wake.set()

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
                work.append(_Work(req, [req.generated[-1]], pos, True, False))
            elif prefill_budget > 0:
                start = req.num_computed
                end = min(len(req.prompt_ids), start + prefill_budget)
                prefill_budget -= end - start
                done = end == len(req.prompt_ids)
                all_logits = req.params.prompt_logprobs is not None
                work.append(_Work(req, req.prompt_ids[start:end], start, done, all_logits))
        return work

    def _execute(self, work: list[_Work], freed: list[Any]) -> list[_WorkResult]:
        """Runs in the worker thread: one forward over all chunks, then sampling and logprobs."""
        # free hooks run here, between forwards, so they never race a forward's routing state
        for seq in freed:
            for free_hook in self._free_hooks:
                free_hook(seq)
        layout = [(w.req.request_id, len(w.token_ids)) for w in work]
        for hook in self._step_hooks:
            hook(layout)
        chunks = [self._make_chunk(w.req.seq, w.token_ids, w.start_pos, w.all_logits) for w in work]
        logits = self.model.forward(chunks)  # one [n, V] (all_logits) or [1, V] per chunk
        return [self._isolated_result(w, rows) for w, rows in zip(work, logits)]

    def _isolated_result(self, w: _Work, rows: torch.Tensor) -> _WorkResult:
        """One request's sampling and logprobs; a failure there is that request's error, never the step's."""
        try:
            return self._result(w, rows)
        except Exception as exc:  # noqa: BLE001 -- e.g. a NaN row or a bad parameter: fail this request only
            return _WorkResult(None, None, [], error=f"{type(exc).__name__}: {exc}")

    def _result(self, w: _Work, rows: torch.Tensor) -> _WorkResult:
        params = w.req.params
        prompt_lps: list[TokenLogprob] = []
        if w.all_logits:
            # row i predicts prompt token start_pos + i + 1; the last row of the final chunk
            # predicts the first generated token instead.
            targets = w.req.prompt_ids[w.start_pos + 1 : w.start_pos + len(w.token_ids) + 1]
            if targets:
                prompt_lps = token_logprobs(rows[: len(targets)], targets, params.prompt_logprobs or 0)
        if not w.samples:
            return _WorkResult(None, None, prompt_lps)
        last = rows[-1]  # [V]
        token = sample_token(last, params.temperature, params.top_p, w.req.generator)
        token_lp = None
        if params.logprobs is not None:
            token_lp = token_logprobs(last[None, :], [token], params.logprobs)[0]
        return _WorkResult(token, token_lp, prompt_lps)

    def _apply(self, work: list[_Work], results: list[_WorkResult]) -> None:
        now = self._clock()
        for w, res in zip(work, results):
            req = w.req
            if req.abort_reason is not None:
                self._finish(req, req.abort_reason)
                continue
            if res.error is not None:
                self._finish(req, FINISH_ERROR, error=res.error)
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
            req.queue.put_nowait(RequestOutput((res.token_id,), lps, prompt_lps, None))
            if reason is not None:
                self._finish(req, reason)

    def _finish_reason(self, req: _Request, token: int) -> str | None:
        params = req.params
        if not params.ignore_eos and token in self.config.eos_token_ids:
            return FINISH_STOP
        if token in params.stop_token_ids:
            return FINISH_STOP
        if len(req.generated) >= params.max_tokens:
            return FINISH_LENGTH
        return None

    def _finish(self, req: _Request, reason: str, error: str | None = None) -> None:
        if req.finished:
            return
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
        req.queue.put_nowait(RequestOutput((), (), None, reason, error))
        if self._on_finish is not None:
            first = req.token_times_s[0] if req.token_times_s else None
            self._on_finish(
                FinishedRequest(
                    request_id=req.request_id,
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=len(req.generated),
                    arrival_s=req.arrival_s,
                    first_token_s=first,
                    token_times_s=tuple(req.token_times_s),
                    finish_s=self._clock(),
                    finish_reason=reason,
                )
            )
        self._wake.set()
