"""Paging simulator: replays a routing trace through `paged_experts.residency.planner` and `.policies` (the very
`LayerResidency`, wave planner and eviction policies the runtime uses; Belady through `BeladyPolicy`) and reports per
layer and in total: hits, misses, hit rate, bytes paged per token, waves per step, union size.

Concurrency regroups a trace into batched steps: each request keeps its own chunk sequence, and a
closed loop keeps `concurrency` requests active (a finished request is replaced by the next one in
order of first appearance). Concurrency 0 replays the steps exactly as recorded.

With prefill replayed (`include_prefill`), what a prefill chunk leaves in the slots matters to the
decode that follows: `prefill_keep` runs each residency policy of `paged_experts.residency.planner.PREFILL_KEEP`
and every result splits its counts into prefill steps (a chunk of more than one token), decode steps,
and the first `early_decode_steps` decode steps after a prefill step (`decode`, `early`).

Speed model (stated in every report): a step takes `max(compute_s_per_step, step_miss_bytes /
link_b_per_s)` (compute and page-in fully overlapped, one decode step's compute independent of
batch size), and predicted tok/s = tokens / sum of step times. It ignores wave serialisation
beyond the bytes it moves and the launch latency of small copies, so it is an upper bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from paged_experts.residency.planner import DEFAULT_PREFILL_KEEP, LayerResidency
from paged_experts.residency.policies import (
    POLICIES,
    BeladyPolicy,
    DecayedLfuPolicy,
    EvictionPolicy,
    RandomPolicy,
    make_policy,
)
from paged_experts.routing.trace import Chunk, Trace

SIM_POLICIES = (*POLICIES, "duel", "belady")
"""Policy names; `lfu-decay:<H>` also names the decayed LFU with a half-life of H steps, `lfu-aging:<P>` the
LFU whose counts halve every P steps (`lfu-aging:<P>:<W>`: experts used in the last W steps evicted last),
`duel:<P>[:<W>]` LRU against that LFU."""


def check_policy(name: str) -> str:
    """`name` if the simulator knows it (`SIM_POLICIES`, `lfu-decay:<H>` with H > 0 or `lfu-aging:<P>` with an
    integer P >= 1), else ValueError."""
    if name in SIM_POLICIES:
        return name
    base, _, param = name.partition(":")
    if base in ("lfu-decay", "lfu-aging", "duel") and param:
        try:
            _parametrized(base, param, 1)
        except ValueError:
            pass
        else:
            return name
    raise ValueError(
        f"unknown policy {name!r}; choose from {SIM_POLICIES}, lfu-decay:<half-life steps>, lfu-aging:<period steps>"
        " or duel:<period steps>"
    )


def _parametrized(base: str, param: str, k: int) -> EvictionPolicy:
    if base == "lfu-decay":
        return DecayedLfuPolicy(float(param))
    return make_policy(f"{base}:{param}", k)  # the server's own parsing of lfu-aging:<P>[:<W>], duel:<P>[:<W>]


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
    prefill_keep: tuple[str, ...] = (DEFAULT_PREFILL_KEEP,)
    early_decode_steps: int = 16
    staging_rows: int = 0  # RuntimeConfig.prefill_staging_rows: every layer but the first stages large steps


@dataclass(frozen=True)
class LayerStats:
    layer: int  # trace layer index (-1 for the total over layers)
    steps: int
    tokens: int
    hits: int
    misses: int
    waves: int  # summed over steps
    union: int  # summed over steps: distinct experts routed per step (and staged ones not routed: planner.StepPlan)

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
    prefill_keep: str = DEFAULT_PREFILL_KEEP
    prefill: LayerStats | None = None  # steps with a prompt chunk (all layers)
    decode: LayerStats | None = None  # the other steps
    early: LayerStats | None = None  # the first `early_decode_steps` decode steps after a prefill step


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


def step_routed(trace: Trace, steps: Sequence[Sequence[Chunk]], layer: int) -> list[np.ndarray]:
    return [
        np.concatenate([trace.ids[c.row_start : c.row_start + c.num_tokens, layer].ravel() for c in step])
        for step in steps
    ]


def _policy(name: str, routed: list[np.ndarray], seed: int, k: int) -> EvictionPolicy:
    if name == "belady":
        return BeladyPolicy([set(r.tolist()) for r in routed])
    if name == "random":
        return RandomPolicy(seed)
    if ":" in name:
        base, _, param = name.partition(":")
        return _parametrized(base, param, k)
    if name == "duel":
        return make_policy(name, k)
    return POLICIES[name]()


@dataclass(frozen=True)
class LayerReplay:
    """One layer's replay, per step [S]."""

    hits: np.ndarray
    misses: np.ndarray
    waves: np.ndarray
    union: np.ndarray

    def stats(self, layer: int, mask: np.ndarray, step_tokens: np.ndarray) -> LayerStats:
        counts = (int(a[mask].sum()) for a in (step_tokens, self.hits, self.misses, self.waves, self.union))
        return LayerStats(layer, int(mask.sum()), *counts)


