"""Decode-sized MoE kernels in Triton: routing in one kernel, the expert pass in two.

Why: a compiled, graphed decode step of the 48-layer Qwen3-30B-A3B shape spent 141 us of GPU time
per layer on the H200 (benchmarks/results/h200/profile_8layers_compiled_b1.txt): three CUTLASS
grouped GEMMs (3 x 16.7 us for ~16 us of HBM traffic at batch 1), their setup kernels, a sort,
a scatter, an index copy, a combine, and the router's softmax / top-k / sort (~15 us). Decode has
at most B x top_k pairs, each reading its expert's 9.4 MB once, so the expert pass is a batched
GEMV that wants the HBM bandwidth and nothing else:
- `route`: softmax over E, top-k by iterative argmax, optional renormalisation: one program per
  token (E <= 1024), ids int64 and weights fp32 like `experts.route`;
- `_gate_up`: one program per (pair, tile of I): h[p] = silu(x[t] . W_gate[r]) * (x[t] . W_up[r]),
  gate and up streamed together, fp32 accumulation, one rounding;
- `_down_combine`: one program per (token, tile of H): y[t] = sum_j w[t, j] * (h[t*k+j] . W_down[r]),
  the k pairs summed in j order in fp32 (no per-pair output, no scatter, no separate combine);
  `_down_combine_vec` (tiles with pair_vector) is the same sum with the k pairs' tiles loaded at once.
Pairs are not sorted or grouped: a pair's row r (expert in `[E, ...]`, slot in `[K, ...]`) is read
directly. A pair's result depends only on its token's input and its row's weights, and a token's
sum runs in a fixed order, so paged == resident bit for bit whenever both use these kernels.
Two pairs of one step that share an expert each stream it (from L2 when close in time): that is
why steps above MAX_PAIRS keep torch's grouped GEMM, which reads each routed expert once.

Block-FP8 experts (fp8.py) run `_gate_up_fp8` / `_down_combine_fp8`: the same passes reading
float8_e4m3fn rows (half the bytes of bf16) and their float32 128 x 128 block scales; each reduction
step lies inside one scale block (block_k divides 128), so a row's partial dot is scaled once per
block and accumulated in fp32 (no dequantized copy of a weight is ever written).

Selected with `fused.set_expert_backend("triton")` (decode_h200 variant `triton`). Tile sizes are
per kernel in `CONFIGS`; `benchmarks/moe_kernels_h200.py` sweeps them on the GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU torch wheel ships no Triton
    triton = None  # type: ignore[assignment]

MAX_PAIRS = 32
"""Steps of at most this many (token, expert) pairs (batch 4 at top-8) use the per-pair kernels;
larger ones (prefill, big batches) keep the grouped GEMM."""


@dataclass(frozen=True)
class TileConfig:
    block_n: int  # output features per program
    block_k: int  # reduction step
    num_warps: int
    pair_vector: bool = (
        False  # down only: load a token's k pairs' tiles together ([k, BN, BK]), not one pair after another
    )


# The fastest batch-1 tiles of benchmarks/moe_kernels_h200.py on the H200 (results/h200/s3_call5):
# 8 rows x 512 columns per gate+up step with 2 warps; down with a token's 8 pairs loaded together.
CONFIGS: dict[str, TileConfig] = {
    "gate_up": TileConfig(block_n=8, block_k=512, num_warps=2),
    "down": TileConfig(block_n=4, block_k=128, num_warps=8, pair_vector=True),
}
TILES_ENV = "PAGED_EXPERTS_MOE_TILES"
"""`gate_up=16x256x4,down=8x512x4` (block_n x block_k x num_warps per kernel) overrides CONFIGS
at import: what `benchmarks/moe_kernels_h200.py` prints as the best tiles of a GPU."""


def tile_spec(name: str, c: TileConfig) -> str:
    """The PAGED_EXPERTS_MOE_TILES item of one kernel's tiles (parse_tiles reads it back)."""
    return f"{name}={c.block_n}x{c.block_k}x{c.num_warps}" + ("xv" if c.pair_vector else "")


def parse_tiles(spec: str) -> dict[str, TileConfig]:
    """'gate_up=16x256x4,down=8x128x4xv' -> {kernel: TileConfig}; names must be CONFIGS keys; a
    trailing 'xv' (down only) loads a token's pairs together."""
    out: dict[str, TileConfig] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, dims = item.partition("=")
        parts = dims.split("x")
        vector = name == "down" and len(parts) == 4 and parts[3] == "v"
        nums = parts[:3] if vector else parts
        if name not in CONFIGS or len(nums) != 3 or not all(p.isdigit() and int(p) > 0 for p in nums):
            raise ValueError(f"{TILES_ENV}: {item!r} is not <{'|'.join(CONFIGS)}>=<block_n>x<block_k>x<num_warps>[xv]")
        out[name] = TileConfig(*(int(p) for p in nums), pair_vector=vector)
    return out


