"""The dense block-FP8 linear in Triton: attention projections kept as a block-FP8 checkpoint stores them.

`fp8_linear(x, w, scale)`: x [M, K] (bf16 / fp16 / fp32), w [N, K] float8_e4m3fn with float32 128 x 128 block
scales [ceil(N/128), ceil(K/128)] -> [M, N] = x @ (w * scale)^T in x's dtype, fp32 accumulation. The weight is
stored as its FP8 bytes (half of bf16's), and decode steps read it so: the attention projections of
Qwen3-30B-A3B take 0.91 GB this way against 1.81 GB in bf16, room for ~4 more resident experts per layer at a
16 GB budget, and half the bytes a decode token reads for them.

Two paths, chosen by M (never by anything else, so a row computes the same bits in every step of its size):
- M <= GEMV_MAX_ROWS (decode): `_fp8_gemv`, one program per BN output features holding all M rows; each K step
  multiplies the FP8 weight tile (converted to fp32) elementwise with the activations times their column's block
  scale (the decode expert kernels' arithmetic, moe_triton `_gate_up`) into a [rows, BN, BK] fp32 accumulator,
  reduced over BK once at the end: the loop is loads and FMAs only. (The first version reduced every step:
  2.3-7x slower than cuBLAS' bf16 GEMV at 2-16 rows on the H200, benchmarks/fp8_linear_h200.py.)
  A bucket's tiles may instead name `_fp8_mma` (kind 'mma'): the same product on the tensor cores, swap-AB;
- larger M (prefill): the weight dequantized into a scratch buffer of the activations' dtype (`_dequant`, one
  read of the FP8 bytes, one write), then `F.linear` (cuBLAS): a Triton MMA over FP8 tiles converted in
  registers ran 2.3-3x slower than cuBLAS' bf16 at 2,048 rows there. The scratch is one buffer per device and
  dtype, grown to the largest weight (21 MB at Qwen3-30B-A3B's q/k/v), reused by every layer on the stream.
Tiles: `LINEAR_TILES` (per row bucket), overridden by `PAGED_EXPERTS_FP8_LINEAR_TILES`; benchmarks/
fp8_linear_h200.py sweeps them on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU torch wheel ships no Triton
    triton = None

QUANT_BLOCK = 128  # fp8.BLOCK
GEMV_MAX_ROWS = 16  # larger steps dequantize into the scratch buffer for cuBLAS


@dataclass(frozen=True)
class GemvTiles:
    """One row bucket's kernel and tiles. kind 'gemv': `_fp8_gemv` (fp32 FMAs); 'mma': `_fp8_mma`, the weight tile
    as the MMA's first operand and the activations transposed as its second (swap-AB: the rows pad to 16 columns of
    the tensor-core tile, not to 16 of its rows), each 128-column block's scale applied to its partial product."""

    block_n: int  # output features per program (divides 128: the tile shares one row of scales)
    block_k: int  # reduction step ('mma': divides 128, one scale per step)
    num_warps: int
    kind: str = "gemv"
    num_stages: int = 3  # 'mma' only: the loads' software pipeline

    def spec(self) -> str:
        """The PAGED_EXPERTS_FP8_LINEAR_TILES value of these tiles (parse_tiles reads it back)."""
        dims = f"{self.block_n}x{self.block_k}x{self.num_warps}"
        return f"mma:{dims}x{self.num_stages}" if self.kind == "mma" else dims


# The H200's fastest (benchmarks/fp8_linear_h200.py, 2026-12-03, the q/k/v and o shapes' times added): at one row
# 4 features a program over 1,024-column steps, 14.4 us for both projections against cuBLAS' bf16 16.3 us; at 2 and 4
# rows the GEMV stays slower than bf16 (18.2 and 29.7 us against 16.6 and 16.5: benchmarks/results/h200/
# 2026-12-03-attnfp8/README.md). Buckets 8 and 16: not swept, the [rows, BN, BK] accumulator at 32 registers a thread.
LINEAR_TILES: dict[int, GemvTiles] = {
    1: GemvTiles(block_n=4, block_k=1024, num_warps=4),
    2: GemvTiles(block_n=4, block_k=1024, num_warps=4),
    4: GemvTiles(block_n=8, block_k=512, num_warps=8),
    8: GemvTiles(block_n=8, block_k=128, num_warps=8),
    16: GemvTiles(block_n=4, block_k=128, num_warps=8),
}
TILES_ENV = "PAGED_EXPERTS_FP8_LINEAR_TILES"
"""`1=4x1024x4,4=mma:32x128x4x3` (rows bucket = [mma:]block_n x block_k x num_warps[x num_stages]) overrides
LINEAR_TILES' buckets."""


