"""One MoE layer's decode-time kernels on the GPU, alone: routing and the expert pass, torch's
path (softmax + top-k; sort + three CUTLASS grouped GEMMs + combine) against moe_triton's, and a
sweep of moe_triton's tile sizes. Prints the best tiles as a PAGED_EXPERTS_MOE_TILES value.

Timing: each measured op is captured `--reps` times in one CUDA graph (a different random routing
per repetition, so the weights come from HBM, not L2: one layer's experts are 1.2 GB), replayed
`--replays` times between CUDA events; the figure is the mean time per op, launch gaps included,
as in a graphed decode step. GB/s = bytes of the distinct experts the op reads / time.

    python benchmarks/moe_kernels_h200.py --out moe_kernels.json [--batches 1,2,4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_h200 import provenance  # noqa: E402

from paged_experts.experts import route  # noqa: E402
from paged_experts.kernels import moe_tiles, moe_triton  # noqa: E402
from paged_experts.kernels.fused import experts_over_rows  # noqa: E402


def time_graph(ops: list[Callable[[], object]], replays: int) -> float:
    """Seconds per op: the ops captured back to back in one graph, replayed."""
    for op in ops[:2]:  # warm-up (Triton compiles, cuBLAS picks) outside the capture
        op()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for op in ops:
            op()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * len(ops))


# Over 80 lines on purpose: the sweep's steps in the order one GPU call runs them (set-up, each
# kernel against its reference, the tile sweep, the table); split helpers would only pass its locals around.
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument(
        "--sweep",
        default="gate_up:8,16,32:256,512:2,4,8;down:8,16:256,512:2,4;down/v:4,8,16:64,128,256:4,8",
        help="kernel[/v]:block_n list:block_k list:num_warps list, ';'-separated (/v: pairs loaded together)",
    )
    args = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    gen = torch.Generator(device=dev).manual_seed(0)
    gate = torch.randn(e, i, h, device=dev, dtype=dt, generator=gen) / 40  # [E, I, H]
    up = torch.randn(e, i, h, device=dev, dtype=dt, generator=gen) / 40  # [E, I, H]
    down = torch.randn(e, h, i, device=dev, dtype=dt, generator=gen) / 30  # [E, H, I]
    router = torch.randn(e, h, device=dev, dtype=dt, generator=gen) / 40  # [E, H]
    expert_bytes = 3 * h * i * 2
    record: dict[str, Any] = {
        "benchmark": "moe_kernels_h200",
        "command": ["python", "benchmarks/moe_kernels_h200.py", *sys.argv[1:]],
        "provenance": provenance(),
        "gpu": torch.cuda.get_device_name(),
        "shape": {"experts": e, "hidden": h, "inter": i, "top_k": k, "dtype": "bfloat16"},
        "batches": [],
    }
    sweep: list[tuple[str, moe_tiles.TileConfig]] = []
    for part in filter(None, args.sweep.split(";")):
        kernel, *lists = part.split(":")
        name, vector = kernel.removesuffix("/v"), kernel.endswith("/v")
        for bn, bk, warps in itertools.product(*([int(v) for v in lst.split(",")] for lst in lists)):
            sweep.append((name, moe_tiles.TileConfig(bn, bk, warps, pair_vector=vector)))
    best_tiles: dict[str, tuple[float, moe_tiles.TileConfig]] = {}
    for b in (int(v) for v in args.batches.split(",")):
        xs = [torch.randn(b, h, device=dev, dtype=dt, generator=gen) for _ in range(args.reps)]  # [B, H] each
        logits = [torch.nn.functional.linear(x, router) for x in xs]  # [B, E] each
        routed = [route(lg, k, True) for lg in logits]  # (ids [B, k], weights [B, k]) each
        distinct = sum(int(ids.unique().numel()) for ids, _ in routed) / args.reps
        moved = distinct * expert_bytes  # bytes of weights a step reads at best
        row: dict[str, Any] = {"batch": b, "distinct_experts": distinct, "bytes_per_op": moved}

        def ops_of(fn: Callable[[int], object]) -> list[Callable[[], object]]:
            return [lambda r=r: fn(r) for r in range(args.reps)]

        timings = {
            "route_torch": ops_of(lambda r, logits=logits: route(logits[r], k, True)),
            "route_triton": ops_of(lambda r, logits=logits: moe_triton.route(logits[r], k, True)),
            "experts_grouped": ops_of(
                lambda r, xs=xs, routed=routed: experts_over_rows(
                    xs[r], routed[r][0].reshape(-1), routed[r][1], gate, up, down, k, backend="grouped"
                )
            ),
            "experts_triton": ops_of(
                lambda r, xs=xs, routed=routed: moe_triton.moe_pairs(
                    xs[r], routed[r][0].reshape(-1), routed[r][1], gate, up, down, k
                )
            ),
        }
        for name, ops in timings.items():
            s = time_graph(ops, args.replays)
            row[f"{name}_us"] = s * 1e6
            if name.startswith("experts"):
                row[f"{name}_GB_per_s"] = moved / s / 1e9
        ref = experts_over_rows(xs[0], routed[0][0].reshape(-1), routed[0][1], gate, up, down, k, backend="grouped")
        ref = ref[0].float()
        got = moe_triton.moe_pairs(xs[0], routed[0][0].reshape(-1), routed[0][1], gate, up, down, k).float()
        row["triton_vs_grouped_max_rel"] = ((got - ref).abs().max() / ref.abs().max()).item()
        saved = dict(moe_tiles.CONFIGS)
        row["sweep"] = []
        for kernel, tiles in sweep:  # one kernel's tiles at a time, the other kernel at its default
            moe_tiles.CONFIGS.update(saved)
            moe_tiles.CONFIGS[kernel] = tiles
            try:
                s = time_graph(timings["experts_triton"], args.replays)
                out = moe_triton.moe_pairs(xs[0], routed[0][0].reshape(-1), routed[0][1], gate, up, down, k).float()
            except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses is recorded
                row["sweep"].append({"tiles": moe_tiles.tile_spec(kernel, tiles), "error": repr(exc)[:200]})
                continue
            rel = ((out - ref).abs().max() / ref.abs().max()).item()
            row["sweep"].append(
                {"tiles": moe_tiles.tile_spec(kernel, tiles), "experts_us": s * 1e6, "max_rel_vs_grouped": rel}
            )
            if b == 1 and rel < 0.05 and (kernel not in best_tiles or s < best_tiles[kernel][0]):
                best_tiles[kernel] = (s, tiles)
        moe_tiles.CONFIGS.update(saved)
        record["batches"].append(row)
        brief = {key: round(v, 2) for key, v in row.items() if isinstance(v, float)}
        print(f"B={b}: {brief}", flush=True)
        args.out.write_text(json.dumps(record, indent=2, default=str))
    tiles = ",".join(moe_tiles.tile_spec(n, c) for n, (_, c) in best_tiles.items())
    record["best_tiles_b1"] = tiles
    args.out.write_text(json.dumps(record, indent=2, default=str))
    print(f"best tiles at batch 1 (each kernel swept with the other at its default): {moe_tiles.TILES_ENV}={tiles}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
