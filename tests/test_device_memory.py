"""benchsuite.tools.device_memory on the CPU: NVML's process records decoded (unknown memory left out,
never 0), the peak of a real process tree sampled through a scripted reader, the device-delta
fallback where NVML's pids are not ours, and None (never 0) without a GPU."""

from __future__ import annotations

import asyncio
import ctypes
import subprocess
import sys
import time

import pytest

from benchsuite.tools import device_memory as dm

MIB = 2**20
GIB = 2**30


def infos(*rows: tuple[int, int]) -> ctypes.Array[dm._ProcessInfo]:
    array = (dm._ProcessInfo * len(rows))()
    for i, (pid, used) in enumerate(rows):
        array[i].pid, array[i].usedGpuMemory = pid, used
        array[i].gpuInstanceId = array[i].computeInstanceId = 0xFFFFFFFF
    return array


def test_nvml_records_are_summed_per_pid_and_unknown_memory_is_left_out() -> None:
    records = infos((10, 500 * MIB), (11, 2**64 - 1), (10, 300 * MIB), (12, 0))
    assert dm.used_by_pid(records) == {10: 800 * MIB, 12: 0}  # pid 10 on two GPUs; 11 unknown: absent


class Scripted:
    """A reader whose figures the test scripts: bytes per pid, and the device's used memory."""

    def __init__(self, by_pid, device_used: int = 0) -> None:
        self.by_pid, self.device_used, self.reads = by_pid, device_used, 0

    def read(self) -> dm.DeviceSnapshot:
        self.reads += 1
        return dm.DeviceSnapshot(self.by_pid(self.reads), self.device_used)

    def close(self) -> None:
        pass


@pytest.fixture
def tree():
    """A real parent with one child (the child stands in for an engine's worker process)."""
    code = "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
    code += "print(c.pid, flush=True); time.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    yield parent.pid, child
    subprocess.run(["kill", str(child)], check=False)
    parent.kill()
    parent.wait(timeout=10)


def test_the_peak_sums_the_tree_and_ignores_other_processes(tree) -> None:
    parent, child = tree
    curve = [1000, 3000, 2000]  # MiB on the child over three samples: the peak is the middle one

    def by_pid(read: int) -> dict[int, int]:
        used = curve[min(read, len(curve)) - 1] * MIB
        return {parent: 400 * MIB, child: used, 1: 70_000 * MIB}  # pid 1: somebody else's job

    sampler = dm.PeakSampler(Scripted(by_pid), parent, baseline=None, interval_s=0.01)

    async def cell() -> dm.PeakMemory:
        sampler.start()
        await asyncio.sleep(0.2)
        return await sampler.stop()

    peak = asyncio.run(cell())
    assert peak == dm.PeakMemory(3400 * MIB, dm.PER_PROCESS, peak.samples) and peak.samples >= 3


def test_hidden_pids_fall_back_to_the_device_delta(tree) -> None:
    parent, _ = tree
    sampler = dm.PeakSampler(Scripted(lambda _: {99999: GIB}, device_used=9 * GIB), parent, baseline=2 * GIB)
    sampler.sample()
    assert sampler.result() == dm.PeakMemory(7 * GIB, dm.DEVICE_DELTA, 1)


def test_no_gpu_is_none_never_zero(tree) -> None:
    parent, _ = tree
    assert asyncio.run(_sampled(dm.PeakSampler(None, parent, None))) == dm.PeakMemory(None, None, 0)
    nothing_ours = dm.PeakSampler(Scripted(lambda _: {parent: 0}, device_used=GIB), parent, baseline=GIB)
    nothing_ours.sample()
    # listed at 0 bytes, and the device did not grow: nothing attributable, unknown, not 0
    assert nothing_ours.result() == dm.PeakMemory(None, None, 1)


async def _sampled(sampler: dm.PeakSampler) -> dm.PeakMemory:
    sampler.start()
    await asyncio.sleep(0.02)
    return await sampler.stop()


def test_a_missing_driver_library_means_no_reader() -> None:
    with pytest.raises(dm.NvmlError):
        dm.NvmlReader("libnvidia-ml-not-here.so.1")


class Slow:
    """A reader whose every read takes `read_s` (NVML on a busy driver): how many reads are in flight,
    the most there ever were at once, and whether one was still running when it was closed."""

    def __init__(self, pid: int, read_s: float) -> None:
        import threading

        self.pid, self.read_s, self.reads = pid, read_s, 0
        self.in_flight = self.most_in_flight = 0
        self.read_after_close = False
        self.closed = False
        self._lock = threading.Lock()

    def read(self) -> dm.DeviceSnapshot:
        import time

        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.reads += 1
            used = self.reads * GIB  # every read higher: the last one is the peak
        time.sleep(self.read_s)
        with self._lock:
            self.in_flight -= 1
            self.read_after_close |= self.closed
        return dm.DeviceSnapshot({self.pid: used}, 0)

    def close(self) -> None:
        self.closed = True


