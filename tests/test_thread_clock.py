"""The calling thread's clocks (paged_experts/thread_clock.py): on Linux a busy loop is time on a CPU, a sleep is time
blocked with a voluntary switch, another thread's work is not this thread's, and a platform that cannot say a figure
gives None, never 0."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from paged_experts import thread_clock
from paged_experts.server.engine_types import RequestPrefill
from paged_experts.step import PrefillStepHost

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the thread's scheduler figures are Linux's")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _spin_cpu(seconds: float) -> None:
    """Spins until this thread has had `seconds` of CPU time (however loaded the machine is)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


Seen = list[tuple[thread_clock.ThreadInterval, int]]  # each thread's interval, and its file's descriptor


@linux
def test_a_busy_loop_is_time_on_a_cpu_and_a_sleep_is_time_blocked() -> None:
    first = thread_clock.read()
    assert first.run_delay_s is not None and first.voluntary_switches is not None
    assert first.cpu_id is not None and 0 <= first.cpu_id < (os.cpu_count() or 1) * 4  # a CPU number, not a count
    _spin(0.05)
    spun = thread_clock.read()
    busy = thread_clock.between(first, spun)
    # on a CPU most of the time (the machine may queue it a little: that is run_delay, not blocked time)
    assert busy.cpu_s + (busy.run_delay_s or 0.0) >= 0.8 * busy.wall_s
    time.sleep(0.05)
    slept = thread_clock.between(spun, thread_clock.read())
    assert slept.wall_s >= 0.05 and slept.cpu_s < 0.01  # asleep, off the CPU
    assert slept.voluntary_switches is not None and slept.voluntary_switches >= 1  # it blocked
    blocked_s = slept.wall_s - slept.cpu_s - (slept.run_delay_s or 0.0)
    assert blocked_s >= 0.04  # a sleep is not time waiting for a CPU


@linux
def test_each_thread_reads_its_own_clocks() -> None:
    """Another thread spinning is not this thread's CPU time, and each thread gets its own /proc file."""
    seen: list[thread_clock.ThreadInterval] = []

    def worker() -> None:
        start = thread_clock.read()
        _spin_cpu(0.05)
        seen.append(thread_clock.between(start, thread_clock.read()))

    first = thread_clock.read()
    other = threading.Thread(target=worker)
    other.start()
    other.join()
    mine = thread_clock.between(first, thread_clock.read())
    assert seen[0].cpu_s >= 0.05  # the worker's spin is the worker's
    assert mine.cpu_s < 0.03 and mine.voluntary_switches is not None and mine.voluntary_switches >= 1  # I waited


def _pinned(cpu: int, cpu_s: float, out: Seen, start: threading.Barrier) -> None:
    """Spins in Python on `cpu` (this thread only) until it had `cpu_s` of CPU time, then appends what its clocks
    saw and its file."""
    os.sched_setaffinity(0, {cpu})  # 0: the calling thread
    start.wait()
    first = thread_clock.read()
    _spin_cpu(cpu_s)
    out.append((thread_clock.between(first, thread_clock.read()), thread_clock._thread_files().schedstat))


@linux
def test_a_process_spinning_on_the_same_cpu_is_time_waiting_for_it() -> None:
    """Another process on our CPU: the thread is runnable but not running about half the time (run delay, with
    involuntary switches: the scheduler takes the CPU back), not asleep."""
    cpu = min(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", f"import os, time; os.sched_setaffinity(0, {{{cpu}}}); "
                                "end = time.time() + 3\nwhile time.time() < end: pass"])  # fmt: skip
    try:
        time.sleep(0.3)  # it is spinning
        seen: Seen = []
        thread = threading.Thread(target=_pinned, args=(cpu, 0.2, seen, threading.Barrier(1)))
        thread.start()
        thread.join()
    finally:
        spinner.kill()
        spinner.wait()
    got = seen[0][0]
    assert got.run_delay_s is not None and got.run_delay_s >= 0.05, got
    assert got.involuntary_switches is not None and got.involuntary_switches >= 1, got
    assert got.cpu_s + got.run_delay_s >= 0.8 * got.wall_s, got  # on the CPU or waiting for it, hardly asleep
    assert got.cpu_id_first == got.cpu_id_last == cpu


