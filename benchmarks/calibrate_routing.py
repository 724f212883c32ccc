"""Calibrate the `qwen3-30b-a3b` synthetic routing preset against DESIGN.md section 8.

Target (Qwen3-30B-A3B decode, 25 prompts, 3,225 tokens): consecutive-token overlap 42.7% (7.9%-59.7%
by layer); per-layer hit rate with 8/16/32/64 of 128 experts resident: LRU 42.4/64.7/81.0/91.8%,
LFU 42.5/61.5/79.5/91.7%, random 36.5/58.2/76.7/90.6%, Belady 60.8/78.4/88.8/92.9%.

    python benchmarks/calibrate_routing.py              # print the preset's curves (via residency)
    python benchmarks/calibrate_routing.py --search 60  # random local search of the parameters

The search scores candidates with a vectorised LRU that equals `LayerResidency` + `LruPolicy` for
one stream at batch 1 (resident set = the K experts with the largest (last use, id)); the printed
curves of the final parameters always come from `benchsuite.tools.simulate` (the residency code).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from benchsuite.tools.simulate import SimOptions, simulate
from paged_experts.routing.sources import RoutingProcess, synth_stream
from paged_experts.routing.specs import PRESETS, RoutingParams
from paged_experts.routing.trace import synthesize_trace

KS = (8, 16, 32, 64)
PUBLISHED = {
    "lru": (0.424, 0.647, 0.810, 0.918),
    "lfu": (0.425, 0.615, 0.795, 0.917),
    "random": (0.365, 0.582, 0.767, 0.906),
    "belady": (0.608, 0.784, 0.888, 0.929),
}
OVERLAP_MEAN, OVERLAP_MIN, OVERLAP_MAX = 0.427, 0.079, 0.597
E, TOP_K, TOKENS = 128, 8, 3225


def overlap_per_layer(ids: np.ndarray) -> np.ndarray:
    """[L] mean share of a token's experts also routed to the previous token. ids: [N, L, k]."""
    same = (ids[1:, :, :, None] == ids[:-1, :, None, :]).any(axis=3)  # [N-1, L, k]
    return same.mean(axis=(0, 2))


def fast_lru_hit_rate(ids: np.ndarray, k_slots: int, num_experts: int) -> float:
    """LRU hit rate of one stream at batch 1, all layers at once. ids: [N, L, k]."""
    n, layers, _ = ids.shape
    rows = np.arange(layers)[:, None]
    key = np.full((layers, num_experts), -2.0)  # never used and not resident
    key[:, :k_slots] = -1.0  # initial residents 0..K-1
    key += np.arange(num_experts)[None, :] / (2 * num_experts)  # ties: lowest id leaves first
    hits = 0
    for t in range(n):
        kth = np.partition(key, num_experts - k_slots, axis=1)[:, num_experts - k_slots][:, None]
        hits += int((key[rows, ids[t]] >= kth).sum())
        key[rows, ids[t]] = t + np.arange(num_experts)[ids[t]] / (2 * num_experts)
    return hits / ids[:, :, :].size


def score(params: RoutingParams, num_layers: int, tokens: int, seed: int) -> tuple[float, np.ndarray, np.ndarray]:
    ids = synth_stream(RoutingProcess(num_layers, E, TOP_K, params, seed), tokens)
    curve = np.array([fast_lru_hit_rate(ids, k, E) for k in KS])
    ov = overlap_per_layer(ids)
    err = np.abs(curve - PUBLISHED["lru"]).max()
    err += 0.5 * abs(ov.mean() - OVERLAP_MEAN) + 0.2 * (abs(ov.min() - OVERLAP_MIN) + abs(ov.max() - OVERLAP_MAX))
    return float(err), curve, ov


def search(start: RoutingParams, iterations: int, num_layers: int, tokens: int, seed: int) -> RoutingParams:
    rng = np.random.default_rng(seed)
    names = ("keep_prob", "recency_mix", "recency_alpha", "zipf_s", "working_set", "working_set_mass",
             "layer_strength_min", "layer_strength_gamma")  # fmt: skip
    steps = np.array([0.03, 0.05, 0.1, 0.1, 0.03, 0.01, 0.03, 0.08])
    lo = np.array([0.0, 0.0, 0.2, 0.0, 0.1, 0.5, 0.0, 0.05])
    hi = np.array([1.0, 1.0, 3.0, 3.0, 1.0, 1.0, 1.0, 3.0])
    best = start
    best_err, curve, ov = score(best, num_layers, tokens, seed)
    print(f"start err {best_err:.4f} lru {np.round(curve, 3)} overlap {ov.mean():.3f} [{ov.min():.3f}, {ov.max():.3f}]")
    for i in range(iterations):
        x = np.array([getattr(best, n) for n in names])
        cand = np.clip(x + rng.normal(0, steps), lo, hi)
        params = RoutingParams(**dict(zip(names, (round(float(v), 3) for v in cand))))
        err, curve, ov = score(params, num_layers, tokens, seed)
        if err < best_err:
            best, best_err = params, err
            print(
                f"{i:3d} err {err:.4f} lru {np.round(curve, 3)} "
                f"overlap {ov.mean():.3f} [{ov.min():.3f}, {ov.max():.3f}] {params}"
            )
            sys.stdout.flush()
    return best


def report(params: RoutingParams, num_layers: int, tokens: int, seed: int, policies: tuple[str, ...]) -> None:
    trace = synthesize_trace("qwen3-30b-a3b", num_layers, E, TOP_K, requests=1, tokens_per_request=tokens,
                             seed=seed, params=params)  # fmt: skip
    ov = overlap_per_layer(trace.ids)
    print(f"synthetic routing {params}")
    print(f"{num_layers} layers, one stream of {tokens} decode tokens, batch 1, seed {seed}")
    print(f"consecutive-token overlap {ov.mean():.1%} (layers {ov.min():.1%}-{ov.max():.1%});"
          f" published {OVERLAP_MEAN:.1%} ({OVERLAP_MIN:.1%}-{OVERLAP_MAX:.1%})")  # fmt: skip
    print("LRU is the calibration target. Residency pins a step's experts (a wave must hold all of them), so"
          " at K = top_k = 8 every policy equals LRU; the published random/Belady figures at K=8 differ from LRU,"
          " so the study's cache did not pin a token's experts (our inference): compare those at K >= 16.")  # fmt: skip
    print(f"{'policy':<8} {'K':>4} {'synthetic':>10} {'published':>10} {'diff':>7}")
    for policy in policies:
        results = simulate(trace, SimOptions(ks=KS, policies=(policy,), concurrencies=(1,), seed=seed))
        for r, pub in zip(results, PUBLISHED[policy]):
            print(
                f"{policy:<8} {r.k:>4} {r.total.hit_rate:>10.1%} {pub:>10.1%} {100 * (r.total.hit_rate - pub):>+6.1f}pt"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--search", type=int, default=0, help="local-search iterations (0: just print)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--search-layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="lru,lfu,random,belady")
    args = ap.parse_args(argv)
    params = PRESETS["qwen3-30b-a3b"]
    if args.search:
        t0 = time.perf_counter()
        params = search(params, args.search, args.search_layers, args.tokens, args.seed)
        print(f"search took {time.perf_counter() - t0:.0f} s; best: {dataclasses.asdict(params)}")
    report(params, args.layers, args.tokens, args.seed, tuple(args.policies.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
