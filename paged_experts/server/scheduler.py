"""The engine's scheduling state, with no thread, model or event loop in it: requests waiting and
running, KV admission, the plan of each step, what a step's results do to its requests
(`sample_work`: one request's next token from a step's logits), and a request's output stream.

KV admission reserves `prompt + max_tokens` tokens per request (so a running request never runs
out of KV and nothing is ever preempted or truncated). `check_admissible` refuses requests that
could never fit; requests that fit the capacity but not the free space wait in FIFO order. A step
is one token per decoding request plus prompt chunks of newly admitted requests up to
`chunked_prefill_tokens` in total, so a long prompt stalls the decoding requests for at most one
step per chunk. `continuation` plans the next decode step of requests whose tokens are still on
the device (the overlap scheduler, server/engine.py).

The engine calls every method under its lock; `finish` frees a request's KV, which only the engine
thread may do for a running request (a waiting request holds none).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from paged_experts.server.engine_types import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    AdmissionError,
    EngineConfig,
    FinishedRequest,
    KvPoolLike,
    RequestOutput,
    RequestPrefill,
    SamplingParams,
)
from paged_experts.server.sampling import TokenLogprob, sample_token, token_logprobs
from paged_experts.step import StepLogits


@dataclass
class Request:
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
    prefill: RequestPrefill = field(default_factory=RequestPrefill)  # the host's side of its prompt's steps
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
class Work:
    """One request's part of a step: tokens to run and whether the last row yields a new token."""

    req: Request
    token_ids: list[int]
    start_pos: int
    samples: bool
    all_logits: bool
    decode: bool = False  # one generated token fed back (not a prompt chunk)


@dataclass(frozen=True)
class WorkResult:
    token_id: int | None
    token_lp: TokenLogprob | None
    prompt_lps: list[TokenLogprob]
    error: str | None = None  # this request's own failure (its sampling), not the step's


class RequestStream:
    """The async stream of one request's outputs; `abort()` frees its KV (client gone)."""

    def __init__(self, req: Request, abort: Callable[[str, str], None]) -> None:
        self._abort = abort  # Engine.abort: frees the request's KV, from any thread
        self._req = req
        self.request_id = req.request_id
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    @property
    def arrival_s(self) -> float:
        """When the engine accepted the request (its clock)."""
        return self._req.arrival_s

    @property
    def token_times_s(self) -> tuple[float, ...]:
        """When each generated token was read back on the engine's clock: the engine's own timings."""
        return tuple(self._req.token_times_s)

    @property
    def prefill_timings(self) -> dict[str, float | int]:
        """The host's side of the steps that ran its prompt (`RequestPrefill.timings`; written by the engine
        thread before the request's first token, read after it)."""
        return self._req.prefill.timings()

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
            self._abort(self.request_id, reason)


Event = tuple[Request, RequestOutput, FinishedRequest | None]
"""What a request's stream receives, and the timings the metrics listener gets when it ended."""


