"""Peak device memory of an engine server over one cell, measured the same way for every engine.

What is measured: the device memory NVML attributes to the server's processes (the server's pid
and every descendant, found with psutil each sample), summed over the GPUs, sampled every
`SAMPLE_INTERVAL_S` on a background task from the start of the cell (before its warmups) to its
end; the cell stores the highest sum (`CellResult.peak_device_memory_bytes`) and how it was
measured (`device_memory_method`). NVML's per-process figure is what the driver has given that
process: its CUDA context (a few hundred MiB), every allocation, the PyTorch caching allocator's
reserved-but-free blocks, CUDA graph pools, cuBLAS/Triton workspaces and the tables of the
built-in engine's synthetic router. It is what a card of that size must hold, which is the
question a budget asks. An engine that frees and re-allocates between samples can peak higher
than sampled for under one interval; allocations that live that briefly are not what a budget
limits (the caching allocator keeps what it reserved until the process ends).

Where no NVML pid matches the server's tree while its GPU memory grew (a container whose pid
namespace hides host pids from NVML), the figure falls back to the device's used memory minus
its used memory before the server started (`nvml-device-delta`): other processes that start or
stop on that GPU during the run move it, which the method name says. No GPU, no NVML library, or
nothing attributable: None, never 0.

Why ctypes over libnvidia-ml.so.1 and not `nvidia-smi --query-compute-apps`: the driver library
is on every machine with an NVIDIA driver (pynvml / nvidia-ml-py often is not), one sample costs
microseconds in-process, while forking nvidia-smi every 150 ms costs tens of milliseconds of CPU
each on the machine whose host overhead per decode step we are measuring.

`DeviceReader` is the seam: `NvmlReader` reads the driver; tests inject a reader whose figures
they script (the real server processes, a scripted memory).
"""

from __future__ import annotations

import asyncio
import ctypes
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import psutil

SAMPLE_INTERVAL_S = 0.15
NVML_LIBRARY = "libnvidia-ml.so.1"
_NVML_SUCCESS = 0
_NVML_ERROR_INSUFFICIENT_SIZE = 7
_NVML_VALUE_NOT_AVAILABLE = 2**64 - 1  # usedGpuMemory when the driver cannot say (WDDM, some containers)

PER_PROCESS = "nvml-per-process"
DEVICE_DELTA = "nvml-device-delta"


@dataclass(frozen=True)
class DeviceSnapshot:
    """One NVML reading over every GPU."""

    used_by_pid: Mapping[int, int]  # pid -> device bytes NVML attributes to it, summed over GPUs
    device_used_bytes: int  # every GPU's used memory, summed (all processes, driver reservations)


class DeviceReader(Protocol):
    def read(self) -> DeviceSnapshot: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PeakMemory:
    """A cell's peak device memory and how it was measured (the CellResult fields of the same meaning), and when
    the sampler read NVML: (perf_counter start, seconds) per read, the clock the load generator times requests by,
    so a request can be checked against the reads that overlapped it (`sampler_record`)."""

    peak_bytes: int | None
    method: str | None  # PER_PROCESS, DEVICE_DELTA, or None with peak_bytes None
    samples: int
    reads: tuple[tuple[float, float], ...] = field(default=(), compare=False)  # how it was read, not the figure


def sampler_record(peak: PeakMemory, interval_s: float = SAMPLE_INTERVAL_S) -> dict[str, Any]:
    """What the memory sampler did during a cell (CellResult.extras["memory_sampler"]): its interval, how many NVML
    reads it made and how long they took. Why: the instrument must not be what it measures, and NVML's process-list
    queries are not free: a monitoring tool measured its graphics-process query at 4.5 ms a call, holding the
    driver's lock that a game's submission threads then waited on (MangoHud PR #2104). This sampler's
    compute-process query runs every `interval_s` of every cell, so its cost is kept per cell, and each request's
    share of it (`read_s_within`) on the request's record (RequestRecord.sampler_read_s)."""
    seconds = sorted(d for _, d in peak.reads)
    return {
        "interval_s": interval_s,
        "reads": len(peak.reads),
        "read_ms_median": statistics.median(seconds) * 1e3 if seconds else None,
        "read_ms_max": seconds[-1] * 1e3 if seconds else None,
        "read_s_total": sum(seconds),
    }


