"""Grouped matmul over block-FP8 expert rows in Triton: the large-step (prefill) twin of fused.grouped_mm.

`grouped_fp8_mm(a, w, scale, offs)`: a [P, K] rows sorted by group (offs [G] cumulative), w [G, N, K]
float8_e4m3fn with float32 128 x 128 block scales [G, N/128, K/128] -> [P, N] = a[rows of g] @ W[g]^T.
Before it, FP8 steps larger than moe_triton.MAX_PAIRS dequantized the whole table to bf16 in HBM
(`ExpertTensors.dense`: a layer's 604 MB of FP8 read, 1.2 GB of bf16 written and read again per
step); here a weight tile is converted to the activations' dtype in registers (e4m3 values are exact
in bf16 and fp32), multiplied on the tensor cores, and its 128 x 128 block's scale applied to the
partial product in fp32, one K step per scale block (block_k divides 128, block_n divides 128).

Programs: one per (block of block_m rows of one group, tile of N). The block table (which group,
which rows) is built on the device from offs (`block_table`: no host sync, graph-safe), over the
bound cdiv(P, BM) + min(G, P) blocks; blocks past the last group exit at once. A host-planned step
lays its waves' tables out on the host instead (`host_block_tables`, moe/waves.py): exact grids.

`grouped_fp8_glu(a, gate, up, blocks)`: the same tile loop (`_grouped_tile`, constexpr GLU) over the gate and the up
rows at once, their gated product silu(a Wg^T) * (a Wu^T) written once: a wave's gate, up, silu and product in one
launch.

A group's rows may be contiguous or packed (moe_triton.row_stride): their strides are constexprs, a contiguous
table compiling to the code it always did.

A row's result depends only on its own activations and its group's weights (masked rows are zeros
and the MMA computes each output from its own row), and the tiles are fixed per shape, never chosen
by the step's size: so a pair computes the same bits in a resident step and in any paged wave.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU torch wheel ships no Triton
    triton = None

from typing import NamedTuple

from paged_experts.kernels.moe_tiles import GroupedTiles
from paged_experts.kernels.moe_triton import row_stride, shared_stride

QUANT_BLOCK = 128  # fp8.BLOCK


class BlockTable(NamedTuple):
    """The row blocks of one grouped step: block b computes rows m0[b] to min(m0[b] + BM, m1[b]) of
    group[b] (-1: none), m1 being the group's end."""

    group: torch.Tensor  # [NB] int32
    m0: torch.Tensor  # [NB] int32
    m1: torch.Tensor  # [NB] int32


