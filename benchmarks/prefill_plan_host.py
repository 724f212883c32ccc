"""The host's planning per paged prefill layer-step, timed alone (no GPU needed).

With the model's own router a paged prefill layer-step is a serial chain: attention and routing on the
device, one read of the routed ids, then the host's plan, then the first page-ins (docs/prefill.md). This
times the host's part of it that does not touch a device: `LayerResidency.plan_step` (waves, victims,
keep ranks), `plan_waves` (the one layout of every wave's pairs) and `batch_desc` (`page_in: batch`'s
descriptors of every wave's page-ins: `contiguous_runs` and `batch_copy.descriptors` over an FP8 row's six
tensors, the bulk of the host's work before each wave's one driver call; the engine's table lookup, duplicate
and stream checks are not in it), on the 2,048-token chunks of a
Qwen3-30B-A3B-shaped layer (E=128, top_k=8) at the K a 16 GB budget gives (49), for routing drawn
uniformly and skewed (a Dirichlet(0.7) popularity, about the random model's own skew). Each chunk is
planned after the ones before it, as a server plans a prompt's chunks, one layer at a time.

    PYTHONPATH=$PWD python benchmarks/prefill_plan_host.py [--k 49] [--chunks 40] [--repeats 5]

Prints the median and p90 over chunks (after the first 5) of each part, in ms per layer-step; a
48-layer model pays this 48 times a chunk (before the layout's device copy and the first wave's launches). Beside
them, medians per layer-step: waves, misses (page-ins), and `runs`, the page-ins' runs of rows consecutive in both
the host store and the slots: `direct` issues a DMA per weight tensor and run (`--keep lru` orders the waves by id).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from paged_experts import fp8
from paged_experts.moe.waves import FUSED
from paged_experts.residency.batch_copy import descriptors, row_tables
from paged_experts.residency.planner import LayerResidency
from paged_experts.residency.store import ExpertTensors, contiguous_runs

E, TOP_K, TOKENS = 128, 8, 2048
WARMUP = 5  # chunks planned first and not counted


def chunks(skewed: bool, count: int, seed: int) -> list[torch.Tensor]:
    """`count` chunks of routed ids [TOKENS, TOP_K], distinct experts per token."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(E, 0.7)) if skewed else np.full(E, 1.0 / E)
    # top-k without replacement by Gumbel keys: one vectorized draw per chunk
    out = []
    for _ in range(count):
        keys = np.log(p)[None, :] - np.log(-np.log(rng.random((TOKENS, E))))  # [T, E]
        out.append(torch.from_numpy(np.argsort(-keys, axis=1)[:, :TOP_K].astype(np.int64)))
    return out


def time_parts(k: int, ids: list[torch.Tensor], keep: str) -> dict[str, list[float]]:
    layer = LayerResidency(E, k, prefill_keep=keep)
    x = torch.zeros(TOKENS, 8)  # the layout reads the ids only; x sets the pairs' buffer
    # FP8 rows at a small shape: a descriptor's cost does not depend on the row's bytes, only on the six tensors
    host, slots = (ExpertTensors.empty(n, 128, 128, torch.bfloat16, torch.device("cpu"), is_fp8=True) for n in (E, k))
    tables = row_tables([fp8.raw(host.get(n)) for n in host.names()], [fp8.raw(slots.get(n)) for n in slots.names()])
    parts: dict[str, list[float]] = {
        "plan_step": [],
        "plan_waves": [],
        "batch_desc": [],
        "waves": [],
        "misses": [],
        "runs": [],
    }
    for chunk in ids:
        t0 = time.perf_counter()
        plan = layer.plan_step(chunk.reshape(-1).numpy())
        t1 = time.perf_counter()
        run = FUSED.begin(x, chunk, E, torch.device("cpu"))
        t2 = time.perf_counter()
        run.plan_waves(plan.waves, k)
        t3 = time.perf_counter()
        runs = 0
        for wave in plan.waves:
            if wave.page_ins:
                wave_runs = contiguous_runs(wave.page_ins)
                descriptors(tables, wave_runs)
                runs += len(wave_runs)
        t4 = time.perf_counter()
        parts["runs"].append(runs)
        parts["batch_desc"].append((t4 - t3) * 1e3)
        parts["plan_step"].append((t1 - t0) * 1e3)
        parts["plan_waves"].append((t3 - t2) * 1e3)
        parts["waves"].append(len(plan.waves))
        parts["misses"].append(plan.misses)
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=49)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5, help="runs of the whole sequence; the best median is kept")
    ap.add_argument("--keep", default="recent")
    args = ap.parse_args()
    if args.chunks <= WARMUP:
        ap.error(f"--chunks must be above {WARMUP}: the first {WARMUP} chunks warm up and are not counted")
    torch.set_num_threads(1)
    print(f"E={E} top_k={TOP_K} K={args.k} {TOKENS}-token chunks, keep={args.keep}, ms per layer-step")
    print(f"{'routing':<8} {'part':<11} {'median':>7} {'p90':>7}   waves  misses  runs")
    for name, skewed in (("uniform", False), ("skewed", True)):
        ids = chunks(skewed, args.chunks, seed=1)
        best: dict[str, list[float]] | None = None
        for _ in range(args.repeats):
            parts = time_parts(args.k, ids, args.keep)
            if best is None or statistics.median(parts["plan_step"]) < statistics.median(best["plan_step"]):
                best = parts
        assert best is not None
        for part in ("plan_step", "plan_waves", "batch_desc"):
            values = sorted(best[part][WARMUP:])
            p90 = values[int(0.9 * (len(values) - 1))]
            print(
                f"{name:<8} {part:<11} {statistics.median(values):7.3f} {p90:7.3f}   "
                f"{statistics.median(best['waves'][WARMUP:]):5.1f}  {statistics.median(best['misses'][WARMUP:]):6.1f}  "
                f"{statistics.median(best['runs'][WARMUP:]):4.1f}"
            )


if __name__ == "__main__":
    main()
