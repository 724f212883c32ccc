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
selected (`RuntimeConfig(kernel_backend="triton")`); equal to `attention.attend` within rounding.

Split over the context (flash-decoding, `decode_attention_split`, what the graphed step runs): that
grid has B x KV heads programs (4 at batch 1 for Qwen3-30B-A3B), each walking its whole context
alone, so a 2,048-token context ran at 129 tok/s against 278 short on the H200. The split kernel
gives each (sequence, KV head, chunk of `SplitPlan.chunk_tokens` positions) its own program, which
writes its normalised partial output with its running max and sum of exponentials to fp32 scratch;
a second kernel combines a sequence's chunks per query head. The number of chunks is fixed by the
table's width (the pool's capacity: the longest context any sequence can reach), so the grid and
scratch are static and one captured graph still serves every length: programs past a sequence's
own position exit at once. `split_plan` is the one place the chunk size is chosen, with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU torch wheel ships no Triton
    triton = None

BLOCK_L = 64  # context rows per step of the online softmax
H200_SMS = 132
MAX_SPLITS = 256  # chunks per (sequence, KV head): bounds the scratch for large pools
SPLITS_PER_REDUCE_STEP = 16  # chunks the combine kernel reads per step


@dataclass(frozen=True)
class SplitPlan:
    """How `decode_attention_split` cuts a context: chunks of `chunk_tokens` positions, `num_splits`
    of them per (sequence, KV head), enough for `capacity_tokens` (the table's width in positions)."""

    chunk_tokens: int
    num_splits: int
    capacity_tokens: int

    def scratch_bytes(self, batch: int, num_heads: int, head_dim: int) -> int:
        """fp32 partial outputs [B, nh, S, D] plus their max and sum [B, nh, S] each."""
        return 4 * batch * num_heads * self.num_splits * (head_dim + 2)


