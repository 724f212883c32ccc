"""A device-planned paged step with its page-ins hidden behind compute (RuntimeConfig.overlap_page_in).

Once a layer's routing is planned (`DeviceResidency.plan`), the misses are known on the device.
Without overlap the step copies them all and then computes every pair. Here:
- the misses are dealt round-robin into G groups (`overlap_groups`; miss i in group i mod G, so
  with up to G misses each is alone in its group) and each group's rows are copied on the page-in
  stream, one after another, each followed by an event (`StreamCopies`);
- the hit pairs compute at once, while the copies run (a victim slot is never a routed expert's,
  so no hit reads a slot being written);
- each group's pairs compute as soon as that group's event has fired: the compute stream waits
  for the event, not for the host and not for the other groups.
Everything is stream-ordered, so the pass is captured in the decode graph like the rest.

Two expert kernels, the same ones a non-overlapped step of the same size runs (so paged stays
equal to resident bit for bit; the caller says which, by `fused.uses_triton`):
- triton: gate/up is one launch per group (`moe_triton`'s `SKIP`: the programs of other groups'
  pairs return at once), and a pair's values never depend on the launch that computed them; the
  down projection sums a token's k pairs in one program, so it runs once, after the last copy.
  The copies are ordered to match: every group's gate/up rows first, then all the misses' down
  rows, so the link carries what the next launch needs first;
- grouped (`fused.run_pairs`, CPU and the grouped backend): each group's pairs as their own
  grouped pass over the slots, whole rows copied per group; each pair's row comes from the pass
  that owns it. Each pass prepares the whole slot table as one pass does (FP8 rows without the
  grouped FP8 kernel are dequantized G + 1 times): the triton backend is the fast path.
On the CPU the copies run inline (`InlineCopies`). Tests substitute copies that land in any order
the GPU could produce (tests/test_overlap_page_in.py).

What runs the copies (RuntimeConfig.overlap_copies): `StreamCopies`, the copy kernel on the page-in stream;
`ProxyCopies`, the DMA proxy; `SwitchCopies`, the copy engines started by the captured step itself (SWITCH
conditional nodes with memcpy bodies into staging rows, then one device copy of each landed row into its slot).
"""

from __future__ import annotations

from typing import Protocol

import torch

from paged_experts.kernels import moe_triton
from paged_experts.kernels.copy_kernel import copy_planned
from paged_experts.kernels.fused import combine_pairs, group_pairs, run_pairs
from paged_experts.residency.device import DevicePlan
from paged_experts.residency.dma_proxy import DmaProxy
from paged_experts.residency.store import ExpertTensors
from paged_experts.residency.switch_lanes import SwitchLanes

GATE_UP_TENSORS = ("gate", "up", "gate_scale", "up_scale")
DOWN_TENSORS = ("down", "down_scale")


class MissCopies(Protocol):
    """Where an overlapped pass's page-ins run, and how its compute waits for one of them."""

    def start(
        self, host: ExpertTensors, slots: ExpertTensors, experts: torch.Tensor, slot_ids: torch.Tensor,
        names: tuple[str, ...] | None,
    ) -> object:  # fmt: skip
        """Issues host rows `experts` -> slots `slot_ids` (padded, as `copy_planned` takes them),
        ordered after everything the compute stream was given before; returns what `wait` takes."""
        ...

    def wait(self, started: object) -> None:
        """Work issued on the compute stream after this sees that copy's rows."""
        ...


class InlineCopies:
    """Copies done when issued (CPU; a CUDA device without a page-in stream)."""

    def __init__(self, programs: int | None = None) -> None:
        self.programs = programs  # RuntimeConfig.copy_programs

    def start(
        self, host: ExpertTensors, slots: ExpertTensors, experts: torch.Tensor, slot_ids: torch.Tensor,
        names: tuple[str, ...] | None,
    ) -> object:  # fmt: skip
        copy_planned(host, slots, experts, slot_ids, names, self.programs)
        return None

    def wait(self, started: object) -> None:
        return None


