"""The paged placement: K device slots per layer, all E experts in the host store, LRU residency.

A `PagedLayer` is given its planning strategies (`planning.py`): `HostWaves` always (prefill,
batches above one wave, the loop kernel), and `DeviceLru` where the runtime plans on the device
(one-wave steps with no host sync, the graphed decode path). Which one runs a step is decided by
the step's size and the kernel, never by a flag inside the compute.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from paged_experts.kernels import moe_triton
from paged_experts.kernels.fused import experts_over_rows, uses_triton
from paged_experts.moe.layer import BeforeCompute, ExpertsFn, MoeLayer, MoeShared, StepContext, page_in_stream
from paged_experts.moe.overlap import (
    InlineCopies,
    MissCopies,
    ProxyCopies,
    StreamCopies,
    SwitchCopies,
    overlapped_pass,
    prepare_switch,
)
from paged_experts.moe.planning import DeviceLru, HostWaves
from paged_experts.moe.streaming import LayerCopies
from paged_experts.residency import dma_proxy
from paged_experts.residency.device import DeviceResidency, pull_many
from paged_experts.residency.planner import LayerResidency
from paged_experts.residency.store import ExpertTensors


class PagedLayer(MoeLayer):
    placement = "paged"
    stats_include_page_ins = True

    def __init__(
        self,
        layer_idx: int,
        router_weight: torch.Tensor,
        host: ExpertTensors,
        slots: ExpertTensors,
        shared: MoeShared,
        waves: HostWaves,
        device_lru: DeviceLru | None = None,
    ) -> None:
        super().__init__(layer_idx, router_weight, host, shared)
        self.device_experts = slots  # [K, ...] on the device
        self.waves = waves
        self.device_lru = device_lru
        if device_lru is not None:
            shared.steps.device_planned.append(self)
            if device_lru.overlap and device_lru.overlap_copies == "switch":
                # every lane set this layer's steps can ask for, now: no module load or allocation under a capture
                prepare_switch(device_lru.switch_lanes, host, slots, device_lru.copy_programs)
        shared.steps.paged.append(self)  # in layer order: the layer a prefill step stages for next

    @property
    def residency(self) -> LayerResidency:
        return self.waves.residency

    @property
    def device_residency(self) -> DeviceResidency | None:
        return self.device_lru.residency if self.device_lru is not None else None

    def experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ids_cpu: torch.Tensor | None, ctx: StepContext
    ) -> torch.Tensor:
        lru, num_pairs = self.device_lru, ids.numel()
        if lru is not None and self.kernel.device_pass and lru.fits(num_pairs):
            out, stats = self.decode_pass(x, ids, weights, experts_over_rows, _nothing)
            assert stats is not None
            self.record_device(stats, num_pairs)
            return out
        with self._host_time() as waits:
            if lru is None:
                return self._host_planned(x, ids, weights, ids_cpu, ctx, waits)
            waits.append(self._pull_stale_states())  # a read of device state: waits for the device like the ids do
            try:
                return self._host_planned(x, ids, weights, ids_cpu, ctx, waits)
            finally:
                lru.push_from(self.residency)  # host work of this layer-step too: counted in its host_plan_s

    @contextmanager
    def _host_time(self) -> Iterator[list[float]]:
        """The host's seconds in one host-planned layer-step, counted when it is part of a prefill step
        (`PrefillCounts.host_wait_s`, `host_plan_s`): the reads that block on the device append their seconds to
        the list this yields; the rest of the layer-step (plan, launches, residency write-backs) is host_plan_s."""
        waits: list[float] = []
        started = time.perf_counter()
        yield waits
        if self.shared.steps.prefill:
            wait_s = sum(waits)
            self.shared.counters.prefill_host(wait_s=wait_s, plan_s=time.perf_counter() - started - wait_s)

    def _host_planned(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        ids_cpu: torch.Tensor | None,
        ctx: StepContext,
        waits: list[float],
    ) -> torch.Tensor:
        """A layer-step planned on the host, wave by wave; the seconds its read of the routed ids blocked on
        the device are appended to `waits` (`_host_time`)."""
        sh = self.shared
        t0 = time.perf_counter()
        ids_cpu = ids.to("cpu", torch.long) if ids_cpu is None else ids_cpu  # [T, k]: the one sync per layer, if any
        waits.append(time.perf_counter() - t0)
        stream = page_in_stream(sh.device)
        copies = LayerCopies(sh.device, stream, sh.steps, sh.counters, self.layer_idx, sh.expert_bytes)
        staged = sh.staging.take(self.layer_idx, ctx) if sh.staging is not None else None
        run, n = self.waves.step(
            self.kernel, x, ids_cpu, self.host, self.device_experts, sh.page_in, copies, sh.staging, staged
        )
        self._stage_next(ids_cpu.numel(), ctx, stream)
        self.record_host(union=n.union, routed_pairs=ids_cpu.numel(), hits=n.hits, misses=n.misses, waves=n.waves)
        return run.finish(weights).to(sh.device)

    def _stage_next(self, num_pairs: int, ctx: StepContext, stream: torch.cuda.Stream | None) -> None:
        """With staging rows: the next paged layer's first page-ins of this step, copied now, behind this
        layer's (moe/staging.py); nothing for a step below the staging threshold or after the last layer."""
        sh, staging = self.shared, self.shared.staging
        if staging is None:
            return
        layers = sh.steps.paged
        at = layers.index(self)
        if at + 1 >= len(layers):
            return
        nxt = layers[at + 1]
        experts = nxt.residency.stage_candidates(staging.num_rows, num_pairs)
        if not experts:
            return
        copies = LayerCopies(sh.device, stream, sh.steps, sh.counters, nxt.layer_idx, sh.expert_bytes)
        staging.stage(
            nxt.layer_idx, ctx, experts, copies, lambda pairs: sh.page_in.copy_rows(nxt.host, staging.rows, pairs)
        )

    def _pull_stale_states(self) -> float:
        """Before a host-planned step: every paged layer's device state the host has not seen, read
        at once (all layers of a step plan alike, so the later ones need it too). Returns the seconds the
        read blocked on the device (writing the states into the host planners is not in them)."""
        stale = [m for m in self.shared.steps.device_planned if m.device_lru.host_stale]
        read_s = pull_many([(m.device_lru.residency, m.residency) for m in stale])
        for m in stale:
            m.device_lru.host_stale = False
        return read_s

    # ---- the graphed decode contract -----------------------------------------------------------

    @property
    def graphable(self) -> bool:
        return self.device_lru is not None

    def fits_one_wave(self, num_tokens: int) -> bool:
        return self.device_lru is not None and self.device_lru.fits(num_tokens * self.shared.top_k)

    def decode_pass(
        self,
        h: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts_fn: ExpertsFn,
        before_compute: BeforeCompute,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Plan on the device, page in the misses, then the pass over the slots: h [B, H] ->
        (out [B, H], stats [3], or [5] when a prefetch served the step)."""
        lru, slots, sh = self.device_lru, self.device_experts, self.shared
        if lru is None:
            raise ValueError("a paged layer planned on the host has no graph-safe decode pass")
        flat = ids.reshape(-1).to(device=sh.device, dtype=torch.long)  # [B*k]
        if lru.overlap:  # hits computing while the misses copy (no prefetch: see RuntimeConfig)
            before_compute()
            plan = lru.plan(flat)
            stream = page_in_stream(sh.device)
            programs = lru.copy_programs
            copies: MissCopies
            if lru.overlap_copies == "dma":  # the copy engine, rung from inside the graph
                copies = ProxyCopies(dma_proxy.for_device(sh.device, dma_proxy.MAX_PAIRS))
            elif stream is None:
                copies = InlineCopies(programs)
            elif lru.overlap_copies == "switch":  # the copy engines, started by the graph's SWITCH nodes
                copies = SwitchCopies(stream, sh.device, lru.switch_lanes, programs=programs)
            else:
                copies = StreamCopies(stream, sh.device, programs)
            triton = uses_triton(flat.shape[0], sh.device, sh.kernel_backend)  # what a plain step would run
            out = overlapped_pass(h, weights, self.host, slots, plan, sh.top_k, lru.overlap_groups, copies, triton)
            return out, plan.stats
        if lru.fused_page_in and h.shape[0] == 1 and uses_triton(flat.shape[0], sh.device, sh.kernel_backend):
            return self._fused_page_in(h, flat, weights, before_compute)
        plan, pending = lru.page_in(self.host, slots, flat)
        before_compute()  # after this layer's page-ins are queued: its misses go first on the link
        out = experts_fn(
            h, plan.pair_slot, weights, slots.gate, slots.up, slots.down, sh.top_k, False, *slots.scales,
            backend=sh.kernel_backend,
        )[0]  # fmt: skip
        return out, lru.step_stats(plan, pending, flat)

    def _fused_page_in(
        self, h: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor, before_compute: BeforeCompute
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-token step whose misses the expert kernels page in themselves (RuntimeConfig.fused_page_in):
        a missed pair's programs read its row from the pinned host store and write it through to the
        slot the plan gave it, while the hits' programs of the same launch read their slots. Copy and
        compute of a miss are one pass, and the hits compute while the misses cross the link, with no
        copy kernel and no second stream. One token routes to k distinct experts, so each missed row
        crosses the link once, as a copy would move it; the arithmetic is the plain step's (paged ==
        resident bit for bit). h [1, H], flat [k] -> (out [1, H], stats)."""
        lru, slots, sh = self.device_lru, self.device_experts, self.shared
        assert lru is not None
        plan, pending = lru.plan_step(flat)
        before_compute()
        src_rows = torch.where(plan.pair_missed, flat, -1)  # [k] host row of each missed pair, -1 for a hit
        out = moe_triton.moe_pairs(
            h, plan.pair_slot, weights, slots.gate, slots.up, slots.down, sh.top_k, *slots.scales,
            read=moe_triton.ReadThrough(src_rows, self.host),
        )  # fmt: skip
        return out, lru.step_stats(plan, pending, flat)

    @property
    def can_prefetch(self) -> bool:
        return self.device_lru is not None

    def prefetch(self, predicted: torch.Tensor, copy_stream: torch.cuda.Stream | None) -> None:
        """Predicted experts [B, k] of this layer's coming step paged in ahead (see DeviceLru.prefetch);
        the step's `decode_pass` waits for the copy and counts what was used."""
        if self.device_lru is None:
            raise ValueError("prefetch needs a paged layer planned on the device")
        self.device_lru.prefetch(self.host, self.device_experts, predicted, copy_stream)

    def after_replay(self) -> None:
        if self.device_lru is not None:
            self.device_lru.host_stale = True

    def reload_slots(self) -> None:
        """Copies into every slot the host row its device map names, so maps and slots agree again
        after warm-up steps that paged other experts in and then rewound the map (before serving)."""
        lru = self.device_lru
        if lru is None:
            raise ValueError("reload_slots needs a paged layer planned on the device")
        experts = lru.residency.expert_in[: lru.residency.num_slots].tolist()
        self.shared.page_in.copy_rows(self.host, self.device_experts, [(e, s) for s, e in enumerate(experts)])
        lru.host_stale = True

    def drop_prefetch(self) -> None:
        if self.device_lru is not None:
            self.device_lru.pending = None

    def lru_state(self) -> LayerResidency:
        """A copy of this layer's residency state (LRU or aging LFU) as the host planner's type (what the simulator
        replays)."""
        if self.device_lru is None:
            return copy.deepcopy(self.residency)
        k, keep = self.device_lru.residency.num_slots, self.residency.prefill_keep
        # the host policy's copy: the device state overwrites what it holds (same policy, same period)
        state = LayerResidency(self.shared.num_experts, k, copy.deepcopy(self.residency.policy), prefill_keep=keep)
        self.device_lru.residency.pull_to(state)
        state.large_steps, state.last_large = self.residency.large_steps, self.residency.last_large.copy()  # host-only
        return state


def _nothing() -> None:
    return None
