"""CUDA checks of block-FP8 experts (paged_experts/fp8.py) at Qwen3-30B-A3B layer shapes:
- the FP8 Triton kernels compiled, in bf16, against the dequantized weights (the interpreter test's
  check at the GPU's dtype), and paged (permuted slot table) == resident bit for bit;
- at the real shape, the decode kernels with the tile table's tiles for batches 1-4, and the grouped
  FP8 kernel of large steps (prefill) against the dequantize-then-grouped-GEMM path;
- the page-in kernel copies FP8 rows and their scales from pinned memory, nothing for padding;
- FP8 paged == FP8 resident bit for bit for K from top_k to E (device-planned one-wave decode,
  host-planned multi-wave prefill), with the grouped backend and with the triton backend;
- graphed FP8 paged decode (triton backend) equals eager paged decode within bf16 rounding;
- a device-planned FP8 paged layer does not synchronize the host;
- the unpaged-scale control fails equality on the GPU too;
- the attention projections kept FP8 (kernels/linear_fp8.py): both kernels in bf16 against the dequantized
  weight, at the real q/k/v and o shapes for decode and prefill row counts; the compiled, graphed decode
  (the server's path) with FP8 attention against eager, and against the dequantized attention's logits.

Plain functions, so the module also runs as a script: `python tests/cuda/test_fp8_cuda.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from test_device_paging_cuda import decode  # tests/cuda is on sys.path (pytest's rootdir import, or script mode)

import paged_experts.residency.store as store_mod
from paged_experts import fp8
from paged_experts.kernels.copy_kernel import copy_planned
from paged_experts.model import MoeCausalLM
from paged_experts.moe import StepContext
from paged_experts.residency.store import ExpertTensors
from paged_experts.runtime import RuntimeConfig

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass

QWEN2 = "synth:qwen3-30b-a3b-fp8-shape?layers=2&seed=0"  # 128 FP8 experts per layer, top_k 8
PROMPTS = [[5, 17, 300, 41, 9, 77, 3, 8], [800, 2, 64], [11, 12, 13, 14, 15]]


def rt(**kw: object) -> RuntimeConfig:
    return RuntimeConfig(device="cuda", dtype="bfloat16", **kw)  # type: ignore[arg-type]


def test_fp8_kernels_bf16() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_moe_triton import check_fp8_kernels

    check_fp8_kernels(device="cuda", dtype=torch.bfloat16, tol=2e-2)


def test_grouped_fp8_kernel_bf16() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_moe_triton import check_grouped_fp8

    check_grouped_fp8(device="cuda", dtype=torch.bfloat16, tol=2e-2)


def test_grouped_fp8_glu_kernel_bf16() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_moe_triton import check_grouped_fp8_glu

    check_grouped_fp8_glu(device="cuda", dtype=torch.bfloat16, tol=2e-2)


def test_grouped_fp8_row_maps_bf16() -> None:
    """A wave's launches reading and writing rows through the layout (moe/waves.py ROWS_IN_KERNEL) compute the bits
    of the gather, launch and index copy they replace, on the GPU's compiled kernels (the interpreter's check): small
    tiles, then the production's tiles at Qwen3-30B-A3B's expert shape (wgmma and a pipelined K loop on Hopper)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_moe_triton import check_row_maps

    from paged_experts.kernels import moe_tiles

    check_row_maps(device="cuda", dtype=torch.bfloat16)
    check_row_maps(device="cuda", dtype=torch.bfloat16, tiles=moe_tiles.fp8_prefill(2048, 768), hidden=2048, inter=768)


def _real_layer(e: int = 128, h: int = 2048, i: int = 768) -> ExpertTensors:
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = [fp8.quantize(torch.randn(s, device="cuda", generator=gen) / 30) for s in ((e, i, h), (e, i, h), (e, h, i))]
    return ExpertTensors(*(w for w, _ in q), *(s for _, s in q))


