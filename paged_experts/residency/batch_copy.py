"""Every copy of a page-in call in one driver call (`page_in: batch`): `cuMemcpyBatchAsync`.

Why: the paged prefill is host-bound (docs/prefill.md). On the H200 its host spent 4.9 ms a layer-step
issuing a 2,048-token chunk's waves (h200-headline-c, model routing), and the profiles' largest single
part was issuing the page-ins: one `_foreach_copy_` a wave of ~40 DMAs (3 weight tensors x the wave's runs
of rows), ~6 us of host each, ~1.4 ms a layer-step (2026-12-05 profile, 8 layers, cProfile), plus an index
upload and a row-kernel launch for the FP8 scale rows. The driver's batch call takes the whole list of
(destination, source, size) at once: one call a wave, weights and scales alike, no upload, no launch.

The descriptors (`descriptors`): for each tensor of the row (gate, up, down, then FP8's three scales) and
each run of consecutive rows `(src row, dst row, n)`, the run's bytes are one contiguous block of both
tensors (an `[R, ...]` contiguous tensor's row r starts r x row bytes after its base). Every run is checked
against both tables' rows before any address is made: a raw pointer has no bounds check of its own.

The ABI: `cuMemcpyBatchAsync` appeared in CUDA 12.8 with a `failIdx` argument that CUDA 13.0 dropped (its
`cuMemcpyBatchAsync_v2`); `cuGetProcAddress` asked for the 12.8 version returns the 12.8 entry point from
any driver >= 12.8, so one signature serves both. The source is read in stream order
(`CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`), as a `cudaMemcpyAsync` reads it. The driver refuses the legacy
default stream (handle 0 or CU_STREAM_LEGACY), and a batch copy cannot be captured into a CUDA graph:
`store.PageInEngine` sends a call made on the legacy stream (a benchmark's serial path, a slot reload, offloaded
layers) or under capture by its `direct` copies instead, and counts those calls. Copies within one batch run in
no set order, so a call naming one destination row twice is refused (`direct` would let the last one win).

On the CPU the same descriptors run as `ctypes.memmove`s (`memmove_batch`), so the CPU tests check every
address a GPU would copy.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
_ABI_VERSION = 12080  # the 12.8 signature (with failIdx), which drivers of 13.x still return when asked for it
_CU_GET_PROC_ADDRESS_DEFAULT = 0
LEGACY_STREAMS = (0, 1)  # the legacy default stream: the NULL handle and CU_STREAM_LEGACY (the driver refuses both)


class BatchCopyUnavailable(RuntimeError):
    """This driver has no batch copy; the message says why."""


class BatchCopy(Protocol):
    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Copies sizes[i] bytes from srcs[i] to dsts[i] for every i ([N] uint64 each), queued on `stream`."""
        ...


@dataclass(frozen=True)
class RowTables:
    """The tensors of one (source, destination) pair of row tables, as base addresses and row bytes."""

    tensors: tuple[torch.Tensor, ...]  # every source tensor, then every destination tensor (held: the bases stay valid)
    src_base: np.ndarray  # [N] uint64: each source tensor's first byte
    dst_base: np.ndarray  # [N] uint64
    row_bytes: np.ndarray  # [N] uint64: bytes of one row of each tensor
    src_rows: int
    dst_rows: int


def row_tables(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], keep: Sequence[torch.Tensor] = ()
) -> RowTables:
    """Row tables of the same tensors on both sides (the same row shape and dtype, each contiguous); `keep`: the
    tensors the caller knows them by (views of them, such as FP8 weights as bytes: held and compared instead)."""
    if len(src) != len(dst) or not src:
        raise ValueError(f"{len(src)} source tensors against {len(dst)} destination tensors")
    for s, d in zip(src, dst):
        if s.shape[1:] != d.shape[1:] or s.dtype != d.dtype:
            raise ValueError(f"rows differ: {tuple(s.shape)} {s.dtype} against {tuple(d.shape)} {d.dtype}")
        if not (s.is_contiguous() and d.is_contiguous()):
            raise ValueError("a batch copy needs contiguous row tables (a run of rows is then one block)")
    src_rows, dst_rows = {int(t.shape[0]) for t in src}, {int(t.shape[0]) for t in dst}
    if len(src_rows) != 1 or len(dst_rows) != 1:
        raise ValueError(f"the tensors of one table differ in rows: {sorted(src_rows)}, {sorted(dst_rows)}")
    return RowTables(
        tensors=tuple(keep) or (*src, *dst),
        src_base=np.array([t.data_ptr() for t in src], dtype=np.uint64),
        dst_base=np.array([t.data_ptr() for t in dst], dtype=np.uint64),
        row_bytes=np.array([t[0].numel() * t.element_size() if t.shape[0] else 0 for t in src], dtype=np.uint64),
        src_rows=src_rows.pop(),
        dst_rows=dst_rows.pop(),
    )