def read_s_within(reads: Iterable[tuple[float, float]], start_s: float, end_s: float) -> float:
    """Seconds of the reads ((start perf_counter s, seconds) each) inside [start_s, end_s]."""
    return sum(max(0.0, min(end_s, t + d) - max(start_s, t)) for t, d in reads)


# ---- NVML through ctypes --------------------------------------------------------------------------


class _ProcessInfo(ctypes.Structure):
    """nvmlProcessInfo_t (v2 and v3 layouts are the same): what ..._GetComputeRunningProcesses fills."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class _Memory(ctypes.Structure):
    """nvmlMemory_t."""

    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def used_by_pid(infos: Iterable[_ProcessInfo]) -> dict[int, int]:
    """NVML process records -> pid -> bytes; a record whose memory NVML cannot report is left out
    (unknown is never 0), and a pid on several GPUs is summed."""
    out: dict[int, int] = {}
    for info in infos:
        if info.usedGpuMemory == _NVML_VALUE_NOT_AVAILABLE:
            continue
        out[int(info.pid)] = out.get(int(info.pid), 0) + int(info.usedGpuMemory)
    return out


class NvmlError(OSError):
    """The driver library is missing or answered an error code."""


class NvmlReader:
    """Every GPU's compute processes and used memory through libnvidia-ml (one nvmlInit per reader)."""

    def __init__(self, library: str = NVML_LIBRARY) -> None:
        try:
            self._nvml = ctypes.CDLL(library)
        except OSError as exc:
            raise NvmlError(f"{library}: {exc}") from None
        self._check(self._nvml.nvmlInit_v2(), "nvmlInit_v2")
        count = ctypes.c_uint(0)
        self._check(self._nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)), "nvmlDeviceGetCount_v2")
        self._devices = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            self._check(self._nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)), "GetHandleByIndex")
            self._devices.append(handle)
        # _v3 (drivers >= 510) and _v2 fill the same struct; older drivers have only _v2
        name = "nvmlDeviceGetComputeRunningProcesses_v3"
        self._processes = getattr(self._nvml, name, None) or self._nvml.nvmlDeviceGetComputeRunningProcesses_v2

    @property
    def device_count(self) -> int:
        return len(self._devices)

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != _NVML_SUCCESS:
            raise NvmlError(f"NVML {what} returned error {code}")

    def _device_processes(self, handle: ctypes.c_void_p) -> list[_ProcessInfo]:
        count = ctypes.c_uint(0)
        code = self._processes(handle, ctypes.byref(count), None)
        if code == _NVML_SUCCESS:
            return []
        for _ in range(3):  # a process may start between the two calls: ask again with room to spare
            if code != _NVML_ERROR_INSUFFICIENT_SIZE:
                self._check(code, "GetComputeRunningProcesses")
            count = ctypes.c_uint(count.value + 8)
            infos = (_ProcessInfo * count.value)()
            code = self._processes(handle, ctypes.byref(count), infos)
            if code == _NVML_SUCCESS:
                return list(infos[: count.value])
        self._check(code, "GetComputeRunningProcesses")
        return []

    def name(self, index: int) -> str:
        buffer = ctypes.create_string_buffer(96)  # NVML_DEVICE_NAME_V2_BUFFER_SIZE
        self._check(self._nvml.nvmlDeviceGetName(self._devices[index], buffer, len(buffer)), "GetName")
        return buffer.value.decode(errors="replace")

    def total_bytes(self, index: int) -> int:
        memory = _Memory()
        self._check(self._nvml.nvmlDeviceGetMemoryInfo(self._devices[index], ctypes.byref(memory)), "GetMemoryInfo")
        return int(memory.total)

    def read(self) -> DeviceSnapshot:
        infos: list[_ProcessInfo] = []
        device_used = 0
        for handle in self._devices:
            infos += self._device_processes(handle)
            memory = _Memory()
            self._check(self._nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)), "GetMemoryInfo")
            device_used += int(memory.used)
        return DeviceSnapshot(used_by_pid(infos), device_used)

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def open_reader() -> DeviceReader | None:
    """The machine's reader: NVML when the driver library loads and sees a GPU, else None (no GPU)."""
    try:
        reader = NvmlReader()
    except NvmlError:
        return None
    if reader.device_count == 0:
        reader.close()
        return None
    return reader


