"""Paging counters per MoE layer and in total; `snapshot()` returns plain frozen data.

Definitions (one layer-step is one MoE layer in one `forward`):
- `activations`: distinct experts routed in the layer-step (the union; with prefill staging rows, also a
  staged expert the step did not route, paged in all the same), summed over steps;
- `routed_pairs`: tokens x top_k, summed over steps;
- `hits`: activations already in a device slot when the step began (paged) or resident anyway;
- `misses`: activations copied from the host store before use (paged page-ins; offload counts
  every activation as a miss because it came over the link this step);
- `cpu_activations`: activations computed on the CPU (cpu-experts layers), neither hit nor miss;
  so `hits + misses + cpu_activations == activations` always, and `hits + misses == activations`
  in resident, paged and offload modes;
- `prefetched`: experts paged in speculatively before their layer's routing was known (next-layer
  prefetch, `RuntimeConfig.prefetch_next_layer`); `prefetch_used`: those the layer then routed to
  (they count as hits: resident when the step's plan ran); a wrong prediction costs link time only;
- `bytes_paged_in = (misses + prefetched) x expert_bytes` (experts copied into slots);
- `bytes_h2d`: every expert byte copied host->device, comparable across modes: equal to
  `bytes_paged_in` in paged mode, `num_experts x expert_bytes` per offloaded layer-step;
- `copy_time_s`: time of the host->device expert copies (CUDA events on GPU, wall clock on CPU);
- `waves`, `steps`: compute passes and layer-steps; `union_sum`, `union_max` over steps.

Prefill (`PrefillCounts`, `snapshot().prefill`): engine steps with a prompt chunk (a sequence with
more than one token in the step), any placement:
- `steps`, `chunks`, `tokens`: prefill steps, their prompt chunks and those chunks' tokens;
- `router_s`: host time in a router override during those steps (a synthetic router's draws: a cost
  of the measurement, which a model's own router does not have);
and over the paged layers' host-planned layer-steps of those steps (moe/streaming.py):
- `layer_steps`, `hits`, `misses`: those layer-steps and their hits and misses (so the decode's own
  hit rate is the totals' minus these);
- `bytes_paged_in`: expert bytes paged in by those layer-steps;
- `copy_time_s`: time their page-in copies took (CUDA events on the page-in stream; CPU: wall clock);
- `span_s`: per step, from its first MoE layer starting to its last paged layer's last wave
  (CUDA events on the compute stream; CPU: wall clock), summed over steps;
- `waves`: waves of those layer-steps, all layers;
- `host_wait_s`: host time those layer-steps spent blocked on the device: reading the layer's routed ids
  (the model's own router; a synthetic router's ids are on the host already, its draws in `router_s`) and
  the one read of the device-planned residency states;
- `host_plan_s`: the rest of those layer-steps' host time: the plan, the page-ins' and waves' launches,
  writing residency states between host and device planners (on the CPU the waves' compute too; with
  `page_in: staged` the copies block the host, inside it). An idle before a layer that grows with
  `host_plan_s` points to the host's own work, one that grows with `host_wait_s` to the device's queue;
  the attention and router launches between layers are in neither;
- `copy_busy_fraction = copy_time_s / span_s`: the share of the prefill the copy engine was busy.
A prefill step whose layers each fit one device-planned wave (tokens x top_k <= K) is not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from paged_experts.step import PrefillStepHost

TimeMark = torch.cuda.Event | float
"""A point in time: a CUDA event (timing enabled) or a `time.perf_counter()` reading."""


@dataclass(frozen=True)
class LayerCounts:
    activations: int = 0
    routed_pairs: int = 0
    hits: int = 0
    misses: int = 0
    cpu_activations: int = 0
    bytes_paged_in: int = 0
    bytes_h2d: int = 0
    copy_time_s: float = 0.0
    waves: int = 0
    steps: int = 0
    union_sum: int = 0
    union_max: int = 0
    prefetched: int = 0
    prefetch_used: int = 0

    @property
    def hit_rate(self) -> float | None:
        """hits / (hits + misses); None when nothing was served from the device."""
        served = self.hits + self.misses
        return self.hits / served if served else None

    def __add__(self, other: LayerCounts) -> LayerCounts:
        values = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            values[f.name] = max(a, b) if f.name == "union_max" else a + b
        return LayerCounts(**values)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass(frozen=True)
class PrefillCounts:
    """Prefill steps' page-in (see the module docstring)."""

    steps: int = 0
    chunks: int = 0
    tokens: int = 0
    router_s: float = 0.0
    layer_steps: int = 0
    hits: int = 0
    misses: int = 0
    bytes_paged_in: int = 0
    copy_time_s: float = 0.0
    span_s: float = 0.0
    waves: int = 0
    staged_unused: int = 0  # prefill staging rows: staged experts those steps paged in and did not route
    # The link idle in those steps, split by what it waited for (the page-in stream's gaps: a copy's start mark
    # is recorded after the events it waits on): before each paged layer's first page-in (and its staging copy,
    # with staging rows), from the step's start or the previous layer's last page-in (the layer's serial chain:
    # the previous layer's last waves, this one's attention and routing, the host's read of the ids and its
    # plan, its first wave); and between the page-ins of one layer-step (copies waiting for a wave's compute).
    # span_s less both and copy_time_s is the tail after the last page-in.
    idle_before_layer_s: float = 0.0
    idle_between_waves_s: float = 0.0
    # The host's side of those layer-steps (perf_counter): blocked on the device, and the rest (plan, launches)
    host_wait_s: float = 0.0
    host_plan_s: float = 0.0

    @property
    def copy_busy_fraction(self) -> float | None:
        """copy_time_s / span_s; None before any prefill step was timed."""
        return self.copy_time_s / self.span_s if self.span_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "copy_busy_fraction": self.copy_busy_fraction}


