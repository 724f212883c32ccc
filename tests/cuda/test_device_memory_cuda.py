"""CUDA checks of benchsuite.tools.device_memory with the real driver library (libnvidia-ml through ctypes):
- NVML opens, sees the GPU and its total memory;
- a child process (standing in for an engine: the sampler finds it as a descendant) that allocates
  2 GiB on the device, holds it, then frees it, is measured at a peak of at least 2 GiB plus its
  CUDA context and at most 2 GiB more, by NVML's per-process figure (or, where the container's pid
  namespace hides host pids from NVML, by the device delta, which the method says);
- without a baseline and with nothing attributable the figure is None, never 0.

Plain functions, so the module also runs as a script: `python tests/cuda/test_device_memory_cuda.py`.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import torch

from benchsuite.tools import device_memory as dm

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass

GIB = 2**30
CHILD = """
import sys, time, torch
x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("allocated", flush=True)
time.sleep(1.5)
del x
torch.cuda.empty_cache()
time.sleep(1.0)
"""


def test_nvml_opens_and_sees_the_gpu() -> None:
    reader = dm.open_reader()
    assert reader is not None, "libnvidia-ml.so.1 did not load or saw no GPU"
    try:
        assert isinstance(reader, dm.NvmlReader) and reader.device_count >= 1
        snap = reader.read()
        assert snap.device_used_bytes > 0
    finally:
        reader.close()
    total = dm.gpu_total_bytes()
    assert total is not None and total >= torch.cuda.get_device_properties(0).total_memory * 0.9


def test_a_child_s_peak_is_measured_through_the_tree() -> None:
    reader = dm.open_reader()
    assert reader is not None
    baseline = dm.baseline_bytes(reader)
    # a parent shell -> python child (`; true` keeps sh from exec'ing it): the allocating process is a
    # descendant, as in an engine
    proc = subprocess.Popen(["/bin/sh", "-c", f'"{sys.executable}" -c \'{CHILD}\'; true'], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip

    async def measure() -> dm.PeakMemory:
        sampler = dm.PeakSampler(reader, proc.pid, baseline)
        sampler.start()
        await asyncio.to_thread(proc.wait, 60)
        return await sampler.stop()

    try:
        peak = asyncio.run(measure())
    finally:
        proc.kill()
        reader.close()
    print(f"peak {peak.peak_bytes / GIB:.2f} GiB by {peak.method} over {peak.samples} samples")
    assert peak.method in (dm.PER_PROCESS, dm.DEVICE_DELTA)
    assert peak.peak_bytes is not None and 2 * GIB <= peak.peak_bytes <= 4 * GIB
    assert peak.samples >= 10  # ~2.5 s at 150 ms


def test_nothing_attributable_is_none() -> None:
    reader = dm.open_reader()
    assert reader is not None
    try:
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
        sampler = dm.PeakSampler(reader, sleeper.pid, baseline=None)
        sampler.sample()
        assert sampler.result().peak_bytes is None  # no CUDA context in that process, no baseline: unknown
    finally:
        sleeper.kill()
        reader.close()


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
