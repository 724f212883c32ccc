"""`GET /metrics` for the built-in server: request metrics and the runtime's paging counters in
the Prometheus text format (version 0.0.4), names prefixed `paged_experts:` like SGLang's `sglang:`.

Definitions (times are the engine clock, `time.perf_counter`):
- time_to_first_token_seconds = first generated token's step end - request arrival;
- inter_token_latency_seconds = gap between consecutive generated tokens of one request;
- e2e_request_latency_seconds = finish - arrival, for requests that ended by stop or length;
- generation_tokens_total counts tokens actually generated (aborted requests included).
Paging counters are the runtime's own (`paged_experts.residency.counters`), cumulative since start: the
server never resets them, so they stay monotonic. `prefill_*` counters cover the paged layers'
host-planned layer-steps of steps with a prompt chunk (page-in bytes and copy time, the steps' span
on the device, waves, hits and misses: `counters.PrefillCounts`). Per-layer hits/misses are separate metric
names (`layer_expert_hits_total{layer=...}`) so summing a metric never double counts. `gc_*` are the process's
garbage collections (`server/gc_pauses.py`): counts, CPU seconds, the longest, and `gc_frozen_objects`, the
objects frozen out of the collector's reach once the server loaded (`--disable-gc-freeze`: only what other code in the
process froze, 375 objects on the H200 against 0.53 M frozen by the server, h200-gcfreeze).

The exposition is prometheus_client's (one private registry per server): request counters and
histograms are its Counter / Histogram, the gauges and the paging counters a Collector that reads
the engine's state at scrape time (the library's way to expose values counted elsewhere).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from paged_experts.server import gc_pauses
from paged_experts.server.connections import ConnectionCounts
from paged_experts.server.engine import FINISH_LENGTH, FINISH_STOP, FinishedRequest

PREFIX = "paged_experts:"

TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5,
)  # fmt: skip
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# (metric suffix, LayerCounts field, help text); all are counters except union_experts_max
PAGING_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("expert_activations_total", "activations", "Distinct experts routed per layer-step, summed"),
    ("routed_pairs_total", "routed_pairs", "Token x top_k routing pairs"),
    ("expert_hits_total", "hits", "Activations already on the device"),
    ("expert_misses_total", "misses", "Activations copied from the host store before use"),
    ("cpu_expert_activations_total", "cpu_activations", "Activations computed on the CPU"),
    ("bytes_paged_total", "bytes_paged_in", "Bytes of experts paged into slots (misses and prefetches)"),
    ("experts_prefetched_total", "prefetched", "Experts paged in before their layer's routing (next-layer prefetch)"),
    ("experts_prefetch_used_total", "prefetch_used", "Prefetched experts the layer then routed to"),
    ("bytes_h2d_total", "bytes_h2d", "Expert bytes copied host to device (any mode)"),
    ("copy_seconds_total", "copy_time_s", "Time of host to device expert copies"),
    ("waves_total", "waves", "Expert compute waves"),
    ("moe_steps_total", "steps", "MoE layer-steps"),
    ("union_experts_total", "union_sum", "Per layer-step union of routed experts, summed"),
)

# (metric suffix, PrefillCounts field, help text): prefill steps' page-in (paged_experts.residency.counters)
PREFILL_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("prefill_steps_total", "steps", "Engine steps with a prompt chunk"),
    ("prefill_chunks_total", "chunks", "Prompt chunks of those steps"),
    ("prefill_tokens_total", "tokens", "Tokens of those chunks"),
    ("prefill_router_seconds_total", "router_s", "Host time in a synthetic router override during those steps"),
    ("prefill_layer_steps_total", "layer_steps", "Host-planned paged layer-steps of those steps"),
    ("prefill_expert_hits_total", "hits", "Expert hits of those layer-steps"),
    ("prefill_expert_misses_total", "misses", "Expert misses of those layer-steps"),
    ("prefill_bytes_paged_total", "bytes_paged_in", "Expert bytes paged in by those layer-steps"),
    ("prefill_copy_seconds_total", "copy_time_s", "Time the page-in copies of those steps took"),
    ("prefill_span_seconds_total", "span_s", "Per step, first paged layer start to last wave end, summed"),
    ("prefill_waves_total", "waves", "Waves of those layer-steps"),
    ("prefill_staged_unused_total", "staged_unused", "Staged experts those layer-steps paged in and did not route"),
    ("prefill_idle_before_layer_seconds_total", "idle_before_layer_s",
     "Link idle before each paged layer's first page-in of those steps (its serial chain)"),
    ("prefill_idle_between_waves_seconds_total", "idle_between_waves_s",
     "Link idle between the page-ins of one layer of those steps (waiting for a wave's compute)"),
    ("prefill_host_wait_seconds_total", "host_wait_s",
     "Host time blocked on the device in the host-planned paged layers of those steps (routed ids, residency)"),
    ("prefill_host_plan_seconds_total", "host_plan_s",
     "The rest of the host time of the host-planned paged layers of those steps (plan, launches, write-backs)"),
)  # fmt: skip

# No `<name>_created` timestamp series beside each counter and histogram: the scrape keeps the
# series it always had (the runner stores every scrape) and no engine we compare with needs them.
prometheus_client.disable_created_metrics()


@dataclass(frozen=True)
class EngineGauges:
    num_running_reqs: int
    num_queue_reqs: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    # engine thread totals over steps whose chunks are all one decode token (see server.engine)
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_step_s: float = 0.0
    decode_model_s: float = 0.0
    steps: int = 0  # every engine step
    phase_s: dict[str, float] | None = None  # host phase -> seconds over every step (server.engine.PHASES)
    gpu_memory_peak_reserved_bytes: int = 0  # torch's caching allocator, peak since start (CUDA)
    gpu_memory_used_bytes: int = 0  # the device's memory in use, every process and context included (CUDA)


@dataclass(frozen=True)
class _EngineState:
    gauges: EngineGauges
    counters: Any | None  # paged_experts.residency.counters.CountersSnapshot; None before the model loads
    routing_synthetic: bool
    connections: ConnectionCounts | None = None  # None where no connection guard runs (in-process tests)


class _EngineCollector(Collector):
    """The engine's gauges and the runtime's cumulative paging counters, as of the current scrape."""

    def __init__(self) -> None:
        self.state: _EngineState | None = None

    def collect(self) -> Iterator[Metric]:
        if self.state is None:
            return
        p, g = PREFIX, self.state.gauges
        for name, help_text, value in (
            ("num_running_reqs", "Requests in the running batch", g.num_running_reqs),
            ("num_queue_reqs", "Requests waiting for admission", g.num_queue_reqs),
            ("kv_used_tokens", "KV tokens in use", g.kv_used_tokens),
            ("kv_capacity_tokens", "KV capacity in tokens", g.kv_capacity_tokens),
            ("routing_synthetic", "1 when synthetic routing replaces the router", int(self.state.routing_synthetic)),
        ):
            yield GaugeMetricFamily(p + name, help_text, value=value)
        yield from _engine_step_families(g)
        yield from _gc_families(gc_pauses.clock().snapshot(), gc_pauses.frozen_objects())
        if self.state.connections is not None:
            yield from _connection_families(self.state.connections)
        if self.state.counters is not None:
            yield from _paging_families(self.state.counters)


def _engine_step_families(g: EngineGauges) -> Iterator[Metric]:
    p = PREFIX
    for name, help_text, value in (
        ("engine_decode_steps_total", "Engine steps of decode tokens only", g.decode_steps),
        ("engine_decode_tokens_total", "Tokens of those steps", g.decode_tokens),
        ("engine_decode_step_seconds_total", "Engine-thread time of those steps, planning to hand-off (no HTTP)",
         g.decode_step_s),
        ("engine_decode_model_seconds_total", "Model time of those steps: launch and wait for the token ids",
         g.decode_model_s),
        ("engine_steps_total", "Engine steps", g.steps),
    ):  # fmt: skip
        yield CounterMetricFamily(p + name, help_text, value=value)
    for name, help_text, value in (
        ("gpu_memory_peak_reserved_bytes", "Peak GPU memory reserved by the server's allocator",
         g.gpu_memory_peak_reserved_bytes),
        ("gpu_memory_used_bytes", "GPU memory in use on the device (contexts included)", g.gpu_memory_used_bytes),
    ):  # fmt: skip
        yield GaugeMetricFamily(p + name, help_text, value=value)
    for phase, seconds in (g.phase_s or {}).items():
        name = p + f"engine_step_{phase}_seconds_total"
        yield CounterMetricFamily(name, f"Engine-thread time in phase {phase}", seconds)


def _gc_families(pauses: gc_pauses.GcPauses, frozen_objects: int) -> Iterator[Metric]:
    """The collector's pauses in this process (server/gc_pauses.py): every Python thread waits for them; and the
    objects frozen out of its reach (`gc.get_freeze_count()`: the loaded server's, unless --disable-gc-freeze)."""
    p = PREFIX
    yield CounterMetricFamily(p + "gc_collections_total", "Python garbage collections, every generation",
                              value=sum(pauses.collections))  # fmt: skip
    yield CounterMetricFamily(p + "gc_full_collections_total", "Python garbage collections of the oldest "
                              "generation (every tracked object)", value=pauses.collections[-1])  # fmt: skip
    yield CounterMetricFamily(p + "gc_pause_seconds_total", "CPU time of garbage collections (the GIL held: every "
                              "Python thread waits)", value=sum(pauses.pause_s))  # fmt: skip
    yield GaugeMetricFamily(p + "gc_pause_max_seconds", "The longest garbage collection since start",
                            value=pauses.max_pause_s)  # fmt: skip
    yield GaugeMetricFamily(p + "gc_frozen_objects", "Objects in the collector's permanent generation "
                            "(gc.freeze: no collection walks them)", value=frozen_objects)  # fmt: skip


def _connection_families(c: ConnectionCounts) -> Iterator[Metric]:
    p = PREFIX
    yield GaugeMetricFamily(p + "connections_open", "Open client connections", value=c.open)
    yield GaugeMetricFamily(p + "connections_max", "The cap on open client connections", value=c.max_connections)
    yield CounterMetricFamily(p + "connections_accepted_total", "Client connections accepted", value=c.accepted)
    family = CounterMetricFamily(
        p + "connections_closed_early_total",
        "Connections closed by the server before a request completed: evicted (the oldest holding no request, "
        "to make room at the cap), refused (at the cap, every connection busy), header_timeout, body_timeout",
        labels=["reason"],
    )
    for reason, count in c.closed_early.items():
        family.add_metric([reason], count)
    yield family
    yield CounterMetricFamily(p + "accept_errors_total", "Failed accepts (out of descriptors or memory)",
                              value=c.accept_errors)  # fmt: skip


def _paging_families(counters: Any) -> Iterator[Metric]:
    p, total = PREFIX, counters.total
    for suffix, attr, help_text in PAGING_COUNTERS:
        yield CounterMetricFamily(p + suffix, help_text, value=getattr(total, attr))
    for suffix, attr, help_text in PREFILL_COUNTERS:
        yield CounterMetricFamily(p + suffix, help_text, value=getattr(counters.prefill, attr))
    yield GaugeMetricFamily(p + "union_experts_max", "Largest per layer-step union of routed experts", total.union_max)
    for suffix, attr in (("layer_expert_hits_total", "hits"), ("layer_expert_misses_total", "misses")):
        family = CounterMetricFamily(p + suffix, f"Per-layer {attr}", labels=["layer"])
        for index, layer in enumerate(counters.layers):
            family.add_metric([str(index)], getattr(layer, attr))
        yield family


class ServerMetrics:
    """Request counters and latency histograms, fed by the engine's `on_finish` listener."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        p, r = PREFIX, self.registry
        self.num_requests = Counter(p + "num_requests", "Finished requests (any reason)", registry=r)
        self.num_aborted_requests = Counter(p + "num_aborted_requests", "Requests aborted or failed", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens of finished requests", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS_S,
                              registry=r)  # fmt: skip
        self.itl = Histogram(p + "inter_token_latency_seconds", "Gap between generated tokens", buckets=ITL_BUCKETS_S,
                             registry=r)  # fmt: skip
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to finish", buckets=E2E_BUCKETS_S, registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)
        gc_pauses.clock()  # counting from now (the process's clock: installed once)

    def on_finish(self, done: FinishedRequest) -> None:
        self.num_requests.inc()
        self.prompt_tokens.inc(done.prompt_tokens)
        self.generation_tokens.inc(done.completion_tokens)
        if done.finish_reason not in (FINISH_STOP, FINISH_LENGTH):
            self.num_aborted_requests.inc()
        if done.first_token_s is not None:
            self.ttft.observe(done.first_token_s - done.arrival_s)
        for earlier, later in pairwise(done.token_times_s):
            self.itl.observe(later - earlier)
        if done.finish_reason in (FINISH_STOP, FINISH_LENGTH):
            self.e2e.observe(done.finish_s - done.arrival_s)

    def render(
        self, gauges: EngineGauges, counters: Any | None, routing_synthetic: bool,
        connections: ConnectionCounts | None = None,
    ) -> str:  # fmt: skip
        """The exposition text; `counters` is a `paged_experts.residency.counters.CountersSnapshot` (None
        before the model loads). One scrape at a time: the event loop serializes them."""
        self._engine.state = _EngineState(gauges, counters, routing_synthetic, connections)
        return generate_latest(self.registry).decode()
