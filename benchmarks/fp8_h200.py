"""Block-FP8 experts on a GPU, in process (issue 17's micro-benchmarks; reports come from `benchsuite run`):

1. page-in GB/s of FP8 experts (Qwen3-30B-A3B shape: 4.72 MB per expert, scales included) from the
   pinned host store into K slots, through the runtime's own paths: `PageInEngine` ('direct' DMA
   copies) and `copy_planned` (the graph-safe Triton kernel), against the measured link ceiling (one
   1 GiB pinned copy) and bf16 experts through the same paths;
2. decode tok/s in process, resident FP8 against resident bf16 (same seeded values, quantized), and
   paged FP8 at K=40 and K=24 (model routing and calibrated synthetic routing), with CUDA graphs and
   the triton expert backend (FP8 kernels), batch 1 and 4; bytes paged per token from the counters.

    python benchmarks/fp8_h200.py --out fp8_h200.json [--layers 48] [--pagein-layers 4] [--steps 32]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagein import copy_ceiling_gbps

from paged_experts.kernels.copy_kernel import copy_planned
from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.residency.store import ExpertTensors, PageInEngine
from paged_experts.routing.sources import make_router
from paged_experts.runtime import RuntimeConfig
from paged_experts.weights import synth_memory

E, H, INTER = 128, 2048, 768


def pagein_cells(layers: int, ms: list[int], k: int = 64, repeats: int = 5) -> list[dict[str, Any]]:
    """One timed step pages m random experts into m random slots of every layer; GB/s = bytes / time."""
    dev, rng = torch.device("cuda"), random.Random(0)
    out = []
    for is_fp8 in (True, False):
        hosts = [
            ExpertTensors.empty(E, H, INTER, torch.bfloat16, torch.device("cpu"), pin=True, is_fp8=is_fp8)
            for _ in range(layers)
        ]
        slots = [ExpertTensors.empty(k, H, INTER, torch.bfloat16, dev, is_fp8=is_fp8) for _ in range(layers)]
        engine = PageInEngine(dev, "direct", H, INTER, torch.bfloat16, k, is_fp8=is_fp8)
        row_bytes = hosts[0].row_bytes
        for m in ms:
            for path in ("dma", "triton_kernel"):
                times = []
                for rep in range(repeats + 1):
                    plans = [(rng.sample(range(E), m), rng.sample(range(k), m)) for _ in range(layers)]
                    tensors = [(torch.tensor(e, device=dev), torch.tensor(s, device=dev)) for e, s in plans]
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for layer in range(layers):
                        if path == "dma":
                            engine.copy_rows(hosts[layer], slots[layer], list(zip(*plans[layer])))
                        else:
                            copy_planned(hosts[layer], slots[layer], *tensors[layer])
                    end.record()
                    end.synchronize()
                    if rep:  # the first is warm-up (Triton compiles)
                        times.append(start.elapsed_time(end) / 1e3)
                nbytes = m * layers * row_bytes
                best = min(times)
                out.append(
                    {
                        "format": "fp8" if is_fp8 else "bf16",
                        "path": path,
                        "experts_per_layer": m,
                        "layers": layers,
                        "expert_bytes": row_bytes,
                        "bytes": nbytes,
                        "best_s": best,
                        "GB_per_s": nbytes / best / 1e9,
                    }
                )
                print(
                    f"page-in {out[-1]['format']:4s} {path:13s} m={m:3d}: {out[-1]['GB_per_s']:6.1f} GB/s "
                    f"({row_bytes / 1e6:.2f} MB per expert)",
                    flush=True,
                )
        del hosts, slots
        gc.collect()
    return out


def decode_cell(model: MoeCausalLM, batch: int, steps: int) -> dict[str, Any]:
    vocab = model.config.vocab_size
    pool = KvPool.for_model(model, capacity_tokens=batch * (steps + 48))
    seqs = [pool.new_sequence() for _ in range(batch)]
    logits = model.forward(
        [SeqChunk(s, [(31 * b + 7 * i + 1) % vocab for i in range(8)], 0) for b, s in enumerate(seqs)]
    )

    def step() -> None:
        nonlocal logits
        logits = model.forward([SeqChunk(s, [int(lg[-1].argmax())], s.num_tokens) for s, lg in zip(seqs, logits)])

    for _ in range(4):  # warm-up: graph capture, Triton compiles
        step()
    torch.cuda.synchronize()
    model.counters.reset()
    replays0, t0 = model.graph_replays, time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    decode_s = time.perf_counter() - t0
    total = model.counters.snapshot().total
    for s in seqs:
        pool.free(s)
    return {
        "batch": batch,
        "steps": steps,
        "tok_per_s": steps * batch / decode_s,
        "ms_per_step": 1e3 * decode_s / steps,
        "graphed_steps": model.graph_replays - replays0,
        "hit_rate": total.hit_rate,
        "bytes_paged_per_token": total.bytes_paged_in / (steps * batch),
        "expert_bytes": model.counters.snapshot().expert_bytes,
    }


def decode_cells(layers: int, steps: int, batches: list[int]) -> list[dict[str, Any]]:
    out = []
    runs = [
        ("qwen3-30b-a3b-fp8-shape", "resident", None),
        ("qwen3-30b-a3b-fp8-shape", "paged", 40),
        ("qwen3-30b-a3b-fp8-shape", "paged", 24),
        ("qwen3-30b-a3b-shape", "resident", None),
    ]
    for preset, mode, k in runs:
        rt = RuntimeConfig(mode=mode, resident_experts=k, device="cuda", dtype="bfloat16", kernel_backend="triton")  # type: ignore[arg-type]
        t0 = time.perf_counter()
        model = MoeCausalLM.synthetic(preset, rt, layers=layers, seed=0)
        model.enable_cuda_graphs(batches)
        build_s = time.perf_counter() - t0
        for routing in ("model", "qwen3-30b-a3b") if mode == "paged" else ("model",):
            model.router_override = None if routing == "model" else make_router(routing, model.config, seed=0)
            for b in batches:
                cell = {
                    "preset": preset,
                    "mode": mode,
                    "K": k,
                    "routing": routing,
                    "build_s": build_s,
                    **decode_cell(model, b, steps),
                    "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
                }
                out.append(cell)
                print(
                    f"decode {preset} {mode} K={k} {routing} B={b}: {cell['tok_per_s']:.1f} tok/s, "
                    f"{cell['bytes_paged_per_token'] / 1e6:.1f} MB paged/token, graphed {cell['graphed_steps']}",
                    flush=True,
                )
        del model
        if preset != runs[min(runs.index((preset, mode, k)) + 1, len(runs) - 1)][0]:
            synth_memory.clear_cache()  # the next preset's host store replaces this one (29 GB FP8, 58 GB bf16)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--pagein-layers", type=int, default=4)
    ap.add_argument("--ms", default="1,4,8,16,32")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    record: dict[str, Any] = {
        "command": sys.argv,
        "git_commit": commit,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "link_ceiling_GB_per_s": copy_ceiling_gbps(torch.device("cuda")),
    }
    print(f"link ceiling (1 GiB pinned copy): {record['link_ceiling_GB_per_s']:.1f} GB/s", flush=True)
    record["pagein"] = pagein_cells(args.pagein_layers, [int(m) for m in args.ms.split(",")])
    args.out.write_text(json.dumps(record, indent=1))
    if not args.skip_decode:
        record["decode"] = decode_cells(args.layers, args.steps, [int(b) for b in args.batches.split(",")])
    args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
