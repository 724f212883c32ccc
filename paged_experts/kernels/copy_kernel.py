"""Page-in planned on the device: copy the planned host rows into their slots without a host read.

On CUDA a Triton kernel reads the pinned host store directly (pinned memory is mapped into the
GPU's address space; Triton accepts such pointers) and writes the slots. The plan's length is
static (padded with the dummy expert E), so the grid is (planned entries x row chunks) and the
programs of padding entries return at once: exactly the planned experts cross the link, and the
launch is capturable in a CUDA graph. On the CPU (tests) and where Triton is missing, the same
copy runs as an index_copy after one host read of the plan (`graph_safe()` says which).

With the full grid every tensor of the rows (an FP8 row: gate, up, down and their three scale rows)
goes in ONE launch (`launch_copy_rows`, the tensors as bytes laid end to end): inside a captured decode
step each launch costs its gap and ramp even when it copies nothing, six of them per paged layer. A
capped grid (`copy_programs`) keeps one launch per tensor.

The kernel's rate against the DMA engines' `copy_` is measured, not assumed:
`benchmarks/decode_h200.py --pagein-kernel-bench` (results under benchmarks/results/h200/).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_experts.residency.store import ExpertTensors

try:  # Triton ships with CUDA builds of torch; the CPU wheel has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

BLOCK_BYTES = 16384  # 16 KiB per program (8,192 bf16, 16,384 FP8 bytes): enough loads in flight per SM to fill the link

if triton is not None:

    @triton.jit
    def _copy_chunk(
        src, dst, experts, slots, entry, chunk, row_elems, src_pitch, dst_pitch, num_experts, BLOCK: tl.constexpr
    ):  # pragma: no cover
        # one 16 KiB chunk of planned entry `entry`; padding entries name expert E: nothing to copy. A row is
        # row_elems long and starts every src_pitch / dst_pitch elements (a packed row's range: more than a row)
        expert = tl.load(experts + entry)
        if expert < num_experts:
            slot = tl.load(slots + entry)
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < row_elems
            v = tl.load(src + expert.to(tl.int64) * src_pitch + offs, mask=mask)
            tl.store(dst + slot.to(tl.int64) * dst_pitch + offs, v, mask=mask)

    @triton.jit
    def _copy_planned_rows(
        src, dst, experts, slots, row_elems, src_pitch, dst_pitch, num_experts, BLOCK: tl.constexpr
    ):  # pragma: no cover
        _copy_chunk(
            src, dst, experts, slots, tl.program_id(0), tl.program_id(1), row_elems, src_pitch, dst_pitch,
            num_experts, BLOCK,
        )  # fmt: skip

    @triton.jit
    def _copy_planned_rows_capped(  # pragma: no cover
        src, dst, experts, slots, row_elems, src_pitch, dst_pitch, num_experts, chunks, work, BLOCK: tl.constexpr
    ):
        # The same copy from a grid of few programs, each taking every n-th (entry, chunk): the copy then
        # holds a few SMs, not all, so kernels on another stream can run beside it (an overlapped pass).
        for item in range(tl.program_id(0), work, tl.num_programs(0)):
            _copy_chunk(
                src, dst, experts, slots, item // chunks, item % chunks, row_elems, src_pitch, dst_pitch,
                num_experts, BLOCK,
            )  # fmt: skip

    # The copies of up to 6 tensors of one expert row (an FP8 row: gate, up, down and their scales) in ONE
    # launch, every tensor as bytes: program (entry, chunk) copies chunk `chunk` of the row's tensors laid
    # end to end (tensor i's chunks start at c_i; c_0 = 0). Inside a captured decode step a launch costs
    # ~1-2.5 us with its gap and its ramp even when it copies nothing (the 3 scale rows: 384 bytes each),
    # and every paged layer copied in 6 launches (benchmarks/results/h200/2026-12-02-flags-overlap).
    # The chunk starts may be 1 (a tiny first tensor): kept as i32, never a constexpr, for the if-chain's types.
    # The row sizes and pitches stay specialized: knowing them multiples of 16 is what lets Triton load 16
    # bytes at a time (ld.global.v4; without it every byte is its own load). A tensor's rows start every
    # p_i bytes, its row n_i long (split tensors: p_i = n_i; a packed row's range: p_i its pitch, both sides).
    @triton.jit(do_not_specialize=["c1", "c2", "c3", "c4", "c5"])
    def _copy_rows_one_launch(  # pragma: no cover
        experts, slots, num_experts,
        s0, d0, n0, p0, s1, d1, n1, p1, s2, d2, n2, p2, s3, d3, n3, p3, s4, d4, n4, p4, s5, d5, n5, p5,
        c1, c2, c3, c4, c5,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        entry = tl.program_id(0)
        chunk = tl.program_id(1)
        expert = tl.load(experts + entry)
        if expert < num_experts:  # padding entries name expert E: nothing to copy
            slot = tl.load(slots + entry)
            src = s0
            dst = d0
            n = n0
            pitch = p0
            first = c1 * 0
            if chunk >= c1:
                src = s1
                dst = d1
                n = n1
                pitch = p1
                first = c1
            if chunk >= c2:
                src = s2
                dst = d2
                n = n2
                pitch = p2
                first = c2
            if chunk >= c3:
                src = s3
                dst = d3
                n = n3
                pitch = p3
                first = c3
            if chunk >= c4:
                src = s4
                dst = d4
                n = n4
                pitch = p4
                first = c4
            if chunk >= c5:
                src = s5
                dst = d5
                n = n5
                pitch = p5
                first = c5
            offs = (chunk - first) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            v = tl.load(src + expert.to(tl.int64) * pitch + offs, mask=mask)
            tl.store(dst + slot.to(tl.int64) * pitch + offs, v, mask=mask)


MAX_ONE_LAUNCH = 6  # tensors one `launch_copy_rows` takes


def launch_copy_rows(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], experts: torch.Tensor, slot_ids: torch.Tensor,
    num_experts: int,
) -> None:  # fmt: skip
    """Rows srcs[t][experts[i]] -> dsts[t][slot_ids[i]] of every tensor t (at most 6; each row contiguous, rows
    `stride(0)` apart, the same on both sides; entries naming expert >= num_experts skipped) in one launch of
    the Triton kernel: one program per (entry, 16 KiB chunk of the row's tensors laid end to end)."""
    if not 1 <= len(srcs) == len(dsts) <= MAX_ONE_LAUNCH:
        raise ValueError(f"one launch copies 1 to {MAX_ONE_LAUNCH} tensors, got {len(srcs)} and {len(dsts)}")
    rows_s = [_bytes(t) for t in srcs]  # bytes: one kernel for every dtype
    rows_d = [_bytes(t) for t in dsts]
    row_bytes = [t[0].numel() for t in rows_s]
    pitches = [t.stride(0) for t in rows_s]
    if pitches != [t.stride(0) for t in rows_d]:
        raise ValueError(
            f"one launch copies rows of one pitch on both sides, got {pitches} and {[t.stride(0) for t in rows_d]}"
        )
    firsts, total = [], 0  # first chunk of each tensor
    for n in row_bytes:
        firsts.append(total)
        total += triton.cdiv(n, BLOCK_BYTES)
    while len(rows_s) < MAX_ONE_LAUNCH:  # unused slots: tensor 0 again, starting past every chunk
        rows_s.append(rows_s[0])
        rows_d.append(rows_d[0])
        row_bytes.append(row_bytes[0])
        pitches.append(pitches[0])
        firsts.append(total)
    args = [a for quad in zip(rows_s, rows_d, row_bytes, pitches) for a in quad]
    grid = (experts.shape[0], total)
    _copy_rows_one_launch[grid](experts, slot_ids, num_experts, *args, *firsts[1:], BLOCK=BLOCK_BYTES, num_warps=4)


def launch_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    experts: torch.Tensor,
    slot_ids: torch.Tensor,
    num_experts: int,
    programs: int | None = None,
) -> None:
    """One tensor's planned rows src[experts[i]] -> dst[slot_ids[i]] (entries naming expert >= num_experts
    skipped) by the Triton kernel: one program per (entry, 16 KiB chunk), or at most `programs`
    programs looping over them (RuntimeConfig.copy_programs)."""
    _check_rows(src)
    _check_rows(dst)
    row_elems, block = src[0].numel(), BLOCK_BYTES // src.element_size()
    pitches = (src.stride(0), dst.stride(0))
    chunks = triton.cdiv(row_elems, block)
    work = experts.shape[0] * chunks
    if programs is None:
        grid = (experts.shape[0], chunks)
        _copy_planned_rows[grid](
            src, dst, experts, slot_ids, row_elems, *pitches, num_experts, BLOCK=block, num_warps=4
        )
        return
    grid_capped = (max(1, min(programs, work)),)
    _copy_planned_rows_capped[grid_capped](
        src, dst, experts, slot_ids, row_elems, *pitches, num_experts, chunks, work, BLOCK=block, num_warps=4
    )


