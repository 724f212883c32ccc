"""residency/switch_lanes.py off the GPU: the driver structs' layout (cuda.h of CUDA 12.8/13.0), the setter's PTX,
and the memcpy descriptors of a lane's bodies, executed here by memmove over CPU tables (split and packed rows), so
every address a GPU graph would copy is checked. The graph itself runs in tests/cuda/test_switch_lanes_cuda.py."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from paged_experts.residency import switch_lanes as sl
from paged_experts.residency.store import ExpertTensors


def test_the_driver_structs_have_cuda_h_layout() -> None:
    assert ctypes.sizeof(sl.GraphNodeParams) == 256  # type, reserved0[3], a 232-byte union, reserved2
    assert sl.GraphNodeParams.u.offset == 16 and sl.GraphNodeParams.reserved2.offset == 248
    cond = sl._CondParams
    assert (cond.handle.offset, cond.type.offset, cond.size.offset, cond.phGraph_out.offset, cond.ctx.offset) == (
        0, 8, 12, 16, 24,
    )  # fmt: skip
    m = sl.Memcpy3D
    assert ctypes.sizeof(m) == 200
    assert (m.srcMemoryType.offset, m.srcDevice.offset, m.srcPitch.offset) == (32, 48, 72)
    assert (m.dstMemoryType.offset, m.dstDevice.offset, m.dstPitch.offset) == (120, 136, 160)
    assert (m.WidthInBytes.offset, m.Height.offset, m.Depth.offset) == (176, 184, 192)


def test_a_1d_memcpy_descriptor_names_both_addresses_as_uva_and_one_row() -> None:
    p = sl.memcpy_1d(dst=0x7000, src=0x9000, nbytes=4096)
    assert (p.srcMemoryType, p.dstMemoryType) == (sl.CU_MEMORYTYPE_UNIFIED, sl.CU_MEMORYTYPE_UNIFIED)
    assert (p.srcDevice, p.dstDevice, p.WidthInBytes, p.Height, p.Depth) == (0x9000, 0x7000, 4096, 1, 1)
    assert not p.srcHost and not p.dstHost and not p.srcArray and not p.dstArray


@pytest.mark.parametrize("lanes", [1, 3, 64])
def test_the_setter_ptx_sets_each_lane_from_its_own_expert_id(lanes: int) -> None:
    ptx = sl.lane_kernel_ptx(lanes)
    assert ptx.count(".param .u64 p_h") == lanes and ".param .u64 p_experts" in ptx and ".param .u32 p_none" in ptx
    assert ptx.count("call cudaGraphSetConditional") == lanes
    assert re.findall(r"\[p_h(\d+)\]", ptx) == [str(j) for j in range(lanes)]  # lane j's handle, in order
    assert re.findall(r"ld\.global\.u64 %rd4, \[%rd1\+(\d+)\]", ptx) == [str(8 * j) for j in range(lanes)]
    # an id at or past `none` (or negative: unsigned) selects `none`
    assert ptx.count("setp.lt.u64 %p1, %rd4, %rd2;") == lanes and ptx.count("selp.b32 %r3, %r2, %r1, %p1;") == lanes
    assert ptx.count("{") == ptx.count("}")


@pytest.mark.parametrize("lanes", [0, sl.MAX_LANES + 1])
def test_the_setter_refuses_a_lane_count_outside_its_parameters(lanes: int) -> None:
    with pytest.raises(ValueError, match="lanes must be"):
        sl.lane_kernel_ptx(lanes)


@pytest.mark.parametrize("packed", [False, True])
def test_a_lanes_copies_move_exactly_the_experts_row_into_the_lanes_row(packed: bool) -> None:
    cpu = torch.device("cpu")
    host = ExpertTensors.empty(6, 256, 128, torch.bfloat16, cpu, is_fp8=True, packed=packed)
    dst = ExpertTensors.empty(4, 256, 128, torch.bfloat16, cpu, is_fp8=True, packed=packed)
    gen = torch.Generator().manual_seed(0)
    for name in host.names():
        raw = host.get(name).view(torch.uint8)
        raw.copy_(torch.randint(0, 120, raw.shape, dtype=torch.uint8, generator=gen))
    for name in dst.names():
        dst.get(name).view(torch.uint8).zero_()
    copies = sl.row_copies(host, dst, expert=4, row=2)
    assert len(copies) == (1 if packed else 6)
    assert sum(n for _, _, n in copies) == (dst.row_pitch if packed else host.row_bytes)
    for d, s, n in copies:
        ctypes.memmove(d, s, n)
    for name in host.names():
        got, want = dst.get(name).view(torch.uint8), host.get(name).view(torch.uint8)
        assert torch.equal(got[2], want[4]), name
        assert not got[[0, 1, 3]].any(), name  # no other row written


def test_a_lanes_copies_refuse_rows_outside_either_table_and_layouts_that_differ() -> None:
    cpu = torch.device("cpu")
    host = ExpertTensors.empty(6, 256, 128, torch.bfloat16, cpu, is_fp8=True)
    dst = ExpertTensors.empty(4, 256, 128, torch.bfloat16, cpu, is_fp8=True)
    with pytest.raises(IndexError):
        sl.row_copies(host, dst, expert=6, row=0)
    with pytest.raises(IndexError):
        sl.row_copies(host, dst, expert=0, row=4)
    with pytest.raises(IndexError):
        sl.row_copies(host, dst, expert=-1, row=0)
    packed = ExpertTensors.empty(4, 256, 128, torch.bfloat16, cpu, is_fp8=True, packed=True)
    with pytest.raises(ValueError, match="differ in layout"):
        sl.row_copies(host, packed, expert=0, row=0)
