"""The unified decode MoE kernels of moe_triton (one set, the FP8 scale path a constexpr switch)
compute what the two twin sets they replaced computed, bit for bit: the bf16 kernels with SCALED off,
the block-FP8 kernels with it on, for the same tiles. The paged == resident bit equality of the
runtime and the tuned tile tables rest on it.

Two checks against the kernels as they were (kept below, verbatim but for their names, only here):
- in the Triton interpreter (TRITON_INTERPRET=1, CPU, in a child interpreter as in
  test_moe_triton.py): the same inputs give torch.equal outputs, every kernel variant, partial tiles
  on both axes;
- compiled for the H200 (sm_90, no GPU needed: Triton's own compiler and ptxas) at the
  Qwen3-30B-A3B layer shape with the shipped tiles: the same PTX but for the kernel's name and
  debug lines, i.e. the GPU runs the same instructions."""

from __future__ import annotations

import os
import re

import pytest
import torch
from interpreted import run_interpreted

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch wheel ships no Triton: the tests below skip
    triton = None  # type: ignore[assignment]

QB = 128  # the FP8 scale block

if triton is not None:

    @triton.jit
    def _old_gate_up(  # pragma: no cover
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
    def _old_down_combine(  # pragma: no cover
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
    def _old_down_combine_vec(  # pragma: no cover
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

    @triton.jit
    def _old_gate_up_fp8(  # pragma: no cover
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
    def _old_down_fp8(  # pragma: no cover
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
    def _old_down_fp8_pairs(  # pragma: no cover
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


def old_pairs(x, rows, topw, w: tuple, scales: tuple | None, top_k: int, tiles: dict) -> torch.Tensor:
    """The expert pass as the two entry points launched it: moe_pairs's bf16 branch, fp8_pairs."""
    t, h = x.shape
    inter = w[0].shape[1]
    hid = x.new_empty(t * top_k, inter)  # [T*k, I]
    out = x.new_empty(t, h)  # [T, H]
    cg, cd = tiles["gate_up"], tiles["down"]
    topw = topw.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    grid_g = (t * top_k, triton.cdiv(inter, cg.block_n))
    grid_d = (t, triton.cdiv(h, cd.block_n))
    kb = triton.next_power_of_2(top_k)
    dims = dict(INTER=inter, H=h, BN=cd.block_n, BK=cd.block_k, num_warps=cd.num_warps)
    if scales is None:
        gate_dims = dict(INTER=inter, H=h, BN=cg.block_n, BK=cg.block_k, num_warps=cg.num_warps)
        _old_gate_up[grid_g](x, rows, w[0], w[1], hid, TOP_K=top_k, **gate_dims)
        if cd.pair_vector:
            _old_down_combine_vec[grid_d](hid, rows, topw, w[2], out, TOP_K=top_k, KB=kb, **dims)
        else:
            _old_down_combine[grid_d](hid, rows, topw, w[2], out, TOP_K=top_k, **dims)
        return out
    gate_dims = dict(INTER=inter, H=h, QB=QB, BN=cg.block_n, BK=cg.block_k, num_warps=cg.num_warps)
    _old_gate_up_fp8[grid_g](x, rows, w[0], w[1], scales[0], scales[1], hid, TOP_K=top_k, **gate_dims)
    if cd.pair_vector:
        _old_down_fp8_pairs[grid_d](hid, rows, topw, w[2], scales[2], out, TOP_K=top_k, KB=kb, QB=QB, **dims)
    else:
        _old_down_fp8[grid_d](hid, rows, topw, w[2], scales[2], out, TOP_K=top_k, QB=QB, **dims)
    return out


# (tokens, experts, top_k, hidden, intermediate): partial tiles of N and K on both passes, a
# non-power-of-two top_k (masked pair lanes), several 128-blocks per row, a row shared by two tokens.
CASES = ((1, 8, 2, 300, 200), (2, 6, 3, 130, 96))
# the shipped tiles of each dtype (a token's pairs loaded together in down; FP8's down steps span two
# scale blocks) and the one-pair down loop over steps of two scale blocks beside gate_up's short steps
TILES = ("gate_up=8x512x2,down=4x128x8xv", "gate_up=8x512x4,down=4x256x8xv", "gate_up=16x64x4,down=8x256x4")


def check_bits() -> None:
    """Old and unified kernels on the same inputs, every tile set, unscaled and FP8 weights: torch.equal
    outputs. In fp32, whose outputs keep every bit of the accumulators (bf16 would round differences away)."""
    from paged_experts import fp8
    from paged_experts.experts import route
    from paged_experts.kernels import moe_tiles, moe_triton

    gen = torch.Generator().manual_seed(7)
    for t, e, k, h, i in CASES:
        shapes = ((e, i, h), (e, i, h), (e, h, i))
        dense = [torch.randn(*s, generator=gen) / 8 for s in shapes]
        quant = [fp8.quantize(d) for d in dense]
        x = torch.randn(t, h, generator=gen)
        rows, topw = route(torch.randn(t, e, generator=gen), k, True)
        if t > 1:
            rows[1] = rows[0]
        rows = rows.reshape(-1).contiguous()
        for spec in TILES:
            tiles = moe_tiles.parse_tiles(spec)
            want = old_pairs(x, rows, topw, tuple(dense), None, k, tiles)
            got = moe_triton.moe_pairs(x, rows, topw, *dense, k, tiles=tiles)
            assert torch.equal(got, want), ("unscaled", spec, (t, e, k, h, i))
            wq, sq = tuple(q for q, _ in quant), tuple(s for _, s in quant)
            want = old_pairs(x, rows, topw, wq, sq, k, tiles)
            got = moe_triton.moe_pairs(x, rows, topw, *wq, k, *sq, tiles=tiles)
            assert torch.equal(got, want), ("FP8", spec, (t, e, k, h, i))
        print("ok", (t, e, k, h, i))


def test_unified_kernels_compute_the_old_bits_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    out = run_interpreted("test_moe_triton_switch", "check_bits")
    assert out.count("ok ") == len(CASES)


def h200_ptx(fn, pointers: dict[str, str], constants: dict[str, object], num_warps: int) -> str:
    """fn's PTX for the H200 (sm_90) with the launcher's specialization (pointers 16-byte aligned,
    None scale pointers constant), less its name, comments and debug lines."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {a: pointers.get(a, "constexpr") for a in fn.arg_names}
    constexprs = {a: constants.get(a) for a in fn.arg_names if a not in pointers}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in pointers}
    src = ASTSource(fn, signature, constexprs, attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
    code = ptx.split(".section\t.debug")[0].replace(fn.__name__, "KERNEL")
    lines = (line.split("//")[0].strip() for line in code.splitlines())
    return "\n".join(x for x in lines if x and not re.match(r"\.loc|\.file|\$L__(func_begin|tmp)", x))


# Qwen3-30B-A3B's layer (H 2048, I 768, top-8), each kernel at the tiles it runs with (moe_tiles.CONFIGS,
# moe_tiles.FP8_CONFIGS) or, for the one-pair down loops, the 8 x 256 x 4 tiles.
GATE_UP = dict(x="*bf16", rows="*i64", w_gate="*bf16", w_up="*bf16", hid="*bf16")
DOWN = dict(hid="*bf16", rows="*i64", topw="*fp32", w_down="*bf16", out="*bf16")
GATE_UP_FP8 = {**GATE_UP, "w_gate": "*fp8e4nv", "w_up": "*fp8e4nv", "s_gate": "*fp32", "s_up": "*fp32"}
DOWN_FP8 = {**DOWN, "w_down": "*fp8e4nv", "s_down": "*fp32"}
# the expert row strides of contiguous tables (gate/up [E, I, H] and down [E, H, I] alike, slots and host rows): what
# moe_triton's wrappers pass for them, so the unified kernels' PTX is the code contiguous tables run
ROWS = dict(W_STRIDE=768 * 2048, S_STRIDE=(768 // QB) * (2048 // QB))
SHAPE = dict(TOP_K=8, INTER=768, H=2048, QB=QB, **ROWS, HW_STRIDE=ROWS["W_STRIDE"], HS_STRIDE=ROWS["S_STRIDE"])
PTX_CASES = (
    ("_gate_up", "_old_gate_up", GATE_UP, dict(BN=8, BK=512), 2, False),
    ("_down_combine_vec", "_old_down_combine_vec", DOWN, dict(KB=8, BN=4, BK=128), 8, False),
    ("_down_combine", "_old_down_combine", DOWN, dict(BN=8, BK=256), 4, False),
    ("_gate_up", "_old_gate_up_fp8", GATE_UP_FP8, dict(BN=8, BK=512), 4, True),
    ("_down_combine_vec", "_old_down_fp8_pairs", DOWN_FP8, dict(KB=8, BN=4, BK=256), 8, True),
    ("_down_combine", "_old_down_fp8", DOWN_FP8, dict(BN=8, BK=256), 4, True),
)


@pytest.mark.parametrize(("new", "old", "pointers", "tiles", "num_warps", "scaled"), PTX_CASES)
def test_unified_kernels_compile_to_the_old_ptx(new, old, pointers, tiles, num_warps, scaled) -> None:
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter compiles nothing")
    from paged_experts.kernels import moe_triton

    before = h200_ptx(globals()[old], pointers, {**SHAPE, **tiles}, num_warps)
    after = h200_ptx(getattr(moe_triton, new), pointers, {**SHAPE, **tiles, "SCALED": scaled, "SKIP": False}, num_warps)
    assert "ld.global" in before and after == before


@pytest.mark.parametrize(("pointers", "num_warps", "scaled"), [(GATE_UP, 2, False), (GATE_UP_FP8, 4, True)])
def test_the_skipping_gate_up_compiles_for_the_h200(pointers, num_warps, scaled) -> None:
    """SKIP (the overlapped pass's per-group launches, moe/overlap.py) compiles for sm_90 at the shipped
    tiles, its weight loads predicated on the pair's row; with SKIP off the PTX is the old one (above)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter compiles nothing")
    from paged_experts.kernels import moe_triton

    constants = {**SHAPE, "BN": 8, "BK": 512, "SCALED": scaled}
    plain = h200_ptx(moe_triton._gate_up, pointers, {**constants, "SKIP": False}, num_warps)
    skipping = h200_ptx(moe_triton._gate_up, pointers, {**constants, "SKIP": True}, num_warps)
    assert "ld.global" in skipping and skipping != plain


READ_POINTERS = {
    "_gate_up": {**GATE_UP_FP8, "src_rows": "*i64", "h_gate": "*fp8e4nv", "h_up": "*fp8e4nv", "hs_gate": "*fp32",
                 "hs_up": "*fp32"},
    "_down_combine_vec": {**DOWN_FP8, "src_rows": "*i64", "h_down": "*fp8e4nv", "hs_down": "*fp32"},
    "_down_combine": {**DOWN_FP8, "src_rows": "*i64", "h_down": "*fp8e4nv", "hs_down": "*fp32"},
}  # fmt: skip


@pytest.mark.parametrize(
    ("kernel", "tiles", "num_warps"),
    [("_gate_up", dict(BN=8, BK=512), 4), ("_down_combine_vec", dict(KB=8, BN=4, BK=256), 8),
     ("_down_combine", dict(BN=8, BK=256), 4)],
)  # fmt: skip
def test_the_read_through_kernels_compile_for_the_h200(kernel, tiles, num_warps) -> None:
    """READ (a batch-1 step's misses read from pinned host rows by the expert kernels and written through
    to their slots: moe/paged.py) compiles for sm_90 at the shipped FP8 tiles: the weight stores are there,
    16-byte wide as the loads; with READ off the kernel is the plain one (the PTX cases above)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter compiles nothing")
    from paged_experts.kernels import moe_triton

    constants = {**SHAPE, **tiles, "SCALED": True}
    fn = getattr(moe_triton, kernel)
    plain = h200_ptx(fn, {k: v for k, v in READ_POINTERS[kernel].items() if k in GATE_UP_FP8 or k in DOWN_FP8},
                     constants, num_warps)  # fmt: skip
    reading = h200_ptx(fn, READ_POINTERS[kernel], {**constants, "READ": True}, num_warps)
    # the plain kernel stores only its output (st.global.b16); the weights written through go out 16 bytes wide
    assert "st.global.v4" in reading and "st.global.v4" not in plain, "the written-through weights go out narrow"
    assert "ld.global.b8" not in reading, "a weight load lost its width (byte loads)"