def _check_rows(t: torch.Tensor) -> None:
    """Each row of t contiguous (its rows may sit `stride(0)` apart: a packed row's range)."""
    if not t[0].is_contiguous():
        raise ValueError(f"the copy kernel copies contiguous rows, got strides {t.stride()}")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's rows as bytes [N, row bytes] (rows `stride(0)` elements apart stay so)."""
    _check_rows(t)
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def graph_safe(device: torch.device) -> bool:
    """True when `copy_planned` runs without a host read (CUDA with Triton)."""
    return device.type == "cuda" and triton is not None


def copy_planned(
    host: ExpertTensors,
    slots: ExpertTensors,
    experts: torch.Tensor,
    slot_ids: torch.Tensor,
    names: Sequence[str] | None = None,
    programs: int | None = None,
    one_launch: bool = True,
) -> None:
    """host rows `experts[i]` -> slot rows `slot_ids[i]` for every entry whose expert is < E.

    experts, slot_ids: [P] int64 on the slots' device, padded with E (expert) / K (slot). Every tensor of
    an expert's row is copied (FP8 weights as bytes, and their block scales), or those of `names`
    among them (an overlapped pass copies gate/up first, down last). `programs`: the copy kernel's
    grid cap (None: one program per 16 KiB chunk, every SM). `one_launch`: with the full grid, every
    tensor in one launch (`launch_copy_rows`); False: a launch per tensor (the A/B of the two)."""
    num_experts = host.num_rows
    # copy_views reads host.names() at call time: the fault-injection tests narrow it. Packed rows: the byte
    # ranges of the row that hold `names` (every tensor: one range, the whole row)
    srcs, dsts = host.copy_views(names), slots.copy_views(names)
    if host.row_pitch != slots.row_pitch:
        raise ValueError(f"host rows and slots differ in layout (row pitches {host.row_pitch}, {slots.row_pitch})")
    if not srcs:
        return
    if graph_safe(slots.gate.device):
        if one_launch and programs is None and len(srcs) <= MAX_ONE_LAUNCH:
            launch_copy_rows(srcs, dsts, experts, slot_ids, num_experts)
            return
        for src, dst in zip(srcs, dsts):  # FP8 rows copy as bytes
            launch_copy(src, dst, experts, slot_ids, num_experts, programs)
        return
    valid = (experts < num_experts).nonzero().reshape(-1)  # [m]: the host read (not graph-safe)
    src_idx = experts[valid].to(host.gate.device)
    dst_idx = slot_ids[valid]
    for src, dst in zip(srcs, dsts):
        dst.index_copy_(0, dst_idx, src.index_select(0, src_idx).to(slots.gate.device))