def test_stop_waits_for_the_sample_in_flight_and_keeps_its_figure(tree) -> None:
    """stop() while a background read is in flight: before, the read went on in its thread after stop
    returned (its higher figure lost, a second read racing it, the reader closed under it)."""
    parent, _ = tree
    reader = Slow(parent, read_s=0.3)
    sampler = dm.PeakSampler(reader, parent, baseline=None, interval_s=0.01)

    async def cell() -> dm.PeakMemory:
        sampler.start()
        await asyncio.sleep(0.1)  # the first read is in flight
        peak = await sampler.stop()
        reader.close()  # what the runner does after its last cell
        return peak

    peak = asyncio.run(cell())
    assert reader.in_flight == 0 and reader.most_in_flight == 1 and not reader.read_after_close
    assert peak.peak_bytes == reader.reads * GIB and peak.samples == reader.reads


def test_each_read_is_kept_with_its_window_on_the_request_clock(tree) -> None:
    """The sampler keeps when it read NVML and for how long (failed reads too), on perf_counter, the clock the load
    generator times requests by; `sampler_record` sums them up per cell and `read_s_within` gives a request's share."""
    parent, _ = tree
    reader = Slow(parent, read_s=0.02)
    sampler = dm.PeakSampler(reader, parent, baseline=None, interval_s=0.01)

    async def cell() -> tuple[float, dm.PeakMemory, float]:
        before = time.perf_counter()
        sampler.start()
        await asyncio.sleep(0.15)
        peak = await sampler.stop()
        return before, peak, time.perf_counter()

    before, peak, after = asyncio.run(cell())
    assert len(peak.reads) == peak.samples == reader.reads >= 3
    starts = [t for t, _ in peak.reads]
    assert starts == sorted(starts) and before <= starts[0] and starts[-1] < after
    assert all(0.02 <= d < 0.5 for _, d in peak.reads)  # each window holds its (scripted) read
    record = dm.sampler_record(peak, sampler.interval_s)
    assert record["reads"] == len(peak.reads) and record["interval_s"] == 0.01
    assert 20 <= record["read_ms_median"] <= record["read_ms_max"]
    assert record["read_s_total"] == pytest.approx(sum(d for _, d in peak.reads))
    # a request's share: whole reads inside its span, the part of one it cuts, nothing outside it
    reads = [(10.0, 0.004), (10.5, 0.004), (11.0, 0.004)]
    assert dm.read_s_within(reads, 9.0, 10.502) == pytest.approx(0.006)
    assert dm.read_s_within(reads, 10.004, 10.5) == 0.0 and dm.read_s_within([], 0.0, 1.0) == 0.0

    class Failing(Slow):
        def read(self) -> dm.DeviceSnapshot:
            raise dm.NvmlError("GPU is lost")

    failing = dm.PeakSampler(Failing(parent, read_s=0.0), parent, baseline=None)
    failing.sample()
    failed = failing.result()
    assert failed.samples == 0 and len(failed.reads) == 1  # a failed read gave no figure but took its time


def test_each_request_gets_the_read_time_inside_its_wait_for_the_first_token(tree) -> None:
    """run/cell.with_sampler_reads: a request whose wait spans reads gets their time, one that got no first token
    and a cell with no read timed keep None; the load generator times requests on the sampler's clock."""
    import inspect

    from benchsuite.load import loadgen
    from benchsuite.records import RequestRecord
    from benchsuite.run.cell import with_sampler_reads

    assert inspect.signature(loadgen.run_load).parameters["clock"].default is time.perf_counter
    parent, _ = tree
    sampler = dm.PeakSampler(Slow(parent, read_s=0.02), parent, baseline=None, interval_s=0.01)

    def record(sent: float, first: float | None) -> RequestRecord:
        return RequestRecord("c", 0, False, False, "p", "short", 8, sent, first, first)

    async def cell() -> tuple[list[RequestRecord], dm.PeakMemory]:
        sampler.start()
        await asyncio.sleep(0.05)
        sent = time.perf_counter()
        await asyncio.sleep(0.2)  # the request's wait: reads of 20 ms every ~30 ms run meanwhile
        waited = record(sent, time.perf_counter())
        return [waited, record(sent, None)], await sampler.stop()

    records, peak = asyncio.run(cell())
    waited, failed = with_sampler_reads(records, peak.reads)
    assert waited.sampler_read_s == pytest.approx(dm.read_s_within(peak.reads, waited.t_sent_s, waited.t_first_token_s))
    assert 0.06 <= waited.sampler_read_s <= 0.2  # several reads' time, never more than the wait
    assert failed.sampler_read_s is None and with_sampler_reads(records, ()) == records
