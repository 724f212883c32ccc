"""residency/switch_lanes.py off the GPU: the driver structs' layout (cuda.h of CUDA 12.8/13.0), the setter's PTX,
and the memcpy descriptors of a lane's bodies, executed here by memmove over CPU tables (split and packed rows), so
every address a GPU graph would copy is checked. The graph itself runs in tests/cuda/test_switch_lanes_cuda.py."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_experts.residency import switch_lanes as sl
from paged_experts.residency.store import ExpertTensors

PIN = torch.cuda.is_available()  # the lanes refuse unpinned host rows where CUDA is present


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
    host = ExpertTensors.empty(6, 256, 128, torch.bfloat16, cpu, pin=PIN, is_fp8=True, packed=packed)
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


def _ptxas() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.is_file() and os.access(path, os.X_OK) else None


@pytest.mark.skipif(_ptxas() is None, reason="needs Triton's bundled ptxas")
@pytest.mark.parametrize("lanes", [1, 4, 64])
def test_the_setter_ptx_assembles_for_hopper_with_the_condition_left_to_the_driver(lanes: int, tmp_path: Path) -> None:
    """Triton's ptxas assembles the PTX for sm_90 as relocatable code (`-c`, as the driver's JIT links it: the
    condition setter stays an undefined symbol that the driver resolves at load)."""
    src, out = tmp_path / "set_lanes.ptx", tmp_path / "set_lanes.cubin"
    src.write_text(sl.lane_kernel_ptx(lanes))
    done = subprocess.run([str(_ptxas()), "-arch=sm_90", "-c", str(src), "-o", str(out)], capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 0
    # the clamped value, not the raw id, is what each call passes
    assert sl.lane_kernel_ptx(lanes).count("st.param.b32 [a1+0], %r3;") == lanes


class FakeDriver:
    """DriverGraphs' surface, recording what `SwitchLanes.add_nodes` asks of the driver (no GPU)."""

    KERNEL_NODE = 0x5000

    def __init__(self) -> None:
        self.handles: list[int] = []
        self.launches: list[tuple[int, int, list[int]]] = []  # (function, stream, the argument values)
        self.switches: list[tuple[int, int, int, int, list[int]]] = []  # (node, handle, size, ctx, deps)
        self.bodies: dict[int, list[tuple[int, int, int]]] = {}  # body graph -> [(dst, src, bytes)]
        self.after: list[int] = []
        self._arrays: list[Any] = []

    def context(self) -> int:
        return 0xC0

    def setter(self, lanes: int) -> int:
        return 0xF00 + lanes

    def capture(self, stream: int) -> tuple[int, list[int]]:
        return 0x6A, ([self.KERNEL_NODE] if self.launches else [])

    def call(self, name: str, *args: Any) -> None:
        if name == "cuGraphConditionalHandleCreate":
            out, graph, ctx, default, flags = args
            assert (graph, ctx, flags) == (0x6A, 0xC0, sl.CU_GRAPH_COND_ASSIGN_DEFAULT)
            out._obj.value = 0x100 + len(self.handles)
            self.handles.append(out._obj.value)
            self.default = default
        elif name == "cuLaunchKernel":
            fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra = args
            assert (gx, gy, gz, bx, by, bz, shared, extra) == (1, 1, 1, 1, 1, 1, 0, None)
            values = [ctypes.c_uint64.from_address(params[i]).value for i in range(len(self.handles) + 1)]
            values.append(ctypes.c_uint.from_address(params[len(self.handles) + 1]).value)
            self.launches.append((fn, stream, values))
        elif name == "cuGraphAddNode":
            out, graph, deps, count, params = args
            p = params._obj
            assert p.type == sl.CU_GRAPH_NODE_TYPE_CONDITIONAL and p.u.conditional.type == sl.CU_GRAPH_COND_TYPE_SWITCH
            size = p.u.conditional.size
            graphs = (ctypes.c_void_p * size)(*[0x10000 * (len(self.switches) + 1) + e for e in range(size)])
            self._arrays.append(graphs)
            p.u.conditional.phGraph_out = ctypes.cast(graphs, ctypes.POINTER(ctypes.c_void_p))
            out._obj.value = 0x7000 + len(self.switches)
            self.switches.append((out._obj.value, p.u.conditional.handle, size, p.u.conditional.ctx,
                                  [deps[i] for i in range(count)]))  # fmt: skip
        elif name == "cuGraphAddMemcpyNode":
            out, body, deps, count, desc, ctx = args
            d = desc._obj
            assert (deps, count, ctx) == (None, 0, 0xC0) and d.Height == d.Depth == 1
            self.bodies.setdefault(body, []).append((d.dstDevice, d.srcDevice, d.WidthInBytes))
            out._obj.value = 0x9000
        elif name == "cuStreamUpdateCaptureDependencies":
            stream, nodes, count, flags = args
            assert flags == sl.CU_STREAM_SET_CAPTURE_DEPENDENCIES
            self.after = [nodes[i] for i in range(count)]
        else:
            raise AssertionError(name)