def gpu_total_bytes(index: int = 0) -> int | None:
    """The memory of GPU `index` (NVML), or None without one: a search's default budget."""
    try:
        reader = NvmlReader()
    except NvmlError:
        return None
    try:
        return reader.total_bytes(index) if index < reader.device_count else None
    finally:
        reader.close()


def gpu_names() -> list[str] | None:
    """Every GPU's name (NVML), or None without NVML: what a checklist line names, read without
    touching CUDA in the orchestrating process (no context, no memory taken from the engines)."""
    try:
        reader = NvmlReader()
    except NvmlError:
        return None
    try:
        return [reader.name(i) for i in range(reader.device_count)]
    except NvmlError:
        return None
    finally:
        reader.close()


# ---- sampling a server's tree over one cell -------------------------------------------------------


def process_tree(pid: int) -> set[int]:
    """The server's pid and its descendants now (an engine's workers may start late)."""
    try:
        root = psutil.Process(pid)
        return {pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.Error:
        return set()


def baseline_bytes(reader: DeviceReader | None) -> int | None:
    """The devices' used memory before a server starts: what the device-delta fallback subtracts."""
    if reader is None:
        return None
    try:
        return reader.read().device_used_bytes
    except NvmlError:
        return None


class PeakSampler:
    """Samples a server tree's device memory every `interval_s` between `start()` and `stop()`."""

    def __init__(self, reader: DeviceReader | None, pid: int | None, baseline: int | None,
                 interval_s: float = SAMPLE_INTERVAL_S) -> None:  # fmt: skip
        self.reader, self.pid, self.baseline, self.interval_s = reader, pid, baseline, interval_s
        self._per_process: int | None = None
        self._delta: int | None = None
        self._samples = 0
        self._reads: list[tuple[float, float]] = []  # every NVML read, failed ones too (PeakMemory.reads)
        self._task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Event | None = None

    def sample(self) -> None:
        """One reading folded into the peaks (also called once at stop, so a short cell has one)."""
        if self.reader is None or self.pid is None:
            return
        started_s = time.perf_counter()
        try:
            snap = self.reader.read()
        except NvmlError:
            return
        finally:
            self._reads.append((started_s, time.perf_counter() - started_s))
        self._samples += 1
        mine = sum(snap.used_by_pid.get(p, 0) for p in process_tree(self.pid))
        if mine > 0:  # a listed pid at 0 bytes attributes nothing: the figure stays unknown, never 0
            self._per_process = max(self._per_process or 0, mine)
        elif self.baseline is not None and snap.device_used_bytes > self.baseline:
            self._delta = max(self._delta or 0, snap.device_used_bytes - self.baseline)

    async def _run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            await asyncio.to_thread(self.sample)  # NVML calls block briefly: off the event loop
            try:
                await asyncio.wait_for(stopping.wait(), self.interval_s)
            except TimeoutError:
                pass

    def start(self) -> None:
        if self.reader is not None and self.pid is not None:
            self._stopping = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(self._stopping))

    async def stop(self) -> PeakMemory:
        """The last sample, then the result. The loop is asked to end, not cancelled: a cancelled
        `to_thread` leaves its sample running in the thread, racing the last one on the peaks and
        reading NVML after the caller may have closed the reader."""
        if self._task is not None and self._stopping is not None:
            self._stopping.set()
            # the sample in flight, if any, finishes first; a sampler task cancelled from outside (loop
            # shutdown) ends the wait without raising here, as before
            await asyncio.wait({self._task})
            self._task = self._stopping = None
            await asyncio.to_thread(self.sample)
        return self.result()

    def result(self) -> PeakMemory:
        # per-process attribution wins whenever any sample had it: the delta is only the fallback
        reads = tuple(self._reads)
        if self._per_process is not None:
            return PeakMemory(self._per_process, PER_PROCESS, self._samples, reads)
        if self._delta is not None:
            return PeakMemory(self._delta, DEVICE_DELTA, self._samples, reads)
        return PeakMemory(None, None, self._samples, reads)
