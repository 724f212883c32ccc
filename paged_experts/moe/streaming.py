"""Stream-ordered page-in of host-planned waves: the copy engine works through a step's page-ins
while the compute stream works through its waves, with no host synchronization between them.

A prefill chunk routes to nearly every expert, so a paged layer pages in about E - K experts per
chunk: the link, not the compute, sets the chunk's time. What keeps the link busy:
- wave j's page-ins run on the page-in stream (`layer.page_in_stream`), and wave j's compute waits
  for them (an event), not for anything else;
- the planner (`residency.planner.LayerResidency`) gives wave j page-ins only slots that waves <= j-2 used
  (the previous wave's experts are pinned), so they copy while wave j-1 computes; each copy waits
  for exactly the wave that last read its slot (`LayerCopies.page_in`), and copies into slots no
  wave of this step has read go first, waiting for nothing;
- the host issues wave j's page-ins as soon as the compute of the last wave reading their slots is
  issued (`page_in_after`: wave j-2's), before wave j-1's launches, and the compute stream waits for
  them just before wave j (`LayerCopies.wait_landed`): the copy engine learns of them one wave earlier;
- a layer's first copies wait only for the step to begin (`StepStreams.start`: every earlier step's
  reads of any slot are ahead of it on the compute stream), not for the previous layer's compute:
  when the routing is known on the host before the device computes it (a synthetic router
  override), the host plans layer i+1 while layer i's copies are still in flight, and layer i+1's
  page-ins queue right behind them.
- with prefill staging rows (moe/staging.py), layer i+1's first page-ins go into rows shared by all layers
  right behind layer i's page-ins (`LayerCopies.stage`, after the previous STAGING wave read the rows), and
  its STAGING wave waits for them (`wait_staged`); no slot's page-in waits for a STAGING wave.
With the model's own router the routed ids are read once per layer (the host plans from them);
nothing else synchronizes.

`StepStreams` also opens each prefill step's counters (`PagingCounters.prefill_*`): page-in bytes
and copy time per chunk, the step's span, waves. On the CPU everything runs inline in plan order
and the same counters take wall-clock times.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from paged_experts.residency.counters import PagingCounters, TimeMark
from paged_experts.residency.planner import STAGING, Wave
from paged_experts.step import is_prompt_chunk

CopyRows = Callable[[Sequence[tuple[int, int]]], None]  # issues the copies of (expert, slot) pairs


def prompt_chunks(seq_ids: Sequence[int]) -> tuple[int, int]:
    """(prompt chunks, their tokens) of a step: a sequence with more than one token in the step is
    a prompt chunk (a decode token is alone in its sequence)."""
    per_seq = Counter(seq_ids)
    chunks = [n for n in per_seq.values() if is_prompt_chunk(n)]
    return len(chunks), sum(chunks)


def wait_groups(
    page_ins: Sequence[tuple[int, int]], slot_wave: dict[int, int]
) -> list[tuple[int, list[tuple[int, int]]]]:
    """A wave's (expert, slot) page-ins grouped by the wave of this step that last read the slot
    (-1: none), earliest first: each group's copies need only that wave's compute to be done, and
    the copies into slots no wave read go first, waiting for nothing."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for expert, slot in page_ins:
        groups.setdefault(slot_wave.get(slot, -1), []).append((expert, slot))
    return sorted(groups.items())


def page_in_after(waves: Sequence[Wave]) -> list[int]:
    """[W] for each wave of a step, the last earlier wave that reads a slot its page-ins go into (-1: none, and
    for a STAGING wave, whose copies were issued before the plan): a wave's copies can be issued as soon as
    that wave's compute is, ahead of the waves in between (they read other slots). The planner pins the
    previous wave, so wave j's copies are issued after wave j-2's compute, not after wave j-1's: the host
    issues the copies one wave earlier, and a layer's first copies do not wait for the second wave's launches."""
    last_read: dict[int, int] = {}  # slot -> the last wave so far that reads it
    after = []
    for j, wave in enumerate(waves):
        if wave.table == STAGING:
            after.append(-1)
            continue
        after.append(max((last_read.get(slot, -1) for _, slot in wave.page_ins), default=-1))
        for slot in wave.slots:
            last_read[slot] = j
    return after