def parse_tiles(spec: str, source: str = TILES_ENV) -> dict[int, GemvTiles]:
    """'1=4x1024x4,4=mma:32x128x4x3' -> {row bucket: GemvTiles}; buckets are LINEAR_TILES' keys, block_n divides
    128 (and for mma block_k too)."""
    out: dict[int, GemvTiles] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        bucket, _, dims = item.partition("=")
        kind, _, dims = dims.rpartition(":")
        nums = dims.split("x")
        want = 4 if kind == "mma" else 3
        ok = bucket.isdigit() and int(bucket) in LINEAR_TILES and kind in ("", "mma") and len(nums) == want
        ok = ok and all(v.isdigit() and int(v) > 0 for v in nums)
        if ok:  # Triton's aranges take powers of two; the MMA's operands at least 16 on each side
            bn, bk = int(nums[0]), int(nums[1])
            ok = QUANT_BLOCK % bn == 0 and bk & (bk - 1) == 0
            ok = ok and (kind != "mma" or (QUANT_BLOCK % bk == 0 and bn >= 16 and bk >= 16))
        if not ok:
            raise ValueError(
                f"{source}: {item!r} is not <{'|'.join(map(str, LINEAR_TILES))}>=<block_n>x<block_k>x<num_warps> or "
                f"...=mma:<block_n>x<block_k>x<num_warps>x<num_stages> (powers of two; block_n, and an mma's "
                f"block_k, divide {QUANT_BLOCK}; an mma's both at least 16)"
            )
        bn, bk, warps = (int(v) for v in nums[:3])
        tiles = GemvTiles(bn, bk, warps, kind="mma", num_stages=int(nums[3])) if kind else GemvTiles(bn, bk, warps)
        out[int(bucket)] = tiles
    return out


LINEAR_TILES.update(parse_tiles(os.environ.get(TILES_ENV, "")))


