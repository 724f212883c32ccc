"""What one paged layer-step's device plan costs, per eviction policy: the fused plan kernel (plan_triton) timed alone.

Why: in h200-duel the duel (`eviction_policy: duel`) paged as few misses as `lfu-aging:256:4` but its decode step took
2.3 ms a token longer (~48 us a paged layer-step), read as its plan kernel's register spill; e791219 rewrote the
shadows' update. A served run mixes the plan with the copies and the experts' compute; this times the plan alone, in
the form the server runs it (one launch a layer-step inside a captured CUDA graph), on the same routing for every
policy, and first checks the device's plan against the host planner's (`LayerResidency`, the simulator's code) at
every step (misses, each pair's slot, which expert each slot holds, the duel's selector), then the captured graph's
misses against the host's: a plan that differs is reported (exit 3), not timed.

Each cell: one layer (E experts, K slots), S decode steps of B streams (B x top_k pairs a step) drawn from calibrated
synthetic routing (`synthesize_trace`) or from the greedy-loop proxy (benchmarks/loop_trace.py); the S launches are
captured in one graph, replayed R times (the state runs on: steady state), and the figure is the median replay's time
over S. `eager_us` (launch, then sync at the end) is beside it: Python's launch cost bounds it on a GPU, so read
`graphed_us`. A duel's shadows are a second launch: eager steps run them right after the plan; a captured step
defers them and runs every layer's in one launch at the step's end (DeviceResidency.defer_shadows, DuelShadows). In
`graphed_us` (one layer) each plan first runs the last step's shadows in line (plan and shadows in series: their
whole cost); `plan_on_path_us` is what the plan adds to a decode step of `--step-layers` layers whose layer work is a
spin of `--standin-cycles` (`layer_us` - `standin_us`, per layer-step, the shadows' one launch shared by the step's
layers): the cost on the decode step's critical path. The record ends with the kernels' compiled variants (the
plan's, the duel's shadows' per layer and for all layers) with their registers and spill (Triton's cache).
On the CPU the plan is `device.plan_step` (torch), or with `--fused` and TRITON_INTERPRET=1 the fused kernels in
Triton's interpreter (the tests' check of this script's kernel variants): a smoke run, no graph, no timing worth
reading.

    PYTHONPATH=$PWD python benchmarks/plan_kernel.py --out plan_kernel.json   # CUDA; ~1 min with Triton's compiles
    PYTHONPATH=$PWD python benchmarks/plan_kernel.py --device cpu --steps 64 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_h200 import provenance  # noqa: E402
from loop_trace import loop_trace  # noqa: E402

from paged_experts.residency import plan_triton  # noqa: E402
from paged_experts.residency.device import DeviceResidency, DuelShadows  # noqa: E402
from paged_experts.residency.planner import LayerResidency  # noqa: E402
from paged_experts.residency.policies import DuelPolicy, make_policy  # noqa: E402
from paged_experts.routing.trace import synthesize_trace  # noqa: E402

STEP_PLANS = 3072  # plans (and spins) in the graph of layer_us: 64 decode steps of 48 layers


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
    """The DeviceResidency a paged server builds for `policy_name`."""
    return DeviceResidency.for_policy(make_policy(policy_name, slots), experts, slots, device)


def host_misses(policy_name: str, ids: np.ndarray, experts: int, slots: int) -> list[int]:
    """Per step, the misses the host planner (the simulator's code) pages for the same steps."""
    residency = LayerResidency(experts, slots, make_policy(policy_name, slots))
    return [residency.plan_step(row.tolist()).misses for row in ids]


def check_plan(dr: DeviceResidency, policy_name: str, ids_dev: torch.Tensor) -> str | None:
    """None when the device plan is the host planner's at every step (its misses, each pair's slot, the expert in
    each slot, and the duel's selector), else where they first differ. Runs `dr` from its state on."""
    k = dr.num_slots
    host = LayerResidency(dr.num_experts, k, make_policy(policy_name, k))
    for i in range(ids_dev.shape[0]):
        row = ids_dev[i].tolist()
        plan = dr.plan(ids_dev[i])  # eager: a duel's shadows run in line, so the selector below is this step's
        want = host.plan_step(row)
        checks: list[tuple[str, object, object]] = [
            ("misses", int(plan.stats[2].item()), want.misses),
            ("pair slots", plan.pair_slot.tolist(), [host.slot_of[e] for e in row]),
            ("slots' experts", dr.expert_in[:k].tolist(), list(host.expert_in)),
        ]
        if isinstance(host.policy, DuelPolicy):
            checks.append(("selector", int(dr.psel.item()), host.policy.psel))
        for what, got, expected in checks:
            if got != expected:
                return f"step {i}: {what}: device {got}, host {expected}"
    return None


def capture(steps: int, body: Any, flush: Any = None) -> torch.cuda.CUDAGraph:
    """`body(i)` for i < steps captured in one graph, then `flush()` (the last step's deferred duel shadows, run inside
    the graph as the decode step's end runs them: a graph that left them pending would drop them at every replay)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(steps):
            body(i)
        if flush is not None:
            flush()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, steps: int, repeats: int) -> list[float]:
    """us per step of each of `repeats` replays (the state runs on from replay to replay: steady state)."""
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / steps)
    return out


def time_plans(
    dr: DeviceResidency,
    policy_name: str,
    ids_dev: torch.Tensor,
    want: list[int],
    repeats: int,
    standin_cycles: int,
    step_layers: int,
) -> dict[str, Any]:
    """us per plan: eager (S launches, one sync) and, on CUDA, graphed (S launches captured, median of R replays; a
    duel's shadows deferred, so each plan first runs the last step's in line: plan and shadows in series);
    `graph_mismatch`: where the graph's first replay (from `dr`'s state as given) misses other than `want`.
    On CUDA also `layer_us`: decode steps of `step_layers` layers (each its own state, from `dr`'s), each layer's plan
    followed by a stand-in for its copies and experts (a spin of `standin_cycles` on the compute stream), and the
    step's end, where every duel layer's deferred shadows run in one launch (DuelShadows), as the graphed decode step
    runs them; per layer-step. `layer_us` - `standin_us` (the spin alone) is what the plan costs the step's critical
    path, the shadows' launch shared by the step's layers."""
    steps = ids_dev.shape[0]
    start_state = dr.state()
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
    out: dict[str, Any] = {"eager_us": statistics.median(eager)}
    if not cuda:
        return out
    dr.load_state(start_state)  # capture runs nothing: the first replay starts here, as the check did
    stats: list[torch.Tensor] = []
    graph = capture(steps, lambda i: stats.append(dr.plan(ids_dev[i]).stats), dr.flush)  # [3] each, a replay's
    graph.replay()  # untimed: its misses checked
    torch.cuda.synchronize()
    got = torch.stack(stats)[:, 2].tolist()
    out["graph_mismatch"] = next((f"step {i}: graph {g} misses, host {w}" for i, (g, w) in enumerate(zip(got, want))
                                  if g != w), None)  # fmt: skip
    graphed = replay_us(graph, steps, repeats)
    out["graphed_us"] = statistics.median(graphed)
    out["graphed_us_min"] = min(graphed)
    out["graphed_us_max"] = max(graphed)
    if standin_cycles > 0 and step_layers > 0:
        layers = [dr]
        for _ in range(step_layers - 1):  # the other layers: the same policy, the same state and routing
            other = device_residency(policy_name, dr.num_experts, dr.num_slots, dr.device)
            other.fused = dr.fused
            other.load_state(start_state)
            layers.append(other)
        dr.load_state(start_state)
        shadows = DuelShadows(layers)
        decode_steps = max(1, min(steps, STEP_PLANS // step_layers))  # a graph of ~STEP_PLANS plans and spins

        def decode_step(i: int) -> None:
            for layer in layers:
                layer.plan(ids_dev[i])
                torch.cuda._sleep(standin_cycles)  # the layer's copies and experts
            shadows.flush()  # the step's end

        plans = decode_steps * step_layers
        spin = capture(plans, lambda i: torch.cuda._sleep(standin_cycles))
        out["standin_us"] = statistics.median(replay_us(spin, plans, repeats))
        shadows.warm(ids_dev.shape[1])  # the batch's first launch loads its module: never inside the capture
        stepped = capture(decode_steps, decode_step)
        out["layer_us"] = statistics.median(replay_us(stepped, plans, repeats))
        out["plan_on_path_us"] = out["layer_us"] - out["standin_us"]
        out["step_layers"] = step_layers
        out["decode_steps"] = decode_steps
    return out


def compiled_variants() -> list[dict[str, Any]]:
    """The plan's and the shadows' compiled kernel variants with their registers and spill, from Triton's cache (its
    layout differs between versions: best effort, an error recorded rather than raised)."""
    if plan_triton.triton is None or os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter compiles nothing
        return []
    try:
        out = []
        for fn in (plan_triton._plan_kernel, plan_triton._shadow_kernel, plan_triton._shadow_layers_kernel):
            for entry in fn.device_caches.values():
                cache = entry[0] if isinstance(entry, tuple) else entry  # Triton 3.x: (kernel cache, ...)
                for key, kernel in cache.items():
                    src = getattr(kernel, "src", None)
                    out.append({
                        "kernel": fn.__name__,
                        "n_regs": getattr(kernel, "n_regs", None),
                        "n_spills": getattr(kernel, "n_spills", None),
                        "constants": str(getattr(src, "constants", ""))[:400],
                        "key": str(key)[:400],
                    })  # fmt: skip
        return out
    except Exception as exc:  # noqa: BLE001 - Triton's internals: record, never fail the run
        return [{"error": repr(exc)}]


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
    ap.add_argument("--standin-cycles", type=int, default=60000,
                    help="the layer's copies and experts as a spin after each plan (CUDA; ~30-35 us at an H100/H200's "
                         "clock; a c=1 paged FP8 layer-step is ~50-140 us); 0: no layer_us")  # fmt: skip
    ap.add_argument("--step-layers", type=int, default=48,
                    help="paged layers a decode step of layer_us plans (each its own state; a duel's shadows run for "
                         "all in one launch at the step's end)")  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fused", action="store_true",
                    help="the fused kernel on the CPU too (with TRITON_INTERPRET=1: Triton's interpreter)")  # fmt: skip
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("plan_kernel: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    if args.fused and plan_triton.triton is None:
        print("plan_kernel: --fused needs Triton", file=sys.stderr)
        return 2
    record: dict[str, Any] = {
        "benchmark": "plan_kernel",
        "argv": sys.argv,
        "machine": platform.node(),
        "provenance": provenance(),  # git commit and tree, torch, GPU, CPUs
        "triton": plan_triton.triton.__version__ if plan_triton.triton is not None else None,
        "cells": [],
    }
    cells: list[dict[str, Any]] = record["cells"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
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
                dr.fused = dr.fused or args.fused
                cell["fused"] = dr.fused
                if device.type == "cuda" and not dr.fused:
                    print(f"plan_kernel: the fused plan does not run here (E={args.experts}, K={args.slots})",
                          file=sys.stderr)  # fmt: skip
                    return 2
                try:
                    start_state = dr.state()
                    cell["mismatch"] = check_plan(dr, name, ids_dev)
                    if cell["mismatch"] is None:
                        dr.load_state(start_state)
                        cell.update(
                            time_plans(dr, name, ids_dev, want, args.repeats, args.standin_cycles, args.step_layers)
                        )
                except Exception as exc:  # noqa: BLE001 - one cell's failure is recorded, the others still run
                    cell["error"] = repr(exc)[:2000]
                cells.append(cell)
                shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in cell.items()}
                print(json.dumps(shown), flush=True)
                args.out.write_text(json.dumps(record, indent=2) + "\n")  # after every cell: a cut call keeps them
    record["compiled"] = compiled_variants()
    for variant in record["compiled"]:
        print(json.dumps(variant))
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    bad = [c for c in cells if c.get("mismatch") or c.get("graph_mismatch") or c.get("error")]
    for c in bad:
        what = c.get("mismatch") or c.get("graph_mismatch") or c.get("error")
        print(f"plan_kernel: {c['policy']} B={c['batch']} {c['routing']}: {what}", file=sys.stderr)
    return 3 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
