"""The Python garbage collector in the server process: its pauses, for `GET /metrics`, and the heap freeze.

A collection holds the GIL, so every Python thread of the server waits for it: the engine's steps (a
prefill's host-planned waves, the decode's launches) and the HTTP side alike; work already queued on the GPU,
and code that released the GIL, go on. A loaded 48-layer paged model keeps ~185,000 objects the collector
tracks (a full collection of them took 62 ms on a 2-core Xeon), and a request's TTFT varied by up to 1.7x
inside one cell on the H200 (h200-staging-b) with nothing in the engine's own counters to say why: these
counters say whether collections account for it.

`clock()` is the process's one `GcPauseClock` (the collector is the process's, so is its clock), installed
on first use: `gc.callbacks` marks each collection's start and stop. The pause is the collecting thread's CPU
time between them (`time.thread_time`): the callbacks are Python code, so the interpreter may hand the GIL to
another thread inside them, and a wall clock would count that thread's turn as collection (a second busy
thread made young collections look twice as long on 3.11). A collection can start inside another's callback
(seen on 3.12): each counts once, and only the outermost one's time is added, as it holds the inner one's.

`freeze_heap()` moves every object the collector tracks into its permanent generation (`gc.freeze`), which
no later collection walks. The server calls it once loaded, warmed and about to answer ready: a full
collection then walks only what was allocated since, not the imported modules, the model and the compiled
state (0.21 M objects in a loaded CPU server, 0.51 M with compiled decode blocks, against hundreds once frozen:
benchmarks/results/cpu/2026-12-03-gc-heap.txt).
`frozen_objects()` is the `/metrics` gauge `gc_frozen_objects`. From the first full collection after the freeze,
CPython's rule (one when the objects promoted since the last exceed a quarter of the old generation) counts
only the unfrozen objects: full collections may run more often, each walking only those.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

GENERATIONS = 3


@dataclass(frozen=True)
class GcPauses:
    """Totals since the clock was installed."""

    collections: tuple[int, ...]  # [generation] collections run
    pause_s: tuple[float, ...]  # [generation] CPU seconds they took (outermost collections only)
    max_pause_s: float  # the longest one, in CPU seconds


class GcPauseClock:
    """Counts the collector's runs and their duration per generation (gc.callbacks)."""

    def __init__(self) -> None:
        self._collections = [0] * GENERATIONS
        self._pause_s = [0.0] * GENERATIONS
        self._max_s = 0.0
        self._starts: list[float] = []  # CPU-time marks of the collections under way, outermost first

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._starts.clear()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.thread_time()  # first: the callback's own work stays out of the mark
        if phase == "start":
            self._starts.append(now)
            return
        if not self._starts:  # installed during a collection: its start was not seen
            return
        started = self._starts.pop()
        generation = min(int(info.get("generation", 0)), GENERATIONS - 1)
        self._collections[generation] += 1
        if self._starts:  # nested: the outer collection's time holds this one's
            return
        seconds = now - started
        self._pause_s[generation] += seconds
        self._max_s = max(self._max_s, seconds)

    def snapshot(self) -> GcPauses:
        return GcPauses(tuple(self._collections), tuple(self._pause_s), self._max_s)


_CLOCK = GcPauseClock()


def clock() -> GcPauseClock:
    """The process's clock, installed."""
    _CLOCK.install()
    return _CLOCK


_holders = 0  # servers of this process whose heap is frozen (tests run several servers in one process)


def freeze_heap() -> int:
    """Collects, then freezes every tracked object; returns the objects the permanent generation holds.

    Why: a full collection walks every tracked object, and a served process holds hundreds of thousands
    that live as long as it does; CPython (3.11, 3.12) runs one once the survivors since the last one exceed
    a quarter of that population, so it lands inside some request and stops every Python thread for it.
    SGLang met the same 100-300 ms stalls and freezes its processes' heaps (`POST /freeze_gc`, then once
    after its warm-up: sgl-project/sglang #9241, #34999). The collection first: a frozen cycle is never
    collected, so the load's garbage would otherwise stay in memory until `release_heap` (so would a
    load-time object that becomes part of a garbage cycle later; the server rebuilds none while serving).
    That collection runs before ready and the clock counts it (the totals and `max_pause_s` since start;
    a cell's figures are differences between scrapes, so none of its cells holds it).
    """
    global _holders
    gc.collect()
    gc.freeze()
    _holders += 1
    return gc.get_freeze_count()


def release_heap() -> None:
    """One holder of the freeze is done (its server stopped); the last one gives the frozen objects back to
    the collector (`gc.unfreeze`), so an in-process server's model is freed once closed."""
    global _holders
    _holders = max(_holders - 1, 0)
    if _holders == 0:
        gc.unfreeze()


def frozen_objects() -> int:
    """Objects in the collector's permanent generation (no collection walks them)."""
    return gc.get_freeze_count()