def test_fp8_decode_kernels_at_the_real_shape_with_the_table_tiles() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_moe_triton import reference_moe

    from paged_experts.kernels import moe_tiles, moe_triton

    layer = _real_layer()
    dense = layer.dense(torch.float32)
    gen = torch.Generator().manual_seed(4)
    for b in (1, 2, 3, 4):
        x = torch.randn(b, 2048, generator=gen).to("cuda", torch.bfloat16)  # [B, H]
        rows = torch.stack([torch.randperm(128, generator=gen)[:8] for _ in range(b)]).reshape(-1).cuda()  # [B*k]
        w = torch.softmax(torch.randn(b, 8, generator=gen), -1).cuda()  # [B, k]
        got = moe_triton.moe_pairs(x, rows, w, layer.gate, layer.up, layer.down, 8, *layer.scales)
        want = reference_moe(x, rows, w, dense.gate, dense.up, dense.down, 8)
        rel = ((got.float() - want).abs().max() / want.abs().max()).item()
        print(f"B={b} tiles {moe_tiles.fp8_tiles(2048, 768, 8, b)}: max relative difference {rel:.2e}")
        assert rel < 2e-2


def test_fp8_grouped_kernel_matches_the_dequantized_path_at_the_real_shape() -> None:
    from paged_experts.kernels.fused import expert_mlp, fp8_grouped_tiles, group_pairs

    layer = _real_layer()
    assert fp8_grouped_tiles(layer) is not None  # the shipped choice for this shape: the FP8 kernel
    gen = torch.Generator().manual_seed(5)
    for tokens in (5, 300):
        rows = torch.stack([torch.randperm(128, generator=gen)[:8] for _ in range(tokens)]).reshape(-1).cuda()
        order, offs, _ = group_pairs(rows, 128)
        x = torch.randn(tokens * 8, 2048, generator=gen).to("cuda", torch.bfloat16)  # [P, H] sorted pairs
        got = expert_mlp(x, layer, offs).float()
        want = expert_mlp(x, layer.dense(torch.bfloat16), offs).float()
        rel = ((got - want).abs().max() / want.abs().max()).item()
        print(f"{tokens} tokens: grouped FP8 kernel vs dequantized grouped GEMM, max relative difference {rel:.2e}")
        assert rel < 2e-2


def test_page_in_kernel_copies_fp8_rows_and_scales() -> None:
    e, inter, hidden, k = 6, 768, 2048, 4
    host = ExpertTensors.empty(e, hidden, inter, torch.bfloat16, torch.device("cpu"), pin=True, is_fp8=True)
    for name in host.names():
        values = torch.randn(host.get(name).shape)
        host.get(name).copy_(values.to(host.get(name).dtype))
    slots = ExpertTensors.empty(k, hidden, inter, torch.bfloat16, torch.device("cuda"), is_fp8=True)
    for name in slots.names():
        fp8.raw(slots.get(name)).zero_()
    copy_planned(host, slots, torch.tensor([5, 2, e, e], device="cuda"), torch.tensor([3, 0, k, k], device="cuda"))
    torch.cuda.synchronize()
    for name in host.names():
        got, want = fp8.raw(slots.get(name)).cpu(), fp8.raw(host.get(name))
        assert torch.equal(got[3], want[5]) and torch.equal(got[0], want[2]), name
        assert not got[1].any() and not got[2].any(), name


def _paged_equals_resident(backend: str, **paged: object) -> None:
    resident = decode(
        MoeCausalLM.from_pretrained(QWEN2, rt(kernel_backend=backend, mode="resident")), PROMPTS[:1], steps=6
    )
    for k in (8, 9, 16, 64, 128):
        model = MoeCausalLM.from_pretrained(
            QWEN2, rt(kernel_backend=backend, mode="paged", resident_experts=k, **paged)
        )
        if paged.get("fused_page_in"):  # the decode steps went the fused way (equal outputs alone cannot say)
            with fused_calls() as calls:
                assert decode(model, PROMPTS[:1], steps=1) and calls[0] == len(model.moe_layers)  # one decode step
            model = MoeCausalLM.from_pretrained(
                QWEN2, rt(kernel_backend=backend, mode="paged", resident_experts=k, **paged)
            )
        assert model.moe_layers[0].host.is_fp8 and model.moe_layers[0].host.gate.is_pinned()
        for i, (a, b) in enumerate(zip(decode(model, PROMPTS[:1], steps=6), resident)):
            assert torch.equal(a, b), f"{backend} K={k}: output {i} differs by {(a - b).abs().max().item()}"
        total = model.counters.snapshot().total
        assert (total.misses > 0) == (k < 128) and total.waves >= total.steps


