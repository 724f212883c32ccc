"""One task of `benchsuite run --ray`: a planned server (or a search) measured on the node the task
landed on, everything it stores streamed back to the driver as messages.

`measure_work` runs the code of a local run (benchsuite.run.runner.server_cells / search_cells: the same
adapters, launcher and cell measurement) against a scratch `NodeStore` on the node, so ports, model
paths, caches, logs and device memory are the node's own; every write of that store is also a
message. The driver (benchsuite.run.ray_run) writes the messages into the one store as they arrive; this
module writes nothing outside its scratch directory, which it removes when it ends.

Messages, in order: `NodeFacts` first (who measures: Ray node id, hostname, address, machine and
source facts); then, as the run loop stores them, `ServerFacts` (the server's manifest record),
`PlannedMore` (a search's chosen server and cells, for the manifest's `planned`), `EngineMetrics` and
`CellStored` per cell, `CellUpdated` for fields known once the server stopped;
`SearchFailed` for a search that found no value; `ServerFiles` (engine logs, routing traces) last.

Cancellation (`ray.cancel`, the driver's Ctrl-C) arrives as KeyboardInterrupt in the task's thread:
the interrupted step is cancelled and run to its end, so every server it started stops (as on a local
Ctrl-C); a heartbeat keeps the event loop waking, so the interrupt is seen within a fraction of a
second even while a request is in flight.
"""

from __future__ import annotations

import asyncio
import platform
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchsuite.config.model_checks import missing_model
from benchsuite.config.plan import CellSpec, Plan, SearchTask
from benchsuite.engines.base import ServerSpec
from benchsuite.errors import RunError
from benchsuite.records import CellResult, RequestRecord
from benchsuite.results.manifest import Manifest, Planned
from benchsuite.results.store import RunStore
from benchsuite.results.stored_files import SERVER_FILE_DIRS
from benchsuite.run import search
from benchsuite.run.cell import failed_result
from benchsuite.run.context import RunContext, SilentEvents
from benchsuite.run.runner import client_session, search_cells, server_cells
from benchsuite.tools import device_memory
from benchsuite.tools.machine import git_facts, machine_facts

_HEARTBEAT_S = 0.2  # how soon a cancelled task notices its KeyboardInterrupt while it waits on sockets


@dataclass(frozen=True)
class Timeouts:
    cell_s: float
    request_s: float


@dataclass(frozen=True)
class Work:
    """What one task measures: a server with its unfinished cells, or a search (`search` set: its
    value is chosen on the node, then its cells run there; `spec` is the searched entry's)."""

    spec: ServerSpec
    cells: tuple[CellSpec, ...] = ()
    search: SearchTask | None = None
    # a resumed search: the entry's cells already stored (its measured candidates are not measured again)
    stored: tuple[CellResult, ...] = ()


@dataclass(frozen=True)
class NodeFacts:
    node: str  # Ray node id (hex)
    hostname: str
    address: str
    facts: dict[str, Any]  # machine.machine_facts() with the source's git_facts() under "git"


@dataclass(frozen=True)
class ServerFacts:
    server_id: str
    facts: dict[str, Any]  # keyword arguments of RunStore.record_server


@dataclass(frozen=True)
class EngineMetrics:
    cell_id: str
    scrapes: dict[str, Any]


@dataclass(frozen=True)
class CellStored:
    result: CellResult
    records: list[RequestRecord] = field(default_factory=list)


@dataclass(frozen=True)
class CellUpdated:
    result: CellResult


@dataclass(frozen=True)
class PlannedMore:
    planned: Planned  # the argument of RunStore.record_planned: a search's chosen server and its cells


@dataclass(frozen=True)
class SearchFailed:
    server_id: str
    message: str


@dataclass(frozen=True)
class ServerFiles:
    files: dict[str, bytes]  # path relative to the run directory -> content


Message = NodeFacts | ServerFacts | PlannedMore | EngineMetrics | CellStored | CellUpdated | SearchFailed | ServerFiles


class NodeStore(RunStore):
    """A scratch store on the node: the run loop reads and writes it as it would the real one, and
    each write is also queued in `outbox` for the driver."""

    def __init__(self, run_dir: Path, **kwargs: Any) -> None:
        super().__init__(run_dir, **kwargs)
        self.outbox: list[Message] = []
        self.shipping = True  # off while seeding it with what the driver already has

    def record_server(self, server_id: str, **facts: Any) -> None:
        super().record_server(server_id, **facts)
        self._ship(ServerFacts(server_id, facts))

    def record_planned(self, planned: Planned) -> None:
        super().record_planned(planned)
        self._ship(PlannedMore(planned))

    def write_engine_metrics(self, cell_id: str, metrics: dict[str, Any]) -> None:
        super().write_engine_metrics(cell_id, metrics)
        self._ship(EngineMetrics(cell_id, metrics))

    def write_cell(self, result: CellResult, records: Iterable[RequestRecord]) -> Any:
        records = list(records)
        stored = super().write_cell(result, records)
        self._ship(CellStored(result, records))
        return stored

    def update_cell(self, result: CellResult) -> None:
        super().update_cell(result)
        self._ship(CellUpdated(result))

    def take(self) -> list[Message]:
        out, self.outbox = self.outbox, []
        return out

    def _ship(self, message: Message) -> None:
        if self.shipping:
            self.outbox.append(message)


