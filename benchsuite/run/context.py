"""What the stages of one run share: the plan, the store, the HTTP session, progress events, timeouts,
the search hook and the prompts built so far.

`RunContext` is handed to every stage of the run loop (benchsuite.run.runner), to the server launcher
(benchsuite.run.server_launch), to the cell measurement (benchsuite.run.cell) and to an injected
search (`SearchHook`, benchsuite.run.search.run_search) and the device-memory reader
(benchsuite.tools.device_memory). `RunEvents` is what a progress display hears.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from benchsuite.config.plan import CellSpec, Plan, SearchTask
from benchsuite.engines.base import EngineOptions, ServerSpec
from benchsuite.records import CellResult
from benchsuite.results.store import RunStore
from benchsuite.run.cell_prompts import PromptCache
from benchsuite.tools.device_memory import DeviceReader

DEFAULT_CELL_TIMEOUT_S = 3600.0
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # one request; a request past it is a failed record, the cell goes on


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
    search: SearchHook | None = None  # runs the plan's searches (benchsuite.run.search.run_search)
    prompts: PromptCache = field(default_factory=dict)  # per (workload, class, tokenizer), built once for the run
    # NVML for every cell's peak device memory (benchsuite.tools.device_memory); None: no GPU, the figures are None
    device_reader: DeviceReader | None = None
    node: str | None = None  # the Ray node measuring (CellResult.node); None: the run's own machine


SearchHook = Callable[[RunContext, SearchTask], Awaitable[EngineOptions]]
