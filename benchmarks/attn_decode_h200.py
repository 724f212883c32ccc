"""Decode attention per layer on the GPU, alone: attn_triton's one-program-per-(sequence, KV head)
kernel (`decode_attention`, before) against its split-KV form (`decode_attention_split`, what the
graphed decode step runs), at the Qwen3-30B-A3B head shape (32 query heads, 4 KV heads x 128, bf16
KV) for contexts 128 / 2,048 / 8,192 and batch 1 / 4.

Timing: 48 calls, one per layer over 48 distinct KV pools (so keys and values come from HBM, not
L2), captured in one CUDA graph and replayed `--replays` times between CUDA events; the figure is
the mean time per layer, launch gaps included, as in a graphed decode step
(`moe_kernels_h200.time_graph`). Each cell's pool holds max(10,240, B x context) tokens (10,240:
the published runs' KV capacity), and the split kernel's grid is sized for that capacity, as the
served step's is. GB/s = keys and values read / time.
Runs in about 30 s on the H200 (most of it Triton's compiles).

    python benchmarks/attn_decode_h200.py [--replays 50] [--out attn.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels_h200 import time_graph  # noqa: E402  (the kernel sweeps' graph-replay timer)

from paged_experts.kernels.attn_triton import decode_attention, decode_attention_split, split_plan  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 48, 32, 4, 128, 16
CAPACITY = 10240


def cell(batch: int, context: int, replays: int) -> dict[str, float | int]:
    capacity = max(CAPACITY, batch * context)
    num_blocks = -(-capacity // BLOCK)
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = [
        torch.randn(2, num_blocks * BLOCK, KV_HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]  # per layer [K/V, slots, kvh, D]
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    blocks = torch.randperm(num_blocks, device="cuda", generator=gen)[None, :].repeat(batch, 1)  # [B, W]
    positions = torch.full((batch,), context - 1, device="cuda", dtype=torch.long)
    plan = split_plan(num_blocks * BLOCK)
    old = time_graph(
        [lambda k=k: decode_attention(q, k[0], k[1], blocks, positions, BLOCK) for k in kv], replays
    )  # fmt: skip
    new = time_graph(
        [lambda k=k: decode_attention_split(q, k[0], k[1], blocks, positions, BLOCK, plan) for k in kv], replays
    )  # fmt: skip
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    return {"batch": batch, "context": context, "chunk_tokens": plan.chunk_tokens, "splits": plan.num_splits,
            "old_us": old * 1e6, "new_us": new * 1e6, "old_gb_s": kv_bytes / old / 1e9,
            "new_gb_s": kv_bytes / new / 1e9}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--contexts", default="128,2048,8192")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--out", type=Path, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("attn_decode_h200: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        print(f"attn_decode_h200: --contexts and --batches take comma-separated integers, got {args.contexts!r}, "
              f"{args.batches!r}", file=sys.stderr)  # fmt: skip
        return 2
    print(f"{torch.cuda.get_device_name()}: decode attention per layer, {HEADS} query heads, {KV_HEADS} KV heads "
          f"x {HEAD_DIM}, bf16, {LAYERS} layers per graph")  # fmt: skip
    print(f"{'B':>2} {'context':>7} {'chunk':>5} {'splits':>6} {'old us':>8} {'new us':>8} {'speedup':>7} "
          f"{'old GB/s':>8} {'new GB/s':>8}")  # fmt: skip
    rows = []
    for b in batches:
        for ctx in contexts:
            r = cell(b, ctx, args.replays)
            rows.append(r)
            print(f"{b:>2} {ctx:>7} {r['chunk_tokens']:>5} {r['splits']:>6} {r['old_us']:>8.2f} {r['new_us']:>8.2f} "
                  f"{r['old_us'] / r['new_us']:>6.2f}x {r['old_gb_s']:>8.0f} {r['new_gb_s']:>8.0f}")  # fmt: skip
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
