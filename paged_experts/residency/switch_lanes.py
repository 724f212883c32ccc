"""Page-ins on the copy engines from inside a captured graph: one SWITCH conditional node per staging lane.

Why: a device-planned decode step knows its misses only on the device, so today it copies them with a kernel
reading pinned host memory through the SMs (~33 GB/s, the copy kernel), against the copy engines' ~50 GB/s; the
DMA proxy reached the copy engines but paid ~20-35 us of host round trip a ring (docs/decode-copies.md). A CUDA
graph's SWITCH node runs body `n` when its condition equals `n` (none when the value is >= its body count), a kernel
in the same graph sets the condition on the device (`cudaGraphSetConditional`), and a body may hold memcpy nodes,
which run on a copy engine. So: lane `j` is a SWITCH node with one body per expert, body `e` the memcpy nodes of
host row `e` into lane `j`'s destination row, and a one-thread kernel sets lane `j`'s condition to the expert it
carries (the expert count, selecting nothing, for an empty lane). No host in the loop, no SM reads host memory.

This module is the mechanism: `benchmarks/copy_overlap.py`'s `switch` arm measures what a lane costs and what rate
it reaches, and `moe/overlap.py`'s `SwitchCopies` (RuntimeConfig.overlap_copies='switch', off by default) runs a
paged decode step's misses through it (docs/decode-copies.md).

- `lane_kernel_ptx(lanes)`: the setter's PTX, one `.u64` parameter per lane's handle (straight-line code, no
  indexing into parameters), then the [lanes] int64 expert ids it reads. The driver's JIT links
  `cudaGraphSetConditional`, so no NVRTC and no device runtime library are needed.
- `row_copies(src, dst, expert, row)`: the (dst, src, bytes) of one expert's row, every copy view of the tables
  (split: six tensors, FP8 as bytes; packed: one range), checked against both tables before an address is made.
- `DriverGraphs`: the driver calls, by `cuGetProcAddress` at the ABI version each signature below was written for
  (a newer driver still returns that version's entry point, as `batch_copy.DriverBatchCopy` relies on).
- `SwitchLanes.capture(experts)`: called while torch captures a graph on the current stream: creates the lanes'
  handles, launches the setter (captured as a kernel node), adds the SWITCH nodes after it with their bodies' memcpy
  nodes, and makes the stream's later work depend on every lane.

The ABI structs follow cuda.h of CUDA 12.8/13.0: `CUgraphNodeParams` (256 bytes: type, 3 reserved ints, a
232-byte union, a trailing reserved long long), `CUDA_CONDITIONAL_NODE_PARAMS` (handle, type, size, phGraph_out,
ctx) and `CUDA_MEMCPY3D`; the CPU tests pin their sizes and offsets.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from paged_experts.residency.store import ExpertTensors

CU_GRAPH_NODE_TYPE_CONDITIONAL = 13
CU_GRAPH_COND_TYPE_SWITCH = 2  # CUDA 12.8
CU_GRAPH_COND_ASSIGN_DEFAULT = 1  # the handle takes its default value at every launch of the graph
CU_STREAM_CAPTURE_STATUS_ACTIVE = 1
CU_STREAM_SET_CAPTURE_DEPENDENCIES = 1
CU_MEMORYTYPE_UNIFIED = 4  # the address is a UVA address; the driver finds host (pinned) or device
SWITCH_DRIVER_VERSION = 12080  # SWITCH nodes came with 12.8 (IF and WHILE, with memcpy bodies, with 12.3/12.4)
CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 5, 6  # CUjit_option: the JIT's error text
MAX_LANES = 64  # the setter's parameters: 8 bytes a lane, well under the 4 KiB a kernel's parameters may take


class SwitchUnavailable(RuntimeError):
    """This driver or device cannot run SWITCH lanes; the message says why."""


class _CondParams(ctypes.Structure):
    _fields_ = [  # CUDA_CONDITIONAL_NODE_PARAMS
        ("handle", ctypes.c_uint64),
        ("type", ctypes.c_uint),
        ("size", ctypes.c_uint),
        ("phGraph_out", ctypes.POINTER(ctypes.c_void_p)),  # the driver's array of `size` body graphs
        ("ctx", ctypes.c_void_p),
    ]


class _NodeUnion(ctypes.Union):
    _fields_ = [("reserved1", ctypes.c_longlong * 29), ("conditional", _CondParams)]


class GraphNodeParams(ctypes.Structure):
    _fields_ = [  # CUgraphNodeParams
        ("type", ctypes.c_uint),
        ("reserved0", ctypes.c_int * 3),
        ("u", _NodeUnion),
        ("reserved2", ctypes.c_longlong),
    ]


class Memcpy3D(ctypes.Structure):
    _fields_ = [  # CUDA_MEMCPY3D
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcZ", ctypes.c_size_t),
        ("srcLOD", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_uint),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("reserved0", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("srcHeight", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstZ", ctypes.c_size_t),
        ("dstLOD", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_uint),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("reserved1", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("dstHeight", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
        ("Depth", ctypes.c_size_t),
    ]


def memcpy_1d(dst: int, src: int, nbytes: int) -> Memcpy3D:
    """A 1D copy of `nbytes` between two UVA addresses (pinned host or device), as a memcpy node takes it."""
    p = Memcpy3D()
    p.srcMemoryType = p.dstMemoryType = CU_MEMORYTYPE_UNIFIED
    p.srcDevice, p.dstDevice = src, dst
    p.srcPitch = p.dstPitch = p.WidthInBytes = nbytes
    p.srcHeight = p.dstHeight = p.Height = p.Depth = 1
    return p


def lane_kernel_ptx(lanes: int) -> str:
    """PTX of `set_lanes(p_h0 .. p_h{lanes-1}, p_experts, p_none)`, launched as one thread: lane j's handle gets
    experts[j] when 0 <= experts[j] < none, else `none` (the SWITCH then runs no body). experts: [lanes] int64 on
    the device."""
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"lanes must be 1..{MAX_LANES}, got {lanes}")
    params = [f"    .param .u64 p_h{j}" for j in range(lanes)] + ["    .param .u64 p_experts", "    .param .u32 p_none"]
    body = [
        "    ld.param.u64 %rd1, [p_experts];",
        "    cvta.to.global.u64 %rd1, %rd1;",
        "    ld.param.u32 %r1, [p_none];",
        "    cvt.u64.u32 %rd2, %r1;",
    ]
    for j in range(lanes):
        body += [
            f"    ld.param.u64 %rd3, [p_h{j}];",
            f"    ld.global.u64 %rd4, [%rd1+{8 * j}];",
            # unsigned compare: a negative id reads as a huge one and selects `none`
            "    setp.lt.u64 %p1, %rd4, %rd2;",
            "    cvt.u32.u64 %r2, %rd4;",
            "    selp.b32 %r3, %r2, %r1, %p1;",
            "    {",
            "    .param .b64 a0;",
            "    st.param.b64 [a0+0], %rd3;",
            "    .param .b32 a1;",
            "    st.param.b32 [a1+0], %r3;",
            "    call cudaGraphSetConditional, (a0, a1);",
            "    }",
        ]
    return "\n".join(
        [
            ".version 7.0",
            ".target sm_60",
            ".address_size 64",
            "",
            ".extern .func cudaGraphSetConditional",
            "(",
            "    .param .b64 handle,",
            "    .param .b32 value",
            ");",
            "",
            ".visible .entry set_lanes(",
            ",\n".join(params),
            ")",
            "{",
            "    .reg .pred %p<2>;",
            "    .reg .b32 %r<4>;",
            "    .reg .b64 %rd<5>;",
            *body,
            "    ret;",
            "}",
            "",
        ]
    )


def _row_span(t: torch.Tensor, row: int) -> tuple[int, int]:
    """(first byte, bytes) of row `row` of a table whose rows are contiguous (a copy view)."""
    if not 0 <= row < t.shape[0]:
        raise IndexError(f"row {row} outside a table of {t.shape[0]} rows")
    one = t[0]
    if not one.is_contiguous():
        raise ValueError(f"a row of {tuple(t.shape)} (strides {t.stride()}) is not contiguous: no single copy")
    return t.data_ptr() + row * t.stride(0) * t.element_size(), one.numel() * t.element_size()


def row_copies(
    src: ExpertTensors, dst: ExpertTensors, expert: int, row: int, names: Sequence[str] | None = None
) -> list[tuple[int, int, int]]:
    """[(dst address, src address, bytes)] that copy src row `expert` into dst row `row`, one per copy view (of the
    tensors `names` only, when given: an overlapped pass copies gate/up first, down last)."""
    if src.row_pitch != dst.row_pitch:
        raise ValueError(f"source and destination rows differ in layout (pitches {src.row_pitch}, {dst.row_pitch})")
    out = []
    for s, d in zip(src.copy_views(names), dst.copy_views(names), strict=True):
        s_addr, s_bytes = _row_span(s, expert)
        d_addr, d_bytes = _row_span(d, row)
        if s_bytes != d_bytes:
            raise ValueError(f"a source row of {s_bytes} bytes against a destination row of {d_bytes}")
        out.append((d_addr, s_addr, s_bytes))
    return out


def lane_bodies(
    src: ExpertTensors, dst: ExpertTensors, row: int, names: Sequence[str] | None = None
) -> list[list[tuple[int, int, int]]]:
    """Every body of one lane, [expert][view] -> (dst address, src address, bytes): `row_copies(src, dst, e, row,
    names)` for each expert e, each view's base, pitch and size checked once and the addresses then summed (a
    48-layer model prepares some 10^5 of them)."""
    first = row_copies(src, dst, 0, row, names)  # expert 0's: every check of row_copies, once
    pitches = [s.stride(0) * s.element_size() for s in src.copy_views(names)]  # bytes between two experts' rows
    return [[(d, s + e * p, n) for (d, s, n), p in zip(first, pitches, strict=True)] for e in range(src.num_rows)]


_CUresult = ctypes.c_int
_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
# (name, ABI version asked of cuGetProcAddress, argument types): the signature of that version
_SIGNATURES: tuple[tuple[str, int, tuple[Any, ...]], ...] = (
    # (stream, status*, id*, graph*, const node** deps, size_t* numDeps): the 11.3 signature (_v2)
    (
        "cuStreamGetCaptureInfo",
        11030,
        (
            _P,
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_uint64),
            _PP,
            ctypes.POINTER(_PP),
            ctypes.POINTER(ctypes.c_size_t),
        ),
    ),
    # (stream, node* deps, numDeps, flags): 11.3 (before 12.3's edge data)
    ("cuStreamUpdateCaptureDependencies", 11030, (_P, _PP, ctypes.c_size_t, ctypes.c_uint)),
    # (handle*, graph, ctx, default value, flags): 12.3
    ("cuGraphConditionalHandleCreate", 12030, (ctypes.POINTER(ctypes.c_uint64), _P, _P, ctypes.c_uint, ctypes.c_uint)),
    # (node*, graph, deps, numDeps, CUgraphNodeParams*): 12.2 (before 12.3's edge data)
    ("cuGraphAddNode", 12020, (_PP, _P, _PP, ctypes.c_size_t, ctypes.POINTER(GraphNodeParams))),
    # (node*, graph, deps, numDeps, CUDA_MEMCPY3D*, ctx): 10.0
    ("cuGraphAddMemcpyNode", 10000, (_PP, _P, _PP, ctypes.c_size_t, ctypes.POINTER(Memcpy3D), _P)),
    # (module*, image, numOptions, CUjit_option*, void** values): 2.1
    ("cuModuleLoadDataEx", 2010, (_PP, ctypes.c_char_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_int), _PP)),
    ("cuModuleGetFunction", 2000, (_PP, _P, ctypes.c_char_p)),
    # (f, grid xyz, block xyz, shared bytes, stream, void** params, void** extra)
    (
        "cuLaunchKernel",
        4000,
        (
            _P,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            _P,
            _PP,
            _PP,
        ),
    ),
    ("cuCtxGetCurrent", 4000, (_PP,)),
)


class DriverGraphs:
    """The driver calls SWITCH lanes need, each at the ABI version of its signature in `_SIGNATURES`."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise SwitchUnavailable(f"no CUDA driver library: {e}") from e
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) or version.value < SWITCH_DRIVER_VERSION:
            raise SwitchUnavailable(f"SWITCH conditional nodes need a CUDA 12.8 driver or newer (this one: "
                                    f"{version.value})")  # fmt: skip
        get = getattr(lib, "cuGetProcAddress_v2", None)
        if get is None:
            raise SwitchUnavailable("the driver has no cuGetProcAddress_v2")
        get.argtypes = [ctypes.c_char_p, _PP, ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._lib = lib
        self.version = version.value
        self._fns: dict[str, Any] = {}
        for name, abi, argtypes in _SIGNATURES:
            fn, status = ctypes.c_void_p(), ctypes.c_int()
            code = get(name.encode(), ctypes.byref(fn), abi, 0, ctypes.byref(status))
            if code or not fn.value:
                raise SwitchUnavailable(f"cuGetProcAddress({name}, {abi}) failed: CUresult {code}, status "
                                        f"{status.value}")  # fmt: skip
            self._fns[name] = ctypes.CFUNCTYPE(_CUresult, *argtypes)(fn.value)

    def call(self, name: str, *args: object) -> None:
        code = self._fns[name](*args)
        if code:
            raise RuntimeError(f"{name} failed: {self._error_name(code)}")

    def raw(self, name: str, *args: object) -> int:
        """The call's CUresult, unchecked (the caller says what failed)."""
        return int(self._fns[name](*args))

    def _error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(text)) or text.value is None:
            return f"CUresult {code}"
        return f"{text.value.decode()} ({code})"

    def context(self) -> int:
        ctx = ctypes.c_void_p()
        self.call("cuCtxGetCurrent", ctypes.byref(ctx))
        if not ctx.value:
            raise RuntimeError("no current CUDA context on this thread (launch a kernel through torch first)")
        return ctx.value

    def capture(self, stream: int) -> tuple[int, list[int]]:
        """(the graph being captured on `stream`, the nodes its next work will depend on); raises when not capturing."""
        status, ident, graph = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
        deps, count = _PP(), ctypes.c_size_t()
        self.call("cuStreamGetCaptureInfo", stream, ctypes.byref(status), ctypes.byref(ident), ctypes.byref(graph),
                  ctypes.byref(deps), ctypes.byref(count))  # fmt: skip
        if status.value != CU_STREAM_CAPTURE_STATUS_ACTIVE or not graph.value:
            raise RuntimeError(f"stream {stream:#x} is not capturing (status {status.value})")
        return graph.value, [deps[i] for i in range(count.value)]

    @functools.cache  # noqa: B019 - one driver object a process; a kernel per lane count
    def setter(self, lanes: int) -> int:
        """The loaded `set_lanes` kernel for `lanes` lanes (CUfunction). The PTX is JIT-compiled here: call it
        before a capture (loading a module is no graph operation)."""
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        log = ctypes.create_string_buffer(16384)
        options = (ctypes.c_int * 2)(CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
        values = (ctypes.c_void_p * 2)(ctypes.cast(log, ctypes.c_void_p), ctypes.c_void_p(len(log)))
        code = self.raw("cuModuleLoadDataEx", ctypes.byref(module), lane_kernel_ptx(lanes).encode(), 2, options, values)
        if code:
            text = log.value.decode(errors="replace").strip() or "no JIT log"
            raise RuntimeError(f"cuModuleLoadDataEx (the {lanes}-lane setter's PTX) failed: {self._error_name(code)}: "
                               f"{text}")  # fmt: skip
        self.call("cuModuleGetFunction", ctypes.byref(fn), module, b"set_lanes")
        return int(fn.value or 0)


@functools.cache
def driver_graphs() -> DriverGraphs:
    """One per process (raises SwitchUnavailable, with the reason, where the driver cannot)."""
    return DriverGraphs()


@dataclass
class SwitchLanes:
    """`lanes` SWITCH nodes copying host rows into destination rows `rows[j]` (lane j), one body an expert.

    `capture(experts)` adds them to the graph torch is capturing on the current stream; every replay then copies
    host row experts[j] into dst row rows[j] for each lane whose id is in [0, num_experts) (the [lanes] int64 device
    tensor is read at each replay), and nothing for the others."""

    host: ExpertTensors  # [E] rows, pinned host memory
    dst: ExpertTensors  # [R] rows on the device
    rows: Sequence[int]  # [lanes]: each lane's destination row
    names: Sequence[str] | None = None  # the tensors of a row the lanes copy (None: all)
    driver: DriverGraphs = field(default_factory=lambda: driver_graphs())  # looked up at each construction
    nodes_added: int = 0  # memcpy nodes of every body (lanes x experts x copy views), summed over every capture
    build_s: float = 0.0  # host time adding the nodes, summed over every capture (instantiation: torch's capture end)

    def __post_init__(self) -> None:
        if not 1 <= len(self.rows) <= MAX_LANES:
            raise ValueError(f"1..{MAX_LANES} lanes, got {len(self.rows)}")
        if len(set(self.rows)) != len(self.rows):
            raise ValueError(f"two lanes copy into one row (rows {list(self.rows)}): their copies would race")
        if torch.cuda.is_available() and not self.host.copy_views()[0].is_pinned():
            raise ValueError("a lane's memcpy nodes need the host rows in pinned (page-locked) memory")
        for r in self.rows:
            _row_span(self.dst.copy_views()[0], r)  # each lane's row is one of the table's
        # every lane's bodies, as (dst, src, bytes): computed (and checked) once, before any capture
        self._copies = [lane_bodies(self.host, self.dst, r, self.names) for r in self.rows]
        self._setter = self.driver.setter(len(self.rows))

    def capture(self, experts: torch.Tensor) -> None:
        """Under capture on the current stream: the setter, then every lane after it, the stream's next work after
        every lane. experts: [lanes] int64 on the device, alive for as long as the graph replays."""
        if (
            experts.dtype != torch.int64 or experts.shape != (len(self.rows),) or experts.device.type != "cuda"
            or not experts.is_contiguous()  # the setter reads id j at byte 8 j
        ):  # fmt: skip
            raise ValueError(f"experts must be [{len(self.rows)}] int64 on the device, got {experts.dtype} "
                             f"{tuple(experts.shape)} on {experts.device}")  # fmt: skip
        self.add_nodes(torch.cuda.current_stream(experts.device).cuda_stream, experts.data_ptr())

    def add_nodes(self, stream: int, experts_ptr: int) -> None:
        """`capture`'s driver calls on the capturing `stream`, the ids at device address `experts_ptr`."""
        t0 = time.perf_counter()
        drv, none = self.driver, self.host.num_rows
        ctx = drv.context()
        graph, _ = drv.capture(stream)
        handles = []
        for _ in self.rows:
            h = ctypes.c_uint64()
            drv.call("cuGraphConditionalHandleCreate", ctypes.byref(h), graph, ctx, none, CU_GRAPH_COND_ASSIGN_DEFAULT)
            handles.append(h)
        ptr, count = ctypes.c_uint64(experts_ptr), ctypes.c_uint(none)
        args = (ctypes.c_void_p * (len(handles) + 2))(
            *[ctypes.addressof(h) for h in handles], ctypes.addressof(ptr), ctypes.addressof(count)
        )
        drv.call("cuLaunchKernel", self._setter, 1, 1, 1, 1, 1, 1, 0, stream, args, None)  # captured: a kernel node
        graph, deps = drv.capture(stream)
        dep_array = (ctypes.c_void_p * len(deps))(*deps)
        lanes = []
        for h, bodies in zip(handles, self._copies, strict=True):
            params = GraphNodeParams()
            params.type = CU_GRAPH_NODE_TYPE_CONDITIONAL
            params.u.conditional.handle = h.value
            params.u.conditional.type = CU_GRAPH_COND_TYPE_SWITCH
            params.u.conditional.size = none
            params.u.conditional.ctx = ctx
            node = ctypes.c_void_p()
            drv.call("cuGraphAddNode", ctypes.byref(node), graph, dep_array, len(deps), ctypes.byref(params))
            out = params.u.conditional.phGraph_out  # the driver's array of `none` body graphs
            for e, copies in enumerate(bodies):
                for dst, src, nbytes in copies:  # a body's copies are independent: no dependencies among them
                    mc, desc = ctypes.c_void_p(), memcpy_1d(dst, src, nbytes)
                    drv.call("cuGraphAddMemcpyNode", ctypes.byref(mc), out[e], None, 0, ctypes.byref(desc), ctx)
                    self.nodes_added += 1
            lanes.append(node.value)
        after = (ctypes.c_void_p * len(lanes))(*lanes)
        drv.call("cuStreamUpdateCaptureDependencies", stream, after, len(lanes), CU_STREAM_SET_CAPTURE_DEPENDENCIES)
        self.build_s += time.perf_counter() - t0
