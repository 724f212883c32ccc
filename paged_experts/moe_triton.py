"""Decode-sized grouped expert matmuls in Triton: each weight row (expert or slot) is read once for
all the pairs it serves, gate and up in one kernel with the SiLU product fused.

Why: on the H200 the CUTLASS grouped GEMM behind `torch._grouped_mm` takes ~16.7 us per call at
batch 1 (8 experts x 3.1 MB: ~7 us of HBM traffic) and is 35% of a compiled, graphed decode step
(benchmarks/results/h200/profile_8layers_compiled_b1.txt). Decode has at most B x top_k pairs, so a
row serves a handful of pairs: one program per (row, tile of N) loads the row's pairs (<= BLOCK_M,
looping if more) and streams the weight tile once along K. Programs of rows without pairs return
at once, so the grid is static (graph-capturable) whatever the routing.

Same contract as `fused.grouped_mm`: pairs sorted by row, `offs[g]` the cumulative pair count of
rows 0..g; a row's result depends only on its own pairs, so paged == resident bit for bit holds
when both use this kernel. Selected with `fused.set_expert_backend("triton")` (decode_h200
variant `triton`); not the default until measured on the GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU torch wheel ships no Triton
    triton = None  # type: ignore[assignment]

BLOCK_M = 16  # pairs per program step (tl.dot needs >= 16; masked)
BLOCK_N = 32
BLOCK_K = 128
MAX_PAIRS = 128  # decode-sized steps only: larger ones (prefill) keep torch's grouped GEMM


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _grouped_rows(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        a, w1, w2, offs, out, n_dim: tl.constexpr, k_dim: tl.constexpr,
        GATED: tl.constexpr, MB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):
        """out[p, n] = a[p] . w1[g, n] (GATED: silu(a[p] . w1[g, n]) * (a[p] . w2[g, n])) for the
        pairs p of row g. a: [P, K]; w1, w2: [G, N, K] row-major; offs: [G + 1] int32 from 0;
        out: [P, N]. N, K are compile-time (one model's shapes). MB = cdiv(P, BM) bounds the row's pair blocks (a static loop: the loaded
        offsets only gate it, so the interpreter runs it too)."""
        g = tl.program_id(0)
        n0 = tl.program_id(1) * BN
        start = tl.load(offs + g)
        end = tl.load(offs + g + 1)
        if end > start:  # rows without pairs read no weights
            n_idx = n0 + tl.arange(0, BN)  # [BN]
            n_ok = n_idx < n_dim
            w_row = g.to(tl.int64) * n_dim * k_dim
            for mb in range(MB):
                m_idx = start + mb * BM + tl.arange(0, BM)  # [BM]
                m_ok = m_idx < end
                if start + mb * BM < end:
                    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
                    acc2 = tl.zeros((BM, BN), dtype=tl.float32)
                    for k0 in range(0, k_dim, BK):
                        k_idx = k0 + tl.arange(0, BK)  # [BK]
                        k_ok = k_idx < k_dim
                        x_off = m_idx[:, None].to(tl.int64) * k_dim + k_idx[None, :]
                        x = tl.load(a + x_off, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                        w_off = w_row + n_idx[:, None].to(tl.int64) * k_dim + k_idx[None, :]  # [BN, BK]
                        w_ok = n_ok[:, None] & k_ok[None, :]
                        acc1 += tl.dot(x, tl.trans(tl.load(w1 + w_off, mask=w_ok, other=0.0)))
                        if GATED:
                            acc2 += tl.dot(x, tl.trans(tl.load(w2 + w_off, mask=w_ok, other=0.0)))
                    if GATED:
                        acc1 = acc1 / (1.0 + tl.exp(-acc1)) * acc2  # silu(gate) * up in fp32
                    o_off = m_idx[:, None].to(tl.int64) * n_dim + n_idx[None, :]
                    tl.store(out + o_off, acc1.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch(a: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor | None, offs0: torch.Tensor) -> torch.Tensor:
    g, n, k = w1.shape
    out = a.new_empty(a.shape[0], n)  # [P, N]
    if a.shape[0] == 0:
        return out
    grid = (g, triton.cdiv(n, BLOCK_N))
    _grouped_rows[grid](
        a.contiguous(), w1, w1 if w2 is None else w2, offs0, out, n, k,
        GATED=w2 is not None, MB=triton.cdiv(a.shape[0], BLOCK_M), BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
    )
    return out


def expert_mlp(x_sorted: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x_sorted: [P, H] pairs sorted by row; gate/up [G, I, H], down [G, H, I]; offs [G] int32 -> [P, H]."""
    if not available():
        raise RuntimeError("the 'triton' expert backend needs Triton (a CUDA build of torch)")
    offs0 = torch.cat([offs.new_zeros(1), offs])  # [G + 1]: row g's pairs are offs0[g]:offs0[g + 1]
    hidden = _launch(x_sorted, gate, up, offs0)  # [P, I] = silu(x W_gate^T) * (x W_up^T)
    return _launch(hidden, down, None, offs0)  # [P, H]