def test_fp8_paged_equals_resident_grouped() -> None:
    _paged_equals_resident("grouped")


def test_fp8_paged_equals_resident_triton() -> None:
    _paged_equals_resident("triton")


@contextmanager
def fused_calls() -> Iterator[list[int]]:
    """Counts `PagedLayer._fused_page_in` calls while open: [count]."""
    from paged_experts.moe.paged import PagedLayer

    calls, plain = [0], PagedLayer._fused_page_in

    def counted(self: PagedLayer, *args: object) -> object:
        calls[0] += 1
        return plain(self, *args)

    PagedLayer._fused_page_in = counted  # type: ignore[method-assign, assignment]
    try:
        yield calls
    finally:
        PagedLayer._fused_page_in = plain  # type: ignore[method-assign]


def test_fp8_paged_equals_resident_triton_fused_page_in() -> None:
    """RuntimeConfig.fused_page_in: a one-token step's misses read from pinned host rows by the expert kernels
    and written through to their slots; later steps read those slots as hits, so a wrong write shows too."""
    _paged_equals_resident("triton", fused_page_in=True)


def test_read_through_kernels_bf16_from_pinned_memory() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_moe_triton import check_read_through

    check_read_through(device="cuda", dtype=torch.bfloat16)


def _graphed_fp8_paged_decode_matches_eager(**paged_kw: object) -> None:
    paged = rt(kernel_backend="triton", mode="paged", resident_experts=40, **paged_kw)
    eager = decode(MoeCausalLM.from_pretrained(QWEN2, paged), PROMPTS, steps=5)
    model = MoeCausalLM.from_pretrained(QWEN2, paged)
    model.enable_cuda_graphs([1, 2, 3, 4])
    graphed = decode(model, PROMPTS, steps=5)
    assert model.graph_replays == 5
    worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(graphed, eager))
    print(f"graphed vs eager FP8 paged decode (bf16, triton, {paged_kw}): worst relative difference {worst:.2e}")
    assert worst < 5e-2


def test_graphed_fp8_paged_decode_matches_eager() -> None:
    _graphed_fp8_paged_decode_matches_eager()


def test_graphed_fp8_paged_decode_with_fused_page_in_matches_eager_and_plain() -> None:
    """Batch-1 graphs with the fused page-in: graphed against eager, and against graphed copy-then-compute
    bit for bit (the same kernels' arithmetic, the same plans)."""
    _graphed_fp8_paged_decode_matches_eager(fused_page_in=True)
    runs = []
    for fused in (False, True):
        model = MoeCausalLM.from_pretrained(
            QWEN2, rt(kernel_backend="triton", mode="paged", resident_experts=16, fused_page_in=fused)
        )
        model.enable_cuda_graphs([1])
        with fused_calls() as calls:  # graphs are captured on first use: inside the decode, whose Python runs once
            runs.append((decode(model, PROMPTS[:1], steps=6), model.counters.snapshot().total))
        assert (calls[0] > 0) == fused, calls
        assert model.graph_replays == 6
    (plain, plain_total), (fused_out, fused_total) = runs
    assert all(torch.equal(a, b) for a, b in zip(fused_out, plain)), "fused page-in differs from copy-then-compute"
    assert fused_total.misses == plain_total.misses > 0 and fused_total.bytes_paged_in == plain_total.bytes_paged_in


def test_device_planned_fp8_paged_layer_does_not_sync() -> None:
    _does_not_sync(tokens=2)  # 16 pairs <= K: copy, then compute


