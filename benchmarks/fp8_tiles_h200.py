"""Tunes the block-FP8 decode expert kernels (moe_triton's, scale path on) per batch on a GPU and writes the tile
table the runtime reads (paged_experts/kernels/moe_tiles_fp8.json, `moe_tiles.fp8_tiles`).

For each batch (tokens per decode step; moe_triton runs steps of at most MAX_PAIRS pairs), one MoE
layer of the given shape (default Qwen3-30B-A3B: E 128, hidden 2048, intermediate 768, top-8) with
FP8 weights and float32 128 x 128 block scales: first the gate_up tiles are swept with down at its
default, then the down tiles with the best gate_up. Each figure is the whole expert pass (both
kernels, launch gaps included): `--reps` passes, each over a different random routing so the weights
come from HBM, captured in one CUDA graph and replayed (`moe_kernels_h200.time_graph`).
GB/s = bytes of the distinct experts a pass reads (FP8 weights + scales) / time, printed against
`--hbm-gbps` (H200: 4,800). Beside it: the untuned defaults (moe_tiles.FP8_CONFIGS), the old
kernels' tiles (16 x 128), and the bf16 kernels (moe_triton.moe_pairs, moe_tiles.CONFIGS) on the
same values dequantized, which read twice the bytes: FP8 must beat them.
A tile is kept only if its output equals the default tiles' within bf16 rounding.
Then the large-step path (steps above MAX_PAIRS: prefill): moe_grouped_fp8's tile candidates and
'dequant' (the table dequantized to bf16, then the grouped GEMM), timed eagerly at 16, 256 and 2,048
tokens; the least total time is written as the shape's `prefill` choice (one for every step size).

    python benchmarks/fp8_tiles_h200.py [--batches 1,2,4] [--write paged_experts/kernels/moe_tiles_fp8.json]
        [--out fp8_tiles.json] [--quick] [--no-prefill]

About 1.5 minutes on the H200 with the default sweep (most of it Triton compiling each tile once).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_h200 import provenance  # noqa: E402
from moe_kernels_h200 import time_graph  # noqa: E402

from paged_experts import fp8  # noqa: E402
from paged_experts.kernels import fused, moe_tiles, moe_triton  # noqa: E402
from paged_experts.kernels.moe_tiles import TileConfig  # noqa: E402
from paged_experts.residency.store import ExpertTensors  # noqa: E402

OLD_TILES = "gate_up=16x128x4,down=16x128x4"  # the kernels before the tile table (per-block partial dots)
GATE_UP = "gate_up:2,4,8,16,32:256,512,1024:2,4,8"
DOWN = "down/v:2,4,8,16:128,256,512:4,8;down:8,16,32:256,512,1024:2,4"
PREFILL_PATHS = ("triton:64x128x128x4x3", "triton:64x128x128x8x3", "triton:128x128x128x8x3", "triton:64x64x128x4x4")
"""Candidates of the large-step path (moe_grouped_fp8 tiles); 'dequant' (the old path) is always timed."""
QUICK_GATE_UP = "gate_up:4,8,16:512,1024:4,8"
QUICK_DOWN = "down/v:2,4,8:256:4,8;down:16:512:4"


def candidates(spec: str) -> list[tuple[str, TileConfig]]:
    """'kernel[/v]:block_n list:block_k list:num_warps list;...' -> [(kernel, tiles)] (block_n | 128)."""
    out = []
    for part in filter(None, spec.split(";")):
        kernel, *lists = part.split(":")
        name, vector = kernel.removesuffix("/v"), kernel.endswith("/v")
        for bn, bk, warps in itertools.product(*([int(v) for v in lst.split(",")] for lst in lists)):
            if 128 % bn == 0:
                out.append((name, TileConfig(bn, bk, warps, pair_vector=vector)))
    return out


def spec_of(tiles: dict[str, TileConfig]) -> str:
    return ",".join(moe_tiles.tile_spec(n, c) for n, c in sorted(tiles.items(), reverse=True))


class Layer:
    """One layer's FP8 experts on the GPU, their bf16 dequantization, and `reps` routings per batch."""

    def __init__(self, e: int, h: int, i: int, top_k: int) -> None:
        dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
        self.h, self.i, self.top_k, self.e = h, i, top_k, e
        self.q, self.s, self.dense = [], [], []
        for shape, std in (((e, i, h), 1 / 40), ((e, i, h), 1 / 40), ((e, h, i), 1 / 30)):
            w = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen) * std  # [E, O, I]
            q, s = fp8.quantize(w)
            del w
            self.q.append(q)  # [E, O, I] float8_e4m3fn
            self.s.append(s)  # [E, O/128, I/128] fp32
            self.dense.append(fp8.dequantize(q, s, torch.bfloat16))  # [E, O, I] bf16, the same values
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in (*self.q, *self.s))

    def routings(self, batch: int, reps: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
        """reps x (x [B, H] bf16, rows [B*k] distinct experts per token, weights [B, k] fp32)."""
        out = []
        for _ in range(reps):
            x = torch.randn(batch, self.h, generator=gen).to("cuda", torch.bfloat16)  # [B, H]
            rows = torch.stack([torch.randperm(self.e, generator=gen)[: self.top_k] for _ in range(batch)])  # [B, k]
            w = torch.softmax(torch.randn(batch, self.top_k, generator=gen), dim=-1)  # [B, k]
            out.append((x, rows.reshape(-1).to("cuda"), w.to("cuda")))
        return out

    def fp8_op(self, routed: tuple[torch.Tensor, ...], tiles: dict[str, TileConfig]) -> Callable[[], torch.Tensor]:
        x, rows, w = routed
        return lambda: moe_triton.moe_pairs(x, rows, w, *self.q, self.top_k, *self.s, tiles=tiles)

    def bf16_op(self, routed: tuple[torch.Tensor, ...]) -> Callable[[], torch.Tensor]:
        x, rows, w = routed
        return lambda: moe_triton.moe_pairs(x, rows, w, *self.dense, self.top_k)


def tune_batch(layer: Layer, batch: int, args: argparse.Namespace, gen: torch.Generator) -> dict[str, Any]:
    routed = layer.routings(batch, args.reps, gen)
    distinct = sum(int(r[1].unique().numel()) for r in routed) / args.reps
    moved = distinct * layer.expert_bytes  # bytes a pass reads at best (weights + scales of its experts)
    row: dict[str, Any] = {"batch": batch, "distinct_experts": distinct, "bytes_per_pass": moved, "sweep": []}

    def measure(label: str, tiles: dict[str, TileConfig] | None) -> float | None:
        ops = [layer.bf16_op(r) if tiles is None else layer.fp8_op(r, tiles) for r in routed]
        try:
            s = time_graph(ops, args.replays)
            got = ops[0]().float()
        except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses is recorded, not fatal
            row["sweep"].append({"tiles": label, "error": repr(exc)[:200]})
            return None
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        bf16_bytes = distinct * 3 * layer.h * layer.i * 2  # bf16 reads twice the FP8 weight bytes, no scales
        gbps = (moved if tiles is not None else bf16_bytes) / s / 1e9
        row["sweep"].append({"tiles": label, "us": s * 1e6, "GB_per_s": gbps, "max_rel_vs_default": rel})
        print(
            f"B={batch} {label:40s} {s * 1e6:7.1f} us {gbps:7.0f} GB/s ({100 * gbps / args.hbm_gbps:4.1f}% of HBM)",
            flush=True,
        )
        return s if rel < 2e-2 else None

    default = dict(moe_tiles.FP8_CONFIGS)
    ref = layer.fp8_op(routed[0], default)().float()
    row["default_us"] = (measure("default " + spec_of(default), default) or float("nan")) * 1e6
    row["old_tiles_us"] = (measure("old " + OLD_TILES, moe_tiles.parse_fp8_tiles(OLD_TILES)) or float("nan")) * 1e6
    bf16_label = "bf16 " + ",".join(moe_tiles.tile_spec(n, c) for n, c in moe_tiles.CONFIGS.items())
    row["bf16_us"] = (measure(bf16_label, None) or float("nan")) * 1e6
    best = dict(default)
    best_s = row["default_us"] / 1e6
    for sweep in (args.gate_up, args.down):
        base = dict(best)
        for kernel, tiles in candidates(sweep):
            trial = {**base, kernel: tiles}
            s = measure(spec_of(trial), trial)
            if s is not None and s < best_s:
                best, best_s = trial, s
    row["best"] = spec_of(best)
    row["best_us"] = best_s * 1e6
    row["best_GB_per_s"] = moved / best_s / 1e9
    return row


def tune_prefill(layer: Layer, args: argparse.Namespace, gen: torch.Generator) -> dict[str, Any]:
    """The large-step FP8 path (steps above MAX_PAIRS: prefill, big batches): moe_grouped_fp8 per tile
    candidate and 'dequant' (dequantize the table, grouped GEMM), each timed eagerly (prefill is not
    graphed) at every size in --prefill-tokens. One choice serves every size: a pair must compute the
    same bits in a resident step and in any paged wave, so the path never depends on the step's size."""
    experts = ExpertTensors(*layer.q, *layer.s)
    cases = []
    for tokens in (int(v) for v in args.prefill_tokens.split(",")):
        rows = torch.stack([torch.randperm(layer.e, generator=gen)[: layer.top_k] for _ in range(tokens)])  # [T, k]
        _, offs, _ = fused.group_pairs(rows.reshape(-1).cuda(), layer.e)  # [E] cumulative pairs per expert
        x = torch.randn(tokens * layer.top_k, layer.h, generator=gen).to("cuda", torch.bfloat16)  # [P, H] sorted pairs
        cases.append((tokens, x, offs))
    row: dict[str, Any] = {"tokens": [c[0] for c in cases], "us": {}}
    for spec in ("dequant", *args.prefill_paths.split(",")):
        tiles = moe_tiles.parse_prefill(spec)
        times = []
        for _, x, offs in cases:
            if tiles is None:
                op = lambda x=x, offs=offs: fused.expert_mlp(x, experts.dense(torch.bfloat16), offs)  # noqa: E731
            else:
                op = lambda x=x, offs=offs, t=tiles: fused.fp8_expert_mlp(x, experts, offs, t)  # noqa: E731
            try:
                times.append(time_eager(op, args.replays // 4 or 1))
            except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses is recorded, not fatal
                row.setdefault("errors", {})[spec] = repr(exc)[:200]
                break
        if len(times) != len(cases):
            continue
        row["us"][spec] = [t * 1e6 for t in times]
        flops = [2 * 3 * tokens * layer.top_k * layer.h * layer.i for tokens, _, _ in cases]
        print(
            f"prefill {spec:24s} "
            + ", ".join(
                f"{tok} tokens {t * 1e6:7.0f} us ({f / t / 1e12:5.1f} TFLOP/s)"
                for tok, t, f in zip(row["tokens"], times, flops)
            ),
            flush=True,
        )
    row["best"] = min(row["us"], key=lambda spec: sum(row["us"][spec]))
    return row


def time_eager(op: Callable[[], object], reps: int) -> float:
    """Seconds per call, eager (host launch costs included, as a prefill step pays them), CUDA events."""
    op()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        op()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="the GPU's HBM bandwidth (H200: 4,800 GB/s)")
    ap.add_argument(
        "--gate-up", default=GATE_UP, help="gate_up candidates: kernel:block_n list:block_k list:warps list"
    )
    ap.add_argument("--down", default=DOWN, help="down candidates, ';'-separated (down/v: a token's pairs together)")
    ap.add_argument("--prefill-tokens", default="16,256,2048", help="step sizes of the large-step path's sweep")
    ap.add_argument("--prefill-paths", default=",".join(PREFILL_PATHS), help="its moe_grouped_fp8 candidates")
    ap.add_argument("--no-prefill", action="store_true", help="tune the decode tiles only")
    ap.add_argument("--quick", action="store_true", help="a smaller sweep (about a minute)")
    ap.add_argument("--write", type=Path, default=moe_tiles.FP8_TABLE_PATH, help="the tile table to update")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", type=Path, help="every measurement as JSON")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if max(batches) * args.top_k > moe_triton.MAX_PAIRS:
        print(
            f"fp8_tiles_h200: batches above {moe_triton.MAX_PAIRS // args.top_k} never run these kernels (MAX_PAIRS)",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print("fp8_tiles_h200: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.quick:
        args.gate_up, args.down = QUICK_GATE_UP, QUICK_DOWN
    t0 = time.perf_counter()
    layer = Layer(args.experts, args.hidden, args.inter, args.top_k)
    gen = torch.Generator().manual_seed(1)
    record: dict[str, Any] = {
        "benchmark": "fp8_tiles_h200",
        "command": ["python", "benchmarks/fp8_tiles_h200.py", *(argv if argv is not None else sys.argv[1:])],
        "provenance": provenance(),
        "shape": {"experts": args.experts, "hidden": args.hidden, "inter": args.inter, "top_k": args.top_k},
        "hbm_GB_per_s": args.hbm_gbps,
        "batches": [tune_batch(layer, b, args, gen) for b in batches],
    }
    if not args.no_prefill:
        record["prefill"] = tune_prefill(layer, args, gen)
        print(
            f"large steps (prefill): {record['prefill']['best']} (least total time over {args.prefill_tokens} tokens)"
        )
    record["elapsed_s"] = time.perf_counter() - t0
    print(
        f"\n{'batch':>5} {'best tiles':40s} {'us':>7} {'GB/s':>6} {'%HBM':>5} "
        f"{'default us':>10} {'old us':>7} {'bf16 us':>7}"
    )
    for r in record["batches"]:
        print(
            f"{r['batch']:5d} {r['best']:40s} {r['best_us']:7.1f} {r['best_GB_per_s']:6.0f} "
            f"{100 * r['best_GB_per_s'] / args.hbm_gbps:5.1f} {r['default_us']:10.1f} "
            f"{r['old_tiles_us']:7.1f} {r['bf16_us']:7.1f}"
        )
    if args.out:
        args.out.write_text(json.dumps(record, indent=1, default=str))
    if not args.no_write:
        table = json.loads(args.write.read_text()) if args.write.exists() else {}
        key = moe_tiles.shape_key(args.hidden, args.inter, args.top_k)
        table.setdefault("tiles", {}).setdefault(key, {}).update(
            {str(r["batch"]): r["best"] for r in record["batches"]}
        )
        table.setdefault("measured", {})[key] = {
            "command": " ".join(record["command"]),
            "gpu": record["provenance"]["gpu"],
            "git_tree": record["provenance"]["git_tree"],
            "us_per_layer": {str(r["batch"]): round(r["best_us"], 2) for r in record["batches"]},
            "GB_per_s": {str(r["batch"]): round(r["best_GB_per_s"]) for r in record["batches"]},
        }
        if "prefill" in record:
            table.setdefault("prefill", {})[moe_tiles.prefill_key(args.hidden, args.inter)] = record["prefill"]["best"]
            table["measured"][key]["prefill_us"] = {
                spec: dict(zip(map(str, record["prefill"]["tokens"]), (round(t) for t in us)))
                for spec, us in record["prefill"]["us"].items()
            }
        args.write.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.write} ({key}); elapsed {record['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
