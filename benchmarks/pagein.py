"""Page-in micro-benchmark: one step that pages in m missing experts in each of L layers.

Qwen3-30B-A3B-shaped bf16 experts (gate/up `[768, 2048]`, down `[2048, 768]`: 3 tensors of
3 MiB, 9.4 MB per expert) sit in a pinned host store of E experts per layer; K device slots per
layer. Each timed step copies m random experts into m random slots of every layer through the
runtime's own `PageInEngine` (the code the model runs), timed with CUDA events after a warmup.
Reported: GB/s (1e9 bytes/s) and the fraction of the pinned copy ceiling, measured here as one
1 GiB pinned host->device copy, and also quoted against the nominal 54 GB/s of DESIGN.md section 5.

    python benchmarks/pagein.py --out results.json [--m 1,2,4,8,16,32,64] [--strategies direct,staged]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

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
    expert_bytes = 3 * hidden * inter * hosts[0].gate.element_size()
    engine = PageInEngine(device, strategy, hidden, inter, hosts[0].gate.dtype, num_slots)
    rng = random.Random(seed)
    rows = []
    for m in ms:
        times = []
        for it in range(warmup + repeats):
            # Fresh random experts and slots each step: no contiguous runs to coalesce.
            plans = [list(zip(rng.sample(range(num_experts), m), rng.sample(range(num_slots), m))) for _ in hosts]
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for host, slot, pairs in zip(hosts, slots, plans):
                engine.copy_rows(host, slot, pairs)
            end.record()
            end.synchronize()
            if it >= warmup:
                times.append(start.elapsed_time(end) / 1e3)
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
        host = ExpertTensors.empty(args.experts, args.hidden, args.inter, torch.bfloat16, torch.device("cpu"), pin=True)
        for t in (host.gate, host.up, host.down):
            t.fill_(0.5)  # the values do not matter for copy speed; a memset is fast
        hosts.append(host)
        slots.append(ExpertTensors.empty(args.slots, args.hidden, args.inter, torch.bfloat16, device))
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
        "expert_shape": {"hidden": args.hidden, "inter": args.inter, "dtype": "bfloat16", "tensors": 3},
        "args": vars(args) | {"out": str(args.out)},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"device {result['device']}; pinned 1 GiB copy ceiling {ceiling:.1f} GB/s")
    print(f"{'strategy':>8} {'m':>3} {'MB/step':>8} {'ms':>7} {'GB/s':>6} {'/ceil':>6} {'/54':>6}")
    for r in rows:
        print(
            f"{r['strategy']:>8} {r['m']:>3} {r['bytes_per_step'] / 1e6:>8.1f} {r['median_step_s'] * 1e3:>7.3f} "
            f"{r['gbps_median']:>6.1f} {r['fraction_of_measured_ceiling']:>6.1%} "
            f"{r['fraction_of_nominal_54gbps']:>6.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
