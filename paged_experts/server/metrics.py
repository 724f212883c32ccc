"""`GET /metrics` for the built-in server: request metrics and the runtime's paging counters in
the Prometheus text format (version 0.0.4), names prefixed `paged_experts:` like SGLang's `sglang:`.

Definitions (times are the engine clock, `time.perf_counter`):
- time_to_first_token_seconds = first generated token's step end - request arrival;
- inter_token_latency_seconds = gap between consecutive generated tokens of one request;
- e2e_request_latency_seconds = finish - arrival, for requests that ended by stop or length;
- generation_tokens_total counts tokens actually generated (aborted requests included).
Paging counters are the runtime's own (`paged_experts.counters`), cumulative since start: the
server never resets them, so they stay monotonic. `prefill_*` counters cover the paged layers'
host-planned layer-steps of steps with a prompt chunk (page-in bytes and copy time, the steps' span
on the device, waves, hits and misses: `counters.PrefillCounts`). Per-layer hits/misses are separate metric
names (`layer_expert_hits_total{layer=...}`) so summing a metric never double counts.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from paged_experts.server.engine import FINISH_LENGTH, FINISH_STOP, FinishedRequest

PREFIX = "paged_experts:"

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
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

# (metric suffix, PrefillCounts field, help text): prefill steps' page-in (paged_experts.counters)
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
)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help_text = help_text
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_num(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def _num(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _scalar(kind: str, name: str, help_text: str, value: float, labels: str = "") -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{labels} {_num(value)}"]


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


class ServerMetrics:
    """Request counters and latency histograms, fed by the engine's `on_finish` listener."""

    def __init__(self) -> None:
        self.num_requests = 0
        self.num_aborted_requests = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS_S)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Gap between generated tokens", ITL_BUCKETS_S)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish", E2E_BUCKETS_S)

    def on_finish(self, done: FinishedRequest) -> None:
        self.num_requests += 1
        self.prompt_tokens += done.prompt_tokens
        self.generation_tokens += done.completion_tokens
        if done.finish_reason not in (FINISH_STOP, FINISH_LENGTH):
            self.num_aborted_requests += 1
        if done.first_token_s is not None:
            self.ttft.observe(done.first_token_s - done.arrival_s)
        times = done.token_times_s
        for earlier, later in pairwise(times):
            self.itl.observe(later - earlier)
        if done.finish_reason in (FINISH_STOP, FINISH_LENGTH):
            self.e2e.observe(done.finish_s - done.arrival_s)

    def render(self, gauges: EngineGauges, counters: Any | None, routing_synthetic: bool) -> str:
        """`counters` is a `paged_experts.counters.CountersSnapshot` (None before the model loads)."""
        p = PREFIX
        lines: list[str] = []
        lines += _scalar("counter", p + "num_requests_total", "Finished requests (any reason)", self.num_requests)
        lines += _scalar("counter", p + "num_aborted_requests_total", "Requests aborted or failed", self.num_aborted_requests)
        lines += _scalar("counter", p + "prompt_tokens_total", "Prompt tokens of finished requests", self.prompt_tokens)
        lines += _scalar("counter", p + "generation_tokens_total", "Generated tokens of finished requests", self.generation_tokens)
        for hist in (self.ttft, self.itl, self.e2e):
            lines += hist.render()
        lines += _scalar("gauge", p + "num_running_reqs", "Requests in the running batch", gauges.num_running_reqs)
        lines += _scalar("gauge", p + "num_queue_reqs", "Requests waiting for admission", gauges.num_queue_reqs)
        lines += _scalar("gauge", p + "kv_used_tokens", "KV tokens in use", gauges.kv_used_tokens)
        lines += _scalar("gauge", p + "kv_capacity_tokens", "KV capacity in tokens", gauges.kv_capacity_tokens)
        lines += _scalar("gauge", p + "routing_synthetic", "1 when a synthetic routing source replaces the router", int(routing_synthetic))
        lines += _scalar("counter", p + "engine_decode_steps_total", "Engine steps of decode tokens only", gauges.decode_steps)
        lines += _scalar("counter", p + "engine_decode_tokens_total", "Tokens of those steps", gauges.decode_tokens)
        lines += _scalar("counter", p + "engine_decode_step_seconds_total",
                         "Engine-thread time of those steps, planning to hand-off (no HTTP)", gauges.decode_step_s)  # fmt: skip
        lines += _scalar("counter", p + "engine_decode_model_seconds_total",
                         "Model time of those steps: launch and wait for the token ids", gauges.decode_model_s)  # fmt: skip
        lines += _scalar("counter", p + "engine_steps_total", "Engine steps", gauges.steps)
        lines += _scalar("gauge", p + "gpu_memory_peak_reserved_bytes", "Peak GPU memory reserved by the server's allocator",
                         gauges.gpu_memory_peak_reserved_bytes)  # fmt: skip
        lines += _scalar("gauge", p + "gpu_memory_used_bytes", "GPU memory in use on the device (contexts included)",
                         gauges.gpu_memory_used_bytes)  # fmt: skip
        for phase, seconds in (gauges.phase_s or {}).items():
            lines += _scalar("counter", p + f"engine_step_{phase}_seconds_total", f"Engine-thread time in phase {phase}", seconds)
        if counters is not None:
            lines += _paging_lines(counters)
        return "\n".join(lines) + "\n"


def _paging_lines(counters: Any) -> list[str]:
    p = PREFIX
    total = counters.total
    lines: list[str] = []
    for suffix, attr, help_text in PAGING_COUNTERS:
        lines += _scalar("counter", p + suffix, help_text, getattr(total, attr))
    lines += _scalar("gauge", p + "union_experts_max", "Largest per layer-step union of routed experts", total.union_max)
    for suffix, attr, help_text in PREFILL_COUNTERS:
        lines += _scalar("counter", p + suffix, help_text, getattr(counters.prefill, attr))
    for suffix, attr in (("layer_expert_hits_total", "hits"), ("layer_expert_misses_total", "misses")):
        name = p + suffix
        lines += [f"# HELP {name} Per-layer {attr}", f"# TYPE {name} counter"]
        lines += [f'{name}{{layer="{i}"}} {getattr(layer, attr)}' for i, layer in enumerate(counters.layers)]
    return lines
