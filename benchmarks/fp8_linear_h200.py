"""Times the block-FP8 attention projections (kernels/linear_fp8.py) on a GPU against bf16 `F.linear` of the same
weights dequantized (cuBLAS), and sweeps the decode GEMV's tiles per row bucket.

Shapes: Qwen3-30B-A3B's fused q/k/v (N 5,120 x K 2,048) and o (2,048 x 4,096) by default. Each figure is one
projection of one layer: `--layers` distinct weights (48: more than the 50 MB L2 holds, so every call reads HBM
as a decode step's layers do) captured back to back in one CUDA graph and replayed (moe_kernels_h200.time_graph).
GB/s = the weight's bytes (FP8 + scales, or bf16) / time. For each row bucket (decode steps of 1..16 tokens) the
table's tiles, every candidate of `--gemv` and `--mma` (the swap-AB tensor-core kernel) and bf16 are
timed; the fastest candidate per bucket (both shapes' times added) is printed as a
`PAGED_EXPERTS_FP8_LINEAR_TILES` value. Prefill rows (`--prefill`) time the large-step path (the weight
dequantized into the scratch buffer, then cuBLAS) against bf16. A candidate whose output differs
from the table tiles' by more than bf16 rounding is refused.

    python benchmarks/fp8_linear_h200.py --out fp8_linear.json [--buckets 1,2,4] [--prefill 2048]

About a minute on the H200 (most of it Triton compiling each tile once per shape).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_h200 import provenance  # noqa: E402
from moe_kernels_h200 import time_graph  # noqa: E402

from paged_experts import fp8  # noqa: E402
from paged_experts.kernels import linear_fp8  # noqa: E402
from paged_experts.kernels.linear_fp8 import GemvTiles  # noqa: E402

GEMV = "4,8,16:128,256,512,1024:4,8"  # block_n list : block_k list : num_warps list
MMA = "16,32,64:64,128:4:3,4"  # the swap-AB tensor-core kernel: block_n : block_k : num_warps : num_stages lists


def gemv_candidates(spec: str, bucket: int) -> list[GemvTiles]:
    """'block_n list:block_k list:warps list' -> the tiles whose [rows, BN, BK] fp32 accumulator holds 16 to 64
    registers a thread."""
    bn, bk, warps = (tuple(int(v) for v in part.split(",")) for part in spec.split(":"))
    return [
        GemvTiles(n, k, w)
        for n, k, w in itertools.product(bn, bk, warps)
        if 128 % n == 0 and 16 * 32 * w <= bucket * n * k <= 64 * 32 * w
    ]


def mma_candidates(spec: str) -> list[GemvTiles]:
    """'block_n list:block_k list:warps list:stages list' -> swap-AB tiles (block_n and block_k divide 128)."""
    if not spec:
        return []
    bn, bk, warps, stages = (tuple(int(v) for v in part.split(",")) for part in spec.split(":"))
    return [
        GemvTiles(n, k, w, kind="mma", num_stages=st)
        for n, k, w, st in itertools.product(bn, bk, warps, stages)
        if 128 % n == 0 and 128 % k == 0
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="5120x2048,2048x4096", help="N x K of each projection")
    ap.add_argument("--buckets", default="1,2,4,8,16")
    ap.add_argument("--gemv", default=GEMV)
    ap.add_argument("--mma", default=MMA, help="swap-AB candidates ('' for none)")
    ap.add_argument("--prefill", default="2048", help="prefill row counts ('' for none)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--hbm-gbps", type=float, default=4800.0)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows: list[dict[str, Any]] = []

    def timed(label: str, n: int, k: int, m: int, fn: Any, weights: list[Any], nbytes: int) -> float:
        ops = [lambda w=w: fn(w) for w in weights]
        seconds = time_graph(ops, args.replays)
        gbps = nbytes / seconds / 1e9
        rows.append({"shape": f"{n}x{k}", "rows": m, "kernel": label, "us": seconds * 1e6, "gb_per_s": gbps})
        print(f"  {n}x{k} M={m:<5} {label:<28} {seconds * 1e6:8.2f} us {gbps:7.0f} GB/s ({gbps / args.hbm_gbps:.0%})")
        return seconds

    best: dict[int, dict[GemvTiles, float]] = {}
    counted: dict[tuple[int, GemvTiles], int] = {}
    for n, k in shapes:
        qs = [fp8.quantize(torch.randn(n, k, device="cuda") / 45) for _ in range(args.layers)]
        dense = [fp8.dequantize(q, s, torch.bfloat16) for q, s in qs]
        fp8_bytes = n * k + 4 * fp8.blocks(n) * fp8.blocks(k)
        print(f"shape N={n} K={k}: FP8 {fp8_bytes / 1e6:.1f} MB, bf16 {2 * n * k / 1e6:.1f} MB a layer")
        ms = [int(b) for b in args.buckets.split(",")] + [int(p) for p in args.prefill.split(",") if p]
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            timed("bf16 F.linear (cuBLAS)", n, k, m, lambda w, x=x: F.linear(x, w), dense, 2 * n * k)
            ref = linear_fp8.fp8_linear(x, *qs[0]).float()
            timed("fp8 (table tiles)", n, k, m, lambda w, x=x: linear_fp8.fp8_linear(x, *w), qs, fp8_bytes)
            tol = 2e-2 * ref.abs().max().item()
            if m <= linear_fp8.GEMV_MAX_ROWS:
                for t in gemv_candidates(args.gemv, linear_fp8.row_bucket(m)) + mma_candidates(args.mma):
                    out = linear_fp8.fp8_linear(x, *qs[0], gemv=t).float()
                    if (out - ref).abs().max().item() > tol:
                        print(f"  refused {t}: output differs")
                        continue
                    label = f"{t.kind} {t.spec().removeprefix('mma:')}"
                    sec = timed(label, n, k, m, lambda w, x=x, t=t: linear_fp8.fp8_linear(x, *w, gemv=t), qs, fp8_bytes)
                    best.setdefault(m, {}).setdefault(t, 0.0)
                    best[m][t] += sec
                    counted[(m, t)] = counted.get((m, t), 0) + 1
        del qs, dense
        torch.cuda.empty_cache()
    # a tile refused (or not compiled) for one shape has fewer times in its sum: only tiles timed on every shape rank
    ranked = {m: {t: sec for t, sec in per.items() if counted[(m, t)] == len(shapes)} for m, per in best.items()}
    spec = ",".join(
        f"{m}={min(per, key=per.__getitem__).spec()}"
        for m, per in sorted(ranked.items())
        if per and m in linear_fp8.LINEAR_TILES
    )
    print(f"best per bucket (both shapes' time added): {linear_fp8.TILES_ENV}={spec}")
    args.out.write_text(json.dumps({"provenance": provenance(), "rows": rows, "best": spec}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