if triton is not None:
    # row0 is not specialized: a wave's first row takes every value, and each value class would compile a variant
    @triton.jit(do_not_specialize=["row0"])
    def _grouped_fp8(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        a, w, s, out, blk_group, blk_m0, blk_m1, a_rows, out_rows, row0,
        N: tl.constexpr, K: tl.constexpr, W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, QB: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, GATHER: tl.constexpr,
        SCATTER: tl.constexpr,
    ):  # fmt: skip
        """a [P, K], w [G, N, K] fp8, s [G, N/QB, K/QB] fp32, blocks (group, first row, end row) -> out [P, N].
        W_STRIDE / S_STRIDE: elements from one group's row of w / s to the next (moe_triton.row_stride). IEEE: fp32
        activations multiply in full fp32 (tl.dot would round them to tf32). GATHER: row m of the product reads a's
        row a_rows[row0 + m] (a: every row, unsorted); SCATTER: it writes out's row out_rows[row0 + m] (out: every
        row)."""
        b = tl.program_id(0)
        g = tl.load(blk_group + b).to(tl.int64)
        if g < 0:  # past the last group's blocks
            return
        _grouped_tile(
            a, w, s, w, s, out, g, b, blk_m0, blk_m1, a_rows, out_rows, row0,
            N, K, W_STRIDE, S_STRIDE, QB, BM, BN, BK, IEEE, False, GATHER, SCATTER,
        )  # fmt: skip

    @triton.jit(do_not_specialize=["row0"])
    def _grouped_fp8_glu(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        a, wg, sg, wu, su, out, blk_group, blk_m0, blk_m1, a_rows, out_rows, row0,
        N: tl.constexpr, K: tl.constexpr, W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, QB: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, GATHER: tl.constexpr,
        SCATTER: tl.constexpr,
    ):  # fmt: skip
        """_grouped_fp8 of the gate rows wg / sg and the up rows wu / su at once -> out = silu(a Wg^T) * (a Wu^T)
        (its own name, so a profile tells it from the plain matmul); wu / su at wg / sg's strides."""
        b = tl.program_id(0)
        g = tl.load(blk_group + b).to(tl.int64)
        if g < 0:  # past the last group's blocks
            return
        _grouped_tile(
            a, wg, sg, wu, su, out, g, b, blk_m0, blk_m1, a_rows, out_rows, row0,
            N, K, W_STRIDE, S_STRIDE, QB, BM, BN, BK, IEEE, True, GATHER, SCATTER,
        )  # fmt: skip

    @triton.jit
    def _grouped_tile(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        a, w, s, wu, su, out, g, b, blk_m0, blk_m1, a_rows, out_rows, row0,
        N: tl.constexpr, K: tl.constexpr, W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, QB: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, GLU: tl.constexpr,
        GATHER: tl.constexpr, SCATTER: tl.constexpr,
    ):  # fmt: skip
        """Block b (of group g >= 0) times one N tile. GLU: w / s are the gate rows and wu / su the up rows (unread
        otherwise), and out = silu(a W^T) * (a Wu^T), rounded at the points the four launches round: each
        product to out's dtype, the silu (computed in fp32) to it, then their product (Triton's exponential,
        not torch's, so a silu can land one rounding apart). GATHER / SCATTER: rows read from a and written to
        out through a_rows / out_rows (from row0 on); the arithmetic is the same either way."""
        m0 = tl.load(blk_m0 + b).to(tl.int64)
        m1 = tl.load(blk_m1 + b).to(tl.int64)
        n0 = tl.program_id(1) * BN
        m = m0 + tl.arange(0, BM)  # [BM]
        m_ok = m < m1
        if GATHER:
            a_row = tl.load(a_rows + row0 + m, mask=m_ok, other=0).to(tl.int64)  # [BM] a's row of each product row
        else:
            a_row = m
        if SCATTER:  # loaded before the K loop, so its latency hides behind the loop, not in the store after it
            o_row = tl.load(out_rows + row0 + m, mask=m_ok, other=0).to(tl.int64)  # [BM] out's row of each
        else:
            o_row = m
        n = n0 + tl.arange(0, BN)  # [BN]
        n_ok = n < N
        sk: tl.constexpr = (K + QB - 1) // QB
        s_row = g * S_STRIDE + (n0 // QB) * sk  # scalar: the tile's scale row (BN | QB)
        w_off = g * W_STRIDE + n[None, :].to(tl.int64) * K  # [1, BN]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)  # GLU only
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)  # [BK], inside one scale block (BK | QB)
            k_ok = k < K
            at = tl.load(a + a_row[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            w_mask = k_ok[:, None] & n_ok[None, :]
            wt = tl.load(w + w_off + k[:, None], mask=w_mask, other=0.0)  # [BK, BN] fp8
            sc = tl.load(s + s_row + k0 // QB)  # the block's scale
            if IEEE:
                acc += sc * tl.dot(at, wt.to(at.dtype), input_precision="ieee")  # [BM, BN], fp32
            else:
                acc += sc * tl.dot(at, wt.to(at.dtype))  # [BM, BN], fp32
            if GLU:
                ut = tl.load(wu + w_off + k[:, None], mask=w_mask, other=0.0)  # [BK, BN] fp8
                sc_u = tl.load(su + s_row + k0 // QB)
                if IEEE:
                    acc_u += sc_u * tl.dot(at, ut.to(at.dtype), input_precision="ieee")
                else:
                    acc_u += sc_u * tl.dot(at, ut.to(at.dtype))
        dt = out.dtype.element_ty
        if GLU:
            gate = acc.to(dt).to(tl.float32)  # [BM, BN]
            up = acc_u.to(dt).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # silu, rounded as torch's
            res = (act * up).to(dt)
        else:
            res = acc.to(dt)
        tl.store(out + o_row[:, None] * N + n[None, :], res, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _block_table(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        offs,
        table,
        NB,
        G: tl.constexpr,
        GB: tl.constexpr,
        BM: tl.constexpr,
        CH: tl.constexpr,
    ):
        """offs [G] cumulative -> table [3, NB] int32 rows (group or -1, first row, end row), one program."""
        gi = tl.arange(0, GB)  # [GB]
        g_ok = gi < G
        end = tl.load(offs + gi, mask=g_ok, other=0).to(tl.int64)  # [GB]
        start = tl.load(offs + gi - 1, mask=g_ok & (gi > 0), other=0).to(tl.int64)  # [GB]
        end = tl.where(g_ok, end, start)  # padding groups: no rows
        nblk = (end - start + BM - 1) // BM  # [GB] blocks of each group
        cum = tl.cumsum(nblk, axis=0)  # [GB] inclusive
        first = cum - nblk  # [GB] the group's first block
        total = tl.sum(nblk, axis=0)
        for b0 in range(0, NB, CH):
            b = b0 + tl.arange(0, CH)  # [CH]
            g = tl.sum((cum[None, :] <= b[:, None]).to(tl.int32), axis=1)  # [CH]: groups wholly before b
            sel = gi[None, :] == g[:, None]  # [CH, GB] one-hot of b's group
            g_start = tl.sum(tl.where(sel, start[None, :], 0), axis=1)  # [CH]
            g_first = tl.sum(tl.where(sel, first[None, :], 0), axis=1)  # [CH]
            g_end = tl.sum(tl.where(sel, end[None, :], 0), axis=1)  # [CH]
            valid = b < total
            b_ok = b < NB
            tl.store(table + b, tl.where(valid, g, -1).to(tl.int32), mask=b_ok)
            tl.store(table + NB + b, (g_start + (b - g_first) * BM).to(tl.int32), mask=b_ok)
            tl.store(table + 2 * NB + b, g_end.to(tl.int32), mask=b_ok)


def block_table(offs: torch.Tensor, num_pairs: int, block_m: int) -> BlockTable:
    """offs [G] int cumulative pair counts -> each group's rows cut into blocks of at most block_m, in
    group order, over NB = cdiv(P, BM) + min(G, P) blocks: (group [NB] or -1 past the last block,
    first row [NB], the group's end row [NB]) int32. One kernel (`_block_table`): the same table in torch took a
    dozen launches, 0.3-0.5 ms of host time per call on the H200, more than a small step's matmuls."""
    g_count = offs.shape[0]
    nb = -(-num_pairs // block_m) + min(g_count, num_pairs)
    table = torch.empty(3, nb, dtype=torch.int32, device=offs.device)  # [3, NB]
    if nb:
        _block_table[(1,)](offs, table, nb, G=g_count, GB=triton.next_power_of_2(g_count), BM=block_m, CH=64)
    return BlockTable(table[0], table[1], table[2])


ALIGN_BLOCKS = 4  # int32 entries in 16 bytes: Triton compiles a variant per 16-byte alignment of each pointer


def host_block_tables(counts: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`block_table` of several steps at once on the host, for a plan already there (a host-planned step's
    waves, moe/waves.py): counts [W, G] pairs of each wave in each group -> (tables [3, NB] int32, starts
    [W + 1], blocks [W]): wave w's blocks are columns starts[w] to starts[w] + blocks[w], in group order (group,
    first row, end row; rows counted from the wave's own start); columns from there to starts[w + 1] are
    padding never read. The same blocks as `block_table` over each wave's cumulative counts, without its -1
    padding: no launch per wave, and a grid of only the blocks that compute. Every wave's columns, and NB,
    start at a multiple of ALIGN_BLOCKS: the slices a wave passes keep one 16-byte alignment, so the kernel
    compiles once, not once per alignment its slices happen to have."""
    w_count, g_count = counts.shape
    ends = np.cumsum(counts, axis=1)  # [W, G] each group's end row within its wave
    nblk = -(-counts // block_m)  # [W, G] blocks of each group
    per_wave = nblk.sum(axis=1)  # [W]
    padded = -(-per_wave // ALIGN_BLOCKS) * ALIGN_BLOCKS  # [W] each wave's columns, a multiple of ALIGN_BLOCKS
    starts = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)  # [W + 1]
    per_block = nblk.reshape(-1)  # [W*G]
    total = int(per_block.sum())
    owner = np.repeat(np.arange(w_count * g_count), per_block)  # [blocks] the (wave, group) of each block
    first = np.cumsum(per_block) - per_block  # [W*G] each group's first block
    j = np.arange(total) - first[owner]  # [blocks] the block's index within its group
    wave = owner // g_count
    column = starts[wave] + np.arange(total) - (np.cumsum(per_wave) - per_wave)[wave]  # [blocks] in its wave's run
    flat_ends = ends.reshape(-1)
    tables = np.zeros((3, int(starts[-1])), dtype=np.int32)  # padding: group 0, rows 0 to 0 (never launched)
    tables[0, column] = owner % g_count
    tables[1, column] = flat_ends[owner] - counts.reshape(-1)[owner] + j * block_m
    tables[2, column] = flat_ends[owner]
    return tables, starts, per_wave


class RowMap(NamedTuple):
    """Rows of a launch read from (gather) or written to (scatter) another table: launch row m is the table's
    row rows[first + m], for m < num (a wave's run of a step's laid-out pairs: moe/waves.py)."""

    rows: torch.Tensor  # [>= first + num] int64 on the kernel's device
    first: int
    num: int


def grouped_fp8_mm(
    a: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    blocks: BlockTable,
    tiles: GroupedTiles,
    scatter: tuple[torch.Tensor, RowMap] | None = None,
) -> torch.Tensor:
    """a [P, K] sorted by group, w [G, N, K] float8_e4m3fn, scale [G, N/128, K/128] fp32 (each group's rows
    contiguous, the table contiguous or packed rows: moe_triton.row_stride), blocks:
    `block_table(offs, P, tiles.block_m)`, or a wave's columns of `host_block_tables` (one table serves
    every matmul of a step) -> [P, N] in a's dtype (fp32 accumulation, one rounding). `scatter` (out [R, N],
    rows): row m written to out's row rows.rows[rows.first + m] instead (a step's pair outputs, no copy after),
    and out returned."""
    return _launch(a, (w, scale), None, blocks, tiles, None, scatter)


def grouped_fp8_glu(
    a: torch.Tensor,
    gate: tuple[torch.Tensor, torch.Tensor],
    up: tuple[torch.Tensor, torch.Tensor],
    blocks: BlockTable,
    tiles: GroupedTiles,
    gather: RowMap | None = None,
) -> torch.Tensor:
    """silu(grouped_fp8_mm(a, *gate)) * grouped_fp8_mm(a, *up) in one launch: a [P, K] sorted by group; gate and
    up each (w [G, N, K] float8_e4m3fn, scale [G, N/128, K/128] fp32) -> [P, N] in a's dtype. One launch a step
    instead of four (two matmuls, the silu, the product), and the two [P, N] products never leave the registers;
    rounded at the points the four launches round, with Triton's exponential (a value can land one rounding apart:
    closeness is tested, and the share of equal bits reported). `gather`: a holds every token's row, unsorted,
    and product row m reads a's row gather.rows[gather.first + m] (P = gather.num): no gathered copy of a."""
    if up[0].shape != gate[0].shape or up[1].shape != gate[1].shape:
        raise ValueError(f"gate {tuple(gate[0].shape)} and up {tuple(up[0].shape)} rows (or their scales) differ")
    return _launch(a, gate, up, blocks, tiles, gather, None)  # _launch checks that their strides agree


def _launch(
    a: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor],
    up: tuple[torch.Tensor, torch.Tensor] | None,
    blocks: BlockTable,
    tiles: GroupedTiles,
    gather: RowMap | None,
    scatter: tuple[torch.Tensor, RowMap] | None,
) -> torch.Tensor:
    """One `_grouped_fp8` launch over `blocks`: a plain matmul, or (with `up`) the gated product; rows read
    through `gather` and written through `scatter` where given (not both: one map, one row0)."""
    k = a.shape[1]
    w, scale = weights
    g, n, _ = w.shape
    # one offset reads a group's gate and up rows (GLU): their tables must share the strides (both layouts do)
    strides = dict(
        W_STRIDE=row_stride(w, "weights") if up is None else shared_stride(w, up[0], "gate/up"),
        S_STRIDE=row_stride(scale, "scales") if up is None else shared_stride(scale, up[1], "gate/up scales"),
    )
    if QUANT_BLOCK % tiles.block_k or QUANT_BLOCK % tiles.block_n:
        raise ValueError(f"grouped FP8 tiles {tiles}: block_n and block_k must divide {QUANT_BLOCK}")
    if gather is not None and scatter is not None:
        raise ValueError("a launch gathers its rows or scatters them, not both")
    rows = gather if gather is not None else scatter[1] if scatter is not None else None
    if rows is not None and (
        rows.rows.dtype != torch.int64 or rows.rows.dim() != 1 or not rows.rows.is_contiguous()
        or rows.rows.device != a.device or rows.first < 0 or rows.rows.numel() < rows.first + rows.num
    ):  # fmt: skip
        raise ValueError(
            f"row map of {rows.num} rows from {rows.first} over {tuple(rows.rows.shape)} {rows.rows.dtype} on "
            f"{rows.rows.device}: one contiguous int64 row index on {a.device} holding them"
        )
    p = gather.num if gather is not None else a.shape[0]
    if scatter is not None:
        out = scatter[0]  # [R, N]: every row of the step, this launch's written in place (row stride N)
        if (
            scatter[1].num != p or out.dim() != 2 or out.shape[1] != n or out.dtype != a.dtype
            or not out.is_contiguous() or out.device != a.device
        ):  # fmt: skip
            raise ValueError(f"scatter into {tuple(out.shape)} {out.dtype} of {scatter[1].num} rows from [{p}, {n}]")
    else:
        out = a.new_empty(p, n)  # [P, N]
    if p == 0:
        return out
    group, m0, m1 = blocks
    grid = (group.shape[0], triton.cdiv(n, tiles.block_n))
    kernel, weights_args = (_grouped_fp8, (w, scale)) if up is None else (_grouped_fp8_glu, (w, scale, *up))
    index = rows.rows if rows is not None else group  # unread without a map: any pointer
    kernel[grid](
        a.contiguous(), *weights_args, out, group, m0, m1, index, index, rows.first if rows is not None else 0,
        N=n, K=k, **strides, QB=QUANT_BLOCK, BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k,
        IEEE=a.dtype == torch.float32, GATHER=gather is not None, SCATTER=scatter is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out
