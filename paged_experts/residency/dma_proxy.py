"""The DMA proxy: a decode step's page-ins, planned on the GPU inside the captured graph, copied by the copy
engine at the link's rate (RuntimeConfig.overlap_copies = 'dma').

Why: an SM-driven copy of pinned host rows stops at ~34 GB/s on an H100 whatever its grid, where the DMA
engines reach 48-50 GB/s and hide ~0.9 of themselves beside the expert pass (copy_overlap.py,
benchmarks/results/h200/2026-12-06-h100-staging16). A captured step cannot issue a DMA whose rows it decides
on the device, so a host thread does, on the device's word:

  GPU, in stream order           host thread (native/dma_proxy.c)          copy engine
  plan -> `ring` kernel  ---->   polls the ring in pinned memory,    ---->  rows -> slots, then
  hits compute                   cuMemcpyHtoDAsync per (expert, tensor)     the ticket -> done
  `wait` kernel spins on done    on its own non-blocking stream
  misses compute

The step's stream never waits for the host: it waits for `done`, which the copy engine writes after the rows (a
record with nothing planned, a layer whose experts all hit, writes its own ticket there: no round trip).
The host waits instead, once per launch (`drain`): the main thread issues nothing more until the thread has
queued the copies of every ring it launched (an eager ring drains before it returns; a graph's owner counts its
captured rings and calls `replayed` after each launch). Without it an eager step's wait gave up on an H100,
cause not identified (`drain`).
The hits read no slot being written (a victim slot is never a routed expert's: moe/overlap.py), and the next
use of a slot is after the wait in stream order. The host thread is C (no GIL: a Python thread would wait for
the interpreter up to its switch interval, 5 ms, while the server's thread runs); it is built from the
package's source with the system's C compiler the first time (`library_path`, cached by the source's hash).

`backend='host'` runs the same thread with memcpy for the copies and host memory for `done` (tests on a
machine without a GPU; the ring kernels then run in Triton's interpreter).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import Literal

import torch

from paged_experts.residency import dma_ring
from paged_experts.residency.store import PACKED_ORDER, ExpertTensors

MAX_PAIRS = 512  # entries a record holds: a one-wave step's padded plan (tokens x top_k) stays below it
# records in flight at most: an overlapped layer rings G + 1 <= 65 before its first wait, and the tickets with nothing
# planned, which complete on the GPU, are bounded by the drain after each replay (one replay's rings: 2-3 a layer)
RING_SLOTS = 256
ENTRIES = 512  # call sites a ticket is noted under (a site's wait follows its ring within one layer)
WAIT_LIMIT = 2_000_000  # polls (each an L2 read, ~0.5 us): ~1 s, where a layer's copies take milliseconds
IDLE_NS = 5_000_000  # after 5 ms without a record the thread polls every 50 us instead of spinning
DRAIN_NS = 5_000_000_000  # a drain stops waiting after 5 s (the GPU busy with earlier work): the waits still guard
ST_STATE, ST_TICKETS, ST_COPIES, ST_BYTES, ST_ERROR, ST_ERROR_AT, ST_WORDS = 0, 1, 2, 3, 4, 5, 8
ERRORS = {
    -2: "a record named a table the proxy does not have",
    -3: "a record held more entries than the ring's",
    -4: "a record named a slot out of range",
    -5: "cuCtxSetCurrent failed in the proxy's thread",
    -6: "the ring lapped the proxy (records were overwritten before it served them)",
    -7: "libcuda.so.1 could not be opened",
    -8: "libcuda.so.1 lacks a driver function the proxy calls",
    -9: "out of memory or threads",
}


class DmaProxyError(RuntimeError):
    """The proxy cannot start, or failed while serving."""


def _source() -> bytes:
    return resources.files("paged_experts").joinpath("native/dma_proxy.c").read_bytes()


def library_path(cache_dir: Path | None = None) -> Path:
    """The proxy's shared library, compiled from the package's C source on first use (cc, or $CC) into
    `cache_dir` ($PAGED_EXPERTS_CACHE, else ~/.cache/paged_experts), named by the source's hash."""
    source = _source()
    root = cache_dir or Path(os.environ.get("PAGED_EXPERTS_CACHE", Path.home() / ".cache" / "paged_experts"))
    cc = shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not cc:
        raise DmaProxyError("overlap_copies='dma' needs a C compiler to build its host thread (cc, or set CC)")
    flags = ["-O2", "-shared", "-fPIC", "-pthread"]
    # the source, the machine and the compiler name the library: a home shared by hosts of two kinds keeps both
    key = hashlib.sha256(source + repr((platform.machine(), cc, flags)).encode()).hexdigest()[:16]
    lib = root / f"dma_proxy-{key}.so"
    if lib.exists():
        return lib
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            src, out = Path(tmp) / "dma_proxy.c", Path(tmp) / "lib.so"
            src.write_bytes(source)
            done = subprocess.run([*cc, *flags, str(src), "-o", str(out), "-ldl"], capture_output=True, text=True)
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines() or ["no output"]
                first = next((line for line in lines if "error" in line), lines[-1])
                raise DmaProxyError(f"building the DMA proxy with {' '.join(cc)} failed: {first.strip()}")
            os.replace(out, lib)  # atomic: a process beside this one sees no half-written library
    except OSError as e:
        raise DmaProxyError(f"building the DMA proxy with {' '.join(cc)} failed: {e.strerror or e}") from e
    return lib


