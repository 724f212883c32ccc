"""`benchsuite simulate TRACE`: replay a routing trace through paged_experts.residency.planner and its eviction
policies (benchsuite.tools.simulate) and print per-policy / K / concurrency results, per layer on request."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from benchsuite.errors import UserError
from benchsuite.tools.preflight import GB_BYTES, MB_BYTES, parse_link
from benchsuite.tools.simulate import (
    SIM_POLICIES,
    LayerStats,
    SimOptions,
    SimResult,
    check_policy,
    simulate,
)
from paged_experts.residency.planner import DEFAULT_PREFILL_KEEP, MAX_STAGING_ROWS, PREFILL_KEEP
from paged_experts.routing.trace import read_trace

SPEED_MODEL = (
    "predicted tok/s = tokens / sum over steps of max(compute_ms_per_step, step miss bytes / link);"
    " compute and page-in overlap fully, step compute independent of batch size: an upper bound"
)
PUBLISHED_INT4_EXPERT_BYTES = 2.43e6  # Qwen3-30B-A3B GPTQ int4 expert (DESIGN.md section 3)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="routing trace (benchsuite trace synth / --record-routing / import-sglang)")
    p.add_argument("--k", type=_ints, default=(8, 16, 32, 64), help="resident experts per layer, e.g. 8,16,32,64")
    p.add_argument(
        "--policy",
        default="lru",
        help=f"comma list of {','.join(SIM_POLICIES)}, lfu-decay:<half-life steps>, "
        "lfu-aging:<period steps>[:<window steps>]",
    )
    p.add_argument("--concurrency", type=_ints, default=(1,), help="requests batched per step; 0 = as recorded")
    p.add_argument("--include-prefill", action="store_true", help="replay prefill chunks too (default: decode only)")
    p.add_argument(
        "--prefill-keep",
        default=DEFAULT_PREFILL_KEEP,
        help=f"comma list of {','.join(PREFILL_KEEP)}: what a prefill chunk leaves in the slots",
    )
    p.add_argument(
        "--staging-rows",
        type=int,
        default=0,
        help="prefill staging rows (the server's --prefill-staging-rows): every layer but the first serves a "
        "large step's first page-ins from N shared rows, promoting into the slots the ones the keep policy "
        "ranks among the K (with --include-prefill)",
    )
    p.add_argument(
        "--early-decode-steps",
        type=int,
        default=16,
        help="decode steps after a prefill counted as 'early' (the hit rate the prefill left)",
    )
    p.add_argument("--expert-bytes", type=float, help=f"bytes per expert (default {PUBLISHED_INT4_EXPERT_BYTES:.3g}: "
                   "published Qwen3-30B-A3B int4)")  # fmt: skip
    p.add_argument("--link-gbps", help="host->device GB/s: number, pcie5x16, or a linkbw JSON path")
    p.add_argument("--compute-ms-per-token", type=float, help="compute time of one decode step (ms)")
    p.add_argument("--per-layer", action="store_true", help="also print every layer")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-eviction policy")
    p.add_argument("--json", action="store_true")


def _rate(stats: LayerStats | None) -> str:
    return f"{stats.hit_rate:>7.1%}" if stats is not None and stats.hits + stats.misses else f"{'-':>7}"


def _row(r: SimResult, prefill: bool) -> str:
    t = r.total
    mb = f"{r.bytes_per_token / MB_BYTES:9.1f}" if r.bytes_per_token is not None else f"{'-':>9}"
    tps = f"{r.predicted_tok_per_s:9.1f}" if r.predicted_tok_per_s is not None else f"{'-':>9}"
    conc = "rec" if r.concurrency == 0 else str(r.concurrency)
    split = f" {r.prefill_keep:<8} {_rate(r.decode)} {_rate(r.early)}" if prefill else ""
    return (f"{r.policy:<12}{split} {r.k:>4} {conc:>4} {t.hit_rate:>7.1%} {t.misses_per_token:>9.2f} {mb}"
            f" {t.waves_per_step:>6.2f} {t.union_per_step:>7.1f} {tps}")  # fmt: skip


def render(
    results: list[SimResult], header: list[str], per_layer: bool, prefill: bool = False, early_steps: int = 16
) -> str:
    split = f" {'prefill':<8} {'dec hit':>7} {'early':>7}" if prefill else ""
    cols = (f"{'policy':<12}{split} {'K':>4} {'conc':>4} {'hit':>7} {'miss/tok':>9} {'MB/tok':>9} {'waves':>6}"
            f" {'union':>7} {'tok/s':>9}")  # fmt: skip
    lines = [*header, "", cols]
    if prefill:
        lines.insert(-1, f"dec hit: decode steps only; early: the first {early_steps} decode steps after each prefill")
    for r in results:
        lines.append(_row(r, prefill))
        if per_layer:
            for s in r.layers:
                lines.append(f"   layer {s.layer:>3}: hit {s.hit_rate:6.1%}  miss/tok {s.misses_per_token:6.2f}"
                             f"  waves {s.waves_per_step:5.2f}  union {s.union_per_step:6.1f}")  # fmt: skip
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        trace = read_trace(args.trace)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"cannot read trace {args.trace}: {exc}") from None
    policies = tuple(p.strip() for p in args.policy.split(",") if p.strip())
    for policy in policies:
        try:
            check_policy(policy)
        except ValueError as exc:
            raise UserError(f"--policy: {exc}") from None
    keeps = tuple(k.strip() for k in args.prefill_keep.split(",") if k.strip())
    if not keeps or [k for k in keeps if k not in PREFILL_KEEP]:
        raise UserError(f"--prefill-keep: {args.prefill_keep!r}; choose from {PREFILL_KEEP}")
    if args.early_decode_steps < 1:
        raise UserError("--early-decode-steps must be >= 1")
    if not 0 <= args.staging_rows <= MAX_STAGING_ROWS:
        raise UserError(f"--staging-rows must be in [0, {MAX_STAGING_ROWS}], got {args.staging_rows}")
    link_b_per_s, link_source = parse_link(args.link_gbps) if args.link_gbps else (None, "")
    expert_bytes = args.expert_bytes if args.expert_bytes else PUBLISHED_INT4_EXPERT_BYTES
    opts = SimOptions(
        ks=args.k,
        policies=policies,
        concurrencies=args.concurrency,
        include_prefill=args.include_prefill,
        expert_bytes=expert_bytes,
        link_b_per_s=link_b_per_s,
        compute_s_per_step=args.compute_ms_per_token / 1e3 if args.compute_ms_per_token is not None else None,
        seed=args.seed,
        prefill_keep=keeps,
        early_decode_steps=args.early_decode_steps,
        staging_rows=args.staging_rows,
    )
    try:
        results = simulate(trace, opts)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    meta = trace.meta
    label = f"SYNTHETIC routing ({meta.source})" if meta.synthetic else f"routing from {meta.source}"
    header = [
        (
            f"{label}: {args.trace}, model {meta.model or '-'}, {meta.num_layers} layers, E={meta.num_experts},"
            f" top_k={meta.top_k}, {'prefill + decode' if args.include_prefill else 'decode steps only'}"
        ),
        f"expert bytes {expert_bytes:,.0f}" + ("" if args.expert_bytes else " (published Qwen3-30B-A3B int4)"),
    ]
    if args.staging_rows:
        header.append(f"prefill staging rows {args.staging_rows} (every layer but the first)")
    if link_b_per_s:
        header.append(f"link {link_b_per_s / GB_BYTES:.1f} GB/s ({link_source}); {SPEED_MODEL}")
    if args.json:
        out = {
            "label": label,
            "synthetic": meta.synthetic,
            "trace": str(args.trace),
            "meta": dataclasses.asdict(meta),
            "options": dataclasses.asdict(opts),
            "speed_model": SPEED_MODEL,
            "results": [_result_dict(r) for r in results],
        }
        print(json.dumps(out, indent=2, default=_nan_to_none))
    else:
        print(render(results, header, args.per_layer, args.include_prefill, args.early_decode_steps))
    return 0


def _stats_dict(s) -> dict:
    return {**dataclasses.asdict(s), "hit_rate": _nan_to_none(s.hit_rate),
            "misses_per_token": _nan_to_none(s.misses_per_token), "waves_per_step": _nan_to_none(s.waves_per_step),
            "union_per_step": _nan_to_none(s.union_per_step)}  # fmt: skip


SPLITS = ("prefill", "decode", "early")


def _result_dict(r: SimResult) -> dict:
    return {
        "policy": r.policy,
        "prefill_keep": r.prefill_keep,
        **{name: None if s is None else _stats_dict(s) for name, s in zip(SPLITS, (r.prefill, r.decode, r.early))},
        "k": r.k,
        "concurrency": r.concurrency,
        "bytes_per_token": r.bytes_per_token,
        "predicted_tok_per_s": r.predicted_tok_per_s,
        "total": _stats_dict(r.total),
        "layers": [_stats_dict(s) for s in r.layers],
    }


def _nan_to_none(v: object) -> object:
    return None if isinstance(v, float) and math.isnan(v) else v