CONFIGS.update(parse_tiles(os.environ.get(TILES_ENV, "")))

QUANT_BLOCK = 128  # fp8.BLOCK: the scale block of FP8 weights
FP8_CONFIGS: dict[str, TileConfig] = {
    "gate_up": TileConfig(block_n=16, block_k=128, num_warps=4),
    "down": TileConfig(block_n=16, block_k=128, num_warps=4),
}
"""Tiles of the FP8 kernels (block_k must divide 128); `benchmarks/fp8_h200.py` measures them."""


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _route_topk(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        logits,
        ids_out,
        w_out,
        E: tl.constexpr,
        EB: tl.constexpr,
        K: tl.constexpr,
        KB: tl.constexpr,
        NORM: tl.constexpr,
    ):
        """logits [T, E] (any float dtype) -> ids_out [T, K] int64, w_out [T, K] fp32; one token per program."""
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, EB)  # [EB]
        e_ok = e < E
        lg = tl.load(logits + t * E + e, mask=e_ok, other=float("-inf")).to(tl.float32)  # [EB]
        p = tl.exp(lg - tl.max(lg, axis=0))  # [EB], 0 where masked
        p = p / tl.sum(p, axis=0)  # softmax over E in fp32
        kk = tl.arange(0, KB)  # [KB]
        ids = tl.zeros((KB,), dtype=tl.int64)
        ws = tl.zeros((KB,), dtype=tl.float32)
        cur = tl.where(e_ok, p, -1.0)  # probabilities are >= 0: -1 marks taken / padding
        for j in tl.static_range(K):
            best = tl.max(cur, axis=0)
            i = tl.min(tl.where(cur == best, e, EB), axis=0)  # lowest id among equal maxima
            ids = tl.where(kk == j, i.to(tl.int64), ids)
            ws = tl.where(kk == j, best, ws)
            cur = tl.where(e == i, -1.0, cur)
        if NORM:
            ws = ws / tl.sum(ws, axis=0)
        tl.store(ids_out + t * K + kk, ids, mask=kk < K)
        tl.store(w_out + t * K + kk, ws, mask=kk < K)

    @triton.jit
    def _gate_up(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        x,
        rows,
        w_gate,
        w_up,
        hid,
        TOP_K: tl.constexpr,
        INTER: tl.constexpr,
        H: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        """x [T, H], rows [T*k] weight row per pair, w_gate/w_up [G, I, H] -> hid [T*k, I]."""
        p = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
        n_ok = n < INTER
        r = tl.load(rows + p).to(tl.int64)
        x_row = x + (p // TOP_K) * H
        w_off = r * INTER * H + n[:, None].to(tl.int64) * H  # [BN, 1]
        acc_g = tl.zeros((BN,), dtype=tl.float32)
        acc_u = tl.zeros((BN,), dtype=tl.float32)
        for k0 in range(0, H, BK):
            k = k0 + tl.arange(0, BK)  # [BK]
            k_ok = k < H
            xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # [1, BK]
            ok = n_ok[:, None] & k_ok[None, :]
            wg = tl.load(w_gate + w_off + k[None, :], mask=ok, other=0.0).to(tl.float32)  # [BN, BK]
            wu = tl.load(w_up + w_off + k[None, :], mask=ok, other=0.0).to(tl.float32)  # [BN, BK]
            acc_g += tl.sum(wg * xv, axis=1)
            acc_u += tl.sum(wu * xv, axis=1)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, fp32
        tl.store(hid + p * INTER + n, h.to(hid.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _down_combine(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        hid,
        rows,
        topw,
        w_down,
        out,
        TOP_K: tl.constexpr,
        INTER: tl.constexpr,
        H: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        """hid [T*k, I], rows [T*k], topw [T*k] fp32, w_down [G, H, I] -> out [T, H] = sum_j w_j * down(h_j)."""
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
        n_ok = n < H
        acc = tl.zeros((BN,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            p = t * TOP_K + j
            r = tl.load(rows + p).to(tl.int64)
            wj = tl.load(topw + p).to(tl.float32)
            w_off = r * H * INTER + n[:, None].to(tl.int64) * INTER  # [BN, 1]
            part = tl.zeros((BN,), dtype=tl.float32)
            for k0 in range(0, INTER, BK):
                k = k0 + tl.arange(0, BK)  # [BK]
                k_ok = k < INTER
                hv = tl.load(hid + p * INTER + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # [1, BK]
                wd = tl.load(w_down + w_off + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                part += tl.sum(wd.to(tl.float32) * hv, axis=1)
            acc += wj * part
        tl.store(out + t * H + n, acc.to(out.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _down_combine_vec(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        hid,
        rows,
        topw,
        w_down,
        out,
        TOP_K: tl.constexpr,
        KB: tl.constexpr,
        INTER: tl.constexpr,
        H: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        """`_down_combine` with a token's k pairs loaded together: each step streams k weight tiles
        [KB, BN, BK] at once (k times the bytes in flight of the one-pair loop)."""
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
        n_ok = n < H
        j = tl.arange(0, KB)  # [KB]
        j_ok = j < TOP_K
        p = t * TOP_K + j  # [KB]
        r = tl.load(rows + p, mask=j_ok, other=0).to(tl.int64)  # [KB]
        wj = tl.load(topw + p, mask=j_ok, other=0.0).to(tl.float32)  # [KB]
        w_off = r[:, None, None] * H * INTER + n[None, :, None].to(tl.int64) * INTER  # [KB, BN, 1]
        acc = tl.zeros((KB, BN), dtype=tl.float32)
        for k0 in range(0, INTER, BK):
            k = k0 + tl.arange(0, BK)  # [BK]
            k_ok = k < INTER
            hv = tl.load(
                hid + p[:, None] * INTER + k[None, :], mask=j_ok[:, None] & k_ok[None, :], other=0.0
            )  # [KB, BK]
            ok = j_ok[:, None, None] & n_ok[None, :, None] & k_ok[None, None, :]
            wd = tl.load(w_down + w_off + k[None, None, :], mask=ok, other=0.0)  # [KB, BN, BK]
            acc += tl.sum(wd.to(tl.float32) * hv.to(tl.float32)[:, None, :], axis=2)
        y = tl.sum(acc * wj[:, None], axis=0)  # [BN]: the k pairs, weighted, summed
        tl.store(out + t * H + n, y.to(out.dtype.element_ty), mask=n_ok)


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


def _require() -> None:
    if not available():
        raise RuntimeError("the 'triton' expert backend needs Triton (a CUDA build of torch)")


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`experts.route` in one kernel: logits [T, E] -> ids [T, k] int64, weights [T, k] fp32."""
    _require()
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)  # [T, k]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)  # [T, k]
    if t:
        _route_topk[(t,)](
            logits.contiguous(),
            ids,
            weights,
            E=e,
            EB=triton.next_power_of_2(e),
            K=top_k,
            KB=triton.next_power_of_2(top_k),
            NORM=norm_topk_prob,
        )
    return ids, weights


def moe_pairs(
    x: torch.Tensor,
    pair_rows: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    gate_scale: torch.Tensor | None = None,
    up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The expert pass of a decode step: x [T, H], pair_rows [T*k] (row of gate/up [G, I, H],
    down [G, H, I]), topk_weights [T, k] -> [T, H] in x's dtype. FP8 weights come with their block
    scales (gate/up [G, I/128, H/128], down [G, H/128, I/128])."""
    _require()
    t, h = x.shape
    inter = gate.shape[1]
    out = x.new_empty(t, h)  # [T, H]
    if t == 0:
        return out
    rows = pair_rows.reshape(-1).contiguous()  # [T*k]
    hid = x.new_empty(t * top_k, inter)  # [T*k, I]
    if gate_scale is not None:
        assert up_scale is not None and down_scale is not None
        _fp8_pairs(x, rows, topk_weights, (gate, up, down), (gate_scale, up_scale, down_scale), top_k, hid, out)
        return out
    cg, cd = CONFIGS["gate_up"], CONFIGS["down"]
    _gate_up[(t * top_k, triton.cdiv(inter, cg.block_n))](
        x.contiguous(),
        rows,
        gate,
        up,
        hid,
        TOP_K=top_k,
        INTER=inter,
        H=h,
        BN=cg.block_n,
        BK=cg.block_k,
        num_warps=cg.num_warps,
    )
    topw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    grid = (t, triton.cdiv(h, cd.block_n))
    if cd.pair_vector:
        _down_combine_vec[grid](
            hid,
            rows,
            topw,
            down,
            out,
            TOP_K=top_k,
            KB=triton.next_power_of_2(top_k),
            INTER=inter,
            H=h,
            BN=cd.block_n,
            BK=cd.block_k,
            num_warps=cd.num_warps,
        )
    else:
        _down_combine[grid](
            hid,
            rows,
            topw,
            down,
            out,
            TOP_K=top_k,
            INTER=inter,
            H=h,
            BN=cd.block_n,
            BK=cd.block_k,
            num_warps=cd.num_warps,
        )
    return out


def _fp8_pairs(
    x: torch.Tensor,
    rows: torch.Tensor,
    topk_weights: torch.Tensor,
    w: tuple[torch.Tensor, ...],
    scales: tuple[torch.Tensor, ...],
    top_k: int,
    hid: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The FP8 kernels of `moe_pairs`: hid [T*k, I] and out [T, H] written in place."""
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