def mark(device: torch.device) -> TimeMark:
    """A point in time: an event recorded on the current CUDA stream, or perf_counter on the CPU."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepStreams:
    """What the MoE layers of one model step share; each layer calls `enter` with the step's
    context, the first one of a step records the step's start (and opens a prefill step's counters)."""

    def __init__(self) -> None:
        self._key: object = None
        self._layers: set[int] = set()  # layers entered in the current step
        self.start: TimeMark | None = None
        self.prefill = False  # the step has a prompt chunk (its host-planned layer-steps are counted)
        # Paged layers planned on the device register here, so the first host-planned layer of a step
        # reads every layer's device state at once (one host read per step, before any page-in).
        self.device_planned: list[Any] = []
        self.paged: list[Any] = []  # every paged layer, in layer order (staging: the next one's page-ins)

    def enter(
        self, key: object, layer: int, seq_ids: Sequence[int], device: torch.device, counters: PagingCounters
    ) -> None:
        """A layer begins its part of the step `key` (the step's context). A layer entering twice
        under one key is a new step too (a caller reusing a context): a step's page-ins wait only
        for its start, so a step must never be taken for the one before it."""
        if key is self._key and layer not in self._layers:
            self._layers.add(layer)
            return
        self._key = key  # held, so its id is never reused while it is compared
        self._layers = {layer}
        self.start = mark(device)
        chunks, tokens = prompt_chunks(seq_ids)
        self.prefill = chunks > 0
        if self.prefill:
            counters.prefill_begin(chunks=chunks, tokens=tokens, start=self.start)


class LayerCopies:
    """One host-planned layer-step's page-ins, stream-ordered against its waves (CUDA), or inline."""

    def __init__(
        self,
        device: torch.device,
        copy_stream: torch.cuda.Stream | None,
        step: StepStreams,
        counters: PagingCounters,
        layer: int,
        row_bytes: int,
    ) -> None:
        self.device = device
        self.copy = copy_stream if device.type == "cuda" else None
        self.compute = torch.cuda.current_stream(device) if self.copy is not None else None
        self.step = step
        self.counters = counters
        self.layer = layer
        self.row_bytes = row_bytes
        self.done: list[torch.cuda.Event | None] = []  # [wave] recorded after the wave's compute (None: CPU)
        self.slot_wave: dict[int, int] = {}  # slot -> last wave of this step that read it
        self.landed: dict[int, torch.cuda.Event] = {}  # wave -> its page-ins' landing, until the wave waits for it
        self._counted = False  # a copy counted: the next one is not this layer-step's first (counters.prefill_copy)
        if self.copy is not None and isinstance(step.start, torch.cuda.Event):
            self.copy.wait_event(step.start)  # earlier steps' reads of these slots are behind it

    def page_in(self, index: int, wave: Wave, copy_rows: CopyRows) -> None:
        """Issues wave `index`'s page-ins on the page-in stream, each group after the wave that last read its
        slots, whose compute must be issued already (`page_in_after`); `wait_landed(index)`, before the wave's
        compute, makes the compute stream wait for them. On the CPU they run here, inline."""
        if not wave.page_ins:
            return
        if self.copy is None:
            self._timed(wave.page_ins, copy_rows)
            return
        with torch.cuda.stream(self.copy):
            for after, pairs in wait_groups(wave.page_ins, self.slot_wave):
                if after >= 0:
                    if after >= len(self.done):
                        raise AssertionError(f"wave {index}'s page-ins issued before wave {after}'s compute")
                    computed = self.done[after]
                    assert computed is not None  # a copy stream: every wave's compute recorded its event
                    self.copy.wait_event(computed)
                self._timed(pairs, copy_rows)
            landed = torch.cuda.Event()
            landed.record(self.copy)
        self.landed[index] = landed

    def wait_landed(self, index: int) -> None:
        """Before wave `index`'s compute: the compute stream waits for its page-ins (none issued: nothing)."""
        landed = self.landed.pop(index, None)
        if landed is not None and self.compute is not None:
            self.compute.wait_event(landed)

    def stage(
        self, pairs: Sequence[tuple[int, int]], copy_rows: CopyRows, after: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        """Staging-row copies (moe/staging.py) on the page-in stream after `after`, counted as this layer's
        page-ins; the compute stream does not wait for them here (`wait_staged` does, before their wave).
        Returns the event their landing records (None on the CPU, where they ran inline)."""
        if self.copy is None:
            self._timed(pairs, copy_rows)
            return None
        with torch.cuda.stream(self.copy):
            if after is not None:
                self.copy.wait_event(after)
            self._timed(pairs, copy_rows)
            landed = torch.cuda.Event()
            landed.record(self.copy)
        return landed

    def wait_staged(self, landed: torch.cuda.Event | None) -> None:
        """Before a STAGING wave's compute: the compute stream waits for the staged copies to land."""
        if landed is not None and self.compute is not None:
            self.compute.wait_event(landed)

    def computed(self, wave: Wave) -> None:
        """After the wave's compute was issued: its slots are read until this point (a STAGING wave reads
        staging rows, not slots: no slot's page-in waits for it)."""
        for slot in wave.slots if wave.table != STAGING else ():
            self.slot_wave[slot] = len(self.done)
        if self.compute is not None:
            event = torch.cuda.Event()
            event.record(self.compute)
            self.done.append(event)
        else:
            self.done.append(None)  # CPU: inline, nothing to wait for

    def finish(self, waves: int, hits: int, misses: int, staged_unused: int = 0) -> None:
        """After the layer-step's last wave was issued (a prefill step's span runs to here)."""
        if self.step.prefill:
            self.counters.prefill_layer_end(
                end=mark(self.device), waves=waves, hits=hits, misses=misses, staged_unused=staged_unused
            )

    def _timed(self, pairs: Sequence[tuple[int, int]], copy_rows: CopyRows) -> None:
        """Issues the copies of `pairs` between two marks on the current stream, and counts them."""
        start = mark(self.device)
        copy_rows(pairs)
        self._count(len(pairs), start, mark(self.device))

    def _count(self, rows: int, start: TimeMark, end: TimeMark) -> None:
        num_bytes = rows * self.row_bytes
        self.counters.record_copy_marks(self.layer, num_bytes, start, end)
        if self.step.prefill:
            self.counters.prefill_copy(num_bytes, start, end, opens_layer=not self._counted)
        self._counted = True