@dataclass(frozen=True)
class CountersSnapshot:
    layers: tuple[LayerCounts, ...]
    expert_bytes: int
    mode: str
    prefill: PrefillCounts = PrefillCounts()

    @property
    def total(self) -> LayerCounts:
        total = LayerCounts()
        for layer in self.layers:
            total = total + layer
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "expert_bytes": self.expert_bytes,
            "total": self.total.to_dict(),
            "layers": [layer.to_dict() for layer in self.layers],
            "prefill": self.prefill.to_dict(),
        }


class _Acc:
    """Mutable accumulator of one layer; CUDA copy timings stay as event pairs until read."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {f.name: 0 for f in fields(LayerCounts)}
        self.values["copy_time_s"] = 0.0
        self.pending_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def resolve_finished(self) -> None:
        """Reads the event pairs that already completed, oldest first, without blocking."""
        done = 0
        for start, end in self.pending_events:
            if not end.query():
                break
            self.values["copy_time_s"] += start.elapsed_time(end) / 1e3
            done += 1
        del self.pending_events[:done]

    def resolve(self) -> None:
        for start, end in self.pending_events:
            end.synchronize()
            self.values["copy_time_s"] += start.elapsed_time(end) / 1e3
        self.pending_events.clear()


def _seconds(start: TimeMark, end: TimeMark) -> float:
    """end - start in seconds (waits for a CUDA end event)."""
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class _PrefillStep:
    """One prefill step's marks, resolved into seconds when the counters are read."""

    def __init__(self, start: TimeMark) -> None:
        self.start = start
        self.end: TimeMark | None = None
        # (start, end, whether it opens a layer-step's page-ins), in the page-in stream's order
        self.copies: list[tuple[TimeMark, TimeMark, bool]] = []

    def finished(self) -> bool:
        """Every mark reached on the device (never waits)."""
        marks = [self.start, *([] if self.end is None else [self.end]), *(m for a, b, _ in self.copies for m in (a, b))]
        return all(isinstance(m, float) or m.query() for m in marks)


@dataclass
class _StepHost:
    """The current prefill step's host figures as they accrue (`PrefillStepHost` without the model's issue times)."""

    chunks: int
    tokens: int
    layer_steps: int = 0
    router_s: float = 0.0
    host_wait_s: float = 0.0
    host_plan_s: float = 0.0


