"""CUDA checks of paged_experts.weights.weightgen: the GPU computes the numpy generator's integers, so the
built-in engine's in-memory model is the GGUF's model on a GPU too.
- indices_torch on CUDA == indices_np over a range that crosses several slabs, at an odd offset;
- one 48-layer-shape expert tensor (gate, [128, 768, 2048]) in bf16 from the GPU == numpy's;
- the in-memory host store built on CUDA == the one built on the CPU (1 layer of the real shapes);
- the generation rate on the GPU is printed (the 48-layer server start builds 58 GB with it).

Plain functions, so the module also runs as a script: `python tests/cuda/test_weightgen_cuda.py`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from paged_experts.weights import synth_memory, weightgen

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass


def test_indices_on_cuda_equal_numpy() -> None:
    start, count = 12_345, 3 * weightgen.SLAB + 77
    got = weightgen.indices_torch(9, "t", start, count, "cuda").cpu().numpy().astype(np.uint8)
    assert np.array_equal(got, weightgen.indices_np(9, "t", start, count))


def test_an_expert_tensor_on_cuda_equals_numpy() -> None:
    hf = weightgen.hf_shape(synth_memory.config_for(synth_memory.SynthSpec("qwen3-30b-a3b-shape", 1, 0)))
    t = weightgen.by_name(hf)[weightgen.expert_name(0, "gate")]
    torch.cuda.synchronize()
    started = time.perf_counter()
    gpu = weightgen.values_torch(0, t, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    print(f"weightgen on CUDA: {t.numel * 2 / seconds / 1e9:.1f} GB/s of bf16 ({t.numel / 1e6:.0f} M values)")
    want = torch.from_numpy(weightgen.values_np(0, t)).to(torch.bfloat16).reshape(t.shape)
    assert torch.equal(gpu.cpu(), want)


def test_host_store_built_on_cuda_equals_the_cpu_one() -> None:
    cfg = synth_memory.config_for(synth_memory.SynthSpec("qwen3-30b-a3b-shape", 1, 0))
    silent = synth_memory.silent_ids("synth:qwen3-30b-a3b-shape")
    synth_memory.clear_cache()
    gpu = synth_memory.host_weights(cfg, torch.bfloat16, 0, torch.device("cuda"), silent)
    synth_memory.clear_cache()
    cpu = synth_memory.host_weights(cfg, torch.bfloat16, 0, torch.device("cpu"), silent)
    assert torch.equal(gpu.lm_head, cpu.lm_head) and torch.equal(gpu.attention[0].q_proj, cpu.attention[0].q_proj)
    for name in ("gate", "up", "down"):
        assert torch.equal(gpu.experts[0].get(name), cpu.experts[0].get(name)), name
    synth_memory.clear_cache()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
