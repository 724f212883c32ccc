"""Exact-size page-locked host memory for the expert store.

torch's pinned allocator (CachingHostAllocator) rounds every request up to a power of two: one
Qwen3-30B-A3B layer's gate tensor, 128 x 768 x 2048 bf16 = 384 MiB, pins 512 MiB, so its 54 GiB
of experts would pin ~72 GiB and the model could not be paged on a 64 GB host. Here the tensors
of one `ExpertTensors` share one anonymous mapping, each starting on a 4 KiB boundary, and the
whole mapping is page-locked with the CUDA driver's `cuMemHostRegister(PORTABLE | DEVICEMAP)`:
- `is_pinned()` is True and `non_blocking` host->device copies are asynchronous, from any context;
- the mapping is mapped into every device's address space, so the page-in kernel of
  `copy_kernel.py` can read it: Triton's launcher turns a tensor's pointer into a device pointer
  with `cuPointerGetAttribute(DEVICE_POINTER)`, which needs DEVICEMAP. We also require every
  device to report CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM (true on 64-bit Linux with UVA), so
  the host pointer itself is valid on the device, as it is for torch's `cudaHostAlloc` memory.

The driver API (ctypes on libcuda.so.1, which Triton's launcher also opens), not torch's
`torch.cuda.cudart().cudaHostRegister`: torch exposes neither the device attribute nor a way to
clear the runtime's last error, and a failed runtime call stays the thread's last error, which
torch's next kernel-launch check (cudaGetLastError) would raise as a failure of that kernel.
Driver calls leave the runtime's error state alone.

Methods, chosen by the env variable PAGED_EXPERTS_PINNED:
- `register` (default): as above. If it cannot be used (libcuda.so.1 missing, a device that
  cannot use the host pointer, the registration refused, e.g. not enough RAM to lock), it logs a
  warning naming the cause and falls back to `torch`;
- `torch`: `torch.empty(..., pin_memory=True)` per tensor, with torch's power-of-two rounding.

`stats()` reports the bytes page-locked now by each method and why `register` fell back, for a
benchmark's provenance.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

log = logging.getLogger(__name__)

ENV = "PAGED_EXPERTS_PINNED"
METHODS = ("register", "torch")
ALIGN_BYTES = 4096  # each tensor starts on a page: the DMA engines and the kernel's loads stay aligned

_CU_MEMHOSTREGISTER_PORTABLE = 0x01  # pinned for every context (every device), not only the current one
_CU_MEMHOSTREGISTER_DEVICEMAP = 0x02  # mapped into the devices' address space (what the Triton kernel reads)
_CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91


class PinningUnavailable(RuntimeError):
    """`register` cannot be used here or now; the message says why (logged, then torch's allocator)."""


class HostRegistrar(Protocol):
    """The CUDA calls that page-locking needs; `CudaDriver` on a GPU, a fake in the CPU tests."""

    unusable_reason: str | None  # None when every device can read registered memory at its host address

    def register(self, ptr: int, nbytes: int) -> int: ...  # a CUresult: 0 = success

    def unregister(self, ptr: int) -> int: ...

    def error_name(self, code: int) -> str: ...

    def synchronize(self) -> None: ...  # waits for every device's queued work


class CudaDriver:
    """`HostRegistrar` on the CUDA driver API (libcuda.so.1)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")  # OSError where there is no driver
        c_int_p = ctypes.POINTER(ctypes.c_int)
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuDeviceGet.argtypes = [c_int_p, ctypes.c_int]
        lib.cuDeviceGetAttribute.argtypes = [c_int_p, ctypes.c_int, ctypes.c_int]
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._lib = lib  # every function returns a CUresult: ctypes' default restype, c_int
        self.unusable_reason = self._check_devices()

    def _check_devices(self) -> str | None:
        code = self._lib.cuInit(0)
        for ordinal in range(torch.cuda.device_count()):
            dev, flag = ctypes.c_int(), ctypes.c_int()
            code = code or self._lib.cuDeviceGet(ctypes.byref(dev), ordinal)
            code = code or self._lib.cuDeviceGetAttribute(
                ctypes.byref(flag), _CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, dev
            )
            if code:
                return f"querying device {ordinal} failed: {self.error_name(code)}"
            if not flag.value:
                return f"device {ordinal} reports CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 0"
        return None

    def register(self, ptr: int, nbytes: int) -> int:
        torch.cuda.synchronize()  # a runtime call makes the primary context current here; the driver needs one
        flags = _CU_MEMHOSTREGISTER_PORTABLE | _CU_MEMHOSTREGISTER_DEVICEMAP
        return int(self._lib.cuMemHostRegister_v2(ptr, nbytes, flags))

    def unregister(self, ptr: int) -> int:
        return int(self._lib.cuMemHostUnregister(ptr))  # after synchronize(), so a context is current

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(name)) or name.value is None:
            return f"CUresult {code}"
        return f"{name.value.decode()} ({code})"

    def synchronize(self) -> None:
        # Only devices this process already uses: synchronizing another would create its context.
        has_context = getattr(torch._C, "_cuda_hasPrimaryContext", lambda i: i == torch.cuda.current_device())
        for i in range(torch.cuda.device_count()):
            if has_context(i):
                torch.cuda.synchronize(i)


@functools.cache
def _cuda_driver() -> CudaDriver:
    return CudaDriver()  # one per process: the library and the device check do not change


@dataclass(frozen=True)
class Layout:
    """Where each tensor lives in the one block: byte offsets, sizes, and the block's size."""

    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    total_bytes: int  # every tensor rounded up to ALIGN_BYTES, nothing more


def plan(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, align: int = ALIGN_BYTES) -> Layout:
    offsets, sizes, end = [], [], 0
    for shape in shapes:
        n = dtype.itemsize
        for d in shape:
            n *= d
        offsets.append(end)
        sizes.append(n)
        end += -(-n // align) * align
    return Layout(offsets=tuple(offsets), nbytes=tuple(sizes), total_bytes=end)


@dataclass
class _Ledger:
    """Bytes page-locked now, by method (the process's pinned memory is process-wide state)."""

    registered_bytes: int = 0
    registered_blocks: int = 0
    torch_bytes: int = 0  # as requested
    torch_rounded_bytes: int = 0  # what torch's allocator pins for them: each rounded up to a power of two
    fallback_reasons: list[str] = field(default_factory=list)  # distinct, in order


_LEDGER = _Ledger()


@dataclass(frozen=True)
class PinnedStats:
    """What this module holds page-locked now (released blocks no longer count)."""

    method: str  # the configured method; fallback_reasons says whether `register` fell back
    registered_bytes: int  # locked by cuMemHostRegister: the stores' exact sizes, rounded to ALIGN_BYTES
    registered_blocks: int  # one per ExpertTensors
    torch_bytes: int  # requested from torch's pinned allocator (method `torch` or a fallback)
    torch_rounded_bytes: int  # what torch pins for them; its cache keeps freed blocks pinned for reuse
    fallback_reasons: tuple[str, ...]


def method() -> str:
    value = os.environ.get(ENV, "register")
    if value not in METHODS:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(METHODS)}")
    return value


def stats() -> PinnedStats:
    return PinnedStats(
        method=method(),
        registered_bytes=_LEDGER.registered_bytes,
        registered_blocks=_LEDGER.registered_blocks,
        torch_bytes=_LEDGER.torch_bytes,
        torch_rounded_bytes=_LEDGER.torch_rounded_bytes,
        fallback_reasons=tuple(_LEDGER.fallback_reasons),
    )


# Lifetime. The block is a `_RegisteredMapping`. `torch.frombuffer` makes a tensor whose storage
# holds a reference to it, and the three tensors, every slice of them (`s_t[s : s + n]` in the
# direct page-in of store.py) and every pointer torch or Triton takes from them share that one
# storage: the block lives exactly as long as any tensor that can reach its memory. When the last
# is freed, the storage drops its reference and `__del__` runs before mmap's own deallocation
# unmaps the pages. It first waits for every device's queued work, since an asynchronous copy or
# page-in kernel queued from a slice that is gone may still be reading, then unregisters.
# Not covered: raw addresses kept outside torch, such as a captured CUDA graph's page-in kernel.
# The graph must not outlive the store; `GraphedDecoder` keeps its model, so the model's stores
# live at least as long. Torch's own allocator has the same rule.
# A child forked later inherits the object but neither the mapping (MADV_DONTFORK) nor the
# registration: only the registering process releases.
class _RegisteredMapping(mmap.mmap):
    _registration: tuple[HostRegistrar, int, int, int] | None = None  # (registrar, address, bytes, pid)

    def hold(self, registrar: HostRegistrar, ptr: int, nbytes: int) -> None:
        self._registration = (registrar, ptr, nbytes, os.getpid())
        _LEDGER.registered_bytes += nbytes
        _LEDGER.registered_blocks += 1

    def __del__(self) -> None:
        if self._registration is None or sys.is_finalizing():  # at exit the process unmaps all
            return
        registrar, ptr, nbytes, pid = self._registration
        if pid != os.getpid():
            return
        self._registration = None
        try:
            registrar.synchronize()
        finally:  # even when the wait failed: unmapping pages that stay registered would be worse
            code = registrar.unregister(ptr)
            _LEDGER.registered_bytes -= nbytes
            _LEDGER.registered_blocks -= 1
            if code:
                log.error("cuMemHostUnregister of %d bytes at %#x failed: %s", nbytes, ptr, registrar.error_name(code))


def _registered(layout: Layout, registrar: HostRegistrar | None) -> torch.Tensor:
    """One page-locked uint8 block of `layout.total_bytes`, or PinningUnavailable."""
    if registrar is None:
        try:
            registrar = _cuda_driver()
        except OSError as exc:
            raise PinningUnavailable(f"the CUDA driver library cannot be loaded: {exc}") from exc
    if registrar.unusable_reason is not None:
        raise PinningUnavailable(registrar.unusable_reason)
    # Anonymous and private: page-aligned, and untouched until cuMemHostRegister faults it in.
    try:
        block = _RegisteredMapping(-1, layout.total_bytes, flags=mmap.MAP_PRIVATE)
    except OSError as exc:
        raise PinningUnavailable(f"mapping {layout.total_bytes} bytes failed: {exc}") from exc
    if hasattr(mmap, "MADV_DONTFORK"):  # a fork would otherwise have to copy every locked page
        block.madvise(mmap.MADV_DONTFORK)
    flat = torch.frombuffer(block, dtype=torch.uint8)  # [total_bytes]; its storage holds `block`
    ptr = flat.data_ptr()
    code = registrar.register(ptr, layout.total_bytes)
    if code:
        raise PinningUnavailable(f"cuMemHostRegister of {layout.total_bytes} bytes: {registrar.error_name(code)}")
    block.hold(registrar, ptr, layout.total_bytes)
    return flat


def _torch_pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, pin_memory=True)
    nbytes = t.numel() * t.element_size()
    rounded = 1 << max(nbytes - 1, 0).bit_length() if nbytes else 0
    _LEDGER.torch_bytes += nbytes
    _LEDGER.torch_rounded_bytes += rounded
    weakref.finalize(t, _torch_released, nbytes, rounded)  # the tensor object, not later slices of it
    return t


def _torch_released(nbytes: int, rounded: int) -> None:
    _LEDGER.torch_bytes -= nbytes
    _LEDGER.torch_rounded_bytes -= rounded


def empty_pinned(
    shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, registrar: HostRegistrar | None = None
) -> list[torch.Tensor]:
    """Contiguous uninitialized page-locked CPU tensors of `shapes`, by the configured method.

    `registrar`: the CUDA calls (None: `CudaDriver`); the CPU tests pass a fake."""
    layout = plan(shapes, dtype)
    if method() == "register" and layout.total_bytes:
        try:
            flat = _registered(layout, registrar)
        except PinningUnavailable as exc:
            reason = str(exc)
            first = reason not in _LEDGER.fallback_reasons  # once, not once per layer
            if first:
                _LEDGER.fallback_reasons.append(reason)
            level = logging.WARNING if first else logging.DEBUG
            log.log(level, "exact-size pinned memory unavailable (%s); using torch's pinned allocator", reason)
        else:
            return [
                flat[off : off + n].view(dtype).view(shape)
                for off, n, shape in zip(layout.offsets, layout.nbytes, shapes)
            ]
    return [_torch_pinned(tuple(shape), dtype) for shape in shapes]