class _PrefillAcc:
    def __init__(self) -> None:
        self.values: dict[str, float] = {f.name: 0 for f in fields(PrefillCounts)}
        self.steps: list[_PrefillStep] = []  # unresolved, oldest first

    def resolve(self, finished_only: bool = False) -> None:
        """Turns steps' marks into seconds, oldest first; `finished_only`: only steps the device has
        finished and not the newest (which may still grow), without waiting for anything."""
        done = 0
        for step in self.steps[:-1] if finished_only else self.steps:
            if finished_only and not step.finished():
                break
            if step.end is not None:
                self.values["span_s"] += _seconds(step.start, step.end)
            self.values["copy_time_s"] += sum(_seconds(a, b) for a, b, _ in step.copies)
            previous = step.start  # the last copy's end
            for a, b, opens in step.copies:
                gap = max(0.0, _seconds(previous, a))  # marks of two streams: never below zero
                self.values["idle_before_layer_s" if opens else "idle_between_waves_s"] += gap
                previous = b
            done += 1
        del self.steps[:done]


class PagingCounters:
    def __init__(self, num_layers: int, expert_bytes: int, mode: str) -> None:
        self.num_layers = num_layers
        self.expert_bytes = expert_bytes
        self.mode = mode
        self._layers = [_Acc() for _ in range(num_layers)]
        self._prefill = _PrefillAcc()
        self._step_host: _StepHost | None = None  # the newest prefill step's host figures (`prefill_step_host`)

    def record_step(
        self, layer: int, *, union: int, routed_pairs: int, hits: int, misses: int, cpu_activations: int, waves: int
    ) -> None:
        if hits + misses + cpu_activations != union:
            raise AssertionError(
                f"layer {layer}: hits {hits} + misses {misses} + cpu {cpu_activations} != union {union}"
            )
        v = self._layers[layer].values
        v["activations"] += union
        v["routed_pairs"] += routed_pairs
        v["hits"] += hits
        v["misses"] += misses
        v["cpu_activations"] += cpu_activations
        v["bytes_paged_in"] += misses * self.expert_bytes
        v["waves"] += waves
        v["steps"] += 1
        v["union_sum"] += union
        v["union_max"] = max(v["union_max"], union)

    def record_copy(self, layer: int, *, bytes_h2d: int, copy_time_s: float = 0.0) -> None:
        v = self._layers[layer].values
        v["bytes_h2d"] += bytes_h2d
        v["copy_time_s"] += copy_time_s

    def record_prefetch(self, layer: int, *, prefetched: int, used: int) -> None:
        """Speculative page-ins for one layer-step (their bytes cross the link like demand misses)."""
        v = self._layers[layer].values
        v["prefetched"] += prefetched
        v["prefetch_used"] += used
        v["bytes_paged_in"] += prefetched * self.expert_bytes
        v["bytes_h2d"] += prefetched * self.expert_bytes

    def record_copy_marks(self, layer: int, num_bytes: int, start: TimeMark, end: TimeMark) -> None:
        """One page-in of `num_bytes` between two marks (events read lazily, or perf_counter readings)."""
        if isinstance(start, float) and isinstance(end, float):
            self.record_copy(layer, bytes_h2d=num_bytes, copy_time_s=end - start)
            return
        assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
        self.record_copy_events(layer, start, end)
        self.record_copy(layer, bytes_h2d=num_bytes)

    def prefill_begin(self, *, chunks: int, tokens: int, start: TimeMark) -> None:
        """A prefill step starts (its first paged layer): `chunks` prompt chunks of `tokens` tokens."""
        acc = self._prefill
        if len(acc.steps) >= 64:
            acc.resolve(finished_only=True)  # a long run without snapshots must not pile up events
        acc.steps.append(_PrefillStep(start))
        acc.values["steps"] += 1
        acc.values["chunks"] += chunks
        acc.values["tokens"] += tokens
        self._step_host = _StepHost(chunks=chunks, tokens=tokens)

    @property
    def prefill_steps_opened(self) -> int:
        """Prefill steps begun since the counters started (or were reset): a step that moves it opened one."""
        return int(self._prefill.values["steps"])

    def prefill_step_host(self, opened_before: int) -> PrefillStepHost | None:
        """The newest prefill step's host figures, if one began after `prefill_steps_opened` read `opened_before`
        (a model reads it before its step and calls this after: None for a step without a prompt chunk)."""
        if self.prefill_steps_opened <= opened_before or self._step_host is None:
            return None
        return PrefillStepHost(**asdict(self._step_host))

    def prefill_router(self, seconds: float) -> None:
        """Host time of one router-override call in the current prefill step."""
        self._prefill.values["router_s"] += seconds
        if self._step_host is not None:
            self._step_host.router_s += seconds

    def prefill_host(self, *, wait_s: float, plan_s: float) -> None:
        """One host-planned paged layer-step of the current prefill step: the host's seconds blocked on the
        device (the routed ids, the residency states' read) and the rest of its host time."""
        v = self._prefill.values
        v["host_wait_s"] += wait_s
        v["host_plan_s"] += plan_s
        if self._step_host is not None:
            self._step_host.host_wait_s += wait_s
            self._step_host.host_plan_s += plan_s

    def prefill_copy(self, num_bytes: int, start: TimeMark, end: TimeMark, opens_layer: bool) -> None:
        """A page-in of the current prefill step, issued on the page-in stream after the ones before. `opens_layer`:
        the first of a layer-step's page-ins, or a staging copy for it (the link's idle before it is the layer's
        chain); else a later one of that layer-step (its idle waited for a wave's compute)."""
        self._prefill.values["bytes_paged_in"] += num_bytes
        self._prefill.steps[-1].copies.append((start, end, opens_layer))

    def prefill_layer_end(self, *, end: TimeMark, waves: int, hits: int, misses: int, staged_unused: int = 0) -> None:
        """A paged layer of the current prefill step issued its last wave (`end` follows it)."""
        v = self._prefill.values
        v["layer_steps"] += 1
        v["waves"] += waves
        v["hits"] += hits
        v["misses"] += misses
        v["staged_unused"] += staged_unused
        self._prefill.steps[-1].end = end
        if self._step_host is not None:
            self._step_host.layer_steps += 1

    def record_copy_events(self, layer: int, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """CUDA copies are timed by events read lazily, so no host sync happens per wave."""
        acc = self._layers[layer]
        acc.pending_events.append((start, end))
        if len(acc.pending_events) >= 256:
            acc.resolve_finished()  # a long run without snapshots must not pile up events

    def snapshot(self) -> CountersSnapshot:
        layers = []
        for acc in self._layers:
            acc.resolve()
            v = acc.values
            counts: dict[str, Any] = {
                f.name: (float(v[f.name]) if f.name == "copy_time_s" else int(v[f.name])) for f in fields(LayerCounts)
            }
            layers.append(LayerCounts(**counts))
        self._prefill.resolve()
        v = self._prefill.values
        prefill_counts: dict[str, Any] = {
            f.name: (float if f.type == "float" else int)(v[f.name]) for f in fields(PrefillCounts)
        }
        prefill = PrefillCounts(**prefill_counts)
        return CountersSnapshot(layers=tuple(layers), expert_bytes=self.expert_bytes, mode=self.mode, prefill=prefill)

    def reset(self) -> None:
        self._layers = [_Acc() for _ in range(self.num_layers)]
        self._prefill = _PrefillAcc()
        self._step_host = None


DeviceTally = tuple[list[list[int]], int, int, tuple[str, ...]]


class TalliedCounters(PagingCounters):
    """`PagingCounters` that also take a layer-step's union as a device scalar, read at `snapshot()`.

    Resident and offload layers know their union only on the device; reading it per layer would
    sync the host 48 times a token. The scalars queue here and are read in one transfer.
    """

    _MAX_PENDING = 8192  # layer-steps queued before a flush

    def __init__(self, num_layers: int, expert_bytes: int, mode: str) -> None:
        super().__init__(num_layers, expert_bytes, mode)
        # (first layer, placements, stats [n, 3 or 5], routed pairs): n consecutive layers of one step
        self._pending: list[tuple[int, tuple[str, ...], torch.Tensor, int]] = []
        self._pending_rows = 0
        # Sources that sum their steps on the device (the static decode step adds every step's stats
        # to a device tally inside its graph); drained at each flush, one device read each.
        self._tallies: list[Callable[[], DeviceTally | None]] = []

    def add_device_tally(self, drain: Callable[[], DeviceTally | None]) -> None:
        """`drain()` returns (per-layer rows [union, hits, misses, prefetched, prefetch used, union
        max] summed over its steps, the number of steps, their routed pairs, the layers' placements)
        and zeroes its sums, or None when it ran no step since the last drain."""
        self._tallies.append(drain)

    def _fold_tally(self, tally: DeviceTally) -> None:
        rows, steps, pairs, placements = tally
        eb = self.expert_bytes
        for layer, ((union, hits, misses, prefetched, used, union_max), placement) in enumerate(zip(rows, placements)):
            v = self._layers[layer].values
            v["activations"] += union
            v["routed_pairs"] += pairs
            v["hits"] += hits
            v["misses"] += misses
            v["bytes_paged_in"] += (misses + prefetched) * eb
            v["waves"] += steps  # a decode step routes >= top_k experts in every layer: one wave each
            v["steps"] += steps
            v["union_sum"] += union
            v["union_max"] = max(v["union_max"], union_max)
            v["prefetched"] += prefetched
            v["prefetch_used"] += used
            if placement == "paged":
                v["bytes_h2d"] += (misses + prefetched) * eb

    def reset(self) -> None:
        for drain in self._tallies:
            drain()  # discard what the device summed so far
        self._pending, self._pending_rows = [], 0
        super().reset()

    def record_step_device(self, layer: int, placement: str, stats: torch.Tensor, routed_pairs: int) -> None:
        """stats: [3] int64 (union, hits, misses) of one layer-step, still on the device."""
        self.record_layers_device(layer, (placement,), stats[None], routed_pairs)

    def record_layers_device(
        self, first_layer: int, placements: tuple[str, ...], stats: torch.Tensor, routed_pairs: int
    ) -> None:
        """stats: [n, 3] int64 (union, hits, misses) of layers first_layer.. first_layer + n - 1 of
        one step, on the device, or [n, 5] with (prefetched, prefetch_used) after them (a graphed
        decode step queues all its layers as one entry: one host call, not one per layer)."""
        self._pending.append((first_layer, placements, stats, routed_pairs))
        self._pending_rows += len(placements)
        if self._pending_rows >= self._MAX_PENDING:
            self.flush()

    def flush(self) -> None:
        for drain in self._tallies:
            tally = drain()
            if tally is not None:
                self._fold_tally(tally)
        if not self._pending:
            return
        pending, self._pending, self._pending_rows = self._pending, [], 0
        # [rows, 5]: 3-wide entries padded with zero prefetches; one device->host read
        rows = iter(torch.cat([torch.nn.functional.pad(p[2], (0, 5 - p[2].shape[1])) for p in pending]).tolist())
        for first, placements, _, pairs in pending:
            for layer, placement in enumerate(placements, start=first):
                union, hits, misses, prefetched, used = next(rows)
                if prefetched:
                    self.record_prefetch(layer, prefetched=int(prefetched), used=int(used))
                self.record_step(
                    layer,
                    union=int(union),
                    routed_pairs=pairs,
                    hits=int(hits),
                    misses=int(misses),
                    cpu_activations=0,
                    waves=1 if union else 0,
                )
                if placement == "paged":  # offload layers record their copies as they issue them
                    self.record_copy(layer, bytes_h2d=int(misses) * self.expert_bytes)

    def snapshot(self) -> CountersSnapshot:
        self.flush()
        return super().snapshot()
