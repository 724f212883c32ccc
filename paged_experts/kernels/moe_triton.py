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
sum runs in a fixed order, so paged == resident bit for bit whenever both use these kernels with
the same tiles (FP8's depend on the step's token count, the same in both).
A table's rows may also be packed (an expert's tensors in one byte row of a uint8 buffer, each tensor a strided
view: residency/store.py): each kernel takes its tables' row strides as constexprs (`row_stride`), so a
contiguous table compiles to the code it always did (tests/test_moe_triton_switch.py) and a packed one
computes the same bits (tests/test_moe_packed_rows.py).
Two pairs of one step that share an expert each stream it (from L2 when close in time): that is
why steps above MAX_PAIRS keep torch's grouped GEMM, which reads each routed expert once.

Block-FP8 experts (fp8.py) run the same kernels with the scale path compiled in: `SCALED` is a
constexpr, as `use_fp8_w8a8` is in the serving engines' fused-MoE kernels, so a bf16 step compiles
exactly the code it did before the two were one (its scale pointers are None, never loaded): each
`if SCALED` sits where the two old kernels differed, every operation in its old place, and
tests/test_moe_triton_switch.py checks that both paths compile to the old kernels' PTX. Where
the scales go: a tile's rows lie inside one 128-row scale block (block_n divides 128), so the scale
of element (n, k) is the tile's `s[k // 128]`, a vector over k. Each step scales the activation
vector by it (`x[k] * s[k // 128]`, fp32) and dots the FP8 row (exact in fp32) with that: one
multiply per activation, not one per weight, no dequantized weight written, and block_k free of
the 128-column scale blocks. Scaling each 128-column partial dot instead tied block_k to <= 128 and
left the GPU waiting on small loads: 61.6 us per batch-1 layer on the H200 (613 GB/s), against
16.4 us this way and 22.5 us for bf16 (benchmarks/results/h200/README.md).