def _load(cache_dir: Path | None) -> ctypes.CDLL:
    path = library_path(cache_dir)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise DmaProxyError(f"the DMA proxy's library {path} does not load: {e}") from e
    i64, u64, ptr = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
    lib.px_start.argtypes = [ctypes.POINTER(ptr), ptr, i64, i64, i64, ptr, ptr, u64, ctypes.c_int, ctypes.c_int, i64]
    lib.px_start.restype = ctypes.c_int
    lib.px_add_table.argtypes = [ptr, i64, i64, i64, *([ctypes.POINTER(u64)] * 5)]
    lib.px_add_table.restype = i64
    lib.px_drain.argtypes = [ptr, i64, ptr, i64]
    lib.px_drain.restype = ctypes.c_int
    lib.px_stop.argtypes = [ptr]
    lib.px_stop.restype = None
    return lib


class DmaProxy:
    """One proxy thread and its ring for a device (`for_device`); `ring` / `wait` launch the GPU's side."""

    def __init__(
        self,
        device: torch.device,
        max_pairs: int,
        backend: Literal["cuda", "host"] = "cuda",
        ring_slots: int = RING_SLOTS,
        cache_dir: Path | None = None,
        wait_limit: int = WAIT_LIMIT,
    ) -> None:
        if backend == "cuda" and device.type != "cuda":
            raise DmaProxyError(f"overlap_copies='dma' needs a CUDA device, got {device}")
        if backend == "cuda" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            # one hardware queue: the thread's copies would queue behind the wait kernel that spins for them
            raise DmaProxyError(
                "overlap_copies='dma' cannot run with CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue)"
            )
        if not dma_ring.available():
            raise DmaProxyError("overlap_copies='dma' needs Triton (the ring and wait kernels)")
        self.device, self.backend = device, backend
        self.max_pairs, self.ring_slots, self.wait_limit = max_pairs, ring_slots, wait_limit
        self.record_words = 4 + 2 * max_pairs
        ring_len = ring_slots * self.record_words
        # pinned host words the GPU writes (ring, error) and the thread writes (echo, status)
        shared = torch.zeros(ring_len + ring_slots + ST_WORDS + 1, dtype=torch.int64, pin_memory=backend == "cuda")
        self._shared = shared
        self._words = shared.numpy()  # `check` reads two words without torch's overhead
        self.ring_words = shared[:ring_len]  # [R * W]
        self.echo = shared[ring_len : ring_len + ring_slots]  # [R]
        self.status = shared[ring_len + ring_slots : ring_len + ring_slots + ST_WORDS]  # [ST_WORDS]
        self.err = shared[-1:]  # [1]: a wait that gave up writes its ticket here
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)  # tickets taken
        self.tick = torch.zeros(ENTRIES, dtype=torch.int64, device=device)  # each call site's last ticket
        self.done = torch.zeros(ring_slots, dtype=torch.int64, device=device)  # the ticket each ring slot served
        self.gave_up = torch.zeros(1, dtype=torch.int64, device=device)  # `err`'s device copy, read by every wait
        self._tables: dict[tuple[int, ...], int] = {}
        self._table_rows: dict[int, int] = {}  # table id -> its host rows (`ring`: which entries are planned)
        self._next_entry = 0
        # rings launched outside a capture, replays' included: the GPU numbers tickets in launch order, so the
        # n-th is ticket n (`drain`); and rings launched during captures, which run on each replay
        self.rung = 0
        self.captured = 0
        self._lock = threading.Lock()
        self._lib = _load(cache_dir)
        handle = ctypes.c_void_p()
        rc = self._lib.px_start(
            ctypes.byref(handle), self.ring_words.data_ptr(), ring_slots, self.record_words, max_pairs,
            self.echo.data_ptr(), self.status.data_ptr(), self.done.data_ptr(), 0 if backend == "cuda" else 1,
            _ordinal(device), IDLE_NS,
        )  # fmt: skip
        if rc != 0:
            raise DmaProxyError(f"the DMA proxy did not start: {ERRORS.get(rc, f'CUDA driver error {rc}')}")
        self._handle: ctypes.c_void_p | None = handle

    # ---- tables: where a layer's host rows and slots are ------------------------------------------------

    def table(self, host: ExpertTensors, slots: ExpertTensors) -> int:
        """The id of (host rows -> slots) for every tensor of the row, registered on first use (before any
        record names it: registration happens while the step is traced or captured, not replayed)."""
        names = DmaProxy._order(host)
        # one unit a tensor: split, the tensor (FP8 as bytes); packed, its range of the row (to the next tensor),
        # so the thread merges a record's adjacent ranges into one copy (gate/up's four, down's two, or all six)
        srcs = [host.copy_views((n,))[0] for n in names]
        dsts = [slots.copy_views((n,))[0] for n in names]
        # addresses, sizes and pitches: a freed model's tensors may come back at the same addresses with other shapes
        key = (
            host.num_rows,
            slots.num_rows,
            *(v for t in (*srcs, *dsts) for v in (t.data_ptr(), t[0].numel() * t.element_size(), t.stride(0))),
        )
        with self._lock:
            if key in self._tables:
                return self._tables[key]
            for name, s, d in zip(names, srcs, dsts):
                if not (s[0].is_contiguous() and d[0].is_contiguous()):
                    raise DmaProxyError(f"the DMA proxy copies contiguous rows; tensor {name!r}'s are not")
                if s[0].numel() * s.element_size() != d[0].numel() * d.element_size():
                    raise DmaProxyError(f"tensor {name!r}: a host row and a slot differ in size")
                if self.backend == "cuda" and not s.is_pinned():
                    raise DmaProxyError(f"tensor {name!r}: the DMA proxy copies from pinned host rows")
            n = len(names)
            arr = ctypes.c_uint64 * n
            row_bytes = arr(*(s[0].numel() * s.element_size() for s in srcs))
            tid = self._lib.px_add_table(
                self._live(), n, host.num_rows, slots.num_rows, arr(*(s.data_ptr() for s in srcs)),
                arr(*(d.data_ptr() for d in dsts)), row_bytes, arr(*(s.stride(0) * s.element_size() for s in srcs)),
                arr(*(d.stride(0) * d.element_size() for d in dsts)),
            )  # fmt: skip
            if tid < 0:
                raise DmaProxyError("the DMA proxy's table of layers is full")
            self._tables[key] = int(tid)
            self._table_rows[int(tid)] = host.num_rows
            return int(tid)

    @staticmethod
    def _order(host: ExpertTensors) -> tuple[str, ...]:
        """The row's tensors in the table's order: packed, the row's own (neighbours in memory are neighbours in
        the table, which the thread merges); split, `names()`."""
        names = host.names()
        return names if host.packed is None else tuple(n for n in PACKED_ORDER if n in names)

    @staticmethod
    def mask(host: ExpertTensors, names: tuple[str, ...] | None) -> int:
        """The tensor mask of `names` among the row's tensors in the table's order (None: all)."""
        return sum(1 << i for i, n in enumerate(DmaProxy._order(host)) if names is None or n in names)

    # ---- the GPU's side ---------------------------------------------------------------------------------

    def ring(self, table: int, experts: torch.Tensor, slot_ids: torch.Tensor, mask: int) -> int:
        """Rings the proxy for rows experts [n] -> slot_ids [n] (int64 on the device, padded with experts
        >= the table's rows) in stream order; returns the call site's entry for `wait`. Outside a capture it
        drains (`drain`) before it returns: an eager step issues nothing more until the record's copies are
        queued. Inside one it counts the ring for the graph (`captured`; the replay's owner calls `replayed`)."""
        self._live()
        with self._lock:
            entry = self._next_entry
            self._next_entry = (entry + 1) % ENTRIES
        # the table's host rows: an entry naming one of them is planned (an unknown table: every entry, so the
        # record goes to the thread, which refuses it and stops)
        rows = self._table_rows.get(table, 1 << 62)
        dma_ring.ring(
            self.counter, self.ring_words, self.tick, self.done, experts.contiguous(), slot_ids.contiguous(), entry,
            table, mask, rows, self.ring_slots, self.record_words, self.max_pairs,
        )  # fmt: skip
        if self.backend == "cuda" and torch.cuda.is_current_stream_capturing():
            self.captured += 1
        else:
            self.rung += 1
            self.drain()
        return entry

    def replayed(self, rings: int, drain: bool = True) -> None:
        """A graph that rang `rings` times (its capture's count of `captured`) was launched; with `drain`, waits
        until the thread has queued every copy it will ask for (`drain`)."""
        self.rung += rings
        if drain and rings:
            self.drain()

    def drain(self) -> int:
        """Waits, on the host (the C side, GIL released), until the thread has queued the copies of every ring
        launched so far. Why: without it, on an H100 (driver 580), an eager decode step's wait gave up while the
        thread had yet to queue its copies (served late); with it the CUDA tests pass. The cause is not
        identified: CUDA's documented implicit synchronizations issued meanwhile did not reproduce it (script
        mode `hazards` of tests/cuda/test_dma_proxy_cuda.py). A safeguard. Returns the C side's code (0 queued, 1
        the thread stopped or failed, 2 a wait gave up, 3 timed out: the GPU still busy with earlier work); every
        case but 0 leaves the step to its waits and `check`."""
        return int(self._lib.px_drain(self._live(), self.rung, self.err.data_ptr(), DRAIN_NS))

    def wait(self, entry: int) -> None:
        """Work issued after this on the current stream sees the rows `entry`'s record named."""
        dma_ring.wait(
            self.done, self.tick, entry, self.err, self.gave_up, self.status, self.wait_limit, self.ring_slots
        )

    # ---- the host's side --------------------------------------------------------------------------------

    def _live(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise DmaProxyError("the DMA proxy is closed")
        return self._handle

    def stats(self) -> dict[str, int]:
        """The thread's counters: tickets served, copies issued, bytes."""
        s = self.status.tolist()
        return {"tickets": s[ST_TICKETS], "copies": s[ST_COPIES], "bytes": s[ST_BYTES]}

    def check(self) -> None:
        """Raises if the thread failed or a wait gave up (reads pinned memory: no device sync)."""
        base = self.ring_slots * self.record_words + self.ring_slots
        if self._words[base + ST_STATE] != -1 and self._words[-1] == 0:
            return
        s = self.status.tolist()
        if s[ST_STATE] == -1:
            code = s[ST_ERROR]
            raise DmaProxyError(
                f"the DMA proxy failed at ticket {s[ST_ERROR_AT]}: {ERRORS.get(code, f'CUDA driver error {code}')}"
            )
        gave_up = int(self.err.item())
        if gave_up:
            raise DmaProxyError(
                f"a decode step gave up waiting for its page-ins (ticket {gave_up}; the proxy served up to "
                f"{s[ST_TICKETS]}): its output is not to be trusted"
            )

    def close(self) -> None:
        """Stops the thread after the records it has seen (idempotent)."""
        if self._handle is not None:
            self._lib.px_stop(self._handle)
            self._handle = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order
        try:
            self.close()
        except Exception:
            pass


def _ordinal(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.current_device() if device.index is None else device.index


_PROXIES: dict[int, DmaProxy] = {}  # by device ordinal: 'cuda' and 'cuda:0' share one
_PROXIES_LOCK = threading.Lock()


def for_device(device: torch.device, max_pairs: int) -> DmaProxy:
    """The process's proxy for a CUDA device, started on first use with room for `max_pairs` entries a
    record (a larger request later starts nothing new: it is refused by `ring`)."""
    if device.type != "cuda":
        raise DmaProxyError(f"overlap_copies='dma' needs a CUDA device, got {device}")
    ordinal = _ordinal(device)
    with _PROXIES_LOCK:
        proxy = _PROXIES.get(ordinal)
        if proxy is None:
            if torch.cuda.is_current_stream_capturing():
                # its zeroed counters would be captured as memsets, re-zeroed on every replay
                raise DmaProxyError("the DMA proxy must start before a CUDA graph capture (an eager step starts it)")
            proxy = _PROXIES[ordinal] = DmaProxy(torch.device("cuda", ordinal), max_pairs)
        return proxy


def captured_rings() -> dict[int, int]:
    """Each device's count of rings launched during captures so far (a graph's own: the difference around it)."""
    return {ordinal: proxy.captured for ordinal, proxy in _PROXIES.items()}


def rings_since(before: dict[int, int]) -> dict[int, int]:
    """The rings each device's proxy counted during captures since `captured_rings()` returned `before`."""
    return {o: n - before.get(o, 0) for o, n in captured_rings().items() if n != before.get(o, 0)}


def replayed(rings: dict[int, int], drain: bool = True) -> None:
    """A graph whose capture rang `rings` (`rings_since`) was launched: see `DmaProxy.replayed`."""
    for ordinal, n in rings.items():
        _PROXIES[ordinal].replayed(n, drain)


def check_all() -> None:
    """Raises if any of the process's proxies failed or a wait gave up (after a step's readback)."""
    for proxy in list(_PROXIES.values()):
        proxy.check()


@atexit.register
def _close_all() -> None:  # the threads stop before the interpreter tears down what they read
    for proxy in list(_PROXIES.values()):
        proxy.close()
