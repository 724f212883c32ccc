"""Paging counters per MoE layer and in total; `snapshot()` returns plain frozen data.

Definitions (one layer-step is one MoE layer in one `forward`):
- `activations`: distinct experts routed in the layer-step (the union), summed over steps;
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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch


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
class CountersSnapshot:
    layers: tuple[LayerCounts, ...]
    expert_bytes: int
    mode: str

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


class PagingCounters:
    def __init__(self, num_layers: int, expert_bytes: int, mode: str) -> None:
        self.num_layers = num_layers
        self.expert_bytes = expert_bytes
        self.mode = mode
        self._layers = [_Acc() for _ in range(num_layers)]

    def record_step(
        self, layer: int, *, union: int, routed_pairs: int, hits: int, misses: int, cpu_activations: int, waves: int
    ) -> None:
        if hits + misses + cpu_activations != union:
            raise AssertionError(f"layer {layer}: hits {hits} + misses {misses} + cpu {cpu_activations} != union {union}")
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
            layers.append(
                LayerCounts(**{f.name: (float(v[f.name]) if f.name == "copy_time_s" else int(v[f.name])) for f in fields(LayerCounts)})
            )
        return CountersSnapshot(layers=tuple(layers), expert_bytes=self.expert_bytes, mode=self.mode)

    def reset(self) -> None:
        self._layers = [_Acc() for _ in range(self.num_layers)]


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

    def record_layers_device(self, first_layer: int, placements: tuple[str, ...], stats: torch.Tensor, routed_pairs: int) -> None:
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
                    layer, union=int(union), routed_pairs=pairs, hits=int(hits), misses=int(misses), cpu_activations=0,
                    waves=1 if union else 0,
                )
                if placement == "paged":  # offload layers record their copies as they issue them
                    self.record_copy(layer, bytes_h2d=int(misses) * self.expert_bytes)

    def snapshot(self) -> CountersSnapshot:
        self.flush()
        return super().snapshot()

