"""CUDA versions of the equality tests: paged == resident bit for bit (fp32 and bf16, both page-in
strategies, every K), offload / cpu-experts close to resident, pinned host store, fault control,
and a Qwen3-30B-A3B-shaped (2-layer) bf16 model paged at several K.

Plain functions without fixtures, so the module also runs as a script on a GPU box without pytest:
`python tests/cuda/test_cuda_runtime.py`.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

import paged_experts.residency.store as store_mod
from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.runtime import RuntimeConfig
from paged_experts.weights.synth import write_checkpoint

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass

PROMPTS = ([5, 17, 300, 41, 9, 77, 123], [800, 2, 64, 64, 901], [11, 12, 13, 14, 15, 16, 17, 18, 19])
DECODE = ([40, 41, 42], [7, 700, 70], [1000, 3, 33])
_TMP = tempfile.TemporaryDirectory(prefix="pe-cuda-")


@functools.cache
def tiny_ckpt() -> Path:
    return write_checkpoint("tiny", Path(_TMP.name) / "tiny", seed=3)


def run_scenario(model: MoeCausalLM) -> list[torch.Tensor]:
    pool = KvPool.for_model(model, capacity_tokens=256)
    seqs = [pool.new_sequence() for _ in PROMPTS]
    out = model.forward([SeqChunk(s, p, 0, all_logits=True) for s, p in zip(seqs, PROMPTS)])
    for step in DECODE:
        out += model.forward([SeqChunk(s, [t], s.num_tokens) for s, t in zip(seqs, step)])
    return out


def check_bit_for_bit(dtype: str, strategy: str) -> None:
    ckpt = tiny_ckpt()
    resident = run_scenario(
        MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="resident", device="cuda", dtype=dtype))
    )
    multi_wave = 0
    for k in range(4, 33):
        rt = RuntimeConfig(mode="paged", resident_experts=k, device="cuda", dtype=dtype, page_in=strategy)  # type: ignore[arg-type]
        model = MoeCausalLM.from_pretrained(ckpt, rt)
        assert model.moe_layers[0].host.gate.is_pinned()
        for i, (a, b) in enumerate(zip(run_scenario(model), resident)):
            assert torch.equal(a, b), f"K={k} {dtype} {strategy}: output {i} differs by {(a - b).abs().max().item()}"
        total = model.counters.snapshot().total
        assert total.hits + total.misses == total.activations
        assert total.bytes_paged_in == total.misses * model.config.expert_bytes(dtype)
        if total.misses:
            assert total.copy_time_s > 0.0
        multi_wave += total.waves > total.steps
    assert multi_wave >= 10


def test_paged_equals_resident_bit_for_bit_fp32_direct() -> None:
    check_bit_for_bit("float32", "direct")


def test_paged_equals_resident_bit_for_bit_fp32_staged() -> None:
    check_bit_for_bit("float32", "staged")


def test_paged_equals_resident_bit_for_bit_bf16_direct() -> None:
    check_bit_for_bit("bfloat16", "direct")


def test_paged_equals_resident_bit_for_bit_bf16_staged() -> None:
    check_bit_for_bit("bfloat16", "staged")


def test_paged_equals_resident_bit_for_bit_bf16_batch() -> None:
    check_bit_for_bit("bfloat16", "batch")  # page-ins of every host-planned step as one cuMemcpyBatchAsync


def test_offload_and_cpu_experts_close_to_resident_cuda() -> None:
    ckpt = tiny_ckpt()
    resident = run_scenario(MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="resident", device="cuda")))
    for rt in (
        RuntimeConfig(mode="offload", device="cuda"),
        RuntimeConfig(mode="offload", offload_layers=2, device="cuda"),
        RuntimeConfig(mode="cpu-experts", cpu_expert_layers=4, device="cuda"),
        RuntimeConfig(mode="cpu-experts", cpu_expert_layers=1, device="cuda"),
    ):
        for a, b in zip(run_scenario(MoeCausalLM.from_pretrained(ckpt, rt)), resident):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_fault_unpaged_down_proj_is_caught_cuda() -> None:
    ckpt = tiny_ckpt()
    resident = run_scenario(MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="resident", device="cuda")))
    saved = store_mod.EXPERT_TENSORS
    store_mod.EXPERT_TENSORS = ("gate", "up")  # the injected fault: down_proj is never paged
    try:
        model = MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="paged", resident_experts=8, device="cuda"))
        paged = run_scenario(model)
    finally:
        store_mod.EXPERT_TENSORS = saved
    assert model.counters.snapshot().total.misses > 0
    assert not all(torch.equal(a, b) for a, b in zip(paged, resident))


def test_qwen3_30b_shape_paged_equals_resident_bf16() -> None:
    """Real per-layer shapes (2 layers, 128 experts, top_k 8, bf16) through the whole load + page path."""
    out = Path(tempfile.mkdtemp(dir=_TMP.name)) / "q3"
    ckpt = write_checkpoint("qwen3-30b-a3b-shape", out, layers=2, seed=0, max_shard_bytes=2**30)
    assert (ckpt / "model.safetensors.index.json").is_file()
    rt = RuntimeConfig(mode="resident", device="cuda", dtype="bfloat16")
    resident = run_scenario(MoeCausalLM.from_pretrained(ckpt, rt))
    for k in (8, 24, 128):
        model = MoeCausalLM.from_pretrained(
            ckpt, RuntimeConfig(mode="paged", resident_experts=k, device="cuda", dtype="bfloat16")
        )
        paged = run_scenario(model)
        for a, b in zip(paged, resident):
            assert torch.equal(a, b), f"K={k}"
        snap = model.counters.snapshot().total
        assert snap.bytes_paged_in == snap.misses * 3 * 2048 * 768 * 2
        if k < 128:
            assert snap.waves > snap.steps  # a prefill union of ~100 experts needs several waves


if __name__ == "__main__":
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
