"""How a paged layer plans its steps: the two strategies a `PagedLayer` is given.

- `HostWaves`: the host LRU planner (`residency.planner.LayerResidency`, the simulator's own code) splits a
  step into waves (one when its union fits K; pipelined waves of (K - protected) // 2 otherwise);
  each wave pages in its misses from the host store (`PageInEngine`) on the page-in stream
  (`streaming.LayerCopies`), then the layer's kernel computes that wave's pairs once they landed.
  Any step size (prefill, large batches); at most one host read of the routed ids per layer-step.
- `DeviceLru`: one-wave steps (tokens x top_k <= K) planned on the device (`DeviceResidency`), paged
  in by `copy_kernel.copy_planned`, with no host synchronization (CUDA-graph capturable); optional
  overlap (hits compute while the misses copy, each group of misses as soon as it landed:
  `overlap.py`) and next-layer prefetch. Shares its state with the
  layer's `HostWaves` (pulled before a host-planned step, pushed back after).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_experts.kernels.copy_kernel import copy_planned
from paged_experts.kernels.fused import fp8_grouped_tiles
from paged_experts.moe.staging import Staged, StagingRows
from paged_experts.moe.streaming import LayerCopies, page_in_after
from paged_experts.moe.waves import WaveKernel, WavePass
from paged_experts.residency.device import DevicePlan, DeviceResidency
from paged_experts.residency.planner import STAGING, LayerResidency, StepPlan
from paged_experts.residency.store import ExpertTensors, PageInEngine


@dataclass(frozen=True)
class StepCounts:
    union: int
    hits: int
    misses: int
    waves: int


class HostWaves:
    """Host-planned waves over one layer's K slots."""

    def __init__(self, residency: LayerResidency) -> None:
        self.residency = residency
        # the waves' grouped FP8 block tables laid out with the plan (moe/waves.py); False: one launch a wave
        # builds each on the device, as before f5cadb7 (benchmarks/profile_step.py's 'devtables' A/B)
        self.lay_out_block_tables = True

    def step(
        self,
        kernel: WaveKernel,
        x: torch.Tensor,
        ids_cpu: torch.Tensor,
        host: ExpertTensors,
        slots: ExpertTensors,
        page_in: PageInEngine,
        copies: LayerCopies,
        staging: StagingRows | None = None,
        staged: Staged | None = None,
    ) -> tuple[WavePass, StepCounts]:
        """x [T, H] on the slots' device, ids_cpu [T, k] -> (the pass with every wave issued: `finish`
        gives [T, H]; the step's counts). Each wave's page-ins are stream-ordered by `copies` (on
        the page-in stream while earlier waves compute; inline on the CPU) and counted there.
        `staged`: experts already copied into `staging`'s rows for this step (moe/staging.py), served
        first from those rows."""
        experts_staged = staged.experts if staged is not None else ()
        plan = self.residency.plan_step(ids_cpu.reshape(-1).numpy(), staged=experts_staged)  # [T*k], in numpy
        after = page_in_after(plan.waves)
        issued = 0  # the waves whose page-ins are issued: a prefix, so the link takes them in wave order
        ahead = 1 if page_in.blocks_host else len(plan.waves)  # how far past the last computed wave copies go

        def issue(computed: int) -> None:
            """The page-ins of every next wave whose slots' earlier readers are all among waves <= computed."""
            nonlocal issued
            while issued < len(plan.waves) and after[issued] <= computed and issued <= computed + ahead:
                if plan.waves[issued].table != STAGING:
                    copies.page_in(issued, plan.waves[issued], lambda pairs: page_in.copy_rows(host, slots, pairs))
                issued += 1

        # The page-ins that wait for no wave of this step (into the slots of residents the step does not route)
        # go to the link before the pass's layout: the link idles at a layer boundary until this layer's first
        # page-in, and on the H200 the pass's setup and layout took ~0.7 ms of the host's ~1.85 ms between the ids'
        # read and the first page-in (benchmarks/prefill_timeline.py, 2026-12-03). A chunk that routes every
        # resident (the random model's own routing) has none: its first page-ins wait for wave 0's compute.
        issue(-1)
        run = kernel.begin(x, ids_cpu, self.residency.num_experts, slots.gate.device)
        rows = max(slots.num_rows, staging.num_rows if staged is not None and staging is not None else 0)
        tiles = fp8_grouped_tiles(slots) if self.lay_out_block_tables else None  # staging rows: the same shape
        # the pass lays out all waves at once, their grouped FP8 block tables too (one host-to-device copy)
        run.plan_waves(plan.waves, rows, tiles.block_m if tiles is not None else None)
        for i, wave in enumerate(plan.waves):
            if wave.table == STAGING:  # copied before the plan: wait for them, then compute from the rows
                assert staging is not None and staged is not None
                copies.wait_staged(staged.landed)
                run.wave(staging.rows, wave.experts, wave.slots)
            else:
                copies.wait_landed(i)  # issued: after[i] < i, and every wave < i has computed
                run.wave(slots, wave.experts, wave.slots)
            copies.computed(wave)
            if staged is not None and staging is not None:
                _promote_after(plan, i, slots, staging)
            issue(i)  # before the next wave's launches: the copy engine gets them one wave earlier
        copies.finish(len(plan.waves), plan.hits, plan.misses, plan.staged_unused)
        return run, StepCounts(plan.union, plan.hits, plan.misses, len(plan.waves))


