"""A routing trace shaped like a random-weight model's greedy loops, for the eviction-policy simulator.

Why: the 48-layer random-weight model the H200 serves loops under greedy decoding (h100-headline-g's caveat: 42 of
48 short requests), so each request decodes from a small working set that LRU keeps within 2 points of Belady
(h200-record) and the frequency arms without a long window lose to it (docs/eviction-policy.md). No such trace is
kept here (the H200's were lost with its machine), and a CPU cannot record the 48-layer model's, so the policies'
behaviour on loops is simulated on this proxy. It is a proxy, not a model's routing: its figures say which way a
policy leans on loops, the H200 says by how much.

Each request walks a few fresh states (2-19 tokens), then repeats a cycle of L states (L drawn from 1..max-period);
each state routes top-k of E experts per layer, drawn as the top-k of a static per-layer bias plus fresh noise (a
random router's static preference), so a request's working set per layer is the union of its cycle's experts and a
new request brings a new one.

    PYTHONPATH=$PWD python benchmarks/loop_trace.py --layers 4 --requests 64 --tokens 128 --max-period 8 -o loop8.trace
"""

from __future__ import annotations

import argparse

import numpy as np

from paged_experts.routing.trace import TraceMeta, write_trace


def loop_trace(
    layers: int, requests: int, tokens: int, max_period: int, experts: int = 128, top_k: int = 8,
    bias: float = 0.5, seed: int = 0,
) -> tuple[TraceMeta, list[list[tuple[str, int]]], np.ndarray]:  # fmt: skip
    """(meta, steps, ids [requests * tokens, layers, top_k]): requests one after another, one token a step."""
    rng = np.random.default_rng(seed)
    layer_bias = rng.normal(size=(layers, experts)) * bias  # [L, E] the router's static preference
    ids, steps = [], []
    for r in range(requests):
        walk_tokens = int(rng.integers(2, 20))
        period_tokens = int(rng.integers(1, max_period + 1))
        states = [np.argsort(-(layer_bias + rng.normal(size=(layers, experts))), axis=1)[:, :top_k]
                  for _ in range(walk_tokens + period_tokens)]  # fmt: skip  # each [L, top_k]
        for t in range(tokens):
            loop = walk_tokens + (t - walk_tokens) % period_tokens
            ids.append(states[t] if t < walk_tokens else states[loop])  # [L, top_k]
            steps.append([(f"loop-{r}", 1)])
    meta = TraceMeta(
        num_layers=layers, num_experts=experts, top_k=top_k, source="synthetic:loop-proxy", model="loop-proxy",
        layer_ids=tuple(range(layers)), weights="absent",
        notes=f"benchmarks/loop_trace.py max_period={max_period} bias={bias} seed={seed}",
    )  # fmt: skip
    return meta, steps, np.stack(ids).astype(np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens per request")
    parser.add_argument("--max-period", type=int, default=8, help="the longest loop, in tokens")
    parser.add_argument("--bias", type=float, default=0.5, help="the static per-layer preference's scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--out", required=True)
    args = parser.parse_args()
    meta, steps, ids = loop_trace(args.layers, args.requests, args.tokens, args.max_period, bias=args.bias,
                                  seed=args.seed)  # fmt: skip
    write_trace(args.out, meta, steps, ids, None)
    print(f"wrote {args.out}: {ids.shape[0]} tokens, {args.layers} layers, {args.requests} requests")


if __name__ == "__main__":
    main()
