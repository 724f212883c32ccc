"""The preflight report: what was given (`PreflightInputs`) -> every figure per expert format and a verdict.

Owns which formulas of `preflight.py` apply to which inputs (a figure whose input was not given is
None), the memory budget assembled from the flags, and the verdict lines (FAIL / WARN / OK / INFO).
The formulas themselves live in `preflight.py`, once.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchsuite.errors import UserError
from benchsuite.tools.preflight import (
    GB_BYTES,
    MemoryBudget,
    ModelShape,
    all_miss_bytes_per_token,
    batch_cap,
    expert_bytes_by_format,
    k_that_fits,
    kv_tokens_per_slot,
    max_miss_allowed,
    min_k_for_concurrency,
    pinned_cap_bytes,
    pinned_host_bytes,
    prefill_page_in_bytes,
    random_miss,
    reuse_implied,
    slot_bytes,
    transfer_time_s,
)


@dataclass(frozen=True)
class PreflightInputs:
    shape: ModelShape
    formats: tuple[str, ...]  # expert formats to evaluate ("explicit" when --expert-mb is given)
    explicit_expert_bytes: float | None = None
    explicit_kv_bytes_per_token: float | None = None
    explicit_non_expert_bytes: float | None = None  # attention, embeddings, router, shared experts (explicit shape)
    k: int | None = None
    vram_bytes: float | None = None
    mem_fraction_static: float = 0.88
    kv_capacity_tokens: int = 10_240
    kv_dtype: str = "bf16"
    # 0.25 GB: the largest overhead at which the published desktop K=92 (int4, 16 GB, 0.88) fits.
    overhead_bytes: float = 0.25 * GB_BYTES
    non_expert_dtype_bytes: float = 2.0
    link_b_per_s: float | None = None
    link_source: str = ""
    tok_per_s: float | None = None
    concurrency: int = 1
    ram_bytes: float | None = None
    wsl2: bool = False


@dataclass(frozen=True)
class FormatReport:
    """Every figure for one expert format; None where an input it needs was not given."""

    format: str
    expert_bytes: float
    slot_bytes: float
    # the weights outside the experts in this format: a block-FP8 checkpoint's attention projections are FP8 too
    # (as SGLang and the built-in runtime keep them), so the fp8 column counts them at 1 byte + their block scales
    non_expert_weight_bytes: float | None
    kv_tokens_per_slot_bf16: int | None
    kv_tokens_per_slot_fp8: int | None
    k_fit: int | None
    k: int | None  # the K analysed: --k, else k_fit
    batch_cap: int | None
    min_k_for_concurrency: int
    pinned_host_bytes: float
    pinned_cap_bytes: float | None
    all_miss_bytes_per_token: float
    prefill_page_in_bytes: float | None
    prefill_page_in_floor_s: float | None
    random_miss: float | None
    max_miss_allowed: float | None
    reuse_implied: bool | None
    verdict: tuple[str, ...]


@dataclass(frozen=True)
class PreflightReport:
    model: str
    num_layers: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    kv_bytes_per_token_bf16: float | None
    kv_bytes_per_token_fp8: float | None
    non_expert_weight_bytes: float | None
    link_b_per_s: float | None
    link_source: str
    tok_per_s: float | None
    concurrency: int
    formats: tuple[FormatReport, ...]


def _kv_per_token(inp: PreflightInputs) -> tuple[float | None, float | None]:
    if inp.explicit_kv_bytes_per_token is not None:
        bf16 = float(inp.explicit_kv_bytes_per_token)
        return bf16, bf16 / 2
    s = inp.shape
    if s.knows_kv_size:
        return float(s.kv_bytes_per_token(2)), float(s.kv_bytes_per_token(1))
    return None, None


def _verdict(r: dict, inp: PreflightInputs) -> tuple[str, ...]:
    lines = []
    k, top_k = r["k"], inp.shape.top_k
    if k is None:
        return ("give --k or --vram-gb to analyse a K",)
    if k < top_k:
        lines.append(f"FAIL: K={k} < top_k={top_k}: one token cannot fit its experts")
    if r["k_fit"] is not None and inp.k is not None and inp.k > r["k_fit"]:
        lines.append(f"FAIL: K={inp.k} does not fit the memory budget (fits {r['k_fit']})")
    if r["batch_cap"] is not None and r["batch_cap"] < inp.concurrency:
        lines.append(
            f"WARN: K // top_k = {r['batch_cap']} < concurrency {inp.concurrency}: decode steps need several"
            f" waves unless requests share experts (need K >= {r['min_k_for_concurrency']})"
        )
    if r["pinned_cap_bytes"] is not None and r["pinned_host_bytes"] > r["pinned_cap_bytes"]:
        cap = "half of RAM (WSL2)" if inp.wsl2 else "RAM"
        lines.append(f"FAIL: pinned host experts {r['pinned_host_bytes'] / GB_BYTES:.1f} GB exceed {cap}")
    if r["reuse_implied"] is True:
        lines.append(
            f"OK: {inp.tok_per_s} tok/s allows at most {r['max_miss_allowed']:.1%} misses, below 0.8 x random"
            f" {r['random_miss']:.1%}: proves expert reuse between tokens"
        )
    elif r["reuse_implied"] is False:
        lines.append(
            f"INFO: {inp.tok_per_s} tok/s allows up to {r['max_miss_allowed']:.1%} misses vs random"
            f" {r['random_miss']:.1%}: the speed alone does not prove reuse"
        )
    if not any(line.startswith(("FAIL", "WARN")) for line in lines):
        lines.insert(0, f"OK: K={k} serves {r['batch_cap']} request(s) per wave")
    return tuple(lines)


def _format_report(
    fmt: str, expert_size_bytes: float, inp: PreflightInputs, kv_bf16, kv_fp8, non_expert
) -> FormatReport:
    s = inp.shape
    slot = slot_bytes(expert_size_bytes, s.num_moe_layers)
    if fmt == "fp8" and inp.explicit_non_expert_bytes is None and non_expert is not None:
        non_expert = float(s.non_expert_weight_bytes(inp.non_expert_dtype_bytes, fp8_attention=True))
    k_fit = None
    if inp.vram_bytes is not None and non_expert is not None and kv_bf16 is not None:
        kv_token = kv_bf16 if inp.kv_dtype == "bf16" else kv_fp8
        budget = MemoryBudget(
            vram_bytes=inp.vram_bytes,
            mem_fraction_static=inp.mem_fraction_static,
            non_expert_weight_bytes=non_expert,
            kv_bytes=inp.kv_capacity_tokens * kv_token,
            overhead_bytes=inp.overhead_bytes,
        )
        k_fit = k_that_fits(budget, slot, s.num_experts)
    k = inp.k if inp.k is not None else k_fit
    all_miss = all_miss_bytes_per_token(s.num_moe_layers, s.top_k, expert_size_bytes)
    r: dict = {
        "format": fmt,
        "expert_bytes": float(expert_size_bytes),
        "slot_bytes": slot,
        "non_expert_weight_bytes": non_expert,
        "kv_tokens_per_slot_bf16": kv_tokens_per_slot(slot, kv_bf16) if kv_bf16 else None,
        "kv_tokens_per_slot_fp8": kv_tokens_per_slot(slot, kv_fp8) if kv_fp8 else None,
        "k_fit": k_fit,
        "k": k,
        "batch_cap": batch_cap(k, s.top_k) if k is not None else None,
        "min_k_for_concurrency": min_k_for_concurrency(inp.concurrency, s.top_k),
        "pinned_host_bytes": pinned_host_bytes(s.num_experts, s.num_moe_layers, expert_size_bytes),
        "pinned_cap_bytes": pinned_cap_bytes(inp.ram_bytes, inp.wsl2) if inp.ram_bytes else None,
        "all_miss_bytes_per_token": all_miss,
        "prefill_page_in_bytes": None,
        "prefill_page_in_floor_s": None,
        "random_miss": None,
        "max_miss_allowed": None,
        "reuse_implied": None,
    }
    if k is not None:
        r["prefill_page_in_bytes"] = prefill_page_in_bytes(k, s.num_experts, slot)
        r["random_miss"] = random_miss(k, s.num_experts)
        if inp.link_b_per_s:
            r["prefill_page_in_floor_s"] = transfer_time_s(r["prefill_page_in_bytes"], inp.link_b_per_s)
            if inp.tok_per_s:
                r["max_miss_allowed"] = max_miss_allowed(inp.link_b_per_s, inp.tok_per_s, all_miss)
                r["reuse_implied"] = reuse_implied(r["max_miss_allowed"], r["random_miss"])
    return FormatReport(**r, verdict=_verdict(r, inp))


def preflight(inp: PreflightInputs) -> PreflightReport:
    s = inp.shape
    kv_bf16, kv_fp8 = _kv_per_token(inp)
    non_expert = float(s.non_expert_weight_bytes(inp.non_expert_dtype_bytes)) if s.has_dims and s.vocab_size else None
    if inp.explicit_non_expert_bytes is not None:
        non_expert = float(inp.explicit_non_expert_bytes)
    if inp.vram_bytes is not None:  # a memory budget is never dropped silently for want of a term
        missing = [
            flag
            for flag, value in (("--kv-bytes-per-token", kv_bf16), ("--non-expert-gb", non_expert))
            if value is None
        ]
        if missing:
            raise UserError(
                f"--vram-gb needs the KV bytes per token and the non-expert weight bytes: give --model, or "
                f"{' and '.join(missing)} with the explicit shape"
            )
    if inp.explicit_expert_bytes is not None:
        sizes = {"explicit": float(inp.explicit_expert_bytes)}
    else:
        by_format = expert_bytes_by_format(s)
        unknown = [f for f in inp.formats if f not in by_format]
        if unknown:
            raise UserError(f"cannot size formats {unknown}: give --model or --expert-mb")
        sizes = {f: float(by_format[f]) for f in inp.formats}
    reports = tuple(_format_report(f, b, inp, kv_bf16, kv_fp8, non_expert) for f, b in sizes.items())
    return PreflightReport(
        model=s.name,
        num_layers=s.num_layers,
        num_moe_layers=s.num_moe_layers,
        num_experts=s.num_experts,
        top_k=s.top_k,
        kv_bytes_per_token_bf16=kv_bf16,
        kv_bytes_per_token_fp8=kv_fp8,
        non_expert_weight_bytes=non_expert,
        link_b_per_s=inp.link_b_per_s,
        link_source=inp.link_source,
        tok_per_s=inp.tok_per_s,
        concurrency=inp.concurrency,
        formats=reports,
    )
