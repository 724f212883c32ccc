"""Page-in planned on the device: copy the planned host rows into their slots without a host read.

On CUDA a Triton kernel reads the pinned host store directly (pinned memory is mapped into the
GPU's address space; Triton accepts such pointers) and writes the slots. The plan's length is
static (padded with the dummy expert E), so the grid is (planned entries x row chunks) and the
programs of padding entries return at once: exactly the planned experts cross the link, and the
launch is capturable in a CUDA graph. On the CPU (tests) and where Triton is missing, the same
copy runs as an index_copy after one host read of the plan (`graph_safe()` says which).

The kernel's rate against the DMA engines' `copy_` is measured, not assumed:
`benchmarks/decode_h200.py --pagein-kernel-bench` (results under benchmarks/results/h200/).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_experts import fp8
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
        src, dst, experts, slots, entry, chunk, row_elems, num_experts, BLOCK: tl.constexpr
    ):  # pragma: no cover
        # one 16 KiB chunk of planned entry `entry`; padding entries name expert E: nothing to copy
        expert = tl.load(experts + entry)
        if expert < num_experts:
            slot = tl.load(slots + entry)
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < row_elems
            v = tl.load(src + expert.to(tl.int64) * row_elems + offs, mask=mask)
            tl.store(dst + slot.to(tl.int64) * row_elems + offs, v, mask=mask)

    @triton.jit
    def _copy_planned_rows(src, dst, experts, slots, row_elems, num_experts, BLOCK: tl.constexpr):  # pragma: no cover
        _copy_chunk(src, dst, experts, slots, tl.program_id(0), tl.program_id(1), row_elems, num_experts, BLOCK)

    @triton.jit
    def _copy_planned_rows_capped(  # pragma: no cover
        src, dst, experts, slots, row_elems, num_experts, chunks, work, BLOCK: tl.constexpr
    ):
        # The same copy from a grid of few programs, each taking every n-th (entry, chunk): the copy then
        # holds a few SMs, not all, so kernels on another stream can run beside it (an overlapped pass).
        for item in range(tl.program_id(0), work, tl.num_programs(0)):
            _copy_chunk(src, dst, experts, slots, item // chunks, item % chunks, row_elems, num_experts, BLOCK)


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
    row_elems, block = src[0].numel(), BLOCK_BYTES // src.element_size()
    chunks = triton.cdiv(row_elems, block)
    work = experts.shape[0] * chunks
    if programs is None:
        grid = (experts.shape[0], chunks)
        _copy_planned_rows[grid](src, dst, experts, slot_ids, row_elems, num_experts, BLOCK=block, num_warps=4)
        return
    grid_capped = (max(1, min(programs, work)),)
    _copy_planned_rows_capped[grid_capped](
        src, dst, experts, slot_ids, row_elems, num_experts, chunks, work, BLOCK=block, num_warps=4
    )


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
) -> None:
    """host rows `experts[i]` -> slot rows `slot_ids[i]` for every entry whose expert is < E.

    experts, slot_ids: [P] int64 on the slots' device, padded with E (expert) / K (slot). Every tensor of
    an expert's row is copied (FP8 weights as bytes, and their block scales), or those of `names`
    among them (an overlapped pass copies gate/up first, down last). `programs`: the copy kernel's
    grid cap (None: one program per 16 KiB chunk, every SM)."""
    num_experts = host.num_rows
    # host.names() read at call time: the fault-injection tests narrow it
    wanted = [n for n in host.names() if names is None or n in names]
    if graph_safe(slots.gate.device):
        for name in wanted:
            src, dst = fp8.raw(host.get(name)), fp8.raw(slots.get(name))  # FP8 rows copy as bytes
            launch_copy(src, dst, experts, slot_ids, num_experts, programs)
        return
    valid = (experts < num_experts).nonzero().reshape(-1)  # [m]: the host read (not graph-safe)
    src_idx = experts[valid].to(host.gate.device)
    dst_idx = slot_ids[valid]
    for name in wanted:
        rows = fp8.raw(host.get(name)).index_select(0, src_idx).to(slots.gate.device)
        fp8.raw(slots.get(name)).index_copy_(0, dst_idx, rows)
