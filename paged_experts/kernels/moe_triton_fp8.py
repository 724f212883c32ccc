"""Decode-sized MoE kernels in Triton for block-FP8 experts (fp8.py): the expert pass in two kernels.

A decode step has at most moe_triton.MAX_PAIRS (token, expert) pairs, so the expert pass is a
batched GEMV: the weight's output dimension fills the tile and each pair's one token is the small
side. It wants HBM bandwidth and nothing else; FP8 rows halve the bytes of bf16.

- `_gate_up_fp8`: one program per (pair, tile of I rows): h[p] = silu(x[t] . W_gate[r]) * (x[t] . W_up[r]);
- `_down_fp8` (`_down_fp8_pairs`: a token's k pairs loaded together, tiles with pair_vector):
  one program per (token, tile of H rows): y[t] = sum_j w[t, j] * (h[t*k+j] . W_down[r]).

Where the scales go: a tile's rows lie inside one 128-row scale block (block_n divides 128), so the
scale of element (n, k) is the tile's `s[k // 128]`, a vector over k. Each step scales the
activation vector by it (`x[k] * s[k // 128]`, fp32) and dots the FP8 row (exact in fp32) with
that, accumulating in fp32: dequantization costs one multiply per activation, not one per weight,
no dequantized weight is ever written, and block_k is free of the 128-column scale blocks (a step
may span several). The old kernels scaled each 128-column partial dot instead, which tied block_k
to <= 128 and left the GPU waiting on small loads: 61.6 us per batch-1 layer on the H200 (613 GB/s),
against 16.4 us here and 22.5 us for the bf16 kernels (benchmarks/results/h200/README.md;
benchmarks/fp8_tiles_h200.py still times their 16 x 128 tiles beside the table's).

A pair's result depends only on its token's input and its row's weights, and a token's k pairs are
summed in j order, so paged == resident bit for bit whenever both run these kernels with the same
tiles (the tiles depend on the step's token count, the same in both). `moe_triton.moe_pairs` calls
`fp8_pairs` when it is given scales; the tiles are `moe_tiles.fp8_tiles(...)` (the tuned table).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU torch wheel ships no Triton
    triton = None

from paged_experts.kernels.moe_tiles import TileConfig, fp8_tiles

QUANT_BLOCK = 128  # fp8.BLOCK: the scale block of FP8 weights


if triton is not None:

    @triton.jit
    def _gate_up_fp8(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        x,
        rows,
        w_gate,
        w_up,
        s_gate,
        s_up,
        hid,
        TOP_K: tl.constexpr,
        INTER: tl.constexpr,
        H: tl.constexpr,
        QB: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        """x [T, H], rows [T*k], w_gate/w_up [G, I, H] float8_e4m3fn, s_gate/s_up [G, I/QB, H/QB] fp32
        -> hid [T*k, I]. BN divides QB: the tile's rows share one scale row."""
        p = tl.program_id(0).to(tl.int64)
        n0 = tl.program_id(1) * BN
        n = n0 + tl.arange(0, BN)  # [BN]
        n_ok = n < INTER
        r = tl.load(rows + p).to(tl.int64)
        x_row = x + (p // TOP_K) * H
        w_off = r * INTER * H + n[:, None].to(tl.int64) * H  # [BN, 1]
        sk: tl.constexpr = (H + QB - 1) // QB
        s_row = r * ((INTER + QB - 1) // QB) * sk + (n0 // QB) * sk  # scalar: the tile's scale row
        acc_g = tl.zeros((BN,), dtype=tl.float32)
        acc_u = tl.zeros((BN,), dtype=tl.float32)
        for k0 in range(0, H, BK):
            k = k0 + tl.arange(0, BK)  # [BK]
            k_ok = k < H
            xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
            sg = tl.load(s_gate + s_row + k // QB, mask=k_ok, other=0.0)  # [BK]: scale of each column
            su = tl.load(s_up + s_row + k // QB, mask=k_ok, other=0.0)  # [BK]
            ok = n_ok[:, None] & k_ok[None, :]
            wg = tl.load(w_gate + w_off + k[None, :], mask=ok, other=0.0).to(tl.float32)  # [BN, BK]
            wu = tl.load(w_up + w_off + k[None, :], mask=ok, other=0.0).to(tl.float32)  # [BN, BK]
            acc_g += tl.sum(wg * (xv * sg)[None, :], axis=1)
            acc_u += tl.sum(wu * (xv * su)[None, :], axis=1)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, fp32
        tl.store(hid + p * INTER + n, h.to(hid.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _down_fp8(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        hid,
        rows,
        topw,
        w_down,
        s_down,
        out,
        TOP_K: tl.constexpr,
        INTER: tl.constexpr,
        H: tl.constexpr,
        QB: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        """hid [T*k, I], rows [T*k], topw [T*k] fp32, w_down [G, H, I] float8_e4m3fn, s_down
        [G, H/QB, I/QB] fp32 -> out [T, H] = sum_j w_j * down(h_j), the pairs one after another."""
        t = tl.program_id(0).to(tl.int64)
        n0 = tl.program_id(1) * BN
        n = n0 + tl.arange(0, BN)  # [BN]
        n_ok = n < H
        si: tl.constexpr = (INTER + QB - 1) // QB
        acc = tl.zeros((BN,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            p = t * TOP_K + j
            r = tl.load(rows + p).to(tl.int64)
            wj = tl.load(topw + p).to(tl.float32)
            w_off = r * H * INTER + n[:, None].to(tl.int64) * INTER  # [BN, 1]
            s_row = r * ((H + QB - 1) // QB) * si + (n0 // QB) * si  # scalar: the tile's scale row
            part = tl.zeros((BN,), dtype=tl.float32)
            for k0 in range(0, INTER, BK):
                k = k0 + tl.arange(0, BK)  # [BK]
                k_ok = k < INTER
                hv = tl.load(hid + p * INTER + k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
                sd = tl.load(s_down + s_row + k // QB, mask=k_ok, other=0.0)  # [BK]
                wd = tl.load(w_down + w_off + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
                part += tl.sum(wd.to(tl.float32) * (hv * sd)[None, :], axis=1)
            acc += wj * part
        tl.store(out + t * H + n, acc.to(out.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _down_fp8_pairs(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        hid,
        rows,
        topw,
        w_down,
        s_down,
        out,
        TOP_K: tl.constexpr,
        KB: tl.constexpr,
        INTER: tl.constexpr,
        H: tl.constexpr,
        QB: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        """`_down_fp8` with a token's k pairs loaded together: each step streams k weight tiles
        [KB, BN, BK] at once (k times the bytes in flight of the one-pair loop)."""
        t = tl.program_id(0).to(tl.int64)
        n0 = tl.program_id(1) * BN
        n = n0 + tl.arange(0, BN)  # [BN]
        n_ok = n < H
        j = tl.arange(0, KB)  # [KB]
        j_ok = j < TOP_K
        p = t * TOP_K + j  # [KB]
        r = tl.load(rows + p, mask=j_ok, other=0).to(tl.int64)  # [KB]
        wj = tl.load(topw + p, mask=j_ok, other=0.0).to(tl.float32)  # [KB]
        w_off = r[:, None, None] * H * INTER + n[None, :, None].to(tl.int64) * INTER  # [KB, BN, 1]
        si: tl.constexpr = (INTER + QB - 1) // QB
        s_row = r * ((H + QB - 1) // QB) * si + (n0 // QB) * si  # [KB]: each pair's scale row
        acc = tl.zeros((KB, BN), dtype=tl.float32)
        for k0 in range(0, INTER, BK):
            k = k0 + tl.arange(0, BK)  # [BK]
            k_ok = k < INTER
            jk = j_ok[:, None] & k_ok[None, :]  # [KB, BK]
            hv = tl.load(hid + p[:, None] * INTER + k[None, :], mask=jk, other=0.0).to(tl.float32)  # [KB, BK]
            sd = tl.load(s_down + s_row[:, None] + k[None, :] // QB, mask=jk, other=0.0)  # [KB, BK]
            ok = j_ok[:, None, None] & n_ok[None, :, None] & k_ok[None, None, :]
            wd = tl.load(w_down + w_off + k[None, None, :], mask=ok, other=0.0)  # [KB, BN, BK]
            acc += tl.sum(wd.to(tl.float32) * (hv * sd)[:, None, :], axis=2)
        y = tl.sum(acc * wj[:, None], axis=0)  # [BN]: the k pairs, weighted, summed
        tl.store(out + t * H + n, y.to(out.dtype.element_ty), mask=n_ok)


def check_tiles(tiles: dict[str, TileConfig]) -> None:
    """A tile's rows must share one scale row: block_n divides the 128-row scale block."""
    for name, c in tiles.items():
        if QUANT_BLOCK % c.block_n:
            raise ValueError(f"FP8 {name} tiles: block_n {c.block_n} must divide the {QUANT_BLOCK}-row scale blocks")


def fp8_pairs(
    x: torch.Tensor,
    rows: torch.Tensor,
    topk_weights: torch.Tensor,
    w: tuple[torch.Tensor, ...],
    scales: tuple[torch.Tensor, ...],
    top_k: int,
    hid: torch.Tensor,
    out: torch.Tensor,
    tiles: dict[str, TileConfig] | None = None,
) -> None:
    """The FP8 kernels of `moe_triton.moe_pairs`: x [T, H], rows [T*k], weights gate/up [G, I, H],
    down [G, H, I] with their scales; hid [T*k, I] and out [T, H] written in place. `tiles` (kernel ->
    TileConfig) defaults to the tuned table's entry for this shape and T (moe_tiles.fp8_tiles)."""
    t, h = x.shape
    inter = w[0].shape[1]
    tiles = tiles or fp8_tiles(h, inter, top_k, t)
    check_tiles(tiles)
    cg, cd = tiles["gate_up"], tiles["down"]
    _gate_up_fp8[(t * top_k, triton.cdiv(inter, cg.block_n))](
        x.contiguous(),
        rows,
        w[0],
        w[1],
        scales[0],
        scales[1],
        hid,
        TOP_K=top_k,
        INTER=inter,
        H=h,
        QB=QUANT_BLOCK,
        BN=cg.block_n,
        BK=cg.block_k,
        num_warps=cg.num_warps,
    )
    topw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    grid = (t, triton.cdiv(h, cd.block_n))
    common = dict(INTER=inter, H=h, QB=QUANT_BLOCK, BN=cd.block_n, BK=cd.block_k, num_warps=cd.num_warps)
    if cd.pair_vector:
        _down_fp8_pairs[grid](
            hid, rows, topw, w[2], scales[2], out, TOP_K=top_k, KB=triton.next_power_of_2(top_k), **common
        )
    else:
        _down_fp8[grid](hid, rows, topw, w[2], scales[2], out, TOP_K=top_k, **common)
