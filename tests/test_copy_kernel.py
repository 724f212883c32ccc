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
