"""Decode-sized MoE kernels in Triton for block-FP8 experts (fp8.py): the expert pass in two kernels.

`_gate_up_fp8` / `_down_combine_fp8` are moe_triton's `_gate_up` / `_down_combine` reading
float8_e4m3fn rows (half the bytes of bf16) and their float32 128 x 128 block scales; each reduction
step lies inside one scale block (block_k divides 128), so a row's partial dot is scaled once per
block and accumulated in fp32 (no dequantized copy of a weight is ever written). `moe_triton.moe_pairs`
calls `fp8_pairs` when it is given scales; the tiles are `moe_tiles.FP8_CONFIGS`.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU torch wheel ships no Triton
    triton = None  # type: ignore[assignment]

from paged_experts.kernels.moe_tiles import FP8_CONFIGS

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
        """`_gate_up` over FP8 rows: w_gate/w_up [G, I, H] float8_e4m3fn with scales [G, I/QB, H/QB] fp32."""
        p = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
        n_ok = n < INTER
        r = tl.load(rows + p).to(tl.int64)
        x_row = x + (p // TOP_K) * H
        w_off = r * INTER * H + n[:, None].to(tl.int64) * H  # [BN, 1]
        sk: tl.constexpr = (H + QB - 1) // QB
        s_off = r * ((INTER + QB - 1) // QB) * sk + (n // QB).to(tl.int64) * sk  # [BN]: the row's scale block row
        acc_g = tl.zeros((BN,), dtype=tl.float32)
        acc_u = tl.zeros((BN,), dtype=tl.float32)
        for k0 in range(0, H, BK):
            k = k0 + tl.arange(0, BK)  # [BK], inside one scale block (QB % BK == 0)
            k_ok = k < H
            xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # [1, BK]
            ok = n_ok[:, None] & k_ok[None, :]
            wg = tl.load(w_gate + w_off + k[None, :], mask=ok, other=0.0).to(tl.float32)  # [BN, BK]
            wu = tl.load(w_up + w_off + k[None, :], mask=ok, other=0.0).to(tl.float32)  # [BN, BK]
            sg = tl.load(s_gate + s_off + k0 // QB, mask=n_ok, other=0.0)  # [BN]
            su = tl.load(s_up + s_off + k0 // QB, mask=n_ok, other=0.0)  # [BN]
            acc_g += sg * tl.sum(wg * xv, axis=1)
            acc_u += su * tl.sum(wu * xv, axis=1)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, fp32
        tl.store(hid + p * INTER + n, h.to(hid.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _down_combine_fp8(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
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
        """`_down_combine` over FP8 rows: w_down [G, H, I] float8_e4m3fn with scales [G, H/QB, I/QB] fp32."""
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
        n_ok = n < H
        si: tl.constexpr = (INTER + QB - 1) // QB
        acc = tl.zeros((BN,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            p = t * TOP_K + j
            r = tl.load(rows + p).to(tl.int64)
            wj = tl.load(topw + p).to(tl.float32)
            w_off = r * H * INTER + n[:, None].to(tl.int64) * INTER  # [BN, 1]
            s_off = r * ((H + QB - 1) // QB) * si + (n // QB).to(tl.int64) * si  # [BN]
            part = tl.zeros((BN,), dtype=tl.float32)
            for k0 in range(0, INTER, BK):
                k = k0 + tl.arange(0, BK)  # [BK], inside one scale block
                k_ok = k < INTER
                hv = tl.load(hid + p * INTER + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # [1, BK]
                wd = tl.load(w_down + w_off + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                sd = tl.load(s_down + s_off + k0 // QB, mask=n_ok, other=0.0)  # [BN]
                part += sd * tl.sum(wd.to(tl.float32) * hv, axis=1)
            acc += wj * part
        tl.store(out + t * H + n, acc.to(out.dtype.element_ty), mask=n_ok)


def fp8_pairs(
    x: torch.Tensor,
    rows: torch.Tensor,
    topk_weights: torch.Tensor,
    w: tuple[torch.Tensor, ...],
    scales: tuple[torch.Tensor, ...],
    top_k: int,
    hid: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The FP8 kernels of `moe_triton.moe_pairs`: hid [T*k, I] and out [T, H] written in place."""
    t, h = x.shape
    inter = w[0].shape[1]
    cg, cd = FP8_CONFIGS["gate_up"], FP8_CONFIGS["down"]
    for name, c in FP8_CONFIGS.items():
        if QUANT_BLOCK % c.block_k:
            raise ValueError(f"FP8 {name} tiles: block_k {c.block_k} must divide the {QUANT_BLOCK}-wide scale blocks")
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
    _down_combine_fp8[(t, triton.cdiv(h, cd.block_n))](
        hid,
        rows,
        topw,
        w[2],
        scales[2],
        out,
        TOP_K=top_k,
        INTER=inter,
        H=h,
        QB=QUANT_BLOCK,
        BN=cd.block_n,
        BK=cd.block_k,
        num_warps=cd.num_warps,
    )