def replay_layer(
    routed: list[np.ndarray],
    num_experts: int,
    k: int,
    policy: str,
    seed: int = 0,
    prefill_keep: str = DEFAULT_PREFILL_KEEP,
    staging_rows: int = 0,
    stages: bool = False,
) -> LayerReplay:
    """Replay one layer's per-step routed ids (token order) through a fresh `LayerResidency`.
    `staging_rows` with `stages` (every paged layer but the first: the runtime stages a layer's page-ins
    while the one before it computes): the experts the runtime copies into staging rows before a step
    (`LayerResidency.stage_candidates`, a function of the state), served from there."""
    residency = LayerResidency(num_experts, k, _policy(policy, routed, seed, k), prefill_keep=prefill_keep)
    out = np.zeros((4, len(routed)), dtype=np.int64)  # hits, misses, waves, union per step
    for s, ids in enumerate(routed):
        staged = residency.stage_candidates(staging_rows, int(ids.size)) if stages else ()
        plan = residency.plan_step(ids.tolist(), staged=staged)
        out[:, s] = (plan.hits, plan.misses, len(plan.waves), plan.union)
    return LayerReplay(*out)


def _step_masks(steps: list[list[Chunk]], early_decode_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """[S] prefill steps (a chunk of more than one token), [S] decode steps within `early_decode_steps`
    of the last prefill step."""
    prefill = np.array([any(c.num_tokens > 1 for c in step) for step in steps], dtype=bool)
    early = np.zeros(len(steps), dtype=bool)
    since = None
    for s, is_prefill in enumerate(prefill):
        since = 0 if is_prefill else (None if since is None else since + 1)
        early[s] = not is_prefill and since is not None and since <= early_decode_steps
    return prefill, early


def _total(parts: list[LayerStats], tokens: int) -> LayerStats:
    return LayerStats(
        layer=-1,
        steps=sum(s.steps for s in parts),  # layer-steps: waves and union per step read per layer
        tokens=tokens,
        hits=sum(s.hits for s in parts),
        misses=sum(s.misses for s in parts),
        waves=sum(s.waves for s in parts),
        union=sum(s.union for s in parts),
    )


def simulate_one(
    trace: Trace,
    steps: list[list[Chunk]],
    k: int,
    policy: str,
    concurrency: int,
    opts: SimOptions,
    prefill_keep: str = DEFAULT_PREFILL_KEEP,
) -> SimResult:
    check_policy(policy)
    meta = trace.meta
    step_tokens = np.array([sum(c.num_tokens for c in step) for step in steps], dtype=np.int64)
    prefill, early = _step_masks(steps, opts.early_decode_steps)
    every = np.ones(len(steps), dtype=bool)
    replays = [
        replay_layer(
            step_routed(trace, steps, layer),
            meta.num_experts,
            k,
            policy,
            opts.seed,
            prefill_keep,
            staging_rows=opts.staging_rows,
            stages=layer > 0,
        )  # fmt: skip
        for layer in range(meta.num_layers)
    ]
    layers = [r.stats(i, every, step_tokens) for i, r in enumerate(replays)]
    total = _total(layers, int(step_tokens.sum()))
    parts = {
        name: _total([r.stats(i, mask, step_tokens) for i, r in enumerate(replays)], int(step_tokens[mask].sum()))
        for name, mask in (("prefill", prefill), ("decode", ~prefill), ("early", early))
    }
    step_misses = np.sum([r.misses for r in replays], axis=0) if replays else np.zeros(len(steps), dtype=np.int64)
    bytes_per_token = None
    tok_per_s = None
    if opts.expert_bytes is not None and total.tokens:
        bytes_per_token = total.misses * opts.expert_bytes / total.tokens
        if opts.link_b_per_s and opts.compute_s_per_step is not None:
            step_s = np.maximum(opts.compute_s_per_step, step_misses * opts.expert_bytes / opts.link_b_per_s)
            tok_per_s = float(total.tokens / step_s.sum()) if step_s.sum() > 0 else None
    return SimResult(policy, k, concurrency, tuple(layers), total, bytes_per_token, tok_per_s, prefill_keep, **parts)


def simulate(trace: Trace, opts: SimOptions) -> list[SimResult]:
    for k in opts.ks:
        if not trace.meta.top_k <= k <= trace.meta.num_experts:
            raise ValueError(f"K={k} must be in [top_k={trace.meta.top_k}, E={trace.meta.num_experts}]")
        if opts.staging_rows > trace.meta.num_experts - k:
            raise ValueError(
                f"{opts.staging_rows} staging rows exceed the {trace.meta.num_experts - k} experts outside K={k} slots"
            )
    results = []
    for concurrency in opts.concurrencies:
        steps = batched_steps(trace, concurrency, opts.include_prefill)
        for policy in opts.policies:
            for keep in opts.prefill_keep:
                for k in opts.ks:
                    results.append(simulate_one(trace, steps, k, policy, concurrency, opts, keep))
    return results
