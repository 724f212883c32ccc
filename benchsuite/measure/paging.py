"""The built-in server's paging counters scraped around a cell -> the cell's paging fields.

`PAGING_COUNTERS` names the Prometheus series (`paged_experts.server.metrics` exposes them);
`paging_delta(before, after)` defines every paging and prefill field with its formula, and
`PAGING_DEFINITIONS` their one-line definitions (`metrics.DEFINITIONS` carries them for the report).
`optimal_hit_rate` is the offline optimum (Belady) of the same cell, from the routing trace its
server recorded (`record_routing: true`, replayed once per server by `replay_trace`); the runner
stores it as `hit_rate_optimal` once the server has stopped and written the trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from benchsuite.tools.scrape import metric_value

if TYPE_CHECKING:
    from paged_experts.routing.trace import Trace

PAGING_DEFINITIONS: dict[str, str] = {
    "miss_rate": "expert misses / (hits + misses) over the cell (engine counters)",
    "bytes_paged_per_token": "bytes paged host->device / generated tokens over the cell (prefill page-ins included)",
    "bytes_h2d_per_token": "expert bytes copied host->device (paging or offload's streaming) / generated tokens",
    "waves_per_step": "waves / (MoE layer x step) over the cell",
    "union_mean": "union of routed experts per (MoE layer x step), mean over the cell",
    "engine_decode_step_s": "built-in engine: its own time per all-decode step (plan, model, wait, sample, hand-off; "
    "no HTTP), mean over the cell",
    "gpu_memory_used_bytes": "built-in engine on CUDA: device memory in use after the cell, CUDA context and graph "
    "pools included",
    "engine_decode_tok_s": "built-in engine: decode tokens / engine decode-step seconds, the aggregate rate in process "
    "(compare output_tok_s over HTTP)",
    "gc_pause_s": "built-in engine: CPU seconds of Python garbage collections in its process during the cell (the "
    "GIL held: every Python thread waits, so they can land in TTFTs and token gaps; queued GPU work goes on)",
    "gc_full_collections": "built-in engine: collections of the oldest generation (every tracked object) during the "
    "cell",
    "prefill_chunks": "prompt chunks (a sequence with more than one token in a step) over the cell (engine counters)",
    "prefill_bytes_per_chunk": "expert bytes paged in during prefill steps / prompt chunks",
    "prefill_router_s_per_chunk": "host time a synthetic router override took during prefill steps / prompt chunks",
    "prefill_copy_s_per_chunk": "page-in copy time during prefill steps (CUDA events) / prompt chunks",
    "prefill_span_s_per_chunk": "prefill steps' device time, first paged layer start to last wave end / prompt chunks",
    "prefill_copy_busy": "page-in copy time / prefill span: the share of the prefill the copy engine was busy",
    "prefill_waves_per_layer": "waves / paged layer-steps of prefill steps",
    "prefill_staged_unused_per_layer": "prefill staging rows: staged experts paged in and not routed / paged "
    "layer-steps of prefill steps (bytes moved for nothing; 0 without staging)",
    "prefill_idle_before_layer_s": "link idle before each paged layer's first page-in of a prefill step (from the "
    "step's start or the previous layer's last page-in: the layer's serial chain of last waves, attention, routing, "
    "the host's plan and first wave) / paged layer-steps",
    "prefill_idle_between_waves_s": "link idle between the page-ins of one layer of a prefill step (copies waiting "
    "for a wave's compute) / paged layer-steps",
    "prefill_host_wait_s": "built-in engine: host time a paged layer of a prefill step spent blocked on the device "
    "(reading its routed ids, the residency states' read; a synthetic router's ids are on the host) / paged "
    "layer-steps",
    "prefill_host_plan_s": "built-in engine: the rest of a paged layer's host time in a prefill step (plan, page-in "
    "and wave launches, residency write-backs; `page_in: staged` copies block inside it) / paged layer-steps: with "
    "the idle before a layer, whose side the link waited on",
    "decode_miss_rate": "misses / (hits + misses) of every step but the prefill steps (the decode after the prompts)",
    "experts_prefetched": "next-layer prefetch: experts paged in before their layer's routing was known, over the cell "
    "(their bytes are in bytes_paged; 0 with prefetch off)",
    "prefetch_accuracy": "next-layer prefetch: prefetched experts the layer then routed to / experts prefetched (None "
    "when none was prefetched)",
    "decode_bytes_per_token": "expert bytes paged in outside the prefill-counted steps (prefetches included) / the "
    "tokens of all-decode steps: the link traffic of one decode token (a prompt step small enough to be planned on "
    "the device, or a 1-token prompt chunk, adds its bytes here but not its tokens)",
    "hit_rate_optimal": "Belady's hit rate over the cell's steps: the server's recorded routing trace replayed from "
    "its start with the same K and prefill residency, each miss evicting the expert used farthest in the future; "
    "compare 1 - miss_rate (None without a trace: record_routing false, or not mode paged)",
}
"""Each paging field of `paging_delta` with its one-line formula, in the order the report lists them."""

PAGING_COUNTERS = {
    "activations": "paged_experts:expert_activations_total",
    "hits": "paged_experts:expert_hits_total",
    "misses": "paged_experts:expert_misses_total",
    "prefetched": "paged_experts:experts_prefetched_total",
    "prefetch_used": "paged_experts:experts_prefetch_used_total",
    "bytes_paged": "paged_experts:bytes_paged_total",
    "bytes_h2d": "paged_experts:bytes_h2d_total",
    "waves": "paged_experts:waves_total",
    "moe_steps": "paged_experts:moe_steps_total",
    "union_experts": "paged_experts:union_experts_total",
    "generation_tokens": "paged_experts:generation_tokens_total",
    "prompt_tokens": "paged_experts:prompt_tokens_total",
    "decode_steps": "paged_experts:engine_decode_steps_total",
    "decode_tokens": "paged_experts:engine_decode_tokens_total",
    "decode_step_s": "paged_experts:engine_decode_step_seconds_total",
    "prefill_chunks": "paged_experts:prefill_chunks_total",
    "prefill_layer_steps": "paged_experts:prefill_layer_steps_total",
    "prefill_hits": "paged_experts:prefill_expert_hits_total",
    "prefill_misses": "paged_experts:prefill_expert_misses_total",
    "prefill_bytes": "paged_experts:prefill_bytes_paged_total",
    "prefill_copy_s": "paged_experts:prefill_copy_seconds_total",
    "prefill_span_s": "paged_experts:prefill_span_seconds_total",
    "prefill_waves": "paged_experts:prefill_waves_total",
    "prefill_staged_unused": "paged_experts:prefill_staged_unused_total",
    "prefill_idle_before_layer_s": "paged_experts:prefill_idle_before_layer_seconds_total",
    "prefill_idle_between_waves_s": "paged_experts:prefill_idle_between_waves_seconds_total",
    "prefill_host_wait_s": "paged_experts:prefill_host_wait_seconds_total",
    "prefill_host_plan_s": "paged_experts:prefill_host_plan_seconds_total",
    "prefill_router_s": "paged_experts:prefill_router_seconds_total",
    "gc_pause_s": "paged_experts:gc_pause_seconds_total",
    "gc_full_collections": "paged_experts:gc_full_collections_total",
}


def paging_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """CellResult paging fields from the built-in server's counters scraped around a cell.

    Each counter's delta = after - before (None when missing on either side or when it went
    down, i.e. the server restarted). Assumes waves, moe_steps and union_experts are counted
    per (MoE layer, engine step).
    - expert_activations, expert_hits, expert_misses, bytes_paged: the deltas
    - miss_rate = misses / (hits + misses)
    - bytes_paged_per_token = bytes_paged / generation_tokens (prefill page-ins included, so
      it is the link traffic each generated token cost)
    - bytes_h2d_per_token = bytes_h2d / generation_tokens: every expert byte that crossed the link,
      also offload's per-forward streaming (which pages nothing into slots)
    - waves_per_step = waves / moe_steps
    - experts_prefetched, prefetch_accuracy = the experts next-layer prefetch paged in before their layer's
      routing was known (their bytes are in bytes_paged), and the share of them the layer then routed to
      (None when none was prefetched)
    - union_mean = union_experts / moe_steps (mean per-layer union of routed experts per step)
    - engine_decode_step_s = engine decode-step seconds / decode steps: the engine thread's own time
      per step whose chunks are all decode tokens (plan, model, wait, sample, hand-off; no HTTP)
    - engine_decode_tok_s = decode tokens / engine decode-step seconds: the aggregate decode rate the
      engine produced in process; against output_tok_s it shows what the HTTP side costs
    - gpu_memory_used_bytes: the device memory in use after the cell (a gauge, not a delta; CUDA only):
      what a card of that size must hold for this configuration
    - gc_pause_s, gc_full_collections: the CPU seconds of Python garbage collections in the server process
      during the cell (the GIL held: every Python thread waits, so they can land in TTFTs and token gaps;
      queued GPU work goes on), and the collections of the oldest generation among them (None from a server
      without the counters)
    Prefill (steps with a prompt chunk; bytes, copies, span and waves over the paged layers'
    host-planned layer-steps of those steps, so 0 for a resident cell; per-chunk figures None when
    the cell had no prompt chunk):
    - prefill_chunks; prefill_bytes_per_chunk = prefill bytes paged / chunks;
      prefill_copy_s_per_chunk = page-in copy seconds / chunks; prefill_span_s_per_chunk = the steps'
      device span (first MoE layer start to last wave end) / chunks
    - prefill_router_s_per_chunk = host seconds in a synthetic router override / chunks (the
      measurement's own cost, in every mode's TTFT alike)
    - prefill_copy_busy = copy seconds / span seconds (the copy engine's busy share of the prefill)
    - prefill_waves_per_layer = waves / host-planned layer-steps of those steps
    - prefill_staged_unused_per_layer = staged experts paged in and not routed / those layer-steps
      (prefill staging rows: bytes moved for nothing; None from a server without the counter)
    - prefill_idle_before_layer_s, prefill_idle_between_waves_s = the link's idle seconds before each
      layer's first page-in / between one layer's page-ins, over those layer-steps (None from a server
      without the counters)
    - prefill_host_wait_s, prefill_host_plan_s = the server's host seconds over those layer-steps: blocked on
      the device (the routed ids, the residency states' read), and the rest of the layer-step's host time (plan,
      launches, residency write-backs) (None from a server without the counters)
    - decode_miss_rate = (misses - prefill misses) / (hits + misses - prefill hits - prefill misses):
      the miss rate of every other step (the decode after the prompts)
    - decode_bytes_per_token = (bytes_paged - prefill bytes) / decode_tokens: the bytes paged in outside
      the prefill-counted steps (prefetches included) over the tokens of all-decode steps (not miss rate
      x top_k x layers x expert bytes: with several streams a step's tokens share experts). The two
      sides differ where a step has a prompt chunk the prefill counters skip: one of 1 token, or a
      prompt of at most K / top_k tokens planned on the device (counters.py); its bytes count, its
      tokens do not. The bundled short prompts and 2,048-token prompts at K >= 40 meet neither.
    """
    delta: dict[str, float | None] = {}
    for key, name in PAGING_COUNTERS.items():
        a, b = metric_value(before, name), metric_value(after, name)
        delta[key] = b - a if a is not None and b is not None and b >= a else None
    hits, misses = delta["hits"], delta["misses"]
    looked_up = hits + misses if hits is not None and misses is not None else None
    return {
        "expert_activations": _as_int(delta["activations"]),
        "expert_hits": _as_int(hits),
        "expert_misses": _as_int(misses),
        "miss_rate": _ratio(misses, looked_up),
        "bytes_paged": _as_int(delta["bytes_paged"]),
        "bytes_paged_per_token": _ratio(delta["bytes_paged"], delta["generation_tokens"]),
        "bytes_h2d_per_token": _ratio(delta["bytes_h2d"], delta["generation_tokens"]),
        "waves_per_step": _ratio(delta["waves"], delta["moe_steps"]),
        "experts_prefetched": _as_int(delta["prefetched"]),
        "prefetch_accuracy": _ratio(delta["prefetch_used"], delta["prefetched"]),
        "union_mean": _ratio(delta["union_experts"], delta["moe_steps"]),
        "engine_decode_step_s": _ratio(delta["decode_step_s"], delta["decode_steps"]),
        "engine_decode_tok_s": _ratio(delta["decode_tokens"], delta["decode_step_s"]),
        "gpu_memory_used_bytes": _as_int(metric_value(after, "paged_experts:gpu_memory_used_bytes") or None),
        "gc_pause_s": delta["gc_pause_s"],
        "gc_full_collections": _as_int(delta["gc_full_collections"]),
        **_prefill_fields(delta),
    }


def _prefill_fields(delta: dict[str, float | None]) -> dict[str, Any]:
    """The prefill cell fields of `paging_delta` (its docstring defines them)."""
    chunks = delta["prefill_chunks"] or None  # no prompt chunk counted: every per-chunk figure is None
    hits, misses, p_hits, p_misses = delta["hits"], delta["misses"], delta["prefill_hits"], delta["prefill_misses"]
    decode_miss = decode_looked_up = None
    if hits is not None and misses is not None and p_hits is not None and p_misses is not None:
        decode_miss = misses - p_misses
        decode_looked_up = hits + misses - p_hits - p_misses
    decode_bytes = None
    if delta["bytes_paged"] is not None and delta["prefill_bytes"] is not None:
        decode_bytes = delta["bytes_paged"] - delta["prefill_bytes"]
    return {
        "prefill_chunks": _as_int(delta["prefill_chunks"]),
        "prefill_bytes_per_chunk": _ratio(delta["prefill_bytes"], chunks),
        "prefill_router_s_per_chunk": _ratio(delta["prefill_router_s"], chunks),
        "prefill_copy_s_per_chunk": _ratio(delta["prefill_copy_s"], chunks),
        "prefill_span_s_per_chunk": _ratio(delta["prefill_span_s"], chunks),
        "prefill_copy_busy": _ratio(delta["prefill_copy_s"], delta["prefill_span_s"]),
        "prefill_waves_per_layer": _ratio(delta["prefill_waves"], delta["prefill_layer_steps"]),
        "prefill_staged_unused_per_layer": _ratio(delta["prefill_staged_unused"], delta["prefill_layer_steps"]),
        "prefill_idle_before_layer_s": _ratio(delta["prefill_idle_before_layer_s"], delta["prefill_layer_steps"]),
        "prefill_idle_between_waves_s": _ratio(delta["prefill_idle_between_waves_s"], delta["prefill_layer_steps"]),
        "prefill_host_wait_s": _ratio(delta["prefill_host_wait_s"], delta["prefill_layer_steps"]),
        "prefill_host_plan_s": _ratio(delta["prefill_host_plan_s"], delta["prefill_layer_steps"]),
        "decode_miss_rate": _ratio(decode_miss, decode_looked_up),
        "decode_bytes_per_token": _ratio(decode_bytes, delta["decode_tokens"]),
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def _as_int(value: float | None) -> int | None:
    return None if value is None else round(value)


NO_TRACE_NOTE = "no routing trace: set record_routing: true on the paged builtin engine"


@dataclass(frozen=True)
class StepCounts:
    """Hits and misses per recorded step [S], summed over layers, of one replay of a whole trace."""

    policy: str
    hits: Any  # np.ndarray [S] int64
    misses: Any  # np.ndarray [S] int64

    def hit_rate(self, start: int, end: int) -> float | None:
        """Hits / (hits + misses) over steps [start, end); None when nothing was looked up."""
        hits, misses = int(self.hits[start:end].sum()), int(self.misses[start:end].sum())
        return hits / (hits + misses) if hits + misses else None


def cell_steps(trace: Trace, before: dict[str, float], after: dict[str, float]) -> tuple[int, int]:
    """The cell's engine steps [start, end) in the trace: the server's MoE layer-step counter at the
    two scrapes over its MoE layers (the counters start at zero when the server is ready, and every
    engine step runs every MoE layer once, as the trace records it). ValueError when they disagree."""
    name = PAGING_COUNTERS["moe_steps"]
    a, b = metric_value(before, name), metric_value(after, name)
    layers = trace.meta.num_layers
    if a is None or b is None:
        raise ValueError(f"the scrapes have no {name}")
    if a % layers or b % layers or b < a:
        raise ValueError(f"{name} {a:g} -> {b:g} is not a whole number of {layers}-layer steps")
    start, end = int(a) // layers, int(b) // layers
    if end > len(trace.steps):
        raise ValueError(f"the cell ends at step {end}, the trace holds {len(trace.steps)} steps")
    return start, end


def replay_trace(trace: Trace, k: int, prefill_keep: str, policy: str = "belady", staging_rows: int = 0) -> StepCounts:
    """Replays every recorded step (as batched, prompts included) through the runtime's residency
    code with `policy` from the server's start (slots 0..K-1): once per server, sliced per cell;
    `staging_rows` as the server staged (RuntimeConfig.prefill_staging_rows: every layer but the first)."""
    from benchsuite.tools.simulate import batched_steps, replay_layer, step_routed  # numpy: only with a trace

    steps = batched_steps(trace, 0, include_prefill=True)
    if len(steps) != len(trace.steps):  # a recorded step with no chunk would shift every step index
        raise ValueError("the trace has empty steps")
    replays = [replay_layer(step_routed(trace, steps, layer), trace.meta.num_experts, k, policy,
                            prefill_keep=prefill_keep, staging_rows=staging_rows, stages=layer > 0)
               for layer in range(trace.meta.num_layers)]  # fmt: skip
    return StepCounts(policy, sum(r.hits for r in replays), sum(r.misses for r in replays))


def optimal_hit_rate(
    optimal: StepCounts, trace: Trace, before: dict[str, float], after: dict[str, float]
) -> float | None:
    """`hit_rate_optimal` of one cell (PAGING_DEFINITIONS) from its server's Belady replay
    (`replay_trace`); ValueError when the trace and the scrapes do not line up."""
    return optimal.hit_rate(*cell_steps(trace, before, after))