def row_bucket(m: int) -> int:
    """The GEMV's row count for M rows: the next power of two (one compiled variant per bucket)."""
    return 1 << max(0, (m - 1).bit_length())


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _fp8_gemv(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        x, w, s, out, M,
        N: tl.constexpr, K: tl.constexpr, QB: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """x [M, K], w [N, K] fp8, s [N/QB, K/QB] fp32 -> out [M, N]; rows M <= MB, one program per BN features."""
        n0 = tl.program_id(0) * BN
        n = n0 + tl.arange(0, BN)  # [BN]
        n_ok = n < N
        rows = tl.arange(0, MB)  # [MB]
        m_ok = rows < M
        sk: tl.constexpr = (K + QB - 1) // QB
        s_row = (n0 // QB) * sk  # the tile's row of scales (BN divides QB)
        acc = tl.zeros((MB, BN, BK), dtype=tl.float32)  # reduced over BK once, after the loop
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)  # [BK]
            k_ok = k < K
            sc = tl.load(s + s_row + k // QB, mask=k_ok, other=0.0)  # [BK] each column's block scale
            xv = tl.load(x + rows[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            xs = xv.to(tl.float32) * sc[None, :]  # [MB, BK]
            wt = tl.load(w + n[:, None].to(tl.int64) * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += xs[:, None, :] * wt.to(tl.float32)[None, :, :]  # [MB, BN, BK]
        res = tl.sum(acc, axis=2)  # [MB, BN]
        tl.store(out + rows[:, None] * N + n[None, :], res.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _fp8_mma(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        x, w, s, out, M,
        N: tl.constexpr, K: tl.constexpr, QB: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        """_fp8_gemv's product on the tensor cores, swap-AB: acc [BN, MB] = W tile [BN, BK] @ x^T [BK, MB] per K step
        (MB >= 16 columns, the rows past M masked), times the step's block scale (BK divides QB)."""
        n0 = tl.program_id(0) * BN
        n = n0 + tl.arange(0, BN)  # [BN]
        n_ok = n < N
        rows = tl.arange(0, MB)  # [MB]
        m_ok = rows < M
        sk: tl.constexpr = (K + QB - 1) // QB
        s_row = (n0 // QB) * sk
        acc = tl.zeros((BN, MB), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)  # [BK], inside one scale block
            k_ok = k < K
            wt = tl.load(w + n[:, None].to(tl.int64) * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x + rows[None, :] * K + k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)  # [BK, MB]
            sc = tl.load(s + s_row + k0 // QB)
            if IEEE:
                acc += sc * tl.dot(wt.to(xt.dtype), xt, input_precision="ieee")  # [BN, MB]
            else:
                acc += sc * tl.dot(wt.to(xt.dtype), xt)  # [BN, MB]
        tl.store(out + rows[None, :] * N + n[:, None], acc.to(out.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])

    @triton.jit
    def _dequant(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        w, s, out, N: tl.constexpr, K: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
    ):
        """w [N, K] fp8, s [N/QB, K/QB] fp32 -> out [N, K] = w * s in out's dtype (fp.dequantize's rounding)."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN]
        k = tl.program_id(1) * BK + tl.arange(0, BK)  # [BK]
        ok = (n < N)[:, None] & (k < K)[None, :]
        sk: tl.constexpr = (K + QB - 1) // QB
        sc = tl.load(s + (n // QB)[:, None] * sk + (k // QB)[None, :], mask=ok, other=0.0)  # [BN, BK]
        offs = n[:, None].to(tl.int64) * K + k[None, :]
        wt = tl.load(w + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + offs, (wt * sc).to(out.dtype.element_ty), mask=ok)


# One buffer per device and dtype, grown to the largest weight and shared by every layer (every call uses it at once,
# on the stream it runs on): a model-owned buffer would cost one per model in a process that holds several.
_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def dequantized(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w [N, K] fp8 with its block scales -> [N, K] in `dtype`, written into this device's scratch buffer (valid until
    the next call on it: the caller uses it at once, on the same stream)."""
    n, k = w.shape
    key = (w.device, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n * k:
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            # a captured graph would keep writing into the old buffer after it is freed: grow it before capture
            raise RuntimeError(
                f"fp8_linear: the dequantization scratch ({0 if buf is None else buf.numel()} elements) must grow to "
                f"{n * k} inside a CUDA graph capture; run one eager step of this shape before capturing"
            )
        buf = _SCRATCH[key] = torch.empty(n * k, dtype=dtype, device=w.device)
    out = buf[: n * k].view(n, k)
    _dequant[(triton.cdiv(n, 32), triton.cdiv(k, 128))](w, scale, out, N=n, K=k, QB=QUANT_BLOCK, BN=32, BK=128)
    return out


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, gemv: GemvTiles | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] = x @ (w * scale)^T in x's dtype (fp32 accumulation, one rounding): w [N, K]
    float8_e4m3fn, scale [ceil(N/128), ceil(K/128)] float32. Triton (CUDA, or TRITON_INTERPRET=1).
    gemv: tiles other than the table's (benchmarks/fp8_linear_h200.py sweeps them)."""
    if triton is None:
        raise RuntimeError("fp8_linear needs Triton (a CUDA build of torch)")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"fp8_linear: x has {k} columns, the weight {w.shape[1]}")
    out = x.new_empty(m, n)  # [M, N]
    if m == 0:
        return out
    x = x.contiguous()
    if m <= GEMV_MAX_ROWS:
        mb = row_bucket(m)
        t = gemv or LINEAR_TILES[mb]
        if QUANT_BLOCK % t.block_n or (t.kind == "mma" and QUANT_BLOCK % t.block_k):
            raise ValueError(f"fp8_linear: tiles {t.spec()}: block_n (and an mma's block_k) must divide {QUANT_BLOCK}")
        grid = (triton.cdiv(n, t.block_n),)
        if t.kind == "mma":
            _fp8_mma[grid](
                x, w, scale, out, m, N=n, K=k, QB=QUANT_BLOCK, MB=max(16, mb), BN=t.block_n, BK=t.block_k,
                IEEE=x.dtype == torch.float32, num_warps=t.num_warps, num_stages=t.num_stages,
            )  # fmt: skip
            return out
        _fp8_gemv[grid](
            x, w, scale, out, m, N=n, K=k, QB=QUANT_BLOCK, MB=mb, BN=t.block_n, BK=t.block_k, num_warps=t.num_warps
        )
        return out
    return F.linear(x, dequantized(w, scale, x.dtype))
