"""TalliedCounters: device-side stats queued per layer or per whole step, read in one transfer,
give the same totals as recording each layer-step on the host, across flushes."""

from __future__ import annotations

import random

import torch

from paged_experts.residency.counters import PagingCounters, TalliedCounters


def test_step_batches_and_single_layers_tally_like_the_host() -> None:
    rng = random.Random(0)
    layers, expert_bytes = 5, 1000
    placements = ("paged", "resident", "paged", "offload", "resident")
    host = PagingCounters(layers, expert_bytes, "paged")
    tallied = TalliedCounters(layers, expert_bytes, "paged")
    tallied._MAX_PENDING = 7  # flush several times mid-run
    for step in range(20):
        rows = []
        for layer, placement in enumerate(placements):
            union = rng.randint(1, 8)
            misses = rng.randint(0, union) if placement == "paged" else 0
            rows.append([union, union - misses, misses])
            host.record_step(
                layer, union=union, routed_pairs=8, hits=union - misses, misses=misses, cpu_activations=0, waves=1
            )
            if placement == "paged":
                host.record_copy(layer, bytes_h2d=misses * expert_bytes)
        stats = torch.tensor(rows)  # [layers, 3]
        if step % 2:
            tallied.record_layers_device(0, placements, stats, 8)
        else:
            for layer, placement in enumerate(placements):
                tallied.record_step_device(layer, placement, stats[layer], 8)
    assert tallied.snapshot() == host.snapshot()
