"""Eviction policies compared by the paging simulator: LRU, plain LFU, LFU with aging (`lfu-decay`,
paged_experts.residency.policies.DecayedLfuPolicy, at several half-lives; `lfu-aging`, AgingLfuPolicy, whose
counts halve every P steps, at several periods; `--others arc`: ArcPolicy) and Belady's offline optimum as
the bound, per trace x phase x concurrency x K (benchsuite.tools.simulate, the runtime's own residency code).

Phases: `decode` replays decode steps only (every step one token per active request); `prefill`
replays the prompts too (each prompt one chunk; the slots after it are what `prefill_keep` left),
and reports the decode steps' hit rate and the first 16 decode steps after each prompt (`early`).
`gap` is the share of LRU's distance to Belady that the best online policy closes (negative: worse
than LRU). A trace labelled SYNTHETIC comes from a routing generator, not a model.

    PYTHONPATH=$PWD python benchmarks/eviction_policies.py TRACE... [--k 8,16,32,64] \\
        [--half-lives 1,2,4,16] [--aging-periods 64,256] [--others arc] [--concurrency 1,4]

K values outside [top_k, E) of a trace are dropped for it (the tiny model has E=32, top_k=4:
pass its sizes with `--k`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchsuite.tools.simulate import SimOptions, simulate
from paged_experts.routing.trace import read_trace


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _rate(stats) -> float | None:  # noqa: ANN001 - LayerStats | None
    if stats is None or stats.hits + stats.misses == 0:
        return None
    return stats.hit_rate


def _fmt(v: float | None) -> str:
    return f"{v:>7.1%}" if v is not None else f"{'-':>7}"


def compare(
    path: str,
    ks: tuple[int, ...],
    half_lives: tuple[float, ...],
    concurrencies: tuple[int, ...],
    aging_periods: tuple[str, ...] = (),
    others: tuple[str, ...] = (),
) -> list[str]:
    trace = read_trace(path)
    meta = trace.meta
    ks = tuple(k for k in ks if meta.top_k <= k < meta.num_experts)
    decays, agings = (f"lfu-decay:{h:g}" for h in half_lives), (f"lfu-aging:{p}" for p in aging_periods)
    online = ("lru", "lfu", *decays, *agings, *others)
    policies = (*online, "belady")
    label = f"SYNTHETIC routing ({meta.source})" if meta.synthetic else f"routing from {meta.source}"
    lines = [
        f"== {Path(path).name}: {label}, model {meta.model or '-'}, {meta.num_layers} layers, E={meta.num_experts},"
        f" top_k={meta.top_k}, {len(trace.requests())} requests, {trace.num_tokens} tokens",
    ]
    cols = "  ".join(f"{p:>12}" for p in policies)
    lines.append(f"{'phase':<14} {'c':>2} {'K':>4}  {cols}  {'best online':>14} {'gap':>6}")
    for include_prefill in (False, True):
        has_prefill = any(c.num_tokens > 1 for chunks in trace.requests().values() for c in chunks)
        if include_prefill and not has_prefill:
            continue
        opts = SimOptions(ks=ks, policies=policies, concurrencies=concurrencies, include_prefill=include_prefill)
        results = simulate(trace, opts)
        by = {(r.policy, r.concurrency, r.k): r for r in results}
        views = (("decode", lambda r: r.total),) if not include_prefill else (
            ("prefill>dec", lambda r: r.decode),
            ("prefill>early", lambda r: r.early),
        )  # fmt: skip
        for view, pick in views:
            for c in concurrencies:
                for k in ks:
                    rates = {p: _rate(pick(by[(p, c, k)])) for p in policies}
                    lines.append(_row(view, c, k, rates, online))
    return lines


def _row(view: str, c: int, k: int, rates: dict[str, float | None], online: tuple[str, ...]) -> str:
    cells = "  ".join(f"{_fmt(v):>12}" for v in rates.values())
    known = {p: v for p, v in rates.items() if p in online and v is not None}
    best = max(known, key=known.__getitem__) if known else None
    lru, opt = rates.get("lru"), rates.get("belady")
    gap = "-"
    if best is not None and lru is not None and opt is not None and opt > lru:
        gap = f"{(known[best] - lru) / (opt - lru):+.0%}"
    best_text = f"{best}" if best is not None else "-"
    return f"{view:<14} {c:>2} {k:>4}  {cells}  {best_text:>14} {gap:>6}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--k", type=_ints, default=(8, 16, 32, 64))
    ap.add_argument("--half-lives", default="1,2,4,16", help="lfu-decay half-lives in steps")
    ap.add_argument("--aging-periods", default="", help="lfu-aging periods in steps (counts halve), each P or P:W "
                    "(W: a recency window, experts used in the last W steps evicted last)")  # fmt: skip
    ap.add_argument("--others", default="", help="more online policies by name, comma-separated (e.g. arc)")
    ap.add_argument("--concurrency", type=_ints, default=(1, 4))
    args = ap.parse_args(argv)
    half_lives = tuple(float(v) for v in args.half_lives.split(",") if v.strip())
    print(f"# {' '.join(['benchmarks/eviction_policies.py', *argv])}")
    print("# hit rate = hits / (hits + misses) over all layers; decode: decode steps only; prefill>dec: the decode")
    print("# steps when prompts are replayed too; prefill>early: the first 16 decode steps after each prompt;")
    print("# gap: (best online - lru) / (belady - lru)")
    for path in args.traces:
        t0 = time.perf_counter()
        aging = tuple(v.strip() for v in args.aging_periods.split(",") if v.strip())
        others = tuple(v.strip() for v in args.others.split(",") if v.strip())
        for line in compare(path, args.k, half_lives, args.concurrency, aging, others):
            print(line, flush=True)
        print(f"({time.perf_counter() - t0:.0f} s)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
