"""Staging rows: R device rows, shared by every paged layer, that take a prefill layer-step's first
page-ins before its routing is planned (`RuntimeConfig.prefill_staging_rows`; the rule and why are in
`residency.planner`, the H200 figures in docs/prefill.md).

While paged layer i issues its waves, `stage` copies layer i+1's `stage_candidates` into the rows on the
page-in stream, right behind layer i's own page-ins: the link keeps working through layer i's last wave,
layer i+1's attention and routing, and the host's plan of layer i+1, where it used to idle (every slot
of layer i+1 holds an expert its chunk routes, so no slot is free before a wave has computed). Layer
i+1 then `take`s them: its plan serves them first, from these rows, as a STAGING wave; the ones it promotes
into its slots (`promote`) are copied there as soon as the wave that last reads each slot has computed, and
`computed` is recorded after the last of those copies (or after the STAGING wave, with none), so the next
staging copy waits for exactly that (the rows are read until then).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_experts.kernels.copy_kernel import copy_planned
from paged_experts.moe.streaming import CopyRows, LayerCopies
from paged_experts.residency.planner import Promotion
from paged_experts.residency.store import ExpertTensors
from paged_experts.upload import to_device


@dataclass(frozen=True)
class Staged:
    """Experts copied into staging rows 0..n-1 for one layer-step (`landed`: their copies, None on the CPU)."""

    layer: int
    step: object  # the step's context: staged rows serve that step only
    experts: tuple[int, ...]
    landed: torch.cuda.Event | None


class StagingRows:
    """The shared rows and what is staged in them (at most one layer-step's at a time)."""

    def __init__(self, rows: ExpertTensors) -> None:
        self.rows = rows  # [R, ...] on the device
        self.free: torch.cuda.Event | None = None  # recorded once the last layer-step's reads of the rows were issued
        self.pending: Staged | None = None

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    def stage(self, layer: int, step: object, experts: Sequence[int], copies: LayerCopies, copy_rows: CopyRows) -> None:
        """Copies `experts` into rows 0..n-1 for `layer`'s part of `step`, after the previous staging wave
        has read the rows; counted as `layer`'s page-ins (`copies` is that layer's)."""
        if len(experts) > self.num_rows:
            raise ValueError(f"{len(experts)} experts staged into {self.num_rows} staging rows")
        landed = copies.stage([(e, row) for row, e in enumerate(experts)], copy_rows, after=self.free)
        self.pending = Staged(layer, step, tuple(experts), landed)

    def take(self, layer: int, step: object) -> Staged | None:
        """What was staged for `layer`'s part of `step`, once (None: nothing, or staged for another)."""
        staged = self.pending
        if staged is None or staged.layer != layer or staged.step is not step:
            return None
        self.pending = None
        return staged

    def promote(self, slots: ExpertTensors, promotions: Sequence[Promotion]) -> None:
        """Copies each promotion's staging row into its slot, every tensor, device to device on the current
        stream (planner.Promotion; the step's waves that read those slots are ahead of it). One launch of the
        row copy kernel on CUDA (no temporary copy of the rows: they would count against the memory budget)."""
        index = torch.tensor([(p.row, p.slot) for p in promotions], dtype=torch.long).t().contiguous()  # [2, n]
        device = slots.gate.device
        rows, slot_ids = to_device(index, device)  # each [n]; pinned: the upload does not block the host
        copy_planned(self.rows, slots, rows, slot_ids)

    def computed(self, device: torch.device) -> None:
        """After a layer-step's last read of the rows was issued (its STAGING wave, or its last promotion): the
        next staging copy waits for this point."""
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self.free = event