@linux
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two CPUs: contention for the interpreter lock only")
def test_two_python_threads_on_two_cpus_take_turns_at_the_interpreter_lock() -> None:
    """Two threads spinning in Python on two CPUs: each sleeps while the other holds the interpreter lock, time
    blocked with voluntary switches, not time waiting for a CPU; and each thread reads its own file."""
    first_cpu, second_cpu = sorted(os.sched_getaffinity(0))[:2]
    seen: Seen = []
    start = threading.Barrier(2)
    threads = [threading.Thread(target=_pinned, args=(c, 0.2, seen, start)) for c in (first_cpu, second_cpu)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, _ in seen:
        assert got.voluntary_switches is not None and got.voluntary_switches >= 1, got
        blocked_s = got.wall_s - got.cpu_s - (got.run_delay_s or 0.0)
        assert blocked_s >= 0.1, got  # most of the other's 0.2 s of CPU time: it held the lock meanwhile
    assert seen[0][1] != seen[1][1] != thread_clock._thread_files().schedstat  # a file per thread


@linux
def test_a_thread_that_ends_closes_its_file() -> None:
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = fds()
    for _ in range(5):
        thread = threading.Thread(target=thread_clock.read)
        thread.start()
        thread.join()
    assert fds() == before


@linux
def test_a_forked_child_reads_its_own_thread_not_the_parents() -> None:
    """The parent's file names the parent's thread: a child forked after a reading must read its own (its run
    delay and CPU time start near zero, not at the parent's)."""
    parent = thread_clock.read()
    _spin_cpu(0.05)  # the parent has CPU time a fresh child does not
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its own schedstat's CPU time, as its file says, then leave at once
        os.close(read_end)
        raw = os.pread(thread_clock._thread_files().schedstat, 128, 0).split()
        os.write(write_end, raw[0])
        os._exit(0)
    os.close(write_end)
    child_ns = int(os.read(read_end, 64))
    os.close(read_end)
    os.waitpid(pid, 0)
    assert child_ns / 1e9 < parent.cpu_s + 0.05  # not the parent's file (whose CPU time is past 0.05 s more)
    assert thread_clock._thread_files().schedstat >= 0


def test_a_platform_without_the_figures_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thread_clock, "_RUSAGE_THREAD", None)
    monkeypatch.setattr(thread_clock, "_GETCPU", None)
    monkeypatch.setattr(thread_clock, "_SCHEDSTAT", "/nonexistent/schedstat")
    result: list[thread_clock.ThreadInterval] = []

    def fresh_thread() -> None:  # a new thread opens its file afresh (the path above does not exist)
        start = thread_clock.read()
        result.append(thread_clock.between(start, thread_clock.read()))

    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join()
    got = result[0]
    assert got.wall_s >= 0 and got.cpu_s >= 0
    assert got.run_delay_s is None and got.voluntary_switches is None and got.involuntary_switches is None
    assert got.cpu_id_first is None and got.cpu_id_last is None


def test_a_requests_prefill_sums_its_steps_and_stays_unknown_once_a_step_could_not_say() -> None:
    def step(delay: float | None, voluntary: int | None, first: int, last: int) -> PrefillStepHost:
        return PrefillStepHost(
            chunks=1, tokens=64, layer_steps=2, issue_s=0.1, issue_cpu_s=0.08, issue_run_delay_s=delay,
            issue_voluntary_switches=voluntary, issue_involuntary_switches=1, cpu_id_first=first, cpu_id_last=last,
        )  # fmt: skip

    request = RequestPrefill()
    request.add(step(0.002, 3, first=4, last=5))
    request.add(step(0.001, 2, first=5, last=7))
    t = request.timings()
    assert t["prefill_issue_run_delay_ms"] == pytest.approx(3.0)
    assert t["prefill_issue_voluntary_switches"] == 5 and t["prefill_issue_involuntary_switches"] == 2
    assert (t["prefill_cpu_id_first"], t["prefill_cpu_id_last"]) == (4, 7)  # the first step's start, the last one's end
    request.add(step(None, None, first=7, last=7))
    t = request.timings()
    assert "prefill_issue_run_delay_ms" not in t and "prefill_issue_voluntary_switches" not in t  # not sent as 0
    assert t["prefill_issue_involuntary_switches"] == 3 and t["prefill_steps"] == 3
