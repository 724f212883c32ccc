"""The page-in copy of every tensor of a row in one launch (kernels/copy_kernel.py `launch_copy_rows`):
- in Triton's interpreter (TRITON_INTERPRET=1, a child process) it writes exactly the planned rows of
  every tensor and nothing else: FP8 rows (bytes) with their float32 scale rows, bf16 rows, rows of one
  16 KiB chunk and of several with a partial last chunk, 1 to 6 tensors, padding entries (expert E);
- `copy_planned` takes it for the full grid and the per-tensor launches for a capped grid, alike;
- it compiles for the H200 (sm_90) with the real compiler (its per-chunk choice of tensor is control
  flow over pointers, which the interpreter does not type-check)."""

from __future__ import annotations

import os

import pytest
import torch
from interpreted import run_interpreted

E, K = 10, 6


def _filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(1, 120, raw.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8))
    return t


CASES = (  # per tensor: (row shape, dtype); rows of 384 B, 16 KiB exactly, 40 KiB (3 chunks, the last partial)
    [((64, 320), torch.uint8), ((64, 320), torch.uint8), ((320, 64), torch.uint8),
     ((4, 24), torch.float32), ((4, 24), torch.float32), ((24, 4), torch.float32)],  # an FP8 row
    [((64, 128), torch.bfloat16), ((64, 128), torch.bfloat16), ((128, 64), torch.bfloat16)],  # bf16, 16 KiB
    [((40, 512), torch.uint8)],  # one tensor, 20 KiB
    [((3, 5), torch.float32), ((160, 128), torch.bfloat16)],  # a tiny row first, then 40 KiB
)  # fmt: skip


def check_one_launch() -> None:
    from paged_experts.kernels.copy_kernel import launch_copy_rows

    experts = torch.tensor([7, 2, E, 9, E])  # three planned, two padding
    slot_ids = torch.tensor([4, 0, K, 5, K])
    for case, tensors in enumerate(CASES):
        srcs = [_filled((E, *shape), dtype, 10 * case + i) for i, (shape, dtype) in enumerate(tensors)]
        dsts = [torch.zeros((K + 1, *shape), dtype=dtype) for shape, dtype in tensors]  # + the spare slot K
        launch_copy_rows(srcs, dsts, experts, slot_ids, E)
        for i, (src, dst) in enumerate(zip(srcs, dsts)):
            for e, s in ((7, 4), (2, 0), (9, 5)):
                assert torch.equal(dst[s].view(torch.uint8), src[e].view(torch.uint8)), (case, i, e)
            for s in (1, 2, 3, K):
                assert not dst[s].view(torch.uint8).any(), (case, i, s)
        print("ok", case)


def check_copy_planned_takes_one_launch_for_the_full_grid() -> None:
    """copy_planned on a device it treats as the GPU's (graph_safe patched, as the interpreter runs
    CPU tensors): the full grid in one launch, a capped grid per tensor; the same rows either way."""
    from paged_experts.kernels import copy_kernel
    from paged_experts.residency.store import ExpertTensors

    copy_kernel.graph_safe = lambda device: True  # the interpreter: Triton kernels on CPU tensors
    calls: list[str] = []
    one, per = copy_kernel.launch_copy_rows, copy_kernel.launch_copy

    def one_launch(*args: object) -> None:
        calls.append("one")
        one(*args)  # type: ignore[arg-type]

    def per_tensor(*args: object) -> None:
        calls.append("per")
        per(*args)  # type: ignore[arg-type]

    copy_kernel.launch_copy_rows, copy_kernel.launch_copy = one_launch, per_tensor
    host = ExpertTensors.empty(E, 256, 192, torch.bfloat16, torch.device("cpu"), is_fp8=True)
    for i, name in enumerate(host.names()):
        host.get(name).view(torch.uint8).copy_(_filled(host.get(name).shape, host.get(name).dtype, i).view(torch.uint8))
    experts, slot_ids = torch.tensor([3, E, 8]), torch.tensor([1, K, 4])
    results = []
    for programs, one_launch_flag, want in ((None, True, ["one"]), (4, True, ["per"] * 6), (None, False, ["per"] * 6)):
        calls.clear()
        slots = ExpertTensors.empty(K + 1, 256, 192, torch.bfloat16, torch.device("cpu"), is_fp8=True)
        for name in slots.names():
            slots.get(name).view(torch.uint8).zero_()
        copy_kernel.copy_planned(host, slots, experts, slot_ids, programs=programs, one_launch=one_launch_flag)
        assert calls == want, (programs, one_launch_flag, calls)
        results.append([slots.get(n).view(torch.uint8).clone() for n in slots.names()])
        for n in slots.names():
            got, src = slots.get(n).view(torch.uint8), host.get(n).view(torch.uint8)
            assert torch.equal(got[1], src[3]) and torch.equal(got[4], src[8]), n
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    print("ok planned")


def test_one_launch_copies_exactly_the_planned_rows_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    out = run_interpreted("test_copy_one_launch", "check_one_launch")
    assert out.count("ok ") == len(CASES), out


def test_copy_planned_takes_one_launch_for_the_full_grid_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    out = run_interpreted("test_copy_one_launch", "check_copy_planned_takes_one_launch_for_the_full_grid")
    assert "ok planned" in out, out


def test_one_launch_compiles_for_the_h200() -> None:
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter compiles nothing")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from paged_experts.kernels import copy_kernel

    fn = copy_kernel._copy_rows_one_launch
    pointers = {"experts": "*i64", "slots": "*i64", **{f"{p}{i}": "*u8" for i in range(6) for p in "sd"}}
    signature = {a: pointers.get(a, "constexpr" if a == "BLOCK" else "i32") for a in fn.arg_names}
    # what the launcher derives for real rows: 16-byte aligned tensors, row sizes and pitches multiples of 16
    # (FP8 1,572,864 and 384 bytes; bf16 rows alike; a packed row's pitch is a multiple of 256), which is what
    # allows 16-byte loads
    aligned = [a for a in fn.arg_names if a in pointers or a[0] in "np"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn, signature, {"BLOCK": copy_kernel.BLOCK_BYTES}, attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx  # byte-wide loads would cap the link's rate
    # ... and the launcher may derive them: only the chunk starts are kept from specialization
    kept = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    assert kept == {"c1", "c2", "c3", "c4", "c5"}
