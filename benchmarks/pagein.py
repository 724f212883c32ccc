"""Page-in micro-benchmark: one step that pages in m missing experts in each of L layers.

Qwen3-30B-A3B-shaped bf16 experts (gate/up `[768, 2048]`, down `[2048, 768]`: 3 tensors of
3 MiB, 9.4 MB per expert) sit in a pinned host store of E experts per layer; K device slots per
layer. Each timed step copies m random experts into m random slots of every layer through the
runtime's own `PageInEngine` (the code the model runs), timed with CUDA events after a warmup.
Reported: GB/s (1e9 bytes/s) and the fraction of the pinned copy ceiling, measured here as one
1 GiB pinned host->device copy, and also quoted against the nominal 54 GB/s of DESIGN.md section 5;
and the host's time issuing a step's copies (`issue_us`, perf_counter around the L calls, median): what a
host-bound prefill pays per wave. The copies run on a side stream, as the runtime's page-ins do (the
`batch` strategy's driver call refuses the legacy default stream). `--fp8`: block-FP8 experts (the weights
and three block-scale tensors, 4.7 MB), the engine's scale-row kernel beside `direct` as the runtime has it.

    python benchmarks/pagein.py --out results.json [--m 1,2,4,8,16,32,64] [--strategies direct,staged]
    python benchmarks/pagein.py --out batch.json --fp8 --m 4,8,13,16 --strategies direct,batch,kernel
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from paged_experts.kernels.copy_kernel import copy_planned, graph_safe
from paged_experts.residency.batch_copy import driver_batch_copy
from paged_experts.residency.store import ExpertTensors, PageInEngine

NOMINAL_CEILING_GBPS = 54.0


def copy_ceiling_gbps(device: torch.device, nbytes: int = 2**30, repeats: int = 5) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)  # warmup
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def bench_strategy(
    strategy: str,
    hosts: list[ExpertTensors],
    slots: list[ExpertTensors],
    ms: list[int],
    repeats: int,
    warmup: int,
    seed: int,
) -> list[dict[str, float]]:
    device = slots[0].gate.device
    num_experts, num_slots = hosts[0].num_rows, slots[0].num_rows
    hidden, inter = hosts[0].gate.shape[2], hosts[0].gate.shape[1]
    expert_bytes = hosts[0].row_bytes
    is_fp8 = hosts[0].is_fp8
    engine = PageInEngine(
        device, strategy, hidden, inter, hosts[0].gate.dtype, num_slots, is_fp8=is_fp8,
        row_kernel=copy_planned if graph_safe(device) else None,
        batch_copy=driver_batch_copy(device) if strategy == "batch" else None,
    )  # fmt: skip
    stream = torch.cuda.Stream(device)  # a side stream, as the runtime's page-ins
    rng = random.Random(seed)
    rows = []
    for m in ms:
        times, issue = [], []
        for it in range(warmup + repeats):
            # Fresh random experts and slots each step: no contiguous runs to coalesce.
            plans = [list(zip(rng.sample(range(num_experts), m), rng.sample(range(num_slots), m))) for _ in hosts]
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record()
                t0 = time.perf_counter()
                for host, slot, pairs in zip(hosts, slots, plans):
                    engine.copy_rows(host, slot, pairs)
                issued_s = time.perf_counter() - t0
                end.record()
            end.synchronize()
            if it >= warmup:
                times.append(start.elapsed_time(end) / 1e3)
                issue.append(issued_s)
        nbytes = m * len(hosts) * expert_bytes
        median_s = statistics.median(times)
        rows.append(
            {
                "strategy": strategy,
                "m": m,
                "layers": len(hosts),
                "bytes_per_step": nbytes,
                "median_step_s": median_s,
                "min_step_s": min(times),
                "gbps_median": nbytes / median_s / 1e9,
                "gbps_best": nbytes / min(times) / 1e9,
                "issue_us": statistics.median(issue) * 1e6,
                "issue_us_per_call": statistics.median(issue) * 1e6 / len(hosts),
                "batch_fallbacks": engine.batch_fallbacks,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--m", default="1,2,4,8,16,32,64")
    ap.add_argument("--strategies", default="direct,staged")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp8", action="store_true", help="block-FP8 experts (weights and block scales)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("pagein.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    ms = [int(x) for x in args.m.split(",")]
    if max(ms) > args.slots:
        raise SystemExit(f"m={max(ms)} exceeds --slots {args.slots}")
    hosts, slots = [], []
    for _ in range(args.layers):
        cpu = torch.device("cpu")
        host = ExpertTensors.empty(
            args.experts, args.hidden, args.inter, torch.bfloat16, cpu, pin=True, is_fp8=args.fp8
        )
        for name in host.names():
            host.get(name).view(torch.uint8).fill_(1)  # the values do not matter for copy speed; a memset is fast
        hosts.append(host)
        slots.append(ExpertTensors.empty(args.slots, args.hidden, args.inter, torch.bfloat16, device, is_fp8=args.fp8))
    ceiling = copy_ceiling_gbps(device)
    rows = []
    for strategy in args.strategies.split(","):
        rows += bench_strategy(strategy, hosts, slots, ms, args.repeats, args.warmup, args.seed)
    for r in rows:
        r["fraction_of_measured_ceiling"] = r["gbps_median"] / ceiling
        r["fraction_of_nominal_54gbps"] = r["gbps_median"] / NOMINAL_CEILING_GBPS
    result = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "measured_ceiling_gbps_1gib_pinned": ceiling,
        "nominal_ceiling_gbps": NOMINAL_CEILING_GBPS,
        "expert_shape": {
            "hidden": args.hidden,
            "inter": args.inter,
            "dtype": "float8_e4m3fn" if args.fp8 else "bfloat16",
            "tensors": 6 if args.fp8 else 3,
            "row_bytes": hosts[0].row_bytes,
        },  # fmt: skip
        "args": vars(args) | {"out": str(args.out)},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"device {result['device']}; pinned 1 GiB copy ceiling {ceiling:.1f} GB/s")
    print(
        f"{'strategy':>8} {'m':>3} {'MB/step':>8} {'ms':>7} {'GB/s':>6} {'/ceil':>6} {'/54':>6} {'issue us/call':>13}"
    )
    for r in rows:
        print(
            f"{r['strategy']:>8} {r['m']:>3} {r['bytes_per_step'] / 1e6:>8.1f} {r['median_step_s'] * 1e3:>7.3f} "
            f"{r['gbps_median']:>6.1f} {r['fraction_of_measured_ceiling']:>6.1%} "
            f"{r['fraction_of_nominal_54gbps']:>6.1%} {r['issue_us_per_call']:>13.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