class StreamCopies:
    """Copies on the page-in stream, each followed by an event the compute stream waits for."""

    def __init__(self, copy_stream: torch.cuda.Stream, device: torch.device, programs: int | None = None) -> None:
        self.copy_stream = copy_stream
        self.compute_stream = torch.cuda.current_stream(device)
        self.programs = programs  # RuntimeConfig.copy_programs: a capped copy leaves SMs to the hits' kernels

    def start(
        self, host: ExpertTensors, slots: ExpertTensors, experts: torch.Tensor, slot_ids: torch.Tensor,
        names: tuple[str, ...] | None,
    ) -> object:  # fmt: skip
        # Each copy after everything issued on the compute stream so far: the plan, the index
        # tensors it reads (a group's entries are made contiguous there just before), and every
        # earlier read of the slots. The pass issues every copy before any of its compute.
        self.copy_stream.wait_stream(self.compute_stream)
        with torch.cuda.stream(self.copy_stream):
            self.issue(host, slots, experts, slot_ids, names)
            landed = torch.cuda.Event()
            landed.record(self.copy_stream)
        return landed

    def issue(
        self, host: ExpertTensors, slots: ExpertTensors, experts: torch.Tensor, slot_ids: torch.Tensor,
        names: tuple[str, ...] | None,
    ) -> None:  # fmt: skip
        """The copies themselves, on the page-in stream (the current one)."""
        copy_planned(host, slots, experts, slot_ids, names, self.programs)

    def wait(self, started: object) -> None:
        assert isinstance(started, torch.cuda.Event)
        self.compute_stream.wait_event(started)


class ProxyCopies:
    """Copies the copy engine runs (RuntimeConfig.overlap_copies='dma'): the step rings the DMA proxy's host
    thread from the compute stream, after everything issued before it, and waits on the device for the
    copy engine's word that the rows landed (residency/dma_proxy.py). No second stream in the graph."""

    def __init__(self, proxy: DmaProxy) -> None:
        self.proxy = proxy

    def start(
        self, host: ExpertTensors, slots: ExpertTensors, experts: torch.Tensor, slot_ids: torch.Tensor,
        names: tuple[str, ...] | None,
    ) -> object:  # fmt: skip
        self.proxy.check()  # an eager step's earlier failure, said before it rings again (two pinned words)
        return self.proxy.ring(self.proxy.table(host, slots), experts, slot_ids, DmaProxy.mask(host, names))

    def wait(self, started: object) -> None:
        assert isinstance(started, int)
        self.proxy.wait(started)


SWITCH_LANES = 4  # lanes a SwitchCopies call copies by (c=1 misses ~0.8 a layer-step at 16 GB; the rest: the kernel)
assert SWITCH_LANES % 2 == 0  # the ids past the lanes then start 8 x lanes bytes in: 16-byte aligned, as the kernel's