def test_fused_page_in_layer_does_not_sync() -> None:
    _does_not_sync(tokens=1, fused_page_in=True)  # one token: the fused path


def _does_not_sync(tokens: int, **paged: object) -> None:
    model = MoeCausalLM.from_pretrained(QWEN2, rt(kernel_backend="triton", mode="paged", resident_experts=16, **paged))
    layer = model.moe_layers[0]
    x = torch.randn(tokens, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    ctx = StepContext(seq_ids=tuple(range(tokens)), positions=(0,) * tokens)
    layer.forward(x, ctx, None, [])  # warm-up: Triton compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            layer.forward(torch.randn_like(x), ctx, None, [])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert model.counters.snapshot().total.misses > 0


def test_unpaged_scale_is_caught_on_the_gpu() -> None:
    resident = decode(MoeCausalLM.from_pretrained(QWEN2, rt(mode="resident")), PROMPTS[:1], steps=4)
    saved = store_mod.SCALE_TENSORS
    store_mod.SCALE_TENSORS = ("gate_scale", "up_scale")  # the injected fault: down's scales are never paged
    try:
        model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=8))
        paged = decode(model, PROMPTS[:1], steps=4)
    finally:
        store_mod.SCALE_TENSORS = saved
    assert model.counters.snapshot().total.misses > 0
    assert not all(torch.equal(a, b) for a, b in zip(paged, resident))


def test_fp8_linear_kernels_bf16() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_fp8_attention import check_fp8_linear

    check_fp8_linear(device="cuda", dtype=torch.bfloat16, tol=2e-2)


def test_fp8_linear_at_the_real_shapes() -> None:
    """q/k/v fused (N 5,120 x K 2,048) and o (2,048 x 4,096) at every decode row bucket and a prefill chunk:
    within bf16 rounding of the dequantized weight's fp32 product."""
    from paged_experts.kernels.linear_fp8 import fp8_linear

    gen = torch.Generator(device="cuda").manual_seed(4)
    for n, k in ((5120, 2048), (2048, 4096)):
        q, scale = fp8.quantize(torch.randn(n, k, device="cuda", generator=gen) / 45)
        dense = fp8.dequantize(q, scale, torch.float32)
        for m in (1, 2, 3, 4, 8, 16, 17, 2048):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            got = fp8_linear(x, q, scale).float()
            want = x.float() @ dense.T
            err = ((got - want).abs().max() / want.abs().max()).item()
            print(f"fp8_linear N={n} K={k} M={m}: max error / max value {err:.2e}")
            assert err < 1e-2, (n, k, m, err)


def test_compiled_graphed_decode_with_fp8_attention() -> None:
    """The server's decode path (triton backend, compiled attention halves, CUDA graphs) with the attention
    projections FP8: graphed equals eager within bf16 rounding, and the logits stay close to those of the
    dequantized attention (the same weights; only the products' rounding differs)."""
    paged = rt(kernel_backend="triton", mode="paged", resident_experts=40)
    model = MoeCausalLM.from_pretrained(QWEN2, paged)
    assert all(a.fp8 for a in model.attention_layers)
    eager = decode(model, PROMPTS, steps=5)
    model = MoeCausalLM.from_pretrained(QWEN2, paged)
    model.enable_cuda_graphs([1, 2, 3, 4], compile_layers=True)
    graphed = decode(model, PROMPTS, steps=5)
    assert model.graph_replays == 5
    worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(graphed, eager))
    print(f"compiled graphed vs eager decode, FP8 attention: worst relative difference {worst:.2e}")
    assert worst < 5e-2
    deq = MoeCausalLM.from_pretrained(QWEN2, rt(kernel_backend="triton", mode="paged", resident_experts=40,
                                                dequantize_attention=True))  # fmt: skip
    assert not any(a.fp8 for a in deq.attention_layers)
    first = decode(deq, PROMPTS, steps=0)
    worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(first, eager))
    print(f"prefill logits, FP8 against dequantized attention: worst relative difference {worst:.2e}")
    assert worst < 5e-2


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
