"""Prefill attention through torch's fused kernel (paged_experts.attention.attend, fused=True) against
the explicit matmuls it replaces for long chunks on CUDA: the same values over a chunk that starts
after earlier context (the additive causal mask offset), with grouped KV heads, in fp32 to float
rounding and in bf16 to bf16 rounding; on the CPU the default stays the explicit path."""

from __future__ import annotations

import pytest
import torch

from paged_experts.attention import FUSED_MIN_QUERIES, attend, causal_mask


def inputs(dtype: torch.dtype, start: int, n: int, heads: int = 8, kv_heads: int = 2, dim: int = 16):
    gen = torch.Generator().manual_seed(start * 1000 + n)
    kv_k = torch.randn(300, kv_heads, dim, generator=gen).to(dtype)  # [slots, kvh, D]
    kv_v = torch.randn(300, kv_heads, dim, generator=gen).to(dtype)
    table = torch.randperm(300, generator=gen)[: start + n][None]  # [1, L]: rows scattered in the pool
    q = torch.randn(1, n, heads, dim, generator=gen).to(dtype)  # [1, n, nh, D]
    return q, kv_k, kv_v, table, causal_mask(start, n, dtype)[None]


@pytest.mark.parametrize(("start", "n"), [(0, 1), (0, 70), (40, 70), (100, 3)])
def test_fused_attention_equals_the_explicit_matmuls(start: int, n: int) -> None:
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
        q, kv_k, kv_v, table, mask = inputs(dtype, start, n)
        explicit = attend(q, kv_k, kv_v, table, mask, fused=False)
        fused = attend(q, kv_k, kv_v, table, mask, fused=True)
        assert fused.shape == explicit.shape == (1, n, 8 * 16)
        assert (fused.float() - explicit.float()).abs().max().item() <= tol, dtype
    # the mask is honoured: the chunk's last value changed changes only its last query's output
    q, kv_k, kv_v, table, mask = inputs(torch.float32, start, n)
    before = attend(q, kv_k, kv_v, table, mask, fused=True)
    kv_v[table[0, -1]] += 100.0
    after = attend(q, kv_k, kv_v, table, mask, fused=True)
    assert torch.equal(before[:, :-1], after[:, :-1]) and not torch.equal(before[:, -1], after[:, -1])


def test_the_cpu_keeps_the_explicit_path_by_default() -> None:
    q, kv_k, kv_v, table, mask = inputs(torch.float32, 10, FUSED_MIN_QUERIES)
    assert torch.equal(attend(q, kv_k, kv_v, table, mask), attend(q, kv_k, kv_v, table, mask, fused=False))
