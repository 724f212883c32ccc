"""Paging simulator: replays a routing trace through `paged_experts.residency` (the very
`LayerResidency` and wave planner the runtime uses; Belady through `BeladyPolicy`) and reports per
layer and in total: hits, misses, hit rate, bytes paged per token, waves per step, union size.

Concurrency regroups a trace into batched steps: each request keeps its own chunk sequence, and a
closed loop keeps `concurrency` requests active (a finished request is replaced by the next one in
order of first appearance). Concurrency 0 replays the steps exactly as recorded.

Speed model (stated in every report): a step takes `max(compute_s_per_step, step_miss_bytes /
link_b_per_s)` (compute and page-in fully overlapped, one decode step's compute independent of
batch size), and predicted tok/s = tokens / sum of step times. It ignores wave serialisation
beyond the bytes it moves and the launch latency of small copies, so it is an upper bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from paged_experts.residency import POLICIES, BeladyPolicy, EvictionPolicy, LayerResidency
from paged_experts.trace import Chunk, Trace

SIM_POLICIES = (*POLICIES, "belady")


@dataclass(frozen=True)
class SimOptions:
    ks: tuple[int, ...]
    policies: tuple[str, ...] = ("lru",)
    concurrencies: tuple[int, ...] = (1,)
    include_prefill: bool = False
    expert_bytes: float | None = None
    link_b_per_s: float | None = None
    compute_s_per_step: float | None = None
    seed: int = 0


@dataclass(frozen=True)
class LayerStats:
    layer: int  # trace layer index (-1 for the total over layers)
    steps: int
    tokens: int
    hits: int
    misses: int
    waves: int  # summed over steps
    union: int  # summed over steps: distinct experts routed per step

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else float("nan")

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else float("nan")

    @property
    def waves_per_step(self) -> float:
        return self.waves / self.steps if self.steps else float("nan")

    @property
    def union_per_step(self) -> float:
        return self.union / self.steps if self.steps else float("nan")


@dataclass(frozen=True)
class SimResult:
    policy: str
    k: int
    concurrency: int  # 0 = as recorded
    layers: tuple[LayerStats, ...]
    total: LayerStats  # sums over layers; its `steps` counts layer-steps, its `tokens` tokens once
    bytes_per_token: float | None
    predicted_tok_per_s: float | None


def batched_steps(trace: Trace, concurrency: int, include_prefill: bool) -> list[list[Chunk]]:
    """The steps to replay: as recorded (0), or regrouped with `concurrency` active requests."""
    keep = (lambda c: True) if include_prefill else (lambda c: c.num_tokens == 1)
    if concurrency == 0:
        steps = [[c for c in step if keep(c)] for step in trace.steps]
        return [s for s in steps if s]
    queues = [[c for c in chunks if keep(c)] for chunks in trace.requests().values()]
    queues = [q for q in queues if q]
    waiting = list(reversed(queues))
    active: list[list[Chunk]] = []
    cursor: list[int] = []
    steps = []
    while waiting or active:
        while waiting and len(active) < concurrency:
            active.append(waiting.pop())
            cursor.append(0)
        steps.append([q[i] for q, i in zip(active, cursor)])
        cursor = [i + 1 for i in cursor]
        alive = [j for j, q in enumerate(active) if cursor[j] < len(q)]
        active, cursor = [active[j] for j in alive], [cursor[j] for j in alive]
    return steps


def _step_routed(trace: Trace, steps: Sequence[Sequence[Chunk]], layer: int) -> list[np.ndarray]:
    return [
        np.concatenate([trace.ids[c.row_start : c.row_start + c.num_tokens, layer].ravel() for c in step])
        for step in steps
    ]


def _policy(name: str, routed: list[np.ndarray], seed: int) -> EvictionPolicy:
    if name == "belady":
        return BeladyPolicy([set(r.tolist()) for r in routed])
    if name == "random":
        return POLICIES[name](seed)
    return POLICIES[name]()


def replay_layer(
    layer: int, routed: list[np.ndarray], num_experts: int, k: int, policy: str, step_tokens: Sequence[int], seed: int = 0
) -> tuple[LayerStats, np.ndarray]:
    """Replay one layer's per-step routed ids; returns its stats and misses per step [S]."""
    residency = LayerResidency(num_experts, k, _policy(policy, routed, seed))
    misses = np.zeros(len(routed), dtype=np.int64)
    hits = waves = union = 0
    for s, ids in enumerate(routed):
        plan = residency.plan_step(ids.tolist())
        hits += plan.hits
        misses[s] = plan.misses
        waves += len(plan.waves)
        union += plan.union
    stats = LayerStats(layer, len(routed), int(sum(step_tokens)), hits, int(misses.sum()), waves, union)
    return stats, misses


def simulate_one(trace: Trace, steps: list[list[Chunk]], k: int, policy: str, concurrency: int, opts: SimOptions) -> SimResult:
    if policy not in SIM_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {SIM_POLICIES}")
    meta = trace.meta
    step_tokens = [sum(c.num_tokens for c in step) for step in steps]
    layers = []
    step_misses = np.zeros(len(steps), dtype=np.int64)
    for layer in range(meta.num_layers):
        routed = _step_routed(trace, steps, layer)
        stats, misses = replay_layer(layer, routed, meta.num_experts, k, policy, step_tokens, opts.seed)
        layers.append(stats)
        step_misses += misses
    total = LayerStats(
        layer=-1,
        steps=sum(s.steps for s in layers),  # layer-steps: waves and union per step read per layer
        tokens=int(sum(step_tokens)),
        hits=sum(s.hits for s in layers),
        misses=sum(s.misses for s in layers),
        waves=sum(s.waves for s in layers),
        union=sum(s.union for s in layers),
    )
    bytes_per_token = None
    tok_per_s = None
    if opts.expert_bytes is not None and total.tokens:
        bytes_per_token = total.misses * opts.expert_bytes / total.tokens
        if opts.link_b_per_s and opts.compute_s_per_step is not None:
            step_s = np.maximum(opts.compute_s_per_step, step_misses * opts.expert_bytes / opts.link_b_per_s)
            tok_per_s = float(total.tokens / step_s.sum()) if step_s.sum() > 0 else None
    return SimResult(policy, k, concurrency, tuple(layers), total, bytes_per_token, tok_per_s)


def simulate(trace: Trace, opts: SimOptions) -> list[SimResult]:
    for k in opts.ks:
        if not trace.meta.top_k <= k <= trace.meta.num_experts:
            raise ValueError(f"K={k} must be in [top_k={trace.meta.top_k}, E={trace.meta.num_experts}]")
    results = []
    for concurrency in opts.concurrencies:
        steps = batched_steps(trace, concurrency, opts.include_prefill)
        for policy in opts.policies:
            for k in opts.ks:
                results.append(simulate_one(trace, steps, k, policy, concurrency, opts))
    return results