@pytest.mark.parametrize("packed", [False, True])
def test_adding_the_lanes_wires_handles_setter_switches_and_bodies_in_order(packed: bool) -> None:
    cpu = torch.device("cpu")
    host = ExpertTensors.empty(5, 256, 128, torch.bfloat16, cpu, pin=PIN, is_fp8=True, packed=packed)
    dst = ExpertTensors.empty(4, 256, 128, torch.bfloat16, cpu, is_fp8=True, packed=packed)
    fake = FakeDriver()
    lanes = sl.SwitchLanes(host, dst, rows=[3, 0, 2], driver=fake)  # type: ignore[arg-type]
    lanes.add_nodes(stream=0x57, experts_ptr=0xE0E0)
    assert fake.handles == [0x100, 0x101, 0x102] and fake.default == 5  # the default selects no body
    # the setter for 3 lanes, on the capturing stream, its parameters in the PTX's order: handles, ids, none
    assert fake.launches == [(0xF03, 0x57, [0x100, 0x101, 0x102, 0xE0E0, 5])]
    assert [(h, size, ctx, deps) for _, h, size, ctx, deps in fake.switches] == [
        (h, 5, 0xC0, [FakeDriver.KERNEL_NODE]) for h in fake.handles
    ]  # every lane after the setter, one body an expert
    for lane, row in enumerate([3, 0, 2]):
        for e in range(5):
            body = 0x10000 * (lane + 1) + e
            assert fake.bodies[body] == [tuple(c) for c in sl.row_copies(host, dst, e, row)]
    assert lanes.nodes_added == 3 * 5 * (1 if packed else 6)
    assert fake.after == [node for node, *_ in fake.switches]  # the stream's next work waits for every lane


def test_lanes_refuse_two_lanes_on_one_row() -> None:
    cpu = torch.device("cpu")
    host = ExpertTensors.empty(5, 256, 128, torch.bfloat16, cpu, pin=PIN, is_fp8=True)
    dst = ExpertTensors.empty(4, 256, 128, torch.bfloat16, cpu, is_fp8=True)
    with pytest.raises(ValueError, match="would race"):
        sl.SwitchLanes(host, dst, rows=[1, 1], driver=FakeDriver())  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        sl.SwitchLanes(host, dst, rows=[4], driver=FakeDriver())  # type: ignore[arg-type]


