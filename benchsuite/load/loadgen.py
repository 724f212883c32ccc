"""The load generator: streaming OpenAI-compatible requests under closed-loop or Poisson load.

Each request is sent and recorded by benchsuite.load.stream_client (one `RequestRecord` per request sent,
warmups and failures included, raw clock readings; its docstring has the record's rules). This
module decides when each is sent.

Schedules (LoadSpec):
- closed: `concurrency` workers, each sending the next request when its previous one ends.
- poisson: arrivals at seeded exponential gaps of mean 1/rate_rps; `concurrency` caps the
  requests in flight (an arrival that finds the cap full waits; t_sent_s is when it is sent).
Warmup: `warmup` extra requests (prompts taken cyclically from the start of `requests`) run
closed-loop at `concurrency` and finish before the measured phase; they are stored with
warmup=True. Every request in `requests` is measured. With `cold_first`, the very first request
(a warmup one when warmup > 0) is sent alone and awaited before any other, flagged cold=True, so
its TTFT is the server's cold TTFT undisturbed by other requests.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from benchsuite.errors import UserError
from benchsuite.load.stream_client import Clock, Progress, Sender
from benchsuite.records import LoadRequest, RequestRecord


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int
    arrival: Literal["closed", "poisson"] = "closed"
    rate_rps: float | None = None
    warmup: int = 0
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise UserError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.arrival not in ("closed", "poisson"):
            raise UserError(f"arrival must be 'closed' or 'poisson', got {self.arrival!r}")
        if self.arrival == "poisson" and (self.rate_rps is None or self.rate_rps <= 0):
            raise UserError("poisson arrival needs rate_rps > 0")
        if self.warmup < 0:
            raise UserError(f"warmup must be >= 0, got {self.warmup}")
        if self.timeout_s <= 0:
            raise UserError(f"timeout_s must be > 0, got {self.timeout_s}")


async def run_load(
    base_url: str,
    requests: Sequence[LoadRequest],
    spec: LoadSpec,
    *,
    cell_id: str,
    model_name: str,
    extras: dict[str, Any],
    cold_first: bool,
    session: aiohttp.ClientSession | None = None,
    clock: Clock = time.perf_counter,
    progress: Progress | None = None,
) -> list[RequestRecord]:
    """Send warmups then `requests` under `spec`; return every record, ordered by request_index."""
    if not requests:
        raise UserError(f"cell {cell_id}: no requests to send")
    own_session = session is None
    if session is None:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),  # see runner: llama-server closes streams
            timeout=aiohttp.ClientTimeout(total=None),
        )
    sender = Sender(session, base_url, cell_id, model_name, extras, spec.timeout_s, clock, progress)
    warmups = [requests[i % len(requests)] for i in range(spec.warmup)]
    measured = list(requests)
    try:
        if cold_first:
            first_is_warmup = bool(warmups)
            first = warmups.pop(0) if first_is_warmup else measured.pop(0)
            await sender.send(first, warmup=first_is_warmup, cold=True)
        if warmups:
            await _closed_loop(sender, warmups, spec.concurrency, warmup=True)
        if measured:
            if spec.arrival == "closed":
                await _closed_loop(sender, measured, spec.concurrency, warmup=False)
            else:
                assert spec.rate_rps is not None
                await _poisson(sender, measured, spec.concurrency, spec.rate_rps, spec.seed)
    finally:
        if own_session:
            await session.close()
    return sorted(sender.records, key=lambda r: r.request_index)


async def _closed_loop(sender: Sender, items: list[LoadRequest], concurrency: int, *, warmup: bool) -> None:
    queue = deque(items)

    async def worker() -> None:
        while queue:
            await sender.send(queue.popleft(), warmup=warmup, cold=False)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(items)))))


def poisson_arrivals_s(n: int, rate_rps: float, seed: int) -> list[float]:
    """Arrival offsets from the start of the phase: cumulative exponential gaps of mean 1/rate_rps."""
    rng = random.Random(seed)
    arrivals_s: list[float] = []
    t_s = 0.0
    for _ in range(n):
        t_s += rng.expovariate(rate_rps)
        arrivals_s.append(t_s)
    return arrivals_s


async def _poisson(sender: Sender, items: list[LoadRequest], concurrency: int, rate_rps: float, seed: int) -> None:
    cap = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks: list[asyncio.Task[None]] = []

    async def one(item: LoadRequest) -> None:
        try:
            await sender.send(item, warmup=False, cold=False)
        finally:
            cap.release()

    try:
        for item, arrival_s in zip(items, poisson_arrivals_s(len(items), rate_rps, seed)):
            delay_s = start + arrival_s - loop.time()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            await cap.acquire()
            tasks.append(asyncio.create_task(one(item)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
