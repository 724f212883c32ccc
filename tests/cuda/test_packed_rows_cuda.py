"""CUDA checks of packed expert rows (RuntimeConfig.expert_rows = 'packed', residency/store.py): every tensor of an
expert in one byte row, each read by the kernels at its stride. The same bits as the split layout, so:
- paged prefill == resident at Qwen3-30B-A3B layer shapes, bf16 and block-FP8, with every page-in strategy
  (direct: one DMA a run of rows; kernel; batch; staged) and with prefill staging rows;
- device-planned paged decode == resident: plain, with the copy kernel's capped grid, overlapped (grouped and
  Triton backends, 1 and 2 groups), with the DMA proxy's copies, and with the expert kernels reading the misses'
  rows from the host themselves (fused_page_in);
- graphed == eager with packed rows (tests/graph_check.py: the grouped backend plain and compiled, the Triton
  backend overlapped and compiled);
- split rows, no longer the CUDA default of mode paged (RuntimeConfig.rows_layout) and so no longer what the other
  CUDA files' paged models hold, still equal resident when asked for.

Plain functions, so the module also runs as a script: `python tests/cuda/test_packed_rows_cuda.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_device_paging_cuda import QWEN2, check_graphed_paged, decode  # noqa: E402
from test_prefill_cuda import FP8, assert_same, long_prompt  # noqa: E402

from paged_experts.model import MoeCausalLM  # noqa: E402
from paged_experts.runtime import RuntimeConfig  # noqa: E402

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass


def rt(**kw: object) -> RuntimeConfig:
    return RuntimeConfig(device="cuda", dtype="bfloat16", **kw)  # type: ignore[arg-type]


def packed_model(path: str, **kw: object) -> MoeCausalLM:
    model = MoeCausalLM.from_pretrained(path, rt(expert_rows="packed", **kw))
    layer = model.moe_layers[0]
    assert layer.host.packed is not None and layer.host.packed.is_pinned()  # type: ignore[attr-defined]
    assert layer.device_experts.packed is not None  # type: ignore[attr-defined]
    return model


def test_packed_prefill_equals_resident_with_every_page_in() -> None:
    for path in (FP8, QWEN2):
        want = long_prompt(MoeCausalLM.from_pretrained(path, rt(mode="resident")), 256)
        for k, page_in in ((16, "direct"), (48, "direct"), (16, "kernel"), (16, "batch"), (16, "staged")):
            model = packed_model(path, mode="paged", resident_experts=k, page_in=page_in)
            assert_same(long_prompt(model, 256), want, f"{path} K={k} page_in={page_in}")
            prefill = model.counters.snapshot().prefill
            assert prefill.misses > 0 and prefill.waves > prefill.layer_steps
        staged = packed_model(path, mode="paged", resident_experts=16, prefill_staging_rows=24)
        assert_same(long_prompt(staged, 256), want, f"{path} staging rows")


def test_packed_device_planned_decode_equals_resident() -> None:
    prompts = [[5, 17, 300, 41, 9, 77, 3, 8], [800, 2, 64]]  # batch 2: 16 pairs, one wave for K >= 16
    for backend in ("grouped", "triton"):
        resident = decode(MoeCausalLM.from_pretrained(QWEN2, rt(mode="resident", kernel_backend=backend)), prompts, 6)
        variants: list[dict[str, object]] = [
            {}, {"copy_programs": 7}, {"overlap_page_in": True}, {"overlap_page_in": True, "overlap_groups": 2},
        ]  # fmt: skip
        if backend == "triton":
            variants.append({"overlap_page_in": True, "overlap_copies": "dma"})
        for extra in variants:
            model = packed_model(QWEN2, mode="paged", resident_experts=16, kernel_backend=backend, **extra)
            for i, (a, b) in enumerate(zip(decode(model, prompts, 6), resident)):
                assert torch.equal(a, b), f"{backend} {extra}: output {i} differs by {(a - b).abs().max().item()}"
            assert model.counters.snapshot().total.misses > 0


def test_packed_fused_page_in_equals_resident() -> None:
    """Batch-1 steps whose expert kernels read the misses' rows from the packed host rows and write them through."""
    prompts = [[5, 17, 300, 41, 9, 77, 3, 8]]
    for path in (QWEN2, FP8):
        resident = decode(MoeCausalLM.from_pretrained(path, rt(mode="resident", kernel_backend="triton")), prompts, 6)
        model = packed_model(path, mode="paged", resident_experts=16, kernel_backend="triton", fused_page_in=True)
        for i, (a, b) in enumerate(zip(decode(model, prompts, 6), resident)):
            assert torch.equal(a, b), f"{path}: output {i} differs by {(a - b).abs().max().item()}"
        assert model.counters.snapshot().total.misses > 0


def test_auto_packs_paged_rows_on_cuda_and_split_rows_still_equal_resident() -> None:
    default = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=16))
    assert default.moe_layers[0].host.packed is not None  # type: ignore[attr-defined]  # 'auto' on CUDA
    offload = MoeCausalLM.from_pretrained(QWEN2, rt(mode="offload", offload_layers=1))
    assert offload.moe_layers[0].host.packed is None  # type: ignore[attr-defined]  # offload: split unless asked
    prompts = [[5, 17, 300, 41, 9, 77, 3, 8], [800, 2, 64]]
    for path in (QWEN2, FP8):
        want = long_prompt(MoeCausalLM.from_pretrained(path, rt(mode="resident")), 256)
        split = MoeCausalLM.from_pretrained(path, rt(mode="paged", resident_experts=16, expert_rows="split"))
        assert split.moe_layers[0].host.packed is None  # type: ignore[attr-defined]
        assert_same(long_prompt(split, 256), want, f"{path} split rows, prefill")
        resident = decode(MoeCausalLM.from_pretrained(path, rt(mode="resident", kernel_backend="triton")), prompts, 6)
        split = MoeCausalLM.from_pretrained(
            path, rt(mode="paged", resident_experts=16, expert_rows="split", kernel_backend="triton")
        )
        for i, (a, b) in enumerate(zip(decode(split, prompts, 6), resident)):
            assert torch.equal(a, b), f"{path} split rows: output {i} differs by {(a - b).abs().max().item()}"
        assert split.counters.snapshot().total.misses > 0
    check_graphed_paged(overlap=True, backend="triton", rows="split")  # graphed == eager with split rows too


def test_packed_graphed_decode_matches_eager() -> None:
    check_graphed_paged(overlap=False, rows="packed")
    # the grouped backend compiled: torch.compile traces the expert pass over the packed views
    check_graphed_paged(overlap=False, compile_layers=True, rows="packed")
    check_graphed_paged(overlap=True, groups=2, backend="triton", compile_layers=True, rows="packed")


if __name__ == "__main__":
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
