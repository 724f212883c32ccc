"""The MoE block of one layer in four placements (resident, paged, offload, cpu) and the routing seam.

Routing is always E-wide on the compute device; the placement only decides where expert weights
come from and where the expert matmuls run:
- `resident`: all E experts on the device (the unpaged reference);
- `paged`: K device slots, LRU residency and wave planning from `paged_experts.residency`,
  batched page-in of each wave's misses from the host store;
- `offload`: all E experts copied from the host store into a shared device buffer every forward,
  whatever the router chose (SGLang `--cpu-offload-gb`);
- `cpu`: experts computed on the CPU from the host store (llama.cpp `--n-cpu-moe`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from paged_experts.kernels.copy_kernel import copy_planned
from paged_experts.counters import PagingCounters, TalliedCounters
from paged_experts.device_residency import DevicePlan, DeviceResidency
from paged_experts.experts import Dispatch, build_dispatch, combine, run_experts
from paged_experts.kernels.fused import combine_pairs, experts_over_rows, group_pairs, route_logits, run_pairs
from paged_experts.residency import LayerResidency
from paged_experts.store import ExpertTensors, PageInEngine

EXPERT_KERNELS: tuple[str, ...] = ("fused", "loop")

RouterOverride = Callable[[int, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]
RoutingObserver = Callable[[int, torch.Tensor, torch.Tensor, Any], None]
ExpertsFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # fused.experts_over_rows or its compiled twin


@dataclass(frozen=True)
class StepContext:
    """Per-token facts of one engine step, handed to router overrides and observers."""

    seq_ids: tuple[int, ...]  # [T] sequence id of each token
    positions: tuple[int, ...]  # [T] position of each token in its sequence


@dataclass(frozen=True)
class PendingPrefetch:
    """A paged layer's speculative page-in, issued while the previous layer computed."""

    plan: DevicePlan  # the LRU plan of the predicted experts (already applied to the residency)
    done: torch.cuda.Event | None  # recorded on the copy stream after its copy; None: copied inline (CPU)


@dataclass(frozen=True)
class MoeShared:
    """What the layers of one model share: page-in engine, offload buffer, counters, sizes."""

    device: torch.device
    dtype: torch.dtype
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    expert_bytes: int
    counters: PagingCounters
    page_in: PageInEngine
    offload_buffer: ExpertTensors | None  # [E, ...] on the device, reused by every offloaded layer


