"""The calling thread's clocks, read together: wall time, its CPU time, and where the kernel can say, the time it
spent runnable but waiting for a CPU, its context switches and the CPU it runs on. A difference of two readings
splits the thread's wall time over an interval into

    on a CPU         cpu_s                              (time.thread_time)
    waiting for one  run_delay_s                        (/proc/thread-self/schedstat, 2nd field: runnable, not running)
    blocked          wall_s - cpu_s - run_delay_s       (asleep: a lock such as the interpreter's, a blocking read)

with the switches that say how it left the CPU: voluntary (it blocked) or involuntary (the scheduler took the CPU
back: a time slice ran out, or another task was preferred). Why a model step reads them: the paged prefill is bound
by the host at the margin (docs/prefill.md, "Two speeds"), and a slower engine thread is either slower on the CPU
(cpu_s grows), queued behind other tasks (run_delay_s, involuntary switches), or blocked (voluntary switches).

Linux gives all of them (`resource.RUSAGE_THREAD`, /proc/thread-self); elsewhere (macOS) the ones it cannot give are
None, never 0. Cost on Linux: ~4 us a reading on a 2-core Xeon (getrusage, a read of a /proc file the thread keeps
open, sched_getcpu, the two clocks), taken twice by eager steps that run a prompt chunk; other steps read no clock.
"""

from __future__ import annotations

import ctypes
import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

_SCHEDSTAT = "/proc/thread-self/schedstat"  # "<on-cpu ns> <runnable-waiting ns> <timeslices>"
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)  # Linux only


def _sched_getcpu() -> Callable[[], int] | None:
    """glibc's sched_getcpu: ~0.1 us through ctypes here (/proc/thread-self/stat's field 39 cost 4.5 us)."""
    try:
        fn = ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError, TypeError):  # no such symbol (macOS), no C library to open by None
        return None
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn


_GETCPU = _sched_getcpu()


@dataclass(frozen=True)
class ThreadReading:
    """One reading of the calling thread's clocks (seconds and counts since the thread started; wall_s is
    perf_counter). None: the platform cannot say."""

    wall_s: float
    cpu_s: float
    run_delay_s: float | None
    voluntary_switches: int | None
    involuntary_switches: int | None
    cpu_id: int | None  # the CPU it was on when read


@dataclass(frozen=True)
class ThreadInterval:
    """The difference of two readings of one thread (`ThreadReading.until`)."""

    wall_s: float
    cpu_s: float
    run_delay_s: float | None
    voluntary_switches: int | None
    involuntary_switches: int | None
    cpu_id_first: int | None  # the CPU at the first reading
    cpu_id_last: int | None  # and at the second


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return -1


class _Files:
    """One thread's schedstat file, opened by the thread itself (thread-self names the opener); -1: unreadable here.
    Held in a thread-local, so it closes when the thread's locals go (at its end)."""

    def __init__(self) -> None:
        self.schedstat = _open(_SCHEDSTAT)

    def __del__(self) -> None:
        if self.schedstat >= 0:
            try:
                os.close(self.schedstat)
            except OSError:
                pass


_local = threading.local()


def _forget_files() -> None:
    """In a forked child: the file the forking thread held names the parent's thread; the child opens its own."""
    _local.files = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_files)


def _thread_files() -> _Files:
    files: _Files | None = getattr(_local, "files", None)
    if files is None:
        files = _local.files = _Files()
    return files


def _run_delay_s(fd: int) -> float | None:
    if fd < 0:
        return None
    try:
        fields = os.pread(fd, 128, 0).split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _cpu() -> int | None:
    if _GETCPU is None:
        return None
    cpu = int(_GETCPU())
    return cpu if cpu >= 0 else None


def read() -> ThreadReading:
    """The calling thread's clocks now."""
    files = _thread_files()
    wall_s, cpu_s = time.perf_counter(), time.thread_time()
    voluntary = involuntary = None
    if _RUSAGE_THREAD is not None:
        usage = resource.getrusage(_RUSAGE_THREAD)
        voluntary, involuntary = int(usage.ru_nvcsw), int(usage.ru_nivcsw)
    return ThreadReading(wall_s, cpu_s, _run_delay_s(files.schedstat), voluntary, involuntary, _cpu())


def _minus(a: float | int | None, b: float | int | None) -> float | int | None:
    return None if a is None or b is None else a - b


def between(first: ThreadReading, last: ThreadReading) -> ThreadInterval:
    """What the thread did from `first` to `last` (both read by it, first before last)."""
    delay = _minus(last.run_delay_s, first.run_delay_s)
    voluntary = _minus(last.voluntary_switches, first.voluntary_switches)
    involuntary = _minus(last.involuntary_switches, first.involuntary_switches)
    return ThreadInterval(
        wall_s=last.wall_s - first.wall_s,
        cpu_s=last.cpu_s - first.cpu_s,
        run_delay_s=None if delay is None else float(delay),
        voluntary_switches=None if voluntary is None else int(voluntary),
        involuntary_switches=None if involuntary is None else int(involuntary),
        cpu_id_first=first.cpu_id,
        cpu_id_last=last.cpu_id,
    )