class Scheduler:
    def __init__(
        self, pool: KvPoolLike, config: EngineConfig, clock: Callable[[], float], *, keep_freed: bool, timings: bool
    ) -> None:
        self.pool = pool
        self.config = config
        self._clock = clock
        self._keep_freed = keep_freed  # free hooks want the sequences freed since the last step
        self._timings = timings  # a metrics listener wants each finished request's timings
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}
        self.reserved_tokens = 0
        self.freed: list[Any] = []

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

    def add(self, req: Request) -> None:
        if req.request_id in self.by_id:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.by_id[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str, reason: str) -> list[Event]:
        """Marks a request ended by its consumer; one still waiting ends now (it holds no KV), a
        running one when the engine thread next reaps (`reap_aborted`)."""
        req = self.by_id.get(request_id)
        if req is None or req.finished or req.abort_reason is not None:
            return []
        req.abort_reason = reason
        if req in self.waiting:
            self.waiting.remove(req)
            return [e for e in (self.finish(req, reason),) if e is not None]
        return []

    def reap_aborted(self) -> list[Event]:
        """Running requests whose client ended them: finished here, their KV freed (engine thread)."""
        return [e for r in list(self.running) if r.abort_reason is not None and (e := self.finish(r, r.abort_reason))]

    def finish_all(self, reason: str) -> list[Event]:
        events = [e for r in list(self.waiting) + list(self.running) if (e := self.finish(r, reason))]
        self.waiting.clear()
        return events

    def admissible(self) -> bool:
        """Whether the head of the queue could join the running batch now."""
        if not self.waiting or len(self.running) >= self.config.max_running_requests:
            return False
        return self.reserved_tokens + self.waiting[0].reserved_tokens(self.pool.block_size) <= self.pool.capacity_tokens

    def admit(self) -> None:
        capacity = self.pool.capacity_tokens
        while self.waiting and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            # FIFO: a large request at the head waits for room rather than being overtaken forever
            reserve = req.reserved_tokens(self.pool.block_size)
            if self.reserved_tokens + reserve > capacity:
                break
            self.waiting.popleft()
            req.seq = self.pool.new_sequence()
            self.reserved_tokens += reserve
            self.running.append(req)

    # ---- steps ------------------------------------------------------------------------------

    def plan(self) -> list[Work]:
        work: list[Work] = []
        prefill_budget = self.config.chunked_prefill_tokens
        for req in self.running:
            if not req.prefilling:
                pos = len(req.prompt_ids) + len(req.generated) - 1
                work.append(Work(req, [req.generated[-1]], pos, True, False, decode=True))
            elif prefill_budget > 0:
                start = req.num_computed
                end = min(len(req.prompt_ids), start + prefill_budget)
                prefill_budget -= end - start
                done = end == len(req.prompt_ids)
                all_logits = req.params.prompt_logprobs is not None
                work.append(Work(req, req.prompt_ids[start:end], start, done, all_logits))
        return work

    def continuation(self, pending: list[Work]) -> list[Work] | None:
        """The next decode step of the requests in flight, planned before their tokens are read;
        None when the scheduler must see those tokens first: a request may reach its max_tokens or
        was aborted, or waiting requests could be admitted now."""
        if self.admissible():
            return None
        nxt = []
        for w in pending:
            req = w.req
            if req.finished or req.abort_reason is not None or len(req.generated) + 2 > req.params.max_tokens:
                return None
            nxt.append(Work(req, [0], w.start_pos + 1, True, False, decode=True))  # token: the device argmax
        return nxt

    def apply(self, work: list[Work], results: list[WorkResult]) -> list[Event]:
        now = self._clock()
        events: list[Event | None] = []
        for w, res in zip(work, results):
            req = w.req
            if req.finished:  # ended while this step was in flight (an overlapped step's extra token)
                continue
            if req.abort_reason is not None:
                events.append(self.finish(req, req.abort_reason))
                continue
            if res.error is not None:
                events.append(self.finish(req, FINISH_ERROR, error=res.error))
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
                events.append(self.finish(req, reason))
        return [e for e in events if e is not None]

    def _finish_reason(self, req: Request, token: int) -> str | None:
        params = req.params
        if not params.ignore_eos and token in self.config.eos_token_ids:
            return FINISH_STOP
        if token in params.stop_token_ids:
            return FINISH_STOP
        if len(req.generated) >= params.max_tokens:
            return FINISH_LENGTH
        return None

    def finish(self, req: Request, reason: str, error: str | None = None) -> Event | None:
        """Ends a request, freeing its KV; returns the event to deliver (None when it had ended
        already). Freeing while an overlapped step still writes this sequence's next KV row is safe:
        the device runs steps in order, so a later owner of those blocks writes after."""
        if req.finished:
            return None
        req.finished = True
        if req.seq is not None:
            self.pool.free(req.seq)
            if self._keep_freed:
                self.freed.append(req.seq)
            req.seq = None
            self.reserved_tokens -= req.reserved_tokens(self.pool.block_size)
        if req in self.running:
            self.running.remove(req)
        self.by_id.pop(req.request_id, None)
        done = None
        if self._timings:
            done = FinishedRequest(
                request_id=req.request_id,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(req.generated),
                arrival_s=req.arrival_s,
                first_token_s=req.token_times_s[0] if req.token_times_s else None,
                token_times_s=tuple(req.token_times_s),
                finish_s=self._clock(),
                finish_reason=reason,
            )
        return req, RequestOutput((), (), None, reason, error), done


def sample_work(w: Work, step: StepLogits, first: int, n: int, greedy_id: int) -> WorkResult:
    """One request's part of a finished step: its prompt logprobs and next token. Its rows are
    `step`'s rows first..first+n-1; `greedy_id` is the argmax of its last row, read back from the
    device. Only rows that need the distribution (seeded draws, logprobs) are copied to the host."""
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
        return WorkResult(None, None, prompt_lps)
    if w.req.greedy_only:
        return WorkResult(greedy_id, None, prompt_lps)
    last = cpu_rows[-1] if cpu_rows is not None else step.logits[first + n - 1].to("cpu", torch.float32)  # [V]
    token = (
        greedy_id
        if params.temperature == 0.0
        else sample_token(last, params.temperature, params.top_p, w.req.generator)
    )
    token_lp = None
    if params.logprobs is not None:
        token_lp = token_logprobs(last[None, :], [token], params.logprobs)[0]
    return WorkResult(token, token_lp, prompt_lps)