def test_a_switch_layer_prepares_every_lane_set_before_any_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """moe/overlap.py prepare_switch, run at a paged layer's construction with overlap_copies='switch': the staging
    rows (the slots' layout, one table shared by every layer) and the lanes of 1..4 lanes for each tensor set an
    overlapped pass copies (all, gate/up, down), each lane j into staging row j: nothing left to load or allocate
    under a capture."""
    from paged_experts.moe import overlap

    fake = FakeDriver()
    monkeypatch.setattr(sl, "driver_graphs", lambda: fake)
    monkeypatch.setattr(overlap, "_STAGING", {})
    cpu = torch.device("cpu")
    for packed in (False, True):
        host = ExpertTensors.empty(5, 256, 128, torch.bfloat16, cpu, pin=PIN, is_fp8=True, packed=packed)
        slots = ExpertTensors.empty(8, 256, 128, torch.bfloat16, cpu, is_fp8=True, packed=packed)
        cache: dict[tuple[object, ...], object] = {}
        overlap.prepare_switch(cache, host, slots)
        staging = overlap.staging_rows(slots, overlap.SWITCH_LANES)
        assert staging.num_rows == overlap.SWITCH_LANES and staging.row_pitch == slots.row_pitch
        names_sets = (None, overlap.GATE_UP_TENSORS, overlap.DOWN_TENSORS)
        assert len(cache) == len(names_sets) * overlap.SWITCH_LANES
        for names in names_sets:
            for n in range(1, overlap.SWITCH_LANES + 1):
                lanes = overlap.switch_lanes_for(cache, host, staging, names, n, capturing=True)  # prepared: found
                assert cache[(host.gate.data_ptr(), staging.gate.data_ptr(), names, n)] is lanes
                assert list(lanes.rows) == list(range(n)) and lanes.names == names and lanes.dst is staging
        # the down lanes copy the down rows only (bytes of down and its scale), gate/up the rest
        down = overlap.switch_lanes_for(cache, host, staging, overlap.DOWN_TENSORS, 1)._copies[0][0]
        gate_up = overlap.switch_lanes_for(cache, host, staging, overlap.GATE_UP_TENSORS, 1)._copies[0][0]
        whole = overlap.switch_lanes_for(cache, host, staging, None, 1)._copies[0][0]
        assert sum(n for *_, n in down) + sum(n for *_, n in gate_up) == sum(n for *_, n in whole)
    assert overlap.staging_rows(slots, overlap.SWITCH_LANES) is staging  # one table per layout


def test_lanes_missing_under_a_capture_are_refused_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from paged_experts.moe import overlap

    monkeypatch.setattr(sl, "driver_graphs", lambda: FakeDriver())
    cpu = torch.device("cpu")
    host = ExpertTensors.empty(5, 256, 128, torch.bfloat16, cpu, pin=PIN, is_fp8=True)
    staging = ExpertTensors.empty(4, 256, 128, torch.bfloat16, cpu, is_fp8=True)
    cache: dict[tuple[object, ...], object] = {}
    with pytest.raises(RuntimeError, match="not prepared before the capture"):
        overlap.switch_lanes_for(cache, host, staging, overlap.DOWN_TENSORS, 2, capturing=True)
    assert not cache
    built = overlap.switch_lanes_for(cache, host, staging, overlap.DOWN_TENSORS, 2)  # outside a capture: built
    assert overlap.switch_lanes_for(cache, host, staging, overlap.DOWN_TENSORS, 2, capturing=True) is built


def test_lane_sources_name_each_lanes_staging_row_and_skip_padding() -> None:
    from paged_experts.moe import overlap

    ids = torch.tensor([3, 7, 128, 128])  # two misses, then the plan's padding (E = 128)
    assert overlap.lane_sources(ids, 128, 4).tolist() == [0, 1, 4, 4]  # 4 = the staging row count: skipped
    assert overlap.lane_sources(torch.tensor([0]), 128, 4).tolist() == [0]


