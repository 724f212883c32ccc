"""The page-in copy kernel (paged_experts.kernels.copy_kernel) in Triton's interpreter: the full grid
and the capped grid (RuntimeConfig.copy_programs: few programs looping over the (entry, chunk) work
items) copy exactly the planned rows, skip padding entries, touch no other slot, for bf16 rows and
FP8 rows copied as bytes, rows of one chunk and of several with a ragged last chunk."""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted

pytest.importorskip("triton")


def check_capped_and_full_grids_copy_the_planned_rows() -> None:
    from paged_experts.kernels.copy_kernel import BLOCK_BYTES, launch_copy

    gen = torch.Generator().manual_seed(0)
    e, k = 6, 4
    for dtype, row_shape in ((torch.bfloat16, (3, 5)), (torch.uint8, (BLOCK_BYTES * 2 + 100,))):
        if dtype == torch.uint8:
            src = torch.randint(0, 255, (e, *row_shape), generator=gen, dtype=torch.uint8)
        else:
            src = torch.randn((e, *row_shape), generator=gen).to(dtype)
        experts = torch.tensor([4, e, 1, e, 5])  # two padding entries (expert E); a real one last
        slots = torch.tensor([2, k, 0, k, 3])
        for programs in (None, 1, 3, 1000):
            dst = torch.full((k + 1, *row_shape), 7, dtype=dtype)  # slot K: the spare a padded entry names
            launch_copy(src, dst, experts, slots, e, programs)
            want = torch.full_like(dst, 7)
            want[2], want[0], want[3] = src[4], src[1], src[5]
            assert torch.equal(dst, want), (dtype, programs)
    print("ok")


@pytest.mark.slow
def test_capped_and_full_grids_copy_the_planned_rows_in_the_interpreter() -> None:
    assert run_interpreted("test_copy_kernel", "check_capped_and_full_grids_copy_the_planned_rows").strip() == "ok"


def check_the_overlap_benchmarks_wide_copy_lands_every_row() -> None:
    """benchmarks/copy_overlap.py's `wide:P` arm (the capped kernel at a 64 KiB block and 8 warps, a launch per
    tensor): FP8 rows of two chunks with a ragged last one and scale rows of less than one, for 1 and 3 programs."""
    import importlib.util
    import sys
    from pathlib import Path

    from paged_experts import fp8
    from paged_experts.residency.store import ExpertTensors

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "copy_overlap.py"
    spec = importlib.util.spec_from_file_location("copy_overlap", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["copy_overlap"] = bench  # its dataclass looks its module up there (a child process: nothing leaks)
    spec.loader.exec_module(bench)
    cpu = torch.device("cpu")
    host = ExpertTensors.empty(5, 384, 256, torch.bfloat16, cpu, is_fp8=True)  # gate row 98,304 B: 2 chunks
    gen = torch.Generator().manual_seed(1)
    for name in host.names():
        t = fp8.raw(host.get(name))
        t.copy_(torch.randint(0, 120, t.shape, dtype=torch.uint8, generator=gen) if t.dtype == torch.uint8
                else torch.rand(t.shape, generator=gen))  # fmt: skip
    pairs = [(4, 0), (2, 2)]
    experts, slot_ids = torch.tensor([4, 2]), torch.tensor([0, 2])
    for programs in (1, 3):
        slots = ExpertTensors.empty(3, 384, 256, torch.bfloat16, cpu, is_fp8=True)
        for name in slots.names():  # as the benchmark fills them: slot s holds expert s
            fp8.raw(slots.get(name)).copy_(fp8.raw(host.get(name))[:3])
        setup = bench.Setup(host, slots, cpu, top_k=2, tokens=1)
        bench.clear_rows(setup, [0, 2])
        bench._wide_copy(setup, experts, slot_ids, programs)
        bench.check_copied(setup, pairs)  # rows 0 and 2 copied, row 1 untouched
        bench.clear_rows(setup, [0, 2])
        bench._wide_copy(setup, experts[:1], slot_ids[:1], programs)
        try:  # the check fails a copy that missed a row
            bench.check_copied(setup, pairs)
        except AssertionError as exc:
            assert "slot 2 does not hold expert 2" in str(exc), exc
        else:
            raise AssertionError("check_copied passed a copy that missed slot 2")
    print("ok")


@pytest.mark.slow
def test_the_overlap_benchmarks_wide_copy_lands_every_row_in_the_interpreter() -> None:
    assert run_interpreted("test_copy_kernel", "check_the_overlap_benchmarks_wide_copy_lands_every_row").strip() == "ok"


def test_copy_planned_on_the_cpu_ignores_the_cap() -> None:
    """Without CUDA the copy is an index_copy after one host read; the cap has nothing to cap."""
    from paged_experts.kernels.copy_kernel import copy_planned
    from paged_experts.residency.store import ExpertTensors

    host = ExpertTensors(torch.randn(5, 2, 3), torch.randn(5, 2, 3), torch.randn(5, 3, 2))
    for programs in (None, 2):
        slots = ExpertTensors(torch.zeros(3, 2, 3), torch.zeros(3, 2, 3), torch.zeros(3, 3, 2))
        copy_planned(host, slots, torch.tensor([3, 5]), torch.tensor([1, 3]), programs=programs)
        assert torch.equal(slots.gate[1], host.gate[3]) and torch.equal(slots.down[1], host.down[3])
        assert not slots.gate[0].any() and not slots.gate[2].any()
