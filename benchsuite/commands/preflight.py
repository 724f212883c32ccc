"""`benchsuite preflight`: flags -> PreflightInputs -> benchsuite.checks.preflight_report.preflight -> table or JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json

from benchsuite.checks.preflight_report import PreflightInputs, PreflightReport, preflight
from benchsuite.errors import UserError
from benchsuite.tools.model_names import model_shape
from benchsuite.tools.preflight import (
    EXPERT_FORMATS,
    GB_BYTES,
    GIB_BYTES,
    MB_BYTES,
    ModelShape,
    parse_link,
)


def configure(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("model (either --model or the explicit shapes)")
    src.add_argument(
        "--model",
        help="a checkpoint directory (or its config.json), a generated preset as a matrix names it (tiny, "
        "synth:qwen3-30b-a3b-shape?layers=8), or a known model: Qwen3-30B-A3B, Qwen3-235B-A22B, "
        "Mixtral-8x7B-v0.1, gpt-oss-20b, gpt-oss-120b",
    )
    src.add_argument("--layers", type=int, help="MoE layers (explicit shape)")
    src.add_argument("--experts", type=int, help="experts per layer E (explicit shape)")
    src.add_argument("--top-k", type=int, help="experts per token (explicit shape)")
    src.add_argument("--expert-mb", type=float, help="bytes of one expert of one layer, decimal MB")
    src.add_argument("--kv-bytes-per-token", type=float, help="KV bytes per token at bf16 (explicit shape)")
    src.add_argument(
        "--non-expert-gb",
        type=float,
        help="weights that are not routed experts (attention, embeddings, router, shared experts), "
        "decimal GB (explicit shape)",
    )
    p.add_argument("--format", default=",".join(EXPERT_FORMATS), help="expert formats: bf16,fp8,int4")
    p.add_argument("--k", type=int, help="resident experts per layer to analyse (default: the K that fits)")
    p.add_argument("--vram-gb", type=float, help="GPU memory as sold (GiB: a 16 GB card is 16 x 2^30 bytes)")
    p.add_argument("--mem-fraction", type=float, default=0.88, help="static share of VRAM (SGLang flag)")
    p.add_argument("--kv-tokens", type=int, default=10_240, help="KV capacity in tokens (published: 10240)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--overhead-gb", type=float, default=0.25, help="activations, CUDA graphs, slack (GB)")
    p.add_argument(
        "--non-expert-bytes-per-param",
        type=float,
        default=2.0,
        help="2 = bf16 attention etc. (the fp8 format counts its attention projections as block-FP8)",
    )
    p.add_argument("--link-gbps", help="host->device GB/s: a number, pcie5x16, or a linkbw JSON path")
    p.add_argument("--tok-s", type=float, help="measured single-stream decode tok/s at this K")
    p.add_argument("--concurrency", type=int, default=1, help="target concurrent requests")
    p.add_argument("--ram-gb", type=float, help="system RAM as sold (GiB)")
    p.add_argument("--wsl2", action="store_true", help="pinned memory capped at half of RAM")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _shape(args: argparse.Namespace) -> ModelShape:
    if args.model:
        return model_shape(args.model)
    missing = [f for f in ("layers", "experts", "top_k") if getattr(args, f) is None]
    if missing:
        raise UserError("give --model, or --layers --experts --top-k (and --expert-mb)")
    return ModelShape(num_layers=args.layers, num_moe_layers=args.layers, num_experts=args.experts, top_k=args.top_k)


def inputs_from_args(args: argparse.Namespace) -> PreflightInputs:
    shape = _shape(args)
    link_b_per_s, link_source = parse_link(args.link_gbps) if args.link_gbps else (None, "")
    formats = tuple(f.strip() for f in args.format.split(",") if f.strip())
    bad = [f for f in formats if f not in EXPERT_FORMATS]
    if bad:
        raise UserError(f"--format: unknown {bad}; choose from {EXPERT_FORMATS}")
    if args.k is not None and not 1 <= args.k <= shape.num_experts:
        raise UserError(f"--k must be in [1, {shape.num_experts}]")
    return PreflightInputs(
        shape=shape,
        formats=formats,
        explicit_expert_bytes=args.expert_mb * MB_BYTES if args.expert_mb else None,
        explicit_kv_bytes_per_token=args.kv_bytes_per_token,
        explicit_non_expert_bytes=args.non_expert_gb * GB_BYTES if args.non_expert_gb is not None else None,
        k=args.k,
        vram_bytes=args.vram_gb * GIB_BYTES if args.vram_gb else None,
        mem_fraction_static=args.mem_fraction,
        kv_capacity_tokens=args.kv_tokens,
        kv_dtype=args.kv_dtype,
        overhead_bytes=args.overhead_gb * GB_BYTES,
        non_expert_dtype_bytes=args.non_expert_bytes_per_param,
        link_b_per_s=link_b_per_s,
        link_source=link_source,
        tok_per_s=args.tok_s,
        concurrency=args.concurrency,
        ram_bytes=args.ram_gb * GIB_BYTES if args.ram_gb else None,
        wsl2=args.wsl2,
    )


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "MB":
        return f"{value / MB_BYTES:,.2f} MB"
    if unit == "GB":
        return f"{value / GB_BYTES:,.2f} GB"
    if unit == "%":
        return f"{value:.1%}"
    if unit == "ms":
        return f"{value * 1e3:,.0f} ms"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


_ROWS = (
    ("non-expert weights (fp8: FP8 attention)", "non_expert_weight_bytes", "GB"),
    ("expert bytes", "expert_bytes", "MB"),
    ("slot bytes (expert x MoE layers)", "slot_bytes", "MB"),
    ("KV tokens per slot (bf16 KV)", "kv_tokens_per_slot_bf16", ""),
    ("KV tokens per slot (fp8 KV)", "kv_tokens_per_slot_fp8", ""),
    ("K that fits the budget", "k_fit", ""),
    ("K analysed", "k", ""),
    ("batch cap K // top_k", "batch_cap", ""),
    ("K needed for concurrency", "min_k_for_concurrency", ""),
    ("pinned host bytes", "pinned_host_bytes", "GB"),
    ("pinned cap", "pinned_cap_bytes", "GB"),
    ("all-miss bytes per token", "all_miss_bytes_per_token", "MB"),
    ("prefill page-in bytes", "prefill_page_in_bytes", "GB"),
    ("prefill page-in floor", "prefill_page_in_floor_s", "ms"),
    ("random miss 1 - K/E", "random_miss", "%"),
    ("max miss allowed by tok/s", "max_miss_allowed", "%"),
    ("reuse implied (< 0.8 x random)", "reuse_implied", ""),
)


def render_table(report: PreflightReport) -> str:
    head = [
        f"model {report.model or '(explicit shape)'}: {report.num_moe_layers} MoE layers of {report.num_layers},"
        f" E={report.num_experts}, top_k={report.top_k}",
        f"KV bytes per token: bf16 {_fmt(report.kv_bytes_per_token_bf16)}, fp8 {_fmt(report.kv_bytes_per_token_fp8)};"
        f" non-expert weights {_fmt(report.non_expert_weight_bytes, 'GB')} (per format: the table's first row)",
    ]
    if report.link_b_per_s:
        head.append(f"link {report.link_b_per_s / GB_BYTES:.1f} GB/s ({report.link_source})")
    names = [f.format for f in report.formats]
    width = max(len(r[0]) for r in _ROWS)
    col = 14
    lines = head + ["", f"{'':<{width}}  " + "".join(f"{n:>{col}}" for n in names)]
    for label, field, unit in _ROWS:
        cells = "".join(f"{_fmt(getattr(f, field), unit):>{col}}" for f in report.formats)
        lines.append(f"{label:<{width}}  {cells}")
    for f in report.formats:
        lines.append("")
        lines.append(f"verdict [{f.format}]:")
        lines.extend(f"  {v}" for v in f.verdict)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    report = preflight(inputs_from_args(args))
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(render_table(report))
    return 0