def split_plan(capacity_tokens: int) -> SplitPlan:
    """The chunk size, chosen here once. Why 64 positions (one BLOCK_L tile, one iteration of the
    online softmax): at batch 1 Qwen3-30B-A3B has 4 KV heads, so a 2,048-token context makes
    4 x 32 = 128 programs (about one per SM of the H200's 132) and an 8,192-token one 512 (~4 per
    SM, >= 2 x SMs as a latency-bound load wants); each program reads 64 rows x 128 x 2 B of keys
    and as many values (32 KB): one tile, so a chunk's latency is one load of K and one of V, and
    the combine reads at most 32 partials per head at 2,048. Smaller chunks would cost the same
    latency per program for less work and a wider combine; larger ones leave SMs idle at batch 1
    below ~4,096 tokens. At larger pools the chunk doubles until the chunks per (sequence, head)
    fit MAX_SPLITS, so the scratch stays small (B x 32 heads x 256 x 130 x 4 B = 4.3 MB at B=1)."""
    if capacity_tokens < 1:
        raise ValueError(f"split attention needs a capacity of at least one token, got {capacity_tokens}")
    chunk = BLOCK_L
    while -(-capacity_tokens // chunk) > MAX_SPLITS:
        chunk *= 2
    return SplitPlan(chunk, -(-capacity_tokens // chunk), capacity_tokens)


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

    @triton.jit
    def _split_attention(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        q,
        kv_k,
        kv_v,
        blocks,
        positions,
        part_o,
        part_m,
        part_l,
        scale,
        width,
        num_splits,
        BS: tl.constexpr,
        KVH: tl.constexpr,
        G: tl.constexpr,
        GB: tl.constexpr,
        D: tl.constexpr,
        BL: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """One (sequence b, KV head, chunk s) of `_decode_attention`'s loop: positions
        s*CHUNK .. min((s+1)*CHUNK, positions[b]+1) - 1 -> part_o [B, nh, S, D] (normalised),
        part_m / part_l [B, nh, S] (the chunk's score max and sum of exp(score - max)).
        A chunk past the sequence's position writes nothing (the combine never reads it)."""
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        pos = tl.load(positions + b)
        start = s * CHUNK
        if start <= pos:
            g = tl.arange(0, GB)  # [GB]
            g_ok = g < G
            d = tl.arange(0, D)  # [D]
            heads = kvh * G + g  # [GB]
            qv = tl.load(q + (b * KVH * G + heads[:, None]) * D + d[None, :], mask=g_ok[:, None], other=0.0)
            end = tl.minimum(start + CHUNK, pos + 1)  # exclusive
            m_i = tl.full((GB,), float("-inf"), dtype=tl.float32)
            l_i = tl.zeros((GB,), dtype=tl.float32)
            acc = tl.zeros((GB, D), dtype=tl.float32)
            l0 = start
            while l0 < end:
                cols = l0 + tl.arange(0, BL)  # [BL] positions
                keep = cols < end
                blk = tl.load(blocks + b * width + cols // BS, mask=keep, other=0).to(tl.int64)  # [BL]
                rows = blk * BS + cols % BS  # [BL] KV rows
                kv_off = (rows[:, None] * KVH + kvh) * D + d[None, :]  # [BL, D]
                kt = tl.load(kv_k + kv_off, mask=keep[:, None], other=0.0)  # [BL, D]
                sc = tl.dot(qv, tl.trans(kt)) * scale  # [GB, BL] fp32
                sc = tl.where(keep[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=1))  # finite: column `start` is always kept
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(sc - m_new[:, None])  # [GB, BL]
                l_i = l_i * alpha + tl.sum(p, axis=1)
                vt = tl.load(kv_v + kv_off, mask=keep[:, None], other=0.0)  # [BL, D]
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
                m_i = m_new
                l0 += BL
            row = (b * KVH * G + heads) * num_splits + s  # [GB] index into [B, nh, S]
            tl.store(part_o + row[:, None] * D + d[None, :], acc / l_i[:, None], mask=g_ok[:, None])
            tl.store(part_m + row, m_i, mask=g_ok)
            tl.store(part_l + row, l_i, mask=g_ok)

    @triton.jit
    def _combine_splits(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        part_o,
        part_m,
        part_l,
        positions,
        out,
        num_splits,
        NH: tl.constexpr,
        D: tl.constexpr,
        CHUNK: tl.constexpr,
        SB: tl.constexpr,
    ):
        """Query head h of sequence b: its chunks' partial outputs weighted by exp(m_s - M) l_s,
        over the chunks its position reaches -> out [B, nh * D]."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        n = tl.load(positions + b) // CHUNK + 1  # chunks this sequence filled
        d = tl.arange(0, D)  # [D]
        base = (b * NH + h) * num_splits
        m_run = tl.max(tl.full((SB,), float("-inf"), dtype=tl.float32), axis=0)  # scalar
        l_run = tl.sum(tl.zeros((SB,), dtype=tl.float32), axis=0)
        acc = tl.zeros((D,), dtype=tl.float32)
        for s0 in range(0, n, SB):
            sidx = s0 + tl.arange(0, SB)  # [SB]
            ok = sidx < n
            m = tl.load(part_m + base + sidx, mask=ok, other=float("-inf"))  # [SB]
            lse = tl.load(part_l + base + sidx, mask=ok, other=0.0)  # [SB]
            o = tl.load(part_o + (base + sidx)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)  # [SB, D]
            m_new = tl.maximum(m_run, tl.max(m, axis=0))  # finite: chunk 0 is always filled
            alpha = tl.exp(m_run - m_new)
            w = tl.where(ok, tl.exp(m - m_new) * lse, 0.0)  # [SB]
            l_run = l_run * alpha + tl.sum(w, axis=0)
            acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
            m_run = m_new
        tl.store(out + (b * NH + h) * D + d, (acc / l_run).to(out.dtype.element_ty))


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


def decode_attention_split(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    blocks: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    plan: SplitPlan | None = None,
) -> torch.Tensor:
    """`decode_attention` split over the context: same arguments and result. `plan` defaults to
    `split_plan` of the table's width in positions (static shapes: graph-capturable); its scratch
    is allocated here, so inside a capture it lives in the graph's memory pool."""
    if not available():
        raise RuntimeError("triton decode attention needs Triton (a CUDA build of torch)")
    b, nh, d = q.shape
    kvh = kv_k.shape[1]
    group = nh // kvh
    plan = plan or split_plan(blocks.shape[1] * block_size)
    splits = plan.num_splits
    part_o = torch.empty(b, nh, splits, d, dtype=torch.float32, device=q.device)  # [B, nh, S, D]
    part_m = torch.empty(b, nh, splits, dtype=torch.float32, device=q.device)  # [B, nh, S]
    part_l = torch.empty_like(part_m)
    out = q.new_empty(b, nh * d)  # [B, nh*D]
    positions = positions.contiguous()
    _split_attention[(b, kvh, splits)](
        q.contiguous(), kv_k, kv_v, blocks.contiguous(), positions, part_o, part_m, part_l, d**-0.5,
        blocks.shape[1], splits,
        BS=block_size, KVH=kvh, G=group, GB=max(16, triton.next_power_of_2(group)), D=d, BL=BLOCK_L,
        CHUNK=plan.chunk_tokens,
    )  # fmt: skip
    _combine_splits[(b, nh)](
        part_o, part_m, part_l, positions, out, splits, NH=nh, D=d, CHUNK=plan.chunk_tokens, SB=SPLITS_PER_REDUCE_STEP
    )
    return out
