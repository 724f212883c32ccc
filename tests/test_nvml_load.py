"""benchsuite.tools.nvml_load, the memory sampler's reads as a process of their own: it reads from `ready` until
its stdin closes, then reports how many reads it made and how long they took; without NVML it says so and exits 2."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from benchsuite.tools import device_memory


def test_it_reads_until_its_stdin_closes_and_reports_the_reads() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchsuite.tools.nvml_load", "--interval-s", "0.02", "--scripted-read-s", "0.01"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    out, _ = proc.communicate(input="", timeout=30)
    stats = json.loads(out.strip().splitlines()[-1])
    assert proc.returncode == 0 and stats["interval_s"] == 0.02
    assert 3 <= stats["reads"] <= 0.3 / 0.03 + 3  # one read (10 ms) and one wait (20 ms) at a time
    assert 10 <= stats["read_ms_median"] <= stats["read_ms_max"] and stats["read_s_total"] >= 0.01 * stats["reads"]


@pytest.mark.skipif(device_memory.open_reader() is not None, reason="this machine has NVML to read")
def test_without_nvml_it_says_so_and_exits_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchsuite.tools.nvml_load"], capture_output=True, text=True,
                          check=False, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"].startswith("no NVML to read")
