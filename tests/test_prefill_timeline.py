"""benchmarks/prefill_timeline.py on a trace built here, whose every part of the link's idle time at a
layer boundary is known: the device's chain (with a gap where the compute stream waited), the read's
return, the host's planning and the copy's wait."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from prefill_timeline import PAGE_IN, layer_boundaries, main, summary  # noqa: E402


def _x(cat: str, name: str, ts: float, dur: float, tid: object = 7, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "args": args}


def _layer(t0: float, corr: int, staged: bool = False) -> list[dict]:
    """One boundary from t0 (us): the last page-in of the layer before ends at t0 + 100; the compute
    stream runs 100..400 and 500..900 (a 100 us gap), then the ids' copy 950..1000 (its own work: the stream waited
    for the host 100 + 50 us); the host's call ends at 1030, then a synchronize to 1050 (another thread's
    synchronize at 1032 is not the read's); the first page-in is issued at 1450 and starts at 1650. `staged`: a
    staging copy issued at -50 runs 1300..1310: the link's last work before the layer, not its first page-in."""
    staging = [
        _x("cuda_runtime", "cudaMemcpyAsync", t0 - 50, 5, tid=1, correlation=corr + 5),
        _x("gpu_memcpy", PAGE_IN, t0 + 1300, 10, tid=9, correlation=corr + 5),
    ]
    return [
        _x("gpu_memcpy", PAGE_IN, t0 + 0, 100, tid=9, correlation=corr),
        _x("cuda_runtime", "cudaMemcpyAsync", t0 - 500, 5, tid=1, correlation=corr),
        _x("kernel", "attn", t0 + 100, 300),
        _x("kernel", "router", t0 + 500, 400),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", t0 + 950, 50, bytes=65536, correlation=corr + 1),
        # the waves' layout: a pinned upload on the compute stream, not a page-in
        _x("gpu_memcpy", PAGE_IN, t0 + 1200, 20, correlation=corr + 4),
        _x("cuda_runtime", "cudaMemcpyAsync", t0 + 1190, 5, tid=1, correlation=corr + 4),
        _x("cuda_runtime", "cudaMemcpyAsync", t0 + 400, 630, tid=1, correlation=corr + 1),
        _x("cuda_runtime", "cudaStreamSynchronize", t0 + 1032, 300, tid=2),
        _x("cuda_runtime", "cudaStreamSynchronize", t0 + 1035, 15, tid=1),
        _x("cuda_runtime", "cudaMemcpyAsync", t0 + 1450, 5, tid=1, correlation=corr + 2),
        _x("gpu_memcpy", PAGE_IN, t0 + 1650, 100, tid=9, correlation=corr + 2),
        # a device-to-host copy of another size (the step's logits) is not a layer's read
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", t0 + 1900, 10, bytes=8, correlation=corr + 3),
        _x("cuda_runtime", "cudaMemcpyAsync", t0 + 1890, 30, tid=1, correlation=corr + 3),
    ] + (staging if staged else [])


def test_each_boundary_splits_into_the_device_the_read_the_host_and_the_wait(tmp_path: Path) -> None:
    trace = {"traceEvents": _layer(0, 10) + _layer(5000, 20)}
    rows = layer_boundaries(trace)
    assert len(rows) == 2
    for row in rows:
        assert row == pytest.approx(
            {"idle_ms": 1.55, "device_ms": 0.9, "device_gap_ms": 0.15, "read_ms": 0.05, "host_ms": 0.4, "wait_ms": 0.2}
        )
        parts = row["device_ms"] + row["read_ms"] + row["host_ms"] + row["wait_ms"]
        assert parts == pytest.approx(row["idle_ms"])
    assert "layer boundaries (2): medians idle_ms 1.550, device_ms 0.900" in summary(rows)
    assert "over twice" not in summary(rows)
    slow = {**rows[0], "idle_ms": 7.5}
    assert "1 over twice the median idle (7.50 ms)" in summary([slow, rows[0], rows[1]])
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    assert main([str(path), "--rows"]) == 0


def test_a_copy_issued_before_the_read_is_link_work_not_the_layers_first_page_in() -> None:
    (row,) = layer_boundaries({"traceEvents": _layer(0, 10, staged=True)})
    # the idle time runs from the staging copy's end (1310) to the first page-in (1650); the host's part is still
    # the read's return to that page-in's call, and the device's part is negative: the link was busy past the read
    assert row == pytest.approx(
        {"idle_ms": 0.34, "device_ms": -0.31, "device_gap_ms": 0.0, "read_ms": 0.05, "host_ms": 0.4, "wait_ms": 0.2}
    )


def test_a_trace_without_reads_or_page_ins_has_no_boundaries() -> None:
    assert layer_boundaries({"traceEvents": [_x("kernel", "k", 0, 5)]}) == []
    assert "no ids read" in summary([])