def descriptors(tables: RowTables, runs: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """runs [(src row, dst row, n)] -> (dsts, srcs, sizes), each [N_tensors * R] uint64, tensor-major. Raises
    before making an address when a run leaves either table."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)  # [R, 3]
    if r.size:
        src, dst, n = r[:, 0], r[:, 1], r[:, 2]
        # each column on its own, no sums (a sum near 2**63 wraps, and the wrapped run would pass)
        if not (
            (src >= 0).all() and (dst >= 0).all() and (src < tables.src_rows).all() and (dst < tables.dst_rows).all()
            and (n >= 1).all() and (n <= tables.src_rows - src).all() and (n <= tables.dst_rows - dst).all()
        ):  # fmt: skip
            raise IndexError(
                f"a run of rows outside the tables ({tables.src_rows} source, {tables.dst_rows} dest): {runs}"
            )
    u = r.astype(np.uint64)
    rb = tables.row_bytes[:, None]  # [N, 1]
    srcs = (tables.src_base[:, None] + u[None, :, 0] * rb).reshape(-1)  # [N * R]
    dsts = (tables.dst_base[:, None] + u[None, :, 1] * rb).reshape(-1)
    sizes = (u[None, :, 2] * rb).reshape(-1)
    return dsts, srcs, sizes


def memmove_batch(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
    """The CPU's batch copy: each descriptor by memmove, in order (`stream` unused: the CPU runs inline)."""
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]  # CUmemLocation


class _Attributes(ctypes.Structure):
    _fields_ = [  # CUmemcpyAttributes (v1)
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", _Location),
        ("dstLocHint", _Location),
        ("flags", ctypes.c_uint),
    ]


_BATCH_FN = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # size_t *failIdx (12.8 ABI)
    ctypes.c_void_p,  # CUstream
)


class DriverBatchCopy:
    """`BatchCopy` on the CUDA driver (libcuda.so.1, as `pinned.CudaDriver`): one `cuMemcpyBatchAsync` a call."""

    def __init__(self, device: torch.device) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise BatchCopyUnavailable(f"no CUDA driver library: {e}") from e
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) or version.value < _ABI_VERSION:
            have = f"{version.value // 1000}.{version.value % 1000 // 10}" if version.value else "unknown"
            raise BatchCopyUnavailable(f"cuMemcpyBatchAsync needs a CUDA 12.8 driver or newer (this one: {have})")
        get = getattr(lib, "cuGetProcAddress_v2", None)
        if get is None:
            raise BatchCopyUnavailable("the driver has no cuGetProcAddress_v2")
        c_int_p, c_void_pp = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p)
        get.argtypes = [ctypes.c_char_p, c_void_pp, ctypes.c_int, ctypes.c_uint64, c_int_p]
        fn, status = ctypes.c_void_p(), ctypes.c_int()
        flags = _CU_GET_PROC_ADDRESS_DEFAULT
        code = get(b"cuMemcpyBatchAsync", ctypes.byref(fn), _ABI_VERSION, flags, ctypes.byref(status))
        if code or not fn.value:
            raise BatchCopyUnavailable(
                f"cuGetProcAddress(cuMemcpyBatchAsync, 12.8) failed: CUresult {code}, symbol status {status.value}"
            )
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        self._lib = lib
        self._fn = _BATCH_FN(fn.value)
        self._device = device
        self._attrs = _Attributes(srcAccessOrder=_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)  # one entry for every copy
        self._attrs_first = ctypes.c_size_t(0)  # ... from copy 0 on
        self._threads = threading.local()  # whether this thread's driver context was checked
        self.version = version.value

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        if stream in LEGACY_STREAMS:
            raise ValueError("cuMemcpyBatchAsync refuses the legacy default stream")
        for a in (dsts, srcs, sizes):  # the driver reads dsts.size entries of each: exactly those, as uint64
            if a.dtype != np.uint64 or a.ndim != 1 or a.size != dsts.size or not a.flags.c_contiguous:
                raise ValueError(f"batch copy descriptors must be three [N] uint64 arrays, got {a.dtype} {a.shape}")
        if not dsts.size:
            return
        if not getattr(self._threads, "ready", False):
            self._current_context()
        fail = ctypes.c_size_t(0)
        code = self._fn(
            dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, dsts.size,
            ctypes.addressof(self._attrs), ctypes.addressof(self._attrs_first), 1, ctypes.addressof(fail), stream,
        )  # fmt: skip
        if code:
            raise RuntimeError(
                f"cuMemcpyBatchAsync failed: {self._error_name(code)} (copy {fail.value} of {dsts.size})"
            )

    def _current_context(self) -> None:
        """A driver call needs a context current on the calling thread. A thread that has called the runtime has
        the device's primary context current (every thread that runs a step has launched kernels before its first
        page-in); one that has not is given it here, through the driver (the runtime's set_device skips a device it
        believes current), then checked (once a thread)."""
        ctx = ctypes.c_void_p()
        if self._lib.cuCtxGetCurrent(ctypes.byref(ctx)) or not ctx.value:
            index = self._device.index if self._device.index is not None else torch.cuda.current_device()
            dev, primary = ctypes.c_int(), ctypes.c_void_p()
            # retained for the process's life: the runtime holds the same primary context for as long
            code = self._lib.cuDeviceGet(ctypes.byref(dev), index)
            code = code or self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev)
            code = code or self._lib.cuCtxSetCurrent(primary)
            code = code or self._lib.cuCtxGetCurrent(ctypes.byref(ctx))
            if code or not ctx.value:
                raise RuntimeError(f"cuMemcpyBatchAsync: no CUDA context for device {index} on this thread ({code})")
        self._threads.ready = True

    def _error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(name)) or name.value is None:
            return f"CUresult {code}"
        return f"{name.value.decode()} ({code})"


@functools.cache
def driver_batch_copy(device: torch.device) -> DriverBatchCopy:
    """One per device and process (raises BatchCopyUnavailable, with the reason, where the driver has none)."""
    return DriverBatchCopy(device)