def _promote_after(plan: StepPlan, wave: int, slots: ExpertTensors, staging: StagingRows) -> None:
    """After wave `wave` of a staged step was issued: the promotions whose slot no later wave reads, device to
    device on the compute stream; once the last of them (or the STAGING wave, with none) is issued, the staging
    rows are free for the next layer's copies (a promotion waits for no other wave than its slot's last reader,
    so the next layer's staging copy does not wait for this layer's last waves)."""
    now = [p for p in plan.promotions if p.after == wave]
    if now:
        staging.promote(slots, now)
    if wave == max((p.after for p in plan.promotions), default=0):
        staging.computed(slots.gate.device)


@dataclass(frozen=True)
class PendingPrefetch:
    """A paged layer's speculative page-in, issued while the previous layer computed."""

    plan: DevicePlan  # the LRU plan of the predicted experts (already applied to the residency)
    done: torch.cuda.Event | None  # recorded on the copy stream after its copy; None: copied inline (CPU)


class DeviceLru:
    """One-wave LRU steps planned on the device for one paged layer."""

    def __init__(
        self,
        residency: DeviceResidency,
        overlap: bool = False,
        overlap_groups: int = 1,
        copy_programs: int | None = None,
        fused_page_in: bool = False,
        overlap_copies: str = "kernel",
    ) -> None:
        self.residency = residency
        self.overlap = overlap  # RuntimeConfig.overlap_page_in: moe/overlap.py
        self.fused_page_in = fused_page_in  # RuntimeConfig.fused_page_in: PagedLayer.decode_pass
        self.overlap_groups = overlap_groups  # RuntimeConfig.overlap_groups
        self.overlap_copies = overlap_copies  # RuntimeConfig.overlap_copies: 'kernel', 'dma' (the DMA proxy), 'switch'
        # overlap_copies 'switch': this layer's SWITCH lanes, made once per tensor set and lane count (their
        # bodies name this layer's host rows; held here, so they go when the layer goes)
        self.switch_lanes: dict[tuple[object, ...], object] = {}
        self.copy_programs = copy_programs  # RuntimeConfig.copy_programs: the copy kernel's grid cap
        self.one_launch = True  # every tensor of the rows in one copy launch (a benchmark sets False to compare)
        self.pending: PendingPrefetch | None = None  # set by `prefetch`, taken by `page_in`
        self.host_stale = False  # planned here since the host planner last saw the state

    def fits(self, num_pairs: int) -> bool:
        return num_pairs <= self.residency.num_slots

    def plan(self, flat: torch.Tensor) -> DevicePlan:
        self.host_stale = True
        return self.residency.plan(flat)

    def page_in(
        self, host: ExpertTensors, slots: ExpertTensors, flat: torch.Tensor
    ) -> tuple[DevicePlan, PendingPrefetch | None]:
        """flat [T*k] routed ids -> the wave's LRU plan, whose misses are being paged in (stream-ordered
        before the expert pass), and the prefetch it consumed. The misses copy only after that prefetch
        landed: a mispredicted expert's slot may be the one a miss now takes."""
        plan, pending = self.plan_step(flat)
        self._copy_misses(host, slots, plan)
        return plan, pending

    def plan_step(self, flat: torch.Tensor) -> tuple[DevicePlan, PendingPrefetch | None]:
        """flat [T*k] routed ids -> the wave's LRU plan and the prefetch it consumed, with no page-in
        issued: work queued after this sees that prefetch's rows (a mispredicted expert's slot may be
        the one a miss now takes). `page_in` copies the misses; a fused page-in (RuntimeConfig.fused_page_in)
        leaves them to the expert kernels."""
        plan = self.plan(flat)
        pending, self.pending = self.pending, None
        if pending is not None and pending.done is not None:
            torch.cuda.current_stream(flat.device).wait_event(pending.done)
        return plan, pending

    def prefetch(
        self, host: ExpertTensors, slots: ExpertTensors, predicted: torch.Tensor, copy_stream: torch.cuda.Stream | None
    ) -> None:
        """Pages in the experts predicted for the layer's next step (flat [T*k] ids, T*k <= K) before
        its routing is known: an LRU plan of the prediction (so predicted experts are stamped recent
        and not evicted by it), its misses copied on `copy_stream` (inline where None)."""
        plan = self.plan(predicted.reshape(-1).to(torch.long))
        done = None
        if copy_stream is None:
            self._copy_misses(host, slots, plan)
        else:
            copy_stream.wait_stream(torch.cuda.current_stream(predicted.device))  # the plan is written
            with torch.cuda.stream(copy_stream):
                self._copy_misses(host, slots, plan)
                done = torch.cuda.Event()
                done.record(copy_stream)
        self.pending = PendingPrefetch(plan, done)

    def _copy_misses(self, host: ExpertTensors, slots: ExpertTensors, plan: DevicePlan) -> None:
        """The plan's misses paged in on the current stream, by this layer's copy settings."""
        copy_planned(
            host, slots, plan.miss_experts, plan.miss_slots, programs=self.copy_programs, one_launch=self.one_launch
        )

    def step_stats(self, plan: DevicePlan, pending: PendingPrefetch | None, flat: torch.Tensor) -> torch.Tensor:
        """[3] union, hits, misses of the wave; [5] with (prefetched, prefetch used) when a prefetch
        served it: of the experts it paged in, those the step routed to."""
        if pending is None:
            return plan.stats
        e = self.residency.num_experts
        routed = torch.zeros(e + 1, dtype=torch.bool, device=flat.device).index_fill_(
            0, flat, True
        )  # [E+1], E: padding
        used = routed[pending.plan.miss_experts].sum()  # padding entries name E: never routed
        return torch.cat([plan.stats, torch.stack([pending.plan.stats[2], used])])

    def push_from(self, residency: LayerResidency) -> None:
        self.residency.push_from(residency)
