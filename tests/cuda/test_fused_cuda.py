"""CUDA checks of the fused expert path, the in-memory synthetic models and the graphed decode step:
- fused paged == resident bit for bit (fp32 and bf16, K from top_k: multi-wave steps, to E);
- fused close to the per-expert reference loop in bf16;
- a resident MoE layer and a graphed decode step run with no host synchronization;
- graphed decode equals eager decode within rounding, with equal counters;
- a 2-layer Qwen3-30B-A3B-shaped bf16 model paged at K=16 equals resident.

Plain functions, so the module also runs as a script: `python tests/cuda/test_fused_cuda.py`.
"""

from __future__ import annotations

import torch

from paged_experts.kernels.fused import grouped_backend
from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.moe import StepContext
from paged_experts.runtime import RuntimeConfig

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass

TINY = "synth:tiny?layers=3&seed=5"
PROMPTS = ([5, 17, 300, 41, 9, 77], [800, 2, 64], [11, 12, 13, 14, 15])


def scenario(model: MoeCausalLM, steps: int = 3) -> list[torch.Tensor]:
    pool = KvPool.for_model(model, capacity_tokens=256)
    seqs = [pool.new_sequence() for _ in PROMPTS]
    last = model.forward([SeqChunk(s, p, 0, all_logits=True) for s, p in zip(seqs, PROMPTS)])
    out = list(last)
    for _ in range(steps):
        last = model.forward([SeqChunk(s, [int(lg[-1].argmax()) % 1000], s.num_tokens) for s, lg in zip(seqs, last)])
        out += last
    return out


def rt(dtype: str, **kw: object) -> RuntimeConfig:
    return RuntimeConfig(device="cuda", dtype=dtype, **kw)  # type: ignore[arg-type]


def check_paged_equals_resident(dtype: str) -> None:
    resident = scenario(MoeCausalLM.from_pretrained(TINY, rt(dtype, mode="resident")))
    multi_wave = 0
    for k in (4, 5, 9, 16, 32):
        model = MoeCausalLM.from_pretrained(TINY, rt(dtype, mode="paged", resident_experts=k))
        for i, (a, b) in enumerate(zip(scenario(model), resident)):
            assert torch.equal(a, b), f"K={k} {dtype}: output {i} differs by {(a - b).abs().max().item()}"
        total = model.counters.snapshot().total
        multi_wave += total.waves > total.steps
    assert multi_wave, "no K produced a multi-wave step"
    print(f"fused paged == resident ({dtype}), grouped backends {grouped_backend()}")


def test_fused_paged_equals_resident_fp32() -> None:
    check_paged_equals_resident("float32")


def test_fused_paged_equals_resident_bf16() -> None:
    check_paged_equals_resident("bfloat16")


def test_fused_close_to_loop_bf16() -> None:
    fused = scenario(MoeCausalLM.from_pretrained(TINY, rt("bfloat16", mode="resident")))
    loop = scenario(MoeCausalLM.from_pretrained(TINY, rt("bfloat16", mode="resident"), expert_kernel="loop"))
    worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(fused, loop))
    print(f"fused vs loop (bf16): worst relative difference {worst:.2e}")
    assert worst < 5e-2


def test_resident_moe_layer_does_not_sync() -> None:
    model = MoeCausalLM.from_pretrained(TINY, rt("bfloat16", mode="resident"))
    layer = model.moe_layers[0]
    x = torch.randn(4, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    ctx = StepContext(seq_ids=(0, 1, 2, 3), positions=(0, 0, 0, 0))
    layer.forward(x, ctx, None, [])  # warm-up (first use decides the grouped backend)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer.forward(x, ctx, None, [])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert model.counters.snapshot().total.steps == 2


def check_graphs(dtype: str, tol: float) -> None:
    eager = scenario(MoeCausalLM.from_pretrained(TINY, rt(dtype, mode="resident")), steps=4)
    model = MoeCausalLM.from_pretrained(TINY, rt(dtype, mode="resident"))
    model.enable_cuda_graphs([1, 2, 3, 4])
    graphed = scenario(model, steps=4)
    assert model.graph_replays == 4 and model.captured_graphs == [(3, 64)], model.captured_graphs
    worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(graphed, eager))
    print(f"graphed vs eager decode ({dtype}): worst relative difference {worst:.2e}")
    assert worst < tol


def test_graphs_refuse_fp32() -> None:
    model = MoeCausalLM.from_pretrained(TINY, rt("float32", mode="resident"))
    try:
        model.enable_cuda_graphs([1])
    except ValueError as exc:
        assert "bfloat16" in str(exc)
    else:
        raise AssertionError("fp32 CUDA graphs were accepted")


def test_graphs_match_eager_bf16() -> None:
    check_graphs("bfloat16", 5e-2)


def test_qwen_shaped_paged_equals_resident() -> None:
    path = "synth:qwen3-30b-a3b-shape?layers=2&seed=0"
    resident = scenario(MoeCausalLM.from_pretrained(path, rt("bfloat16", mode="resident")), steps=2)
    paged = scenario(MoeCausalLM.from_pretrained(path, rt("bfloat16", mode="paged", resident_experts=16)), steps=2)
    for a, b in zip(paged, resident):
        assert torch.equal(a, b)


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
            print("ok", name)
