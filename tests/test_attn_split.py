"""attn_triton's split-KV decode attention (`decode_attention_split`) against the one-program-per-head
kernel (`decode_attention`) and plain torch (`attention.attend`), in the Triton interpreter
(TRITON_INTERPRET=1, CPU, fp32): contexts from one position to several chunks, batch sizes 1..8
with uneven lengths in one batch, GQA 8:1, a block size that does not divide the chunk, and chunk
sizes below, at and above the online softmax's tile. tests/cuda/test_attn_split_cuda.py runs the
same `check_split` compiled in bf16, and inside captured graphs.

Triton reads TRITON_INTERPRET when it is imported, so the check runs in a child interpreter."""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted

# (batch, query heads, KV heads, head dim, block size, chunk tokens, positions)
SPLIT_CASES = (
    (1, 8, 1, 16, 16, 16, (0,)),  # one position: a single chunk, GQA 8:1
    (1, 8, 1, 16, 16, 16, (15,)),  # exactly one full chunk
    (1, 8, 1, 16, 16, 16, (16,)),  # the second chunk holds one position
    (3, 16, 2, 32, 8, 32, (100, 3, 64)),  # uneven lengths; a context ending on a chunk boundary
    (8, 8, 1, 16, 4, 16, (0, 1, 15, 16, 17, 47, 130, 7)),  # batch 8, GQA 8:1, block 4
    (2, 32, 4, 64, 16, 64, (191, 60)),  # the Qwen3-30B-A3B ratio (8 query heads per KV head)
    (2, 4, 4, 16, 8, 128, (300, 129)),  # a chunk of two softmax tiles
    (4, 8, 2, 16, 16, 8, (40, 0, 77, 23)),  # a chunk smaller than a tile: 10 chunks, combined in steps of 16
)


def check_split(device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = 1e-4) -> None:
    from paged_experts.attention import attend
    from paged_experts.kernels.attn_triton import SplitPlan, decode_attention, decode_attention_split, split_plan

    gen = torch.Generator().manual_seed(0)
    for b, nh, kvh, d, bs, chunk, pos in SPLIT_CASES:
        width = max(pos) // bs + 3  # the pool's table width: more blocks than any sequence holds
        num_blocks = b * width + 2
        kv_k = torch.randn(num_blocks * bs, kvh, d, generator=gen).to(device, dtype)  # [slots, kvh, D]
        kv_v = torch.randn(num_blocks * bs, kvh, d, generator=gen).to(device, dtype)
        positions = torch.tensor(pos, device=device)  # [B]
        blocks = torch.randperm(num_blocks, generator=gen)[: b * width].view(b, width).to(device)  # [B, W]
        cols = torch.arange(max(pos) + 1, device=device)[None, :]  # [1, L]
        rows = blocks.gather(1, (cols // bs).expand(b, -1)) * bs + cols % bs  # [B, L] KV row of each position
        mask = torch.where(cols <= positions[:, None], 0.0, torch.finfo(torch.float32).min)  # [B, L]
        q = torch.randn(b, nh, d, generator=gen).to(device, dtype)
        capacity = width * bs
        plan = SplitPlan(chunk, -(-capacity // chunk), capacity)
        got = decode_attention_split(q, kv_k, kv_v, blocks, positions, bs, plan)
        one = decode_attention(q, kv_k, kv_v, blocks, positions, bs)
        want = attend(q.float()[:, None], kv_k.float(), kv_v.float(), rows, mask[:, None, :])[:, 0]
        assert got.shape == (b, nh * d) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(got.float(), one.float(), rtol=tol, atol=tol)
        default = decode_attention_split(q, kv_k, kv_v, blocks, positions, bs)  # split_plan's chunk
        assert split_plan(capacity).num_splits >= 1
        torch.testing.assert_close(default.float(), want, rtol=tol, atol=tol)
        print("ok", (b, nh, kvh, d, bs, chunk, pos))


def test_split_plan_reasoned_sizes() -> None:
    from paged_experts.kernels.attn_triton import MAX_SPLITS, split_plan

    plan = split_plan(10240)  # the published runs' KV capacity
    assert (plan.chunk_tokens, plan.num_splits) == (64, 160)
    assert 4 * 2048 // plan.chunk_tokens >= 128  # batch 1, 4 KV heads: ~one program per H200 SM at 2,048
    big = split_plan(262144)
    assert big.num_splits <= MAX_SPLITS and big.chunk_tokens * big.num_splits >= 262144
    assert split_plan(1).num_splits == 1
    assert plan.scratch_bytes(8, 32, 128) < 24 * 2**20  # batch 8, 32 query heads: reused by every layer
    with pytest.raises(ValueError, match="at least one token"):
        split_plan(0)


def test_split_attention_matches_torch_and_the_unsplit_kernel_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    out = run_interpreted("test_attn_split", "check_split")
    assert out.count("ok ") == len(SPLIT_CASES)