class MoeLayer:
    """One layer's router and experts in one placement."""

    def __init__(
        self,
        layer_idx: int,
        placement: str,
        router_weight: torch.Tensor,
        host: ExpertTensors,
        device_experts: ExpertTensors | None,
        shared: MoeShared,
        residency: LayerResidency | None = None,
    ) -> None:
        if placement == "paged" and (residency is None or device_experts is None):
            raise ValueError("a paged layer needs its residency and device slots")
        if placement == "resident" and device_experts is None:
            raise ValueError("a resident layer needs its experts on the device")
        self.layer_idx = layer_idx
        self.placement = placement
        self.router_weight = router_weight  # [E, H] on the device
        self.host = host  # [E, ...] host store rows (pinned when paged/offloaded on CUDA); device rows if resident
        self.device_experts = device_experts  # [K, ...] slots (paged) or [E, ...] (resident)
        self.shared = shared
        self.residency = residency
        self.kernel = "fused"  # or "loop": the per-expert reference path (EXPERT_KERNELS)
        # Paged layers planned on the device (RuntimeConfig.device_planning): one-wave steps never
        # read the host; other steps plan on `residency` after pulling the shared state.
        self.device_residency: DeviceResidency | None = None
        self._host_residency_stale = False
        self.overlap_page_in = False  # RuntimeConfig.overlap_page_in (device-planned steps only)
        self.pending_prefetch: PendingPrefetch | None = None  # set by prefetch_on_device, taken by page_in_on_device

    def forward(
        self,
        x: torch.Tensor,
        ctx: StepContext,
        router_override: RouterOverride | None,
        observers: Sequence[RoutingObserver],
    ) -> torch.Tensor:
        """x: [T, H] on the device -> [T, H]."""
        sh = self.shared
        router_logits = F.linear(x, self.router_weight)  # [T, E]
        ids_cpu = None
        if router_override is not None:
            ids, weights = router_override(self.layer_idx, router_logits, ctx)
            ids, weights, ids_cpu = self._check_override(ids, weights, x.shape[0])
        else:
            ids, weights = route_logits(router_logits, sh.top_k, sh.norm_topk_prob)  # [T, k], [T, k]
        for fn in observers:
            fn(self.layer_idx, ids, weights, ctx)
        if self.placement == "paged" and self.device_residency is not None:
            if self.kernel == "fused" and self.plans_on_device(x.shape[0]):
                out, stats = self.forward_on_device(x, ids, weights)
                self._record_device(stats, x.shape[0] * sh.top_k)
                return out
            self._pull_residency()
            try:
                return self._forward_host_planned(x, ids, weights, ids_cpu)
            finally:
                self.device_residency.push_from(self.residency)  # type: ignore[arg-type]
        return self._forward_host_planned(x, ids, weights, ids_cpu)

    def plans_on_device(self, num_tokens: int) -> bool:
        """A step of `num_tokens` is planned on the device when it fits one wave (T x top_k <= K)."""
        dr = self.device_residency
        return dr is not None and num_tokens * self.shared.top_k <= dr.num_slots

    def _pull_residency(self) -> None:
        if self._host_residency_stale:
            assert self.device_residency is not None and self.residency is not None
            self.device_residency.pull_to(self.residency)
            self._host_residency_stale = False

    def _forward_host_planned(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ids_cpu: torch.Tensor | None
    ) -> torch.Tensor:
        if self.kernel == "fused":
            return self._forward_fused(x, ids, weights, ids_cpu)
        return self._forward_loop(x, ids, weights)

    def _record_device(self, stats: torch.Tensor, num_pairs: int) -> None:
        """stats: [3] (union, hits, misses) on the device, tallied without a host read where possible."""
        sh = self.shared
        if isinstance(sh.counters, TalliedCounters):
            sh.counters.record_step_device(self.layer_idx, self.placement, stats, num_pairs)
            return
        union, hits, misses = (int(v) for v in stats.tolist())
        sh.counters.record_step(
            self.layer_idx, union=union, routed_pairs=num_pairs, hits=hits, misses=misses, cpu_activations=0,
            waves=1 if union else 0,
        )
        if self.placement == "paged":
            sh.counters.record_copy(self.layer_idx, bytes_h2d=misses * sh.expert_bytes)

    def _forward_fused(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ids_cpu: torch.Tensor | None
    ) -> torch.Tensor:
        """Grouped matmuls over the slot table; host syncs only where the host must decide (paged, cpu)."""
        sh = self.shared
        num_pairs = x.shape[0] * sh.top_k
        if self.placement == "paged":
            ids_cpu = ids.to("cpu", torch.long) if ids_cpu is None else ids_cpu  # [T, k]: the one sync per layer
            y_pairs = x.new_empty(num_pairs, x.shape[1])  # [T*k, H]
            self._run_paged_fused(ids_cpu.reshape(-1), x, y_pairs)
            return combine_pairs(y_pairs, weights)
        if self.placement == "cpu":
            ids_cpu = ids.to("cpu", torch.long) if ids_cpu is None else ids_cpu
            x_cpu = x.to("cpu")
            y_pairs = x_cpu.new_empty(num_pairs, x.shape[1])  # [T*k, H]
            order, offs, counts = group_pairs(ids_cpu.reshape(-1), sh.num_experts)
            run_pairs(x_cpu, self.host, order, offs, sh.top_k, y_pairs)
            union = int((counts > 0).sum())
            sh.counters.record_step(
                self.layer_idx, union=union, routed_pairs=num_pairs, hits=0, misses=0, cpu_activations=union,
                waves=1 if union else 0,
            )
            return combine_pairs(y_pairs, weights).to(sh.device)
        out, stats = self.forward_on_device(x, ids, weights)
        self._record_device(stats, num_pairs)
        return out

    def forward_on_device(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts_fn: ExpertsFn = experts_over_rows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Resident, offload and device-planned paged layers: [T, H] -> ([T, H], stats [3] =
        union, hits, misses) with no host synchronization (a CUDA graph can capture resident
        layers, and paged ones whose page-in kernel is graph-safe)."""
        sh = self.shared
        flat = ids.reshape(-1).to(device=sh.device, dtype=torch.long)  # [T*k]
        if self.placement == "paged":
            assert self.device_residency is not None and self.device_experts is not None
            if self.overlap_page_in:
                plan = self.device_residency.plan(flat)
                self._host_residency_stale = True
                return combine_pairs(self._overlapped_pass(x, plan), weights), plan.stats
            plan, pending = self.page_in_on_device(flat)
            return self.experts_on_device(x, plan, weights, experts_fn), self.step_stats(plan, pending, flat)
        src = self._weights_for_step()
        out, counts = experts_fn(x, flat, weights, src.gate, src.up, src.down, sh.top_k)
        assert counts is not None
        union = (counts > 0).sum()
        zero = torch.zeros_like(union)
        stats = torch.stack([union, union, zero] if self.placement == "resident" else [union, zero, union])
        return out, stats

    def page_in_on_device(self, flat: torch.Tensor) -> tuple[DevicePlan, PendingPrefetch | None]:
        """A device-planned paged layer's wave: flat [T*k] routed ids -> its LRU plan, whose misses
        are being paged in (stream-ordered before the expert pass), and the prefetch it consumed.
        The misses copy only after that prefetch landed: a mispredicted expert's slot may be the
        one a miss now takes."""
        assert self.device_residency is not None and self.device_experts is not None
        plan = self.device_residency.plan(flat)
        self._host_residency_stale = True
        pending, self.pending_prefetch = self.pending_prefetch, None
        if pending is not None and pending.done is not None:
            torch.cuda.current_stream(self.shared.device).wait_event(pending.done)
        copy_planned(self.host, self.device_experts, plan.miss_experts, plan.miss_slots)
        return plan, pending

    def experts_on_device(
        self, x: torch.Tensor, plan: DevicePlan, weights: torch.Tensor, experts_fn: ExpertsFn = experts_over_rows
    ) -> torch.Tensor:
        """The expert pass of a planned paged wave over the slots: x [T, H] -> [T, H]."""
        slots = self.device_experts
        assert slots is not None
        return experts_fn(x, plan.pair_slot, weights, slots.gate, slots.up, slots.down, self.shared.top_k, count_rows=False)[0]

    def prefetch_on_device(self, predicted: torch.Tensor, copy_stream: torch.cuda.Stream | None) -> None:
        """Pages in the experts predicted for this layer's next step (flat [T*k] ids, T*k <= K)
        before its routing is known: an LRU plan of the prediction (so predicted experts are
        stamped recent and not evicted by it), its misses copied on `copy_stream` (inline where
        None). The layer's `page_in_on_device` waits for the copy and counts what was used."""
        assert self.device_residency is not None and self.device_experts is not None
        plan = self.device_residency.plan(predicted.reshape(-1).to(torch.long))
        self._host_residency_stale = True
        done = None
        if copy_stream is None:
            copy_planned(self.host, self.device_experts, plan.miss_experts, plan.miss_slots)
        else:
            copy_stream.wait_stream(torch.cuda.current_stream(self.shared.device))  # the plan is written
            with torch.cuda.stream(copy_stream):
                copy_planned(self.host, self.device_experts, plan.miss_experts, plan.miss_slots)
                done = torch.cuda.Event()
                done.record(copy_stream)
        self.pending_prefetch = PendingPrefetch(plan, done)

    def reload_slots(self) -> None:
        """Copies into every slot the host row its device map names, so maps and slots agree again
        after warm-up steps that paged other experts in and then rewound the map (before serving)."""
        assert self.device_residency is not None and self.device_experts is not None
        experts = self.device_residency.expert_in[: self.device_residency.num_slots].tolist()
        self.shared.page_in.copy_rows(self.host, self.device_experts, [(e, s) for s, e in enumerate(experts)])
        self._host_residency_stale = True

    def step_stats(self, plan: DevicePlan, pending: PendingPrefetch | None, flat: torch.Tensor) -> torch.Tensor:
        """[3] union, hits, misses of the wave; [5] with (prefetched, prefetch used) when a prefetch
        served it: of the experts it paged in, those the step routed to."""
        if pending is None:
            return plan.stats
        e = self.shared.num_experts
        routed = torch.zeros(e + 1, dtype=torch.bool, device=flat.device).index_fill_(0, flat, True)  # [E+1], E: padding
        used = routed[pending.plan.miss_experts].sum()  # padding entries name E: never routed
        return torch.cat([plan.stats, torch.stack([pending.plan.stats[2], used])])

    def resident_pass(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts_fn: ExpertsFn = experts_over_rows
    ) -> torch.Tensor:
        """A resident layer's expert pass without its stats (the graphed decode step counts every
        resident layer's union at once): [T, H] -> [T, H], no host synchronization."""
        assert self.placement == "resident" and self.device_experts is not None
        w = self.device_experts
        flat = ids.reshape(-1).to(device=self.shared.device, dtype=torch.long)  # [T*k]
        return experts_fn(x, flat, weights, w.gate, w.up, w.down, self.shared.top_k, count_rows=False)[0]

    def _overlapped_pass(self, x: torch.Tensor, plan: DevicePlan) -> torch.Tensor:
        """[T, H] -> y_pairs [T*k, H]: the hit pairs compute while the misses copy on a second
        stream, then the miss pairs. A slot is all-hit or all-miss within a step, so each group is
        the same product as in one pass (bit for bit). Rows of the other pass are left unwritten
        by each grouped pass (no group), and `where` picks each row from the pass that owns it."""
        sh = self.shared
        assert self.device_experts is not None and self.device_residency is not None
        k = self.device_residency.num_slots
        y_hit = x.new_empty(plan.pair_slot.shape[0], x.shape[1])  # [T*k, H]
        y_miss = torch.empty_like(y_hit)
        copy_stream = page_in_stream(sh.device)
        if copy_stream is not None:
            copy_stream.wait_stream(torch.cuda.current_stream(sh.device))
            with torch.cuda.stream(copy_stream):
                copy_planned(self.host, self.device_experts, plan.miss_experts, plan.miss_slots)
        else:
            copy_planned(self.host, self.device_experts, plan.miss_experts, plan.miss_slots)
        for rows_of, y in ((torch.where(plan.pair_missed, k, plan.pair_slot), y_hit), (None, y_miss)):
            if rows_of is None:  # second pass: the misses, once their rows have landed
                if copy_stream is not None:
                    torch.cuda.current_stream(sh.device).wait_stream(copy_stream)
                rows_of = torch.where(plan.pair_missed, plan.pair_slot, k)
            order, offs, _ = group_pairs(rows_of, k + 1)  # the dummy row k collects the other pass
            run_pairs(x, self.device_experts, order, offs[:k], sh.top_k, y)
        return torch.where(plan.pair_missed[:, None], y_miss, y_hit)

    def route_on_device(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own router (no override): [T, H] -> ids [T, k], weights [T, k]."""
        sh = self.shared
        return route_logits(F.linear(x, self.router_weight), sh.top_k, sh.norm_topk_prob)

    def _run_paged_fused(self, flat_cpu: torch.Tensor, x: torch.Tensor, y_pairs: torch.Tensor) -> None:
        """flat_cpu: [T*k] routed ids on the host; each wave pages in its misses, then one grouped pass."""
        sh = self.shared
        assert self.residency is not None and self.device_experts is not None
        plan = self.residency.plan_step(flat_cpu.tolist())
        k_slots = self.device_experts.num_rows
        for wave in plan.waves:
            slot_of = torch.full((sh.num_experts,), -1, dtype=torch.long)  # [E]
            slot_of[torch.tensor(wave.experts, dtype=torch.long)] = torch.tensor(wave.slots, dtype=torch.long)
            pair_slot = slot_of[flat_cpu]  # [T*k], -1 for pairs of other waves
            mine = torch.nonzero(pair_slot >= 0).reshape(-1)  # [P_w]
            sub_order, offs, _ = group_pairs(pair_slot[mine], k_slots)
            packed = torch.cat([mine[sub_order], offs.to(torch.long)])  # [P_w + K]
            if sh.device.type == "cuda":  # pinned + non_blocking: no second sync (the caching host
                packed = packed.pin_memory()  # allocator keeps the block until the copy has run)
            packed = packed.to(sh.device, non_blocking=True)
            order, offs_dev = packed[: mine.numel()], packed[mine.numel() :].to(torch.int32)
            sh.page_in.copy_rows(self.host, self.device_experts, wave.page_ins, sh.counters, self.layer_idx, sh.expert_bytes)
            run_pairs(x, self.device_experts, order, offs_dev, sh.top_k, y_pairs)
        sh.counters.record_step(
            self.layer_idx, union=plan.union, routed_pairs=int(flat_cpu.numel()), hits=plan.hits, misses=plan.misses,
            cpu_activations=0, waves=len(plan.waves),
        )

    def _forward_loop(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The reference path: one Python iteration (three matmuls) per routed expert."""
        sh = self.shared
        ids_cpu = ids.to("cpu", torch.long)  # [T, k]; planning is host bookkeeping
        compute_device = torch.device("cpu") if self.placement == "cpu" else sh.device
        dispatch = build_dispatch(ids_cpu, sh.num_experts, compute_device)
        x_in = x.to(compute_device)
        x_sorted = x_in[dispatch.tokens]  # [T*k, H]
        y_sorted = torch.empty_like(x_sorted)  # [T*k, H]
        distinct = sorted(set(ids_cpu.reshape(-1).tolist()))
        routed_pairs = int(ids_cpu.numel())
        if self.placement == "paged":
            self._run_paged(ids_cpu, x_sorted, y_sorted, dispatch, routed_pairs)
        else:
            weights_src = self._weights_for_step()
            run_experts(x_sorted, weights_src, dispatch, distinct, distinct, y_sorted)
            union = len(distinct)
            sh.counters.record_step(
                self.layer_idx,
                union=union,
                routed_pairs=routed_pairs,
                hits=union if self.placement == "resident" else 0,
                misses=union if self.placement == "offload" else 0,
                cpu_activations=union if self.placement == "cpu" else 0,
                waves=1 if union else 0,
            )
        out = combine(y_sorted, dispatch, weights)  # [T, H]
        return out.to(sh.device)

    def _weights_for_step(self) -> ExpertTensors:
        sh = self.shared
        if self.placement == "resident":
            assert self.device_experts is not None
            return self.device_experts
        if self.placement == "cpu":
            return self.host
        assert sh.offload_buffer is not None
        # Offload streams the whole layer whatever was routed, as a weight-offload engine does.
        sh.page_in.copy_rows(
            self.host,
            sh.offload_buffer,
            [(e, e) for e in range(sh.num_experts)],
            sh.counters,
            self.layer_idx,
            sh.expert_bytes,
        )
        return sh.offload_buffer

    def _run_paged(
        self, ids_cpu: torch.Tensor, x_sorted: torch.Tensor, y_sorted: torch.Tensor, dispatch: Dispatch, routed_pairs: int
    ) -> None:
        sh = self.shared
        assert self.residency is not None and self.device_experts is not None
        plan = self.residency.plan_step(ids_cpu.reshape(-1).tolist())
        for wave in plan.waves:
            sh.page_in.copy_rows(self.host, self.device_experts, wave.page_ins, sh.counters, self.layer_idx, sh.expert_bytes)
            run_experts(x_sorted, self.device_experts, dispatch, wave.experts, wave.slots, y_sorted)
        sh.counters.record_step(
            self.layer_idx,
            union=plan.union,
            routed_pairs=routed_pairs,
            hits=plan.hits,
            misses=plan.misses,
            cpu_activations=0,
            waves=len(plan.waves),
        )

    def _check_override(
        self, ids: torch.Tensor, weights: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Checks an override's choice on a host copy (one sync), returned for the planner to reuse."""
        sh = self.shared
        expected = (num_tokens, sh.top_k)
        if tuple(ids.shape) != expected or tuple(weights.shape) != expected:
            raise ValueError(
                f"router_override returned ids {tuple(ids.shape)} and weights {tuple(weights.shape)}; expected {expected}"
            )
        ids = ids.to(torch.long)
        ids_cpu = ids.to("cpu")  # [T, k]
        if ids_cpu.numel() and (int(ids_cpu.min()) < 0 or int(ids_cpu.max()) >= sh.num_experts):
            raise ValueError(f"router_override returned expert ids outside [0, {sh.num_experts})")
        for row in ids_cpu.tolist():
            if len(set(row)) != len(row):
                raise ValueError(f"router_override routed a token to the same expert twice: {row}")
        return ids, weights.to(torch.float32), ids_cpu


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def page_in_stream(device: torch.device) -> torch.cuda.Stream | None:
    """One page-in stream per CUDA device (created outside any graph capture: first use is eager)."""
    if device.type != "cuda":
        return None
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]
