"""Decode attention in one Triton kernel: each program takes one sequence and one KV head, reads
that head's keys and values through the sequence's KV block table once, and serves all the query
heads of its group (GQA) with an online softmax over blocks of the context.

The loop runs only up to the sequence's own position (read from the `positions` input), and the
block table has the pool's full width, so one compiled kernel and one captured decode graph per
batch size serve every context length (no per-KV-bucket graphs to capture before serving).

Why: the graphed decode step's torch attention gathers the rows (`kv[table]`), repeats them per
query head, runs two batched matmuls, a masked softmax and their copies: ~15 us of small kernels
per layer on the H200 (benchmarks/results/h200/s3_call1/profile.txt) for ~32 KB of keys and
values at a 64-token context. Used by the graphed decode step when the 'triton' kernel backend is
selected (`fused.set_expert_backend("triton")`); equal to `attention.attend` within rounding.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU torch wheel ships no Triton
    triton = None  # type: ignore[assignment]

BLOCK_L = 64  # context rows per step of the online softmax


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _decode_attention(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        q,
        kv_k,
        kv_v,
        blocks,
        positions,
        out,
        scale,
        width,
        BS: tl.constexpr,
        KVH: tl.constexpr,
        G: tl.constexpr,
        GB: tl.constexpr,
        D: tl.constexpr,
        BL: tl.constexpr,
    ):
        """q [B, KVH*G, D]; kv_k, kv_v [slots, KVH, D]; blocks [B, width] KV block of each BS
        positions; positions [B] (sequence b attends to positions 0..positions[b]); out [B, KVH*G*D]."""
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        g = tl.arange(0, GB)  # [GB] query heads of this KV head (padded to >= 16 for tl.dot)
        g_ok = g < G
        d = tl.arange(0, D)  # [D]
        heads = kvh * G + g  # [GB]
        qv = tl.load(q + (b * KVH * G + heads[:, None]) * D + d[None, :], mask=g_ok[:, None], other=0.0)  # [GB, D]
        pos = tl.load(positions + b)
        m_i = tl.full((GB,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GB,), dtype=tl.float32)
        acc = tl.zeros((GB, D), dtype=tl.float32)
        l0 = 0
        while l0 <= pos:  # a data-dependent bound: one compiled kernel (and graph) for every context length
            cols = l0 + tl.arange(0, BL)  # [BL] positions
            keep = cols <= pos
            blk = tl.load(blocks + b * width + cols // BS, mask=keep, other=0).to(tl.int64)  # [BL]
            rows = blk * BS + cols % BS  # [BL] KV rows
            kv_off = (rows[:, None] * KVH + kvh) * D + d[None, :]  # [BL, D]
            kt = tl.load(kv_k + kv_off, mask=keep[:, None], other=0.0)  # [BL, D]
            s = tl.dot(qv, tl.trans(kt)) * scale  # [GB, BL] fp32
            s = tl.where(keep[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [GB]; finite: column 0 is always kept
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])  # [GB, BL]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(kv_v + kv_off, mask=keep[:, None], other=0.0)  # [BL, D]
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
            l0 += BL
        o = acc / l_i[:, None]
        tl.store(out + (b * KVH * G + heads[:, None]) * D + d[None, :], o.to(out.dtype.element_ty), mask=g_ok[:, None])


def decode_attention(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    blocks: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """q [B, nh, D] (normed, rotated); kv_k/kv_v [slots, kvh, D] with this step's rows written;
    blocks [B, W] each sequence's KV blocks (padded); positions [B] -> [B, nh * D]."""
    if not available():
        raise RuntimeError("triton decode attention needs Triton (a CUDA build of torch)")
    b, nh, d = q.shape
    kvh = kv_k.shape[1]
    group = nh // kvh
    out = q.new_empty(b, nh * d)  # [B, nh*D]
    _decode_attention[(b, kvh)](
        q.contiguous(), kv_k, kv_v, blocks.contiguous(), positions.contiguous(), out, d**-0.5, blocks.shape[1],
        BS=block_size, KVH=kvh, G=group, GB=max(16, triton.next_power_of_2(group)), D=d, BL=BLOCK_L,
    )  # fmt: skip
    return out