@pytest.mark.parametrize("packed", [False, True])
def test_a_captured_switch_call_lands_what_the_kernels_copy_would(
    packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SwitchCopies.issue under a capture, simulated on the CPU: the lanes (here: memmoves of their bodies'
    descriptors, as the copy engines would run them) fill staging rows 0..n-1, the kernel's copy moves them into
    their slots, the misses past the lanes come from the host. The slots end as the plain copy leaves them, for
    0 to 7 misses with the plan's padding, each tensor set an overlapped pass copies."""
    from paged_experts.kernels.copy_kernel import copy_planned
    from paged_experts.moe import overlap

    fake = FakeDriver()
    monkeypatch.setattr(sl, "driver_graphs", lambda: fake)
    monkeypatch.setattr(overlap, "_STAGING", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def land(self: sl.SwitchLanes, experts: torch.Tensor) -> None:
        for j, e in enumerate(experts.tolist()):
            if 0 <= e < self.host.num_rows:
                for d, s, n in self._copies[j][e]:
                    ctypes.memmove(d, s, n)

    monkeypatch.setattr(sl.SwitchLanes, "capture", land)
    cpu, e, k = torch.device("cpu"), 12, 10
    host = ExpertTensors.empty(e, 256, 128, torch.bfloat16, cpu, pin=PIN, is_fp8=True, packed=packed)
    gen = torch.Generator().manual_seed(3)
    for name in host.names():
        raw = host.get(name).view(torch.uint8)
        raw.copy_(torch.randint(1, 120, raw.shape, dtype=torch.uint8, generator=gen))
    for misses in (0, 1, 3, 4, 5, 7):
        for names in (None, overlap.GATE_UP_TENSORS, overlap.DOWN_TENSORS):
            slots = ExpertTensors.empty(k + 1, 256, 128, torch.bfloat16, cpu, is_fp8=True, packed=packed)
            want = ExpertTensors.empty(k + 1, 256, 128, torch.bfloat16, cpu, is_fp8=True, packed=packed)
            for t in (slots, want):
                for name in t.names():
                    t.get(name).view(torch.uint8).zero_()
            cache: dict[tuple[object, ...], object] = {}
            overlap.prepare_switch(cache, host, slots)
            for name in slots.names():  # prepare's warm-up copies must have left the slots alone
                assert not slots.get(name).view(torch.uint8).any(), name
            experts = torch.tensor(sorted(random_sample(e, misses)) + [e] * (8 - misses))  # [8]: ascending, padded
            slot_ids = torch.tensor(random_sample(k, misses) + [k] * (8 - misses))  # distinct victims, then K
            copies = overlap.SwitchCopies.__new__(overlap.SwitchCopies)  # no streams on the CPU: issue() alone
            copies.cache, copies.lanes, copies.programs = cache, overlap.SWITCH_LANES, None
            copies.issue(host, slots, experts, slot_ids, names)
            copy_planned(host, want, experts, slot_ids, names)
            for name in slots.names():
                got, ref = slots.get(name).view(torch.uint8), want.get(name).view(torch.uint8)
                assert torch.equal(got, ref), (misses, names, name)


def random_sample(n: int, k: int) -> list[int]:
    import random

    return random.Random(n * 31 + k).sample(range(n), k)


def test_without_a_cuda_driver_a_switch_layer_fails_at_construction_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The driver library made absent (on any machine, a GPU box too): the layer's preparation says why."""
    from paged_experts.moe import overlap

    def no_driver(name: str, *args: object, **kwargs: object) -> ctypes.CDLL:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(sl.ctypes, "CDLL", no_driver)
    monkeypatch.setattr(sl, "driver_graphs", sl.DriverGraphs)  # not the process's cached driver
    cpu = torch.device("cpu")
    host = ExpertTensors.empty(5, 256, 128, torch.bfloat16, cpu, pin=PIN, is_fp8=True)
    slots = ExpertTensors.empty(8, 256, 128, torch.bfloat16, cpu, is_fp8=True)
    monkeypatch.setattr(overlap, "_STAGING", {})
    with pytest.raises(sl.SwitchUnavailable, match="no CUDA driver library"):
        overlap.prepare_switch({}, host, slots)


@pytest.mark.parametrize("packed", [False, True])
def test_a_lanes_bodies_are_each_experts_row_copies(packed: bool) -> None:
    """lane_bodies (the fast form prepare uses) gives exactly row_copies of every expert, for each tensor set."""
    from paged_experts.moe import overlap

    cpu = torch.device("cpu")
    host = ExpertTensors.empty(9, 256, 128, torch.bfloat16, cpu, is_fp8=True, packed=packed)
    dst = ExpertTensors.empty(4, 256, 128, torch.bfloat16, cpu, is_fp8=True, packed=packed)
    for names in (None, overlap.GATE_UP_TENSORS, overlap.DOWN_TENSORS):
        for row in (0, 3):
            want = [sl.row_copies(host, dst, e, row, names) for e in range(9)]
            assert sl.lane_bodies(host, dst, row, names) == want, (names, row)
    with pytest.raises(IndexError):
        sl.lane_bodies(host, dst, 4)