Selected with `RuntimeConfig(kernel_backend="triton")` (decode_h200 variant `triton`). Tile sizes are
per kernel and dtype: `moe_tiles.CONFIGS` (bf16, swept by `benchmarks/moe_kernels_h200.py`) and, for
FP8, `moe_tiles.fp8_tiles` per shape and batch (the table `benchmarks/fp8_tiles_h200.py` writes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU torch wheel ships no Triton
    triton = None

from paged_experts.kernels.moe_tiles import CONFIGS, TileConfig, fp8_tiles
from paged_experts.residency.store import ExpertTensors

QUANT_BLOCK = 128  # fp8.BLOCK: the scale block of FP8 weights
MAX_PAIRS = 32
"""Steps of at most this many (token, expert) pairs (batch 4 at top-8) use the per-pair kernels;
larger ones (prefill, big batches) keep the grouped GEMM."""


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
        s_gate,
        s_up,
        hid,
        TOP_K: tl.constexpr,
        INTER: tl.constexpr,
        H: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        SCALED: tl.constexpr,
        QB: tl.constexpr,
        W_STRIDE: tl.constexpr,
        S_STRIDE: tl.constexpr,
        SKIP: tl.constexpr = False,
        src_rows=None,
        h_gate=None,
        h_up=None,
        hs_gate=None,
        hs_up=None,
        READ: tl.constexpr = False,
        HW_STRIDE: tl.constexpr = None,
        HS_STRIDE: tl.constexpr = None,
    ):
        """x [T, H], rows [T*k] weight row per pair, w_gate/w_up [G, I, H] -> hid [T*k, I]. SCALED:
        float8_e4m3fn weights with fp32 scales s_gate/s_up [G, I/QB, H/QB], BN dividing QB (the
        tile's rows share one scale row); otherwise s_gate/s_up are None. W_STRIDE / S_STRIDE: elements
        from one row of w_gate and w_up / s_gate and s_up to the next (`row_stride`: each row contiguous,
        the rows contiguous too or packed, one expert's tensors in one byte row); HW_STRIDE / HS_STRIDE:
        the host rows' (READ). SKIP: a pair whose row is
        negative is not this launch's (its weights may still be copying): its programs return after
        reading the row, so a step's pairs can be computed over several launches, each pair's values
        exactly those of one launch over all of them (SKIP off compiles the kernel without the check).
        READ: a pair whose src_rows entry e is >= 0 is a miss being paged in by this launch: its weights
        (and scales) are read from host row e of h_gate/h_up (hs_gate/hs_up), pinned host memory the GPU
        reads directly, and written through to its slot row r; the arithmetic is the same either way.
        Each pair on a missed expert must be marked missed (a plan's pair_missed does that): its programs
        read the row from the host, and every weight element of a pair's row is read by exactly one of
        its programs, so in a batch-1 step (k distinct experts) each missed row crosses the link once;
        pairs of several tokens sharing a missed expert would each read it (the same values written
        twice, the link crossed twice)."""
        p = tl.program_id(0).to(tl.int64)
        n0 = tl.program_id(1) * BN
        n = n0 + tl.arange(0, BN)  # [BN]
        n_ok = n < INTER
        r = tl.load(rows + p).to(tl.int64)
        if SKIP:
            if r < 0:  # another launch's pair: its weights may still be copying
                return
        x_row = x + (p // TOP_K) * H
        w_off = r * W_STRIDE + n[:, None].to(tl.int64) * H  # [BN, 1]
        if SCALED:
            sk: tl.constexpr = (H + QB - 1) // QB
            s_row = r * S_STRIDE + (n0 // QB) * sk  # scalar: the tile's scale row
        if READ:  # where the weights are read: the slot row r, or (a miss) host row e, written through to r
            g_src = w_gate + w_off
            u_src = w_up + w_off
            if SCALED:
                sg_src = s_gate + s_row
                su_src = s_up + s_row
            e = tl.load(src_rows + p).to(tl.int64)
            if e >= 0:
                g_src = h_gate + (e * HW_STRIDE + n[:, None].to(tl.int64) * H)
                u_src = h_up + (e * HW_STRIDE + n[:, None].to(tl.int64) * H)
                if SCALED:
                    hs_row = e * HS_STRIDE + (n0 // QB) * sk
                    sg_src = hs_gate + hs_row
                    su_src = hs_up + hs_row
        acc_g = tl.zeros((BN,), dtype=tl.float32)
        acc_u = tl.zeros((BN,), dtype=tl.float32)
        for k0 in range(0, H, BK):
            k = k0 + tl.arange(0, BK)  # [BK]
            k_ok = k < H
            xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
            if READ:
                if SCALED:
                    sg = tl.load(sg_src + k // QB, mask=k_ok, other=0.0)  # [BK]
                    su = tl.load(su_src + k // QB, mask=k_ok, other=0.0)  # [BK]
                ok = n_ok[:, None] & k_ok[None, :]
                wg_raw = tl.load(g_src + k[None, :], mask=ok, other=0.0)  # [BN, BK]
                wu_raw = tl.load(u_src + k[None, :], mask=ok, other=0.0)  # [BN, BK]
                if e >= 0:  # the miss's tile written through to its slot (no other pair of the launch reads it)
                    tl.store(w_gate + w_off + k[None, :], wg_raw, mask=ok)
                    tl.store(w_up + w_off + k[None, :], wu_raw, mask=ok)
                    if SCALED:
                        tl.store(s_gate + s_row + k // QB, sg, mask=k_ok)
                        tl.store(s_up + s_row + k // QB, su, mask=k_ok)
                wg = wg_raw.to(tl.float32)
                wu = wu_raw.to(tl.float32)
            else:  # the plain step: exactly the instructions it always ran (tests/test_moe_triton_switch.py)
                if SCALED:  # each column's weight scale, applied to the activation: x[k] * s[k // QB]
                    sg = tl.load(s_gate + s_row + k // QB, mask=k_ok, other=0.0)  # [BK]
                    su = tl.load(s_up + s_row + k // QB, mask=k_ok, other=0.0)  # [BK]
                ok = n_ok[:, None] & k_ok[None, :]
                wg = tl.load(w_gate + w_off + k[None, :], mask=ok, other=0.0).to(tl.float32)  # [BN, BK]
                wu = tl.load(w_up + w_off + k[None, :], mask=ok, other=0.0).to(tl.float32)  # [BN, BK]
            acc_g += tl.sum(wg * (xv * sg if SCALED else xv)[None, :], axis=1)
            acc_u += tl.sum(wu * (xv * su if SCALED else xv)[None, :], axis=1)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, fp32
        tl.store(hid + p * INTER + n, h.to(hid.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _down_combine(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        hid,
        rows,
        topw,
        w_down,
        s_down,
        out,
        TOP_K: tl.constexpr,
        INTER: tl.constexpr,
        H: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        SCALED: tl.constexpr,
        QB: tl.constexpr,
        W_STRIDE: tl.constexpr,
        S_STRIDE: tl.constexpr,
        src_rows=None,
        h_down=None,
        hs_down=None,
        READ: tl.constexpr = False,
        HW_STRIDE: tl.constexpr = None,
        HS_STRIDE: tl.constexpr = None,
    ):
        """hid [T*k, I], rows [T*k], topw [T*k] fp32, w_down [G, H, I] -> out [T, H] = sum_j w_j * down(h_j),
        the pairs one after another. SCALED: float8_e4m3fn weights with fp32 scales s_down [G, H/QB, I/QB].
        W_STRIDE, S_STRIDE (HW_STRIDE, HS_STRIDE): the rows' strides of w_down, s_down (h_down, hs_down), as
        `_gate_up`'s. READ: as `_gate_up`'s (a miss's down row read from host row src_rows[p] of h_down/hs_down and
        written through to its slot row)."""
        t = tl.program_id(0).to(tl.int64)
        n0 = tl.program_id(1) * BN
        n = n0 + tl.arange(0, BN)  # [BN]
        n_ok = n < H
        si: tl.constexpr = (INTER + QB - 1) // QB  # scale blocks per row (used when SCALED)
        acc = tl.zeros((BN,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            p = t * TOP_K + j
            r = tl.load(rows + p).to(tl.int64)
            wj = tl.load(topw + p).to(tl.float32)
            w_off = r * W_STRIDE + n[:, None].to(tl.int64) * INTER  # [BN, 1]
            if SCALED:
                s_row = r * S_STRIDE + (n0 // QB) * si  # scalar: the tile's scale row
            if READ:
                d_src = w_down + w_off
                if SCALED:
                    sd_src = s_down + s_row
                e = tl.load(src_rows + p).to(tl.int64)
                if e >= 0:  # a miss: host row e, written through to slot row r
                    d_src = h_down + (e * HW_STRIDE + n[:, None].to(tl.int64) * INTER)
                    if SCALED:
                        sd_src = hs_down + (e * HS_STRIDE + (n0 // QB) * si)
            part = tl.zeros((BN,), dtype=tl.float32)
            for k0 in range(0, INTER, BK):
                k = k0 + tl.arange(0, BK)  # [BK]
                k_ok = k < INTER
                hv = tl.load(hid + p * INTER + k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
                if SCALED:
                    if READ:
                        sd = tl.load(sd_src + k // QB, mask=k_ok, other=0.0)  # [BK]
                    else:
                        sd = tl.load(s_down + s_row + k // QB, mask=k_ok, other=0.0)  # [BK]
                else:  # broadcast here, before the weight load, as the bf16 kernel always did
                    hv = hv[None, :]  # [1, BK]
                if READ:
                    wd = tl.load(d_src + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
                    if e >= 0:
                        tl.store(w_down + w_off + k[None, :], wd, mask=n_ok[:, None] & k_ok[None, :])
                        if SCALED:
                            tl.store(s_down + s_row + k // QB, sd, mask=k_ok)
                else:
                    wd = tl.load(w_down + w_off + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
                part += tl.sum(wd.to(tl.float32) * ((hv * sd)[None, :] if SCALED else hv), axis=1)
            acc += wj * part
        tl.store(out + t * H + n, acc.to(out.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _down_combine_vec(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
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
        BN: tl.constexpr,
        BK: tl.constexpr,
        SCALED: tl.constexpr,
        QB: tl.constexpr,
        W_STRIDE: tl.constexpr,
        S_STRIDE: tl.constexpr,
        src_rows=None,
        h_down=None,
        hs_down=None,
        READ: tl.constexpr = False,
        HW_STRIDE: tl.constexpr = None,
        HS_STRIDE: tl.constexpr = None,
    ):
        """`_down_combine` with a token's k pairs loaded together: each step streams k weight tiles
        [KB, BN, BK] at once (k times the bytes in flight of the one-pair loop). READ: as `_down_combine`'s,
        each pair's tiles from its own source (a pointer per pair)."""
        t = tl.program_id(0).to(tl.int64)
        n0 = tl.program_id(1) * BN
        n = n0 + tl.arange(0, BN)  # [BN]
        n_ok = n < H
        j = tl.arange(0, KB)  # [KB]
        j_ok = j < TOP_K
        p = t * TOP_K + j  # [KB]
        r = tl.load(rows + p, mask=j_ok, other=0).to(tl.int64)  # [KB]
        wj = tl.load(topw + p, mask=j_ok, other=0.0).to(tl.float32)  # [KB]
        w_off = r[:, None, None] * W_STRIDE + n[None, :, None].to(tl.int64) * INTER  # [KB, BN, 1]
        if SCALED:
            si: tl.constexpr = (INTER + QB - 1) // QB
            s_row = r * S_STRIDE + (n0 // QB) * si  # [KB]: each pair's scale row
        if READ:  # the misses' pairs read their host rows (written through below), the hits their slots
            # two loads masked by pair, not one through a pointer chosen per pair: that loses the rows'
            # contiguity and compiles to byte loads (ld.global.b8)
            e = tl.load(src_rows + p, mask=j_ok, other=-1).to(tl.int64)  # [KB]
            miss = e >= 0  # [KB]
            h_off = e[:, None, None] * HW_STRIDE + n[None, :, None].to(tl.int64) * INTER  # [KB, BN, 1]
            if SCALED:
                hs_row = e * HS_STRIDE + (n0 // QB) * si  # [KB]
        acc = tl.zeros((KB, BN), dtype=tl.float32)
        for k0 in range(0, INTER, BK):
            k = k0 + tl.arange(0, BK)  # [BK]
            k_ok = k < INTER
            jk = j_ok[:, None] & k_ok[None, :]  # [KB, BK]
            hv = tl.load(hid + p[:, None] * INTER + k[None, :], mask=jk, other=0.0)  # [KB, BK]
            if SCALED:  # bf16 converts hv at its use, FP8 here: each as before
                hv = hv.to(tl.float32)
                if READ:
                    sd_hit = tl.load(s_down + s_row[:, None] + k[None, :] // QB, mask=jk & ~miss[:, None], other=0.0)
                    sd_miss = tl.load(hs_down + hs_row[:, None] + k[None, :] // QB, mask=jk & miss[:, None], other=0.0)
                    sd = tl.where(miss[:, None], sd_miss, sd_hit)  # [KB, BK]
                else:
                    sd = tl.load(s_down + s_row[:, None] + k[None, :] // QB, mask=jk, other=0.0)  # [KB, BK]
            ok = j_ok[:, None, None] & n_ok[None, :, None] & k_ok[None, None, :]
            if READ:
                m3 = miss[:, None, None]
                wd_hit = tl.load(w_down + w_off + k[None, None, :], mask=ok & ~m3, other=0.0)  # [KB, BN, BK]
                wd_miss = tl.load(h_down + h_off + k[None, None, :], mask=ok & m3, other=0.0)  # [KB, BN, BK]
                wd = tl.where(m3, wd_miss, wd_hit)
                tl.store(w_down + w_off + k[None, None, :], wd, mask=ok & m3)  # the misses' tiles written through
                if SCALED:
                    tl.store(s_down + s_row[:, None] + k[None, :] // QB, sd, mask=jk & miss[:, None])
            else:
                wd = tl.load(w_down + w_off + k[None, None, :], mask=ok, other=0.0)  # [KB, BN, BK]
            acc += tl.sum(wd.to(tl.float32) * (hv * sd if SCALED else hv.to(tl.float32))[:, None, :], axis=2)
        y = tl.sum(acc * wj[:, None], axis=0)  # [BN]: the k pairs, weighted, summed
        tl.store(out + t * H + n, y.to(out.dtype.element_ty), mask=n_ok)


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


def row_stride(t: torch.Tensor, name: str) -> int:
    """Elements from one expert row of t [N, ...] to the next, each row contiguous: the row's size in a contiguous
    table, the pitch over the element size in a packed one (an expert's tensors in one byte row of a uint8 buffer,
    each a strided view). The kernels take it as a constexpr: a contiguous table compiles to the code it always did."""
    row = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size > 1 and stride != row:
            raise ValueError(f"{name} {tuple(t.shape)} with strides {t.stride()}: an expert row must be contiguous")
        row *= size
    if t.shape[0] > 1 and t.stride(0) < row:
        raise ValueError(f"{name} {tuple(t.shape)} with strides {t.stride()}: its expert rows overlap")
    return int(t.stride(0))


def shared_stride(a: torch.Tensor, b: torch.Tensor, names: str) -> int:
    """`row_stride` of two tables a kernel reads at one offset (gate and up, or their scales)."""
    stride = row_stride(a, names)
    if row_stride(b, names) != stride:
        raise ValueError(f"{names}: rows {stride} and {b.stride(0)} elements apart; a kernel reads both at one offset")
    return stride


def check_tiles(tiles: dict[str, TileConfig]) -> None:
    """FP8 tiles: a tile's rows must share one scale row, so block_n divides the 128-row scale block."""
    for name, c in tiles.items():
        if QUANT_BLOCK % c.block_n:
            raise ValueError(f"FP8 {name} tiles: block_n {c.block_n} must divide the {QUANT_BLOCK}-row scale blocks")


@dataclass(frozen=True)
class ReadThrough:
    """A step's misses paged in by the expert kernels themselves (`moe_pairs(read=...)`): pair p with
    src_rows[p] = e >= 0 reads host row e of `host` (pinned memory the GPU reads directly; CPU tensors
    in the interpreter) and writes it through to its slot row; -1: a hit, read from its slot."""

    src_rows: torch.Tensor  # [T*k] int64 on the device
    host: ExpertTensors  # the host store's rows (FP8 ones with their scales)

    def gate_up_args(self, scaled: bool) -> dict[str, object]:
        """`_gate_up`'s READ arguments (the host scales only where the step's weights are FP8)."""
        h = self.host
        if scaled != h.is_fp8:
            raise ValueError("a read-through's host rows must be FP8 exactly when the slots are")
        hs_stride = shared_stride(h.get("gate_scale"), h.get("up_scale"), "host gate/up scales") if scaled else None
        return dict(src_rows=self.src_rows.reshape(-1).contiguous(), h_gate=h.gate, h_up=h.up,
                    hs_gate=h.gate_scale, hs_up=h.up_scale, READ=True,
                    HW_STRIDE=shared_stride(h.gate, h.up, "host gate/up"), HS_STRIDE=hs_stride)  # fmt: skip

    def down_args(self, scaled: bool) -> dict[str, object]:
        """The down kernels' READ arguments."""
        h = self.host
        if scaled != h.is_fp8:
            raise ValueError("a read-through's host rows must be FP8 exactly when the slots are")
        return dict(src_rows=self.src_rows.reshape(-1).contiguous(), h_down=h.down, hs_down=h.down_scale, READ=True,
                    HW_STRIDE=row_stride(h.down, "host down"),
                    HS_STRIDE=row_stride(h.get("down_scale"), "host down_scale") if scaled else None)  # fmt: skip


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
    tiles: dict[str, TileConfig] | None = None,
    read: ReadThrough | None = None,
) -> torch.Tensor:
    """The expert pass of a decode step: x [T, H], pair_rows [T*k] (row of gate/up [G, I, H],
    down [G, H, I]), topk_weights [T, k] -> [T, H] in x's dtype. FP8 weights come with their block
    scales (gate/up [G, I/128, H/128], down [G, H/128, I/128]). Each table's rows are contiguous, the
    table itself contiguous or packed rows (`row_stride`). `tiles` (kernel -> TileConfig)
    defaults to the dtype's table: moe_tiles.CONFIGS, or for FP8 moe_tiles.fp8_tiles at this shape and T.
    `read`: the misses' rows come from the host store and are written through to their slots (every pair
    on a missed expert marked; pairs sharing one each read it over the link: for batch-1 steps)."""
    _require()
    t, h = x.shape
    out = x.new_empty(t, h)  # [T, H]
    if t == 0:
        return out
    tiles = pass_tiles(x, gate, top_k, gate_scale is not None, tiles)
    rows = pair_rows.reshape(-1).contiguous()  # [T*k]
    hid = x.new_empty(t * top_k, gate.shape[1])  # [T*k, I]
    gate_up_pairs(x, rows, gate, up, gate_scale, up_scale, hid, top_k, tiles, read=read)
    down_pairs(hid, rows, topk_weights, down, down_scale, out, top_k, tiles, read=read)
    return out


def pass_tiles(
    x: torch.Tensor, gate: torch.Tensor, top_k: int, scaled: bool, tiles: dict[str, TileConfig] | None = None
) -> dict[str, TileConfig]:
    """The tiles of a step's expert pass: `tiles` if given, else the dtype's table (FP8's per shape
    and token count, x [T, H], gate [G, I, H]); FP8 tiles checked against the scale blocks."""
    if scaled:
        tiles = tiles or fp8_tiles(x.shape[1], gate.shape[1], top_k, x.shape[0])
        check_tiles(tiles)
    return tiles or CONFIGS


def gate_up_pairs(
    x: torch.Tensor,
    rows: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_scale: torch.Tensor | None,
    up_scale: torch.Tensor | None,
    hid: torch.Tensor,
    top_k: int,
    tiles: dict[str, TileConfig],
    skip_negative: bool = False,
    read: ReadThrough | None = None,
) -> None:
    """hid [T*k, I] = silu(x . gate[row]) * (x . up[row]) per pair: x [T, H], rows [T*k] contiguous.
    skip_negative: pairs whose row is -1 are left unwritten (another launch computes them).
    read: misses read from the host store and written through (`moe_pairs`)."""
    _require()
    t, h = x.shape
    inter = gate.shape[1]
    cg = tiles["gate_up"]
    scaled = gate_scale is not None
    s_stride = None
    if gate_scale is not None or up_scale is not None:
        if gate_scale is None or up_scale is None:
            raise ValueError("FP8 gate and up rows come with both their scales")
        s_stride = shared_stride(gate_scale, up_scale, "gate/up scales")
    extra = {} if read is None else read.gate_up_args(scaled)
    _gate_up[(t * top_k, triton.cdiv(inter, cg.block_n))](
        x.contiguous(),
        rows,
        gate,
        up,
        gate_scale,
        up_scale,
        hid,
        TOP_K=top_k,
        BN=cg.block_n,
        BK=cg.block_k,
        num_warps=cg.num_warps,
        INTER=inter,
        H=h,
        SCALED=scaled,
        QB=QUANT_BLOCK,
        W_STRIDE=shared_stride(gate, up, "gate/up"),
        S_STRIDE=s_stride,
        SKIP=skip_negative,
        **extra,
    )


def down_pairs(
    hid: torch.Tensor,
    rows: torch.Tensor,
    topk_weights: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor | None,
    out: torch.Tensor,
    top_k: int,
    tiles: dict[str, TileConfig],
    read: ReadThrough | None = None,
) -> None:
    """out [T, H] = sum_j w[t, j] * (hid[t*k+j] . down[row]) in j order, fp32: hid [T*k, I], rows [T*k].
    read: misses read from the host store and written through (`moe_pairs`)."""
    _require()
    t, h = out.shape
    inter = hid.shape[1]
    cd = tiles["down"]
    topw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    grid = (t, triton.cdiv(h, cd.block_n))
    scaled = down_scale is not None
    s_stride = None if down_scale is None else row_stride(down_scale, "down_scale")
    shape: dict[str, object] = dict(
        INTER=inter, H=h, SCALED=scaled, QB=QUANT_BLOCK, W_STRIDE=row_stride(down, "down"), S_STRIDE=s_stride
    )
    if read is not None:
        shape.update(read.down_args(scaled))
    down_tiles = dict(BN=cd.block_n, BK=cd.block_k, num_warps=cd.num_warps, **shape)
    if cd.pair_vector:
        kb = triton.next_power_of_2(top_k)
        _down_combine_vec[grid](hid, rows, topw, down, down_scale, out, TOP_K=top_k, KB=kb, **down_tiles)
    else:
        _down_combine[grid](hid, rows, topw, down, down_scale, out, TOP_K=top_k, **down_tiles)