def measure_work(plan: Plan, manifest: Manifest, work: Work, timeouts: Timeouts) -> Iterator[Message]:
    """The Ray task's body (a generator: Ray streams each message to the driver as it is yielded)."""
    node = node_facts()
    yield node
    scratch = Path(tempfile.mkdtemp(prefix="benchsuite-ray-"))
    try:
        store = NodeStore.open(scratch / plan.run_id, manifest, notify=lambda line: None)
        store.shipping = False
        for result in work.stored:
            store.write_cell(result, [])
        store.shipping = True
        yield from _stream(_measure(plan, store, work, timeouts, node), store)
        yield ServerFiles(_server_files(store.run_dir))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def node_facts() -> NodeFacts:
    import ray  # only inside a Ray worker: the rest of this module runs without Ray (tests/test_ray_parts.py)

    return NodeFacts(
        node=ray.get_runtime_context().get_node_id(),
        hostname=platform.node(),
        address=ray.util.get_node_ip_address(),
        facts={**machine_facts().model_dump(), "git": git_facts().model_dump()},
    )


async def _measure(
    plan: Plan, store: NodeStore, work: Work, timeouts: Timeouts, node: NodeFacts
) -> AsyncIterator[None]:
    missing = _missing_model(work, node)
    reader = device_memory.open_reader()
    try:
        async with client_session() as session:
            ctx = RunContext(plan, store, session, SilentEvents(), timeouts.cell_s, timeouts.request_s,
                             search.run_search, device_reader=reader, node=node.node)  # fmt: skip
            if missing is not None:
                _fail_missing(ctx, store, work, missing)
                return
            if work.search is None:
                async for _ in server_cells(ctx, work.spec, work.cells):
                    yield
                return
            try:
                async for _ in search_cells(ctx, work.search):
                    yield
            except RunError as exc:  # no value fits or every launch failed: the run goes on
                store.outbox.append(SearchFailed(work.spec.server_id, str(exc)))
    finally:
        if reader is not None:
            reader.close()


def _missing_model(work: Work, node: NodeFacts) -> str | None:
    """One line when the server's model path does not exist on this node (model paths are per node)."""
    found = missing_model(work.spec.options)
    if found is None:
        return None
    return f"engine {work.spec.name}: {found[0]}: {found[1]} on node {node.hostname} ({node.address})"


def _fail_missing(ctx: RunContext, store: NodeStore, work: Work, line: str) -> None:
    if work.search is not None:
        store.outbox.append(SearchFailed(work.spec.server_id, line))
        return
    for cell in work.cells:
        store.write_cell(failed_result(ctx, cell, work.spec, line), [])


def _stream(steps: AsyncIterator[None], store: NodeStore) -> Iterator[Message]:
    """Drive the async run loop one stored cell at a time on this thread's own event loop, yielding
    what the store queued after each step (and after the last)."""
    loop = asyncio.new_event_loop()
    heartbeat = loop.create_task(_heartbeat())
    try:
        while True:
            step = loop.create_task(_next(steps))
            try:
                more = loop.run_until_complete(step)
            except BaseException:
                _unwind(loop, step, steps)
                raise
            # not `yield from`: Ray's executor resumes the generator with send(), which a list's iterator refuses
            for message in store.take():  # noqa: UP028
                yield message
            if not more:
                return
    finally:
        heartbeat.cancel()
        loop.run_until_complete(asyncio.gather(heartbeat, return_exceptions=True))
        loop.close()


async def _next(steps: AsyncIterator[None]) -> bool:
    try:
        await steps.__anext__()
    except StopAsyncIteration:
        return False
    return True


async def _heartbeat() -> None:
    while True:
        await asyncio.sleep(_HEARTBEAT_S)


def _unwind(loop: asyncio.AbstractEventLoop, step: asyncio.Task[bool], steps: AsyncIterator[None]) -> None:
    """After an interrupt: the step cancelled and run to its end (its servers stop on the way out)."""
    if not step.done():
        step.cancel()
        loop.run_until_complete(asyncio.gather(step, return_exceptions=True))
    closing = getattr(steps, "aclose", None)
    if closing is not None:
        loop.run_until_complete(asyncio.gather(closing(), return_exceptions=True))


def _server_files(run_dir: Path) -> dict[str, bytes]:
    files = {}
    for sub in SERVER_FILE_DIRS:  # shipped back whole (RunStore.write_server_file)
        for path in sorted((run_dir / sub).glob("*")):
            if path.is_file():
                files[f"{sub}/{path.name}"] = path.read_bytes()
    return files
