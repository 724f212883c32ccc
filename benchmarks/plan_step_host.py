"""The host planner's time for one layer-step, per eviction policy and step size (no GPU needed).

Why: `LayerResidency.plan_step` plans every host-planned layer-step: a prompt chunk on any device (its waves), and
every step of the CPU runtime and of the simulator's replay. Its cost per policy is the policy's bookkeeping (the
victims' keys, the uses) beside the waves' own. In h100-duelconfirm (2026-12-07) a short prompt's host part of the
prefill was 11-19 ms longer with `duel` than with LRU over 48 layers; this separates the planner's share of that
from the device-state round trip (`benchmarks/residency_roundtrip.py`).

Each policy plans the same sequence: per repeat, `--decode` single-step chunks of `--batch` tokens, then one chunk
of each `--tokens` size, timed alone; routing drawn with a Dirichlet(0.7) popularity over E experts (about the
random model's own skew), top-k distinct per token. Prints the median ms of each timed step over `--repeats`
(after 3 not counted), the decode steps' median in us, and the waves and misses of the last timed chunk.

    PYTHONPATH=$PWD python benchmarks/plan_step_host.py --repeats 60         # E=128, top_k=8, K=54 (docs' figures)
    PYTHONPATH=$PWD python benchmarks/plan_step_host.py --tokens 41,2048 --batch 4 --repeats 40
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

from paged_experts.residency.planner import LayerResidency
from paged_experts.residency.policies import make_policy

POLICIES = ("lru", "lfu-aging:256:4", "duel")
WARMUP = 3  # repeats planned first and not counted


def draws(rng: np.random.Generator, popularity: np.ndarray, tokens: int, top_k: int) -> np.ndarray:
    """[tokens * top_k] expert ids, top-k distinct per token by Gumbel keys (one vectorized draw)."""
    keys = np.log(popularity)[None, :] - np.log(-np.log(rng.random((tokens, popularity.size))))  # [T, E]
    return np.argsort(-keys, axis=1)[:, :top_k].reshape(-1).astype(np.int64)


def time_policy(policy: str, args: argparse.Namespace, sizes: list[int]) -> dict[str, float]:
    """Medians for one policy: 'decode_us' and, per size, its ms; 'waves_N' and 'misses_N' of the last chunk."""
    rng = np.random.default_rng(args.seed)  # the same routing for every policy
    popularity = rng.dirichlet(np.full(args.experts, 0.7))
    layer = LayerResidency(args.experts, args.slots, make_policy(policy, args.slots))
    decode_s: list[float] = []
    chunk_s: dict[int, list[float]] = {n: [] for n in sizes}
    out: dict[str, float] = {}
    gc.disable()  # a collection would land in whichever step made the garbage: collected between repeats instead
    try:
        for repeat in range(args.repeats + WARMUP):
            gc.collect()
            steps = [draws(rng, popularity, args.batch, args.top_k) for _ in range(args.decode)]
            started = time.perf_counter()
            for ids in steps:
                layer.plan_step(ids)
            if repeat >= WARMUP and steps:
                decode_s.append((time.perf_counter() - started) / len(steps))
            for n in sizes:
                ids = draws(rng, popularity, n, args.top_k)
                started = time.perf_counter()
                plan = layer.plan_step(ids)
                if repeat >= WARMUP:
                    chunk_s[n].append(time.perf_counter() - started)
                out[f"waves_{n}"], out[f"misses_{n}"] = len(plan.waves), plan.misses
    finally:
        gc.enable()
    out["decode_us"] = statistics.median(decode_s) * 1e6 if decode_s else float("nan")
    for n in sizes:
        out[f"ms_{n}"] = statistics.median(chunk_s[n]) * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--slots", type=int, default=54, help="K")
    ap.add_argument("--tokens", default="41,2048", help="comma list of prompt chunk sizes, each timed alone")
    ap.add_argument("--batch", type=int, default=4, help="tokens in each decode step between the chunks")
    ap.add_argument("--decode", type=int, default=20, help="decode steps before each repeat's chunks")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sizes = [int(n) for n in args.tokens.split(",") if n]
    if args.repeats < 1 or not sizes or args.batch * args.top_k < 1:
        ap.error("--repeats and --tokens need at least one, --batch one token")
    print(
        f"E={args.experts} top_k={args.top_k} K={args.slots}: medians over {args.repeats} repeats; decode steps of "
        f"{args.batch} tokens in us, chunks in ms"
    )
    print(
        f"{'policy':<16} {'decode_us':>9} " + " ".join(f"{'ms_' + str(n):>9} {'waves':>5} {'misses':>6}" for n in sizes)
    )
    for policy in args.policies.split(","):
        row = time_policy(policy, args, sizes)
        cells = " ".join(f"{row[f'ms_{n}']:9.3f} {row[f'waves_{n}']:5.0f} {row[f'misses_{n}']:6.0f}" for n in sizes)
        print(f"{policy:<16} {row['decode_us']:9.1f} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