class SwitchCopies(StreamCopies):
    """Copies on the copy engines, started from inside the captured step with no host
    (RuntimeConfig.overlap_copies='switch'; residency/switch_lanes.py, docs/decode-copies.md).

    `StreamCopies`, with other copies under a capture: the call's first `lanes` entries through SWITCH lanes
    (host row -> staging row j, on the copy engines), then the copy kernel moves each landed staging row into its
    slot (device to device, ~3 us for a 4.7 MB row) and the entries past the lanes straight from the host. A call
    outside a capture (an eager step, a warm-up) copies every entry by the kernel. The staging rows are shared by
    every layer and call (the page-in stream runs the calls one after another)."""

    def __init__(
        self, copy_stream: torch.cuda.Stream, device: torch.device, cache: dict[tuple[object, ...], object],
        lanes: int = SWITCH_LANES, programs: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(copy_stream, device, programs)
        self.cache = cache  # the layer's lanes (DeviceLru.switch_lanes), made by prepare_switch
        self.lanes = lanes

    def issue(
        self, host: ExpertTensors, slots: ExpertTensors, experts: torch.Tensor, slot_ids: torch.Tensor,
        names: tuple[str, ...] | None,
    ) -> None:  # fmt: skip
        n = min(self.lanes, int(experts.shape[0]))
        if not (n and torch.cuda.is_current_stream_capturing()):
            super().issue(host, slots, experts, slot_ids, names)
            return
        staging = staging_rows(slots, self.lanes)
        lanes = switch_lanes_for(self.cache, host, staging, names, n, capturing=True)
        src = lane_sources(experts[:n], host.num_rows, staging.num_rows)  # before the lanes: not behind them
        lanes.capture(experts[:n])  # [n]: a prefix
        copy_planned(staging, slots, src, slot_ids[:n], names, self.programs)  # the landed rows to their slots
        if experts.shape[0] > n:  # n = lanes here (even): the rest start 16-byte aligned, as the eager copy's ids
            super().issue(host, slots, experts[n:], slot_ids[n:], names)


_STAGING: dict[tuple[object, ...], ExpertTensors] = {}  # a few device rows per layout, shared by every model


def _layout(t: ExpertTensors) -> tuple[object, ...]:
    """What makes two expert tables' rows interchangeable: shapes, dtypes, packed or split."""
    return (t.gate.device, t.row_pitch, *((n, tuple(t.get(n).shape[1:]), t.get(n).dtype) for n in t.names()))


def lane_sources(experts: torch.Tensor, num_experts: int, staging_rows: int) -> torch.Tensor:
    """experts [n] (a copy call's first n, padded with num_experts) -> [n] the staging row each lane's expert landed
    in (lane j: row j), or `staging_rows` for a padding entry, which `copy_planned` then skips."""
    lane = torch.arange(experts.shape[0], device=experts.device)  # [n]
    return torch.where(experts < num_experts, lane, staging_rows)


def prepare_switch(
    cache: dict[tuple[object, ...], object], host: ExpertTensors, slots: ExpertTensors, programs: int | None = None,
    lanes: int = SWITCH_LANES,
) -> None:  # fmt: skip
    """Before any capture (a layer's construction): the staging rows, every lane set `SwitchCopies` can ask for
    (1..lanes lanes, for each tensor set an overlapped pass copies), and one run of each kernel a captured call
    launches that no eager step runs (the staging table's copy is a Triton variant of its own: its row count is
    no multiple of 16; `lane_sources`' ops), every entry skipped. So no setter module or kernel is loaded or
    compiled, no staging row allocated and no pinned-memory query made while a graph is being captured. Raises
    SwitchUnavailable (with its reason) where the driver cannot run SWITCH nodes: at load, not at the first step.
    programs: RuntimeConfig.copy_programs (the capped kernel specializes on the call's size)."""
    staging = staging_rows(slots, lanes)
    for names in (None, GATE_UP_TENSORS, DOWN_TENSORS):
        for n in range(1, lanes + 1):
            switch_lanes_for(cache, host, staging, names, n)
            padding = torch.full((n,), host.num_rows, dtype=torch.long, device=slots.gate.device)  # [n]: no expert
            src = lane_sources(padding, host.num_rows, staging.num_rows)  # [n], every entry skipped
            copy_planned(staging, slots, src, torch.full_like(src, slots.num_rows), names, programs)


def staging_rows(slots: ExpertTensors, lanes: int) -> ExpertTensors:
    """`lanes` device rows in the slots' layout, one table per layout and lane count (`prepare_switch` makes it,
    outside any capture: an allocation under a capture would come from that graph's pool)."""
    key = (*_layout(slots), lanes)
    if key not in _STAGING:
        inter, hidden = slots.gate.shape[1], slots.gate.shape[2]
        _STAGING[key] = ExpertTensors.empty(
            lanes, hidden, inter, slots.gate.dtype, slots.gate.device, is_fp8=slots.scales[0] is not None,
            packed=slots.packed is not None,
        )  # fmt: skip
    return _STAGING[key]


def switch_lanes_for(
    cache: dict[tuple[object, ...], object], host: ExpertTensors, staging: ExpertTensors,
    names: tuple[str, ...] | None, n: int, capturing: bool = False,
) -> SwitchLanes:  # fmt: skip
    """The lanes copying `host`'s rows (`names` of them) into staging rows 0..n-1, from the layer's `cache`: one
    object per tensor set and lane count, its bodies' addresses computed once. capturing: a graph is being
    captured, so the lanes must exist already (`prepare_switch`): building them now would query the driver."""
    key = (host.gate.data_ptr(), staging.gate.data_ptr(), names, n)
    lanes = cache.get(key)
    if not isinstance(lanes, SwitchLanes):
        if capturing:
            raise RuntimeError(f"SWITCH lanes {names} x {n} were not prepared before the capture (prepare_switch)")
        lanes = cache[key] = SwitchLanes(host, staging, list(range(n)), names)
    return lanes


def miss_groups(plan: DevicePlan, num_slots: int, groups: int) -> torch.Tensor:
    """[P] group of each routed pair's page-in (miss i of the plan in group i mod `groups`), -1 for a hit."""
    p = plan.miss_slots.shape[0]
    slot_group = torch.full((num_slots + 1,), -1, dtype=torch.long, device=plan.miss_slots.device)  # [K+1]
    # padding entries all name the spare slot K, which no pair uses
    slot_group.index_copy_(0, plan.miss_slots, torch.arange(p, device=plan.miss_slots.device) % groups)
    return torch.where(plan.pair_missed, slot_group[plan.pair_slot], -1)  # [P]


def overlapped_pass(
    x: torch.Tensor,
    weights: torch.Tensor,
    host: ExpertTensors,
    slots: ExpertTensors,
    plan: DevicePlan,
    top_k: int,
    groups: int,
    copies: MissCopies,
    triton: bool,
) -> torch.Tensor:
    """x [T, H], weights [T, k], the step's plan (already applied to the residency) -> [T, H], the
    misses paged in by `copies` in `groups` groups while the hits compute (module docstring).
    triton: moe_triton's kernels (where a plain step of this size runs them: `uses_triton`), else
    the grouped pass."""
    num_slots = slots.num_rows
    pair_group = miss_groups(plan, num_slots, groups)  # [P]
    group_rows = [
        (plan.miss_experts[g::groups].contiguous(), plan.miss_slots[g::groups].contiguous()) for g in range(groups)
    ]  # each [ceil((P - g) / G)], padded like the plan
    if triton:
        return _triton_pass(x, weights, host, slots, plan, pair_group, group_rows, top_k, copies)
    landed = [copies.start(host, slots, experts, slot_ids, None) for experts, slot_ids in group_rows]
    y_pairs = x.new_empty(plan.pair_slot.shape[0], x.shape[1])  # [P, H]
    for g in range(-1, groups):  # -1: the hits, at once
        if g >= 0:
            copies.wait(landed[g])
        mine = pair_group == g  # [P]
        rows_of = torch.where(mine, plan.pair_slot, num_slots)  # [P]: the dummy row K collects the others
        order, offs, _ = group_pairs(rows_of, num_slots + 1)
        y = x.new_empty(y_pairs.shape) if g >= 0 else y_pairs  # [P, H]
        run_pairs(x, slots, order, offs[:num_slots], top_k, y)
        if g >= 0:
            y_pairs = torch.where(mine[:, None], y, y_pairs)
    return combine_pairs(y_pairs, weights)


def _triton_pass(
    x: torch.Tensor,
    weights: torch.Tensor,
    host: ExpertTensors,
    slots: ExpertTensors,
    plan: DevicePlan,
    pair_group: torch.Tensor,
    group_rows: list[tuple[torch.Tensor, torch.Tensor]],
    top_k: int,
    copies: MissCopies,
) -> torch.Tensor:
    """moe_triton's two passes: gate/up for the hits, then per group as its rows land; down once."""
    first = [copies.start(host, slots, experts, slot_ids, GATE_UP_TENSORS) for experts, slot_ids in group_rows]
    last = copies.start(host, slots, plan.miss_experts, plan.miss_slots, DOWN_TENSORS)
    gate_scale, up_scale, down_scale = slots.scales
    tiles = moe_triton.pass_tiles(x, slots.gate, top_k, gate_scale is not None)
    hid = x.new_empty(plan.pair_slot.shape[0], slots.gate.shape[1])  # [P, I]
    for g in range(-1, len(group_rows)):  # -1: the hits, at once
        if g >= 0:
            copies.wait(first[g])
        rows = torch.where(pair_group == g, plan.pair_slot, -1)  # [P]: -1 = another launch's pair
        moe_triton.gate_up_pairs(x, rows, slots.gate, slots.up, gate_scale, up_scale, hid, top_k, tiles, True)
    copies.wait(last)
    out = x.new_empty(x.shape)  # [T, H]
    moe_triton.down_pairs(hid, plan.pair_slot.contiguous(), weights, slots.down, down_scale, out, top_k, tiles)
    return out
