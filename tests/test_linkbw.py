"""Link bandwidth probe: plan, arithmetic, JSON contract with preflight, the timing loop with a fake
clock, and a clear error without CUDA. The real measurement runs under the `cuda` marker."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchsuite.cli import main as cli_main
from benchsuite.errors import RunError, UserError
from benchsuite.tools import linkbw
from benchsuite.tools.preflight import parse_link


def _report(*measurements: linkbw.LinkMeasurement) -> linkbw.LinkBwReport:
    return linkbw.LinkBwReport(device="fake", torch_version="x", cuda_version="y", measurements=measurements)


def test_measurement_arithmetic() -> None:
    m = linkbw.LinkMeasurement("h2d", "pinned", 2_000_000, 10, (0.001, 0.002, 0.0005))
    assert m.median_gb_per_s == pytest.approx(2e7 / 0.001 / 1e9)
    assert m.best_gb_per_s == pytest.approx(2e7 / 0.0005 / 1e9)


def test_plan_cases() -> None:
    cases = linkbw._cases(linkbw.LinkPlan())
    assert len(cases) == 2 * (
        3 * 2 + 1 + 3 + 1
    )  # per direction: pinned 3 sizes x (single + burst) + 1 GiB, pageable 3 + 1
    assert all(copies == 1 for _, memory, _, copies, _ in cases if memory == "pageable")
    assert ("h2d", "pinned", linkbw.GIB_BYTES, 1, 3) in cases
    small = linkbw._cases(linkbw.LinkPlan(pageable=False, d2h=False, burst_copies=1))
    assert [c[0:2] for c in small] == [("h2d", "pinned")] * 4


def test_paging_figure_and_json_round_trip(tmp_path: Path) -> None:
    report = _report(
        linkbw.LinkMeasurement("h2d", "pinned", 9_437_184, 384, (0.08,)),
        linkbw.LinkMeasurement("h2d", "pinned", 2_433_024, 384, (0.02,)),
        linkbw.LinkMeasurement("h2d", "pinned", 2_433_024, 1, (0.0001,)),
        linkbw.LinkMeasurement("d2h", "pinned", 2_433_024, 384, (0.01,)),
    )
    expected_gb_per_s = 2_433_024 * 384 / 0.02 / 1e9  # smallest expert size, back-to-back, host->device
    assert report.paging_gb_per_s == pytest.approx(expected_gb_per_s)
    path = tmp_path / "link.json"
    path.write_text(json.dumps(report.to_dict()))
    assert linkbw.paging_b_per_s_from_json(path) == pytest.approx(expected_gb_per_s * 1e9)
    b_per_s, source = parse_link(str(path))
    assert b_per_s == pytest.approx(expected_gb_per_s * 1e9) and "measured" in source
    with pytest.raises(ValueError):
        _ = _report(linkbw.LinkMeasurement("h2d", "pageable", 10, 1, (1.0,))).paging_gb_per_s


def test_bad_json_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema_version": 0, "paging_gb_per_s": 50}))
    with pytest.raises(UserError, match="schema"):
        linkbw.paging_b_per_s_from_json(path)
    path.write_text("{not json")
    with pytest.raises(UserError):
        linkbw.paging_b_per_s_from_json(path)


class _FakeClockTorch:
    """Stands in for torch in `_time_copies`: events read a fake clock that each copy advances."""

    def __init__(self, s_per_copy: float) -> None:
        self.now_s = 0.0
        self.copies = 0
        clock = self

        class Event:
            def __init__(self, enable_timing: bool) -> None:
                self.t = None

            def record(self) -> None:
                self.t = clock.now_s

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, end: Event) -> float:
                return (end.t - self.t) * 1e3

        self.cuda = SimpleNamespace(Event=Event, synchronize=lambda: None)
        self.s_per_copy = s_per_copy


class _Buf:
    def __init__(self, clock: _FakeClockTorch) -> None:
        self.clock = clock

    def __getitem__(self, _: slice) -> _Buf:
        return self

    def copy_(self, other: _Buf, non_blocking: bool) -> None:
        self.clock.now_s += self.clock.s_per_copy
        self.clock.copies += 1


def test_timing_loop_discards_warmup_and_times_all_copies() -> None:
    fake = _FakeClockTorch(s_per_copy=0.002)
    samples = linkbw._time_copies(fake, _Buf(fake), _Buf(fake), size=100, copies=5, warmup=2, samples=3)
    assert samples == pytest.approx((0.01, 0.01, 0.01))
    assert fake.copies == (2 + 3) * 5


def test_the_kernel_row_is_beside_the_paging_figure_never_in_it() -> None:
    """The copy kernel's measurement (the runtime's decode page-in) is reported as its own figure; the paging figure
    stays the DMAs' even where the kernel's rows would be the smallest back-to-back case."""
    dma = linkbw.LinkMeasurement("h2d", "pinned", 2_433_024, 384, (0.02,))
    kernel = linkbw.LinkMeasurement("h2d", "pinned", 1_000_000, 16, (0.0004,), method="kernel")
    report = _report(dma, kernel)
    assert report.paging_gb_per_s == pytest.approx(dma.median_gb_per_s)
    assert report.kernel_gb_per_s == pytest.approx(16e6 / 0.0004 / 1e9)
    stored = report.to_dict()
    assert stored["kernel_gb_per_s"] == report.kernel_gb_per_s and stored["measurements"][1]["method"] == "kernel"
    assert "decode page-in (the runtime's copy kernel, pinned rows -> slots): 40.0 GB/s" in linkbw.render(report)
    failed = linkbw.LinkBwReport(device="fake", torch_version="x", cuda_version="y", measurements=(dma,),
                                 kernel_error="RuntimeError: no Triton")  # fmt: skip
    assert failed.kernel_gb_per_s is None and failed.to_dict()["kernel_error"] == "RuntimeError: no Triton"
    assert "copy kernel): not measured (RuntimeError: no Triton)" in linkbw.render(failed)


def test_the_kernel_probe_copies_scattered_rows_and_refuses_wrong_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_measure_kernel` on the CPU with the kernel's launch emulated: it copies every other host row into the
    slots in order, checks the bytes (a launch that copies the wrong rows is an error, not a figure) and needs
    twice its rows in the host buffer."""
    from paged_experts.kernels import copy_kernel

    def emulated(srcs, dsts, experts, slot_ids, num_experts) -> None:  # noqa: ANN001 - launch_copy_rows' own
        assert num_experts == 10
        dsts[0][slot_ids] = srcs[0][experts + shift]

    shift = 0
    monkeypatch.setattr(copy_kernel, "graph_safe", lambda device: True)
    monkeypatch.setattr(copy_kernel, "launch_copy_rows", emulated)
    monkeypatch.setattr(linkbw, "_time_runs", lambda torch_, run, warmup, samples: (run(), (0.001,))[1])
    plan = linkbw.LinkPlan(kernel_rows=3, kernel_row_bytes=1000)
    host, dev = torch.zeros(10_500, dtype=torch.uint8), torch.zeros(5000, dtype=torch.uint8)
    measured = linkbw._measure_kernel(torch, plan, host, dev)
    assert (measured.method, measured.copies, measured.size_bytes) == ("kernel", 3, 1000)
    assert measured.median_gb_per_s == pytest.approx(3000 / 0.001 / 1e9)
    assert torch.equal(dev[:3000].view(3, 1000), host[:6000].view(6, 1000)[0::2]) and dev[:3000].any()
    shift = 1
    with pytest.raises(RuntimeError, match="differ from the host rows"):
        linkbw._measure_kernel(torch, plan, host, dev)
    with pytest.raises(RuntimeError, match="too few 1000-byte rows for 6"):
        linkbw._measure_kernel(torch, linkbw.LinkPlan(kernel_rows=6, kernel_row_bytes=1000), host, dev)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_no_cuda_is_a_clear_error(capsys) -> None:
    with pytest.raises(RunError, match="needs a CUDA GPU"):
        linkbw.measure(linkbw.LinkPlan())
    assert cli_main(["linkbw"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_on_gpu(tmp_path: Path) -> None:
    plan = linkbw.LinkPlan(expert_sizes_bytes=(2_433_024,), large_bytes=64 * 2**20, burst_copies=16, samples=2)
    t0 = time.perf_counter()
    report = linkbw.measure(plan)
    assert time.perf_counter() - t0 < 30
    assert all(m.median_gb_per_s > 0.1 for m in report.measurements)
    assert report.paging_gb_per_s > 1.0
    # the runtime's copy kernel, checked for its bytes inside the probe (a Triton build of torch: the CUDA wheels)
    assert report.kernel_error is None and report.kernel_gb_per_s is not None and report.kernel_gb_per_s > 1.0
