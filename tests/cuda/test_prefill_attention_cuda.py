"""CUDA check of prefill attention through torch's fused kernel (attention.attend's default for chunks
of FUSED_MIN_QUERIES queries or more on CUDA) at the Qwen3-30B-A3B head shape (32 query heads, 4 KV
heads x 128), bf16, one 2,048-token chunk after 512 tokens of context:
- its output equals the explicit matmuls within bf16 rounding;
- it needs a fraction of their peak device memory (the explicit path holds the [32, 2048, 2560]
  scores three times, ~1.3 GB here), printed;
- a decode step (one query) keeps the explicit path.

Plain functions, so the module also runs as a script: `python tests/cuda/test_prefill_attention_cuda.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from paged_experts.attention import attend, causal_mask

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass


def _peak_bytes(fn) -> tuple[torch.Tensor, int]:  # noqa: ANN001 - a closure over the inputs
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def test_fused_prefill_attention_matches_and_saves_memory() -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    start, n, heads, kv_heads, dim = 512, 2048, 32, 4, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    kv_k = torch.randn(10240, kv_heads, dim, generator=gen, device=dev).to(dtype)  # [slots, kvh, D]
    kv_v = torch.randn(10240, kv_heads, dim, generator=gen, device=dev).to(dtype)
    table = torch.randperm(10240, generator=gen, device=dev)[: start + n][None]  # [1, L]
    q = torch.randn(1, n, heads, dim, generator=gen, device=dev).to(dtype)
    mask = causal_mask(start, n, dtype).to(dev)[None]  # [1, n, L]
    explicit, explicit_peak = _peak_bytes(lambda: attend(q, kv_k, kv_v, table, mask, fused=False))
    fused, fused_peak = _peak_bytes(lambda: attend(q, kv_k, kv_v, table, mask))  # the default on CUDA
    worst = (fused.float() - explicit.float()).abs().max().item()
    print(f"prefill attention, {n} queries over {start + n} keys: peak {explicit_peak / 2**20:.0f} MiB explicit, "
          f"{fused_peak / 2**20:.0f} MiB fused; worst difference {worst:.3g}")  # fmt: skip
    assert worst < 3e-2
    assert fused_peak < explicit_peak / 4
    # one query (a decode step): the explicit path, bit for bit
    one = q[:, -1:]
    assert torch.equal(
        attend(one, kv_k, kv_v, table, mask[:, -1:]), attend(one, kv_k, kv_v, table, mask[:, -1:], fused=False)
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
