"""What one paged layer-step's device plan costs, per eviction policy: the fused plan kernel (plan_triton) timed alone.

Why: in h200-duel the duel (`eviction_policy: duel`) paged as few misses as `lfu-aging:256:4` but its decode step took
2.3 ms a token longer (~48 us a paged layer-step), read as its plan kernel's register spill; e791219 rewrote the
shadows' update. A served run mixes the plan with the copies and the experts' compute; this times the plan alone, in
the form the server runs it (one launch a layer-step inside a captured CUDA graph), on the same routing for every
policy, and checks the device's misses against the host planner's (`LayerResidency`, the simulator's code) step by
step: a plan that differs is reported, not timed.

Each cell: one layer (E experts, K slots), S decode steps of B streams (B x top_k pairs a step) drawn from calibrated
synthetic routing (`synthesize_trace`) or from the greedy-loop proxy (benchmarks/loop_trace.py); the S launches are
captured in one graph, replayed R times (the state runs on: steady state), and the figure is the median replay's time
over S. `eager_us` (launch, then sync at the end) is beside it. On the CPU the plan is `device.plan_step` (torch):
a smoke run, no graph.

    PYTHONPATH=$PWD python benchmarks/plan_kernel.py --out plan_kernel.json   # CUDA; ~1 min with Triton's compiles
    PYTHONPATH=$PWD python benchmarks/plan_kernel.py --device cpu --steps 64 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_trace import loop_trace  # noqa: E402

from paged_experts.residency.device import DeviceResidency  # noqa: E402
from paged_experts.residency.planner import LayerResidency  # noqa: E402
from paged_experts.residency.policies import AgingLfuPolicy, DuelPolicy, make_policy  # noqa: E402
from paged_experts.routing.trace import synthesize_trace  # noqa: E402


def step_ids(routing: str, steps: int, batch: int, experts: int, top_k: int, seed: int) -> np.ndarray:
    """[steps, batch * top_k] routed ids of one layer: `batch` requests decode side by side, one token a step; a
    request ends after 128 tokens and the next `batch` start together (steps past a whole batch are dropped)."""
    tokens = 128
    groups = -(-steps // tokens)
    if routing == "calibrated":
        trace = synthesize_trace("qwen3-30b-a3b", 1, experts, top_k, requests=groups * batch, tokens_per_request=tokens,
                                 seed=seed)  # fmt: skip
        ids = trace.ids[:, 0]  # [requests * tokens, top_k]
    elif routing == "loop":
        ids = loop_trace(1, groups * batch, tokens, max_period=8, experts=experts, top_k=top_k, seed=seed)[2][:, 0]
    else:
        raise ValueError(f"routing must be calibrated or loop, got {routing!r}")
    per_request = ids.reshape(groups, batch, tokens, top_k)  # [G, B, T, k]
    return per_request.transpose(0, 2, 1, 3).reshape(groups * tokens, batch * top_k)[:steps].astype(np.int64)


def device_residency(policy_name: str, experts: int, slots: int, device: torch.device) -> DeviceResidency:
    """The DeviceResidency a paged server builds for `policy_name` (moe/__init__.py's mapping)."""
    policy = make_policy(policy_name, slots)
    aging = policy.lfu if isinstance(policy, DuelPolicy) else policy if isinstance(policy, AgingLfuPolicy) else None
    return DeviceResidency(
        experts, slots, device,
        aging_period_steps=aging.period_steps if aging else None,
        aging_window_steps=aging.window_steps if aging else 0,
        duel=isinstance(policy, DuelPolicy),
    )  # fmt: skip


def host_misses(policy_name: str, ids: np.ndarray, experts: int, slots: int) -> list[int]:
    """Per step, the misses the host planner (the simulator's code) pages for the same steps."""
    residency = LayerResidency(experts, slots, make_policy(policy_name, slots))
    return [residency.plan_step(row.tolist()).misses for row in ids]


def check_misses(policy_name: str, ids_dev: torch.Tensor, want: list[int], experts: int, slots: int) -> str | None:
    """None when the device plan pages the host's misses at every step, else where they first differ."""
    dr = device_residency(policy_name, experts, slots, ids_dev.device)
    for i in range(ids_dev.shape[0]):
        got = int(dr.plan(ids_dev[i]).stats[2].item())
        if got != want[i]:
            return f"step {i}: device {got} misses, host {want[i]}"
    return None


def time_plans(policy_name: str, ids_dev: torch.Tensor, experts: int, slots: int, repeats: int) -> dict[str, float]:
    """us per plan: eager (S launches, one sync) and, on CUDA, graphed (S launches captured, median of R replays)."""
    steps = ids_dev.shape[0]
    dr = device_residency(policy_name, experts, slots, ids_dev.device)
    for i in range(min(steps, 16)):  # Triton's compile, torch's warm-up
        dr.plan(ids_dev[i])
    cuda = ids_dev.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    eager = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(steps):
            dr.plan(ids_dev[i])
        if cuda:
            torch.cuda.synchronize()
        eager.append((time.perf_counter() - t0) / steps * 1e6)
    out = {"eager_us": statistics.median(eager)}
    if not cuda:
        return out
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture on a side stream, as torch's graph docs do
        with torch.cuda.graph(graph):
            for i in range(steps):
                dr.plan(ids_dev[i])
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()  # once untimed
    torch.cuda.synchronize()
    graphed = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        graphed.append(start.elapsed_time(end) * 1e3 / steps)
    out["graphed_us"] = statistics.median(graphed)
    out["graphed_us_min"] = min(graphed)
    out["graphed_us_max"] = max(graphed)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--policies", default="lru,lfu-aging:256:4,duel")
    ap.add_argument("--batches", default="1,4", help="streams decoding side by side (pairs a step = B x top_k <= K)")
    ap.add_argument("--routings", default="calibrated,loop")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=54, help="K (54: 16 GB's K on the H200's FP8 rows)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("plan_kernel: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    cells: list[dict[str, Any]] = []
    for routing in args.routings.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            if batch * args.top_k > args.slots:
                print(f"plan_kernel: B={batch} routes more pairs than K={args.slots}: host-planned, skipped")
                continue
            ids = step_ids(routing, args.steps, batch, args.experts, args.top_k, args.seed)
            ids_dev = torch.from_numpy(ids).to(device)  # [S, B*k]
            for name in args.policies.split(","):
                want = host_misses(name, ids, args.experts, args.slots)
                cell: dict[str, Any] = {"routing": routing, "batch": batch, "policy": name, "steps": int(ids.shape[0]),
                                        "misses_per_step": sum(want) / len(want)}  # fmt: skip
                dr = device_residency(name, args.experts, args.slots, device)
                cell["fused"] = dr.fused
                cell["mismatch"] = check_misses(name, ids_dev, want, args.experts, args.slots)
                if cell["mismatch"] is None:
                    cell.update(time_plans(name, ids_dev, args.experts, args.slots, args.repeats))
                cells.append(cell)
                shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in cell.items()}
                print(json.dumps(shown), flush=True)
    record = {
        "benchmark": "plan_kernel",
        "argv": sys.argv,
        "machine": platform.node(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cells": cells,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    bad = [c for c in cells if c["mismatch"]]
    for c in bad:
        print(f"plan_kernel: {c['policy']} B={c['batch']} {c['routing']}: {c['mismatch']}", file=sys.stderr)
    return 1 if bad else 0


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
