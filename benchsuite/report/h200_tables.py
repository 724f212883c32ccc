"""The H200 tables: a results run converted from the H200 benchmark JSONs (benchmarks/h200_report.py)
in, pandas frames of exact numbers out. They read only the stored run: the cells frame (whose
extras keep every key each benchmark wrote, under extras["bench"]) and manifest["h200"].

A grid value is the median aggregate tok/s over a configuration's ok cells; a configuration with
no ok cell reads "FAILED: <reason>", one never measured "not run". Nothing absent is written as 0.
Targets, and where each comes from:
- roofline fraction >= 0.9: DESIGN.md section 5 (a page-in path should reach 90% of the link);
- resident >= 250 tok/s at batch 1: the H200 issue's target for the unpaged reference;
- paged vs offload at batch 1: the published PR #42557 ratio, read from the shipped reference.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import pandas as pd

from benchsuite.reference import load_reference

ROOFLINE_TARGET_FRACTION = 0.9
RESIDENT_TARGET_TOK_S_B1 = 250.0
EQUAL_BUDGET_K = 32  # bf16 slots of K=32 plus the non-expert weights are about 16 GB, llama.cpp's fit budget
GB = 10**9  # llama.cpp_h200's fit budget is decimal GB (like the matrix's vram_budget_gb)
DECODE_WORKLOAD = "decode"
REQUIRED_COLUMNS: tuple[str, ...] = (
    "resident", "paged K=16", "paged K=32", "paged K=64", "paged K=92", "offload",
    "cpu-experts N=12", "cpu-experts N=24", "cpu-experts N=48",
    "llama.cpp N=0", "llama.cpp N=12", "llama.cpp N=24", "llama.cpp N=48", "llama.cpp fitted",
)
REQUIRED_BATCHES = (1, 4)
SERVE_CONFIGS = ("resident", "paged32", "paged64", "offload")  # benchmarks/h200_suite.sh SERVE=1
NOT_RUN = "not run"


def bench(cell: pd.Series) -> dict[str, Any]:
    return cell["extras"].get("bench") or {}


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(float(value)):
        return None
    return float(value)


def column_of(cell: pd.Series) -> str:
    """Grid column of a decode or llama.cpp cell: 'paged K=32', 'llama.cpp N=12', plus ' [variant]'."""
    p = cell["params"]
    if cell["engine_kind"] == "llamacpp":
        base = "llama.cpp fitted" if "fit_budget_gb" in p else f"llama.cpp N={p.get('n_cpu_moe')}"
    elif cell["mode"] == "paged":
        base = f"paged K={p.get('resident_experts')}"
    elif cell["mode"] == "cpu-experts":
        base = f"cpu-experts N={p.get('cpu_expert_layers')}"
    else:
        base = str(cell["mode"])
    return f"{base} [{p['variant']}]" if p.get("variant") else base


def routing_text(routing: str) -> str:
    if routing.startswith("synthetic:"):
        return f"SYNTHETIC {routing.split(':', 1)[1]} (calibrated)"
    return "model (random-weight router, near-uniform)"


def _routings(cells: pd.DataFrame) -> list[str]:
    return sorted(set(cells["routing"]), key=lambda r: (r != "model", r))


def outcome(group: pd.DataFrame, metric: str = "output_tok_s") -> float | str:
    """Median of metric over ok cells; else 'FAILED: reason' for the first failed one; else 'not run'."""
    ok = [v for v in (_num(x) for x in group.loc[group["status"] == "ok", metric]) if v is not None]
    if ok:
        return statistics.median(ok)
    bad = group[group["status"] != "ok"]
    if len(bad):
        return f"FAILED: {bad.iloc[0]['reason'] or 'no reason recorded'}"
    return NOT_RUN


def _decode_cells(cells: pd.DataFrame) -> pd.DataFrame:
    out = cells[cells["workload"] == DECODE_WORKLOAD].copy()
    out["column"] = [column_of(c) for _, c in out.iterrows()]
    return out


def _base(column: str) -> str:
    return column.split(" [", 1)[0]


def _column_order(columns: set[str]) -> list[str]:
    def key(col: str) -> tuple[int, str]:
        return (REQUIRED_COLUMNS.index(_base(col)) if _base(col) in REQUIRED_COLUMNS else len(REQUIRED_COLUMNS), col)

    return sorted(set(REQUIRED_COLUMNS) | columns, key=key)


def _outcomes(decode: pd.DataFrame) -> dict[tuple[str, int, str], tuple[float | str, list[str]]]:
    """(routing, batch, column) -> (outcome, cell ids) of each configuration."""
    out = {}
    for (routing, batch, column), group in decode.groupby(["routing", "concurrency", "column"], sort=True):
        out[(str(routing), int(batch), str(column))] = (outcome(group), list(group["cell_id"]))
    return out


def _best(values: list[float | str]) -> float | str:
    """The fastest ok value; else the first failure; else not run."""
    numbers = [v for v in values if isinstance(v, float)]
    if numbers:
        return max(numbers)
    return next((v for v in values if v != NOT_RUN), NOT_RUN)


def _grids(cells: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(best-variant grid, per-variant grid): aggregate tok/s per routing source and batch."""
    decode = _decode_cells(cells)
    outcomes = _outcomes(decode)
    has_llama = bool((decode["engine_kind"] == "llamacpp").any())
    columns = _column_order(set(decode["column"]))
    bases = list(dict.fromkeys(_base(c) for c in columns))
    batches = sorted(set(REQUIRED_BATCHES) | {int(b) for b in decode["concurrency"]})
    best_rows, variant_rows = [], []
    for routing in _routings(decode[decode["engine_kind"] != "llamacpp"]) or ["model"]:
        for batch in batches:
            def value(column: str, routing: str = routing, batch: int = batch) -> float | str:
                if column.startswith("llama.cpp") and routing != "model":  # llama.cpp cells are all model routing
                    return "n/a: own router" if has_llama else NOT_RUN
                return outcomes.get((routing, batch, column), (NOT_RUN, []))[0]

            ids = [i for (r, b, _), (_, found) in outcomes.items() if b == batch and r == routing for i in found]
            head = {"routing": routing_text(routing), "batch": batch}
            variant_rows.append({**head, **{c: value(c) for c in columns}, "cell_ids": " ".join(ids)})
            best: dict[str, float | str] = {}
            chosen = []
            for base in bases:
                mine = [c for c in columns if _base(c) == base]
                best[base] = _best([value(c) for c in mine])
                winner = next((c for c in mine if isinstance(best[base], float) and value(c) == best[base]), base)
                if winner != base:
                    chosen.append(f"{base}: {winner.split(' [', 1)[1][:-1]}")
            fitted = decode[(decode["column"] == "llama.cpp fitted") & (decode["concurrency"] == batch) & (decode["routing"] == routing)]
            best_rows.append({**head, **best, "llama.cpp fitted N": fitted.iloc[0]["params"].get("n_cpu_moe") if len(fitted) else None,
                              "best_variant": "; ".join(chosen) or "default everywhere", "cell_ids": " ".join(ids)})
    best_frame = pd.DataFrame(best_rows)
    best_frame["llama.cpp fitted N"] = pd.Series([r["llama.cpp fitted N"] for r in best_rows], dtype=object)  # 30, not 30.0
    return best_frame, pd.DataFrame(variant_rows)


def tok_s_grid(cells: pd.DataFrame) -> pd.DataFrame:
    """Per routing source and batch, each mode's fastest variant (the required columns always present)."""
    return _grids(cells)[0]


def tok_s_variant_grid(cells: pd.DataFrame) -> pd.DataFrame:
    """The same rows with one column per variant, e.g. 'paged K=32 [graphs+overlap]'."""
    return _grids(cells)[1]


def _per_cell(cells: pd.DataFrame, mode: str) -> pd.DataFrame:
    decode = _decode_cells(cells)
    return decode[(decode["mode"] == mode) & (decode["engine_kind"] == "builtin")].sort_values(["routing", "concurrency", "column"])


def _meets(value: float | None, target: float | None, missing: str) -> str:
    if target is None:
        return "no target"
    return missing if value is None else ("yes" if value >= target else "no")


def roofline_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Every paged decode cell against its roofline max(resident step, misses x expert bytes / link rate)."""
    rows = []
    for _, c in _per_cell(cells, "paged").iterrows():
        b = bench(c)
        fraction = _num(b.get("roofline_fraction"))
        rows.append({
            "routing": routing_text(c["routing"]), "batch": int(c["concurrency"]), "configuration": c["column"], "status": c["status"],
            "tok_per_s": c["output_tok_s"], "ms_per_step": b.get("ms_per_step"),
            "roofline_step_ms": None if _num(b.get("roofline_step_s")) is None else b["roofline_step_s"] * 1e3,
            "link_step_ms": None if _num(b.get("roofline_link_step_s")) is None else b["roofline_link_step_s"] * 1e3,
            "misses_per_token": b.get("misses_per_token"), "hit_rate": b.get("hit_rate"), "roofline_fraction": fraction,
            # runs since the prefetch variant: the no-overlap bound, what prefetch paged, where the misses came from
            "serial_fraction": b.get("serial_fraction"), "prefetched_per_step": b.get("prefetched_per_step"),
            "prefetch_accuracy": b.get("prefetch_accuracy"), "misses_source": b.get("roofline_misses_source"),
            "target_fraction": ROOFLINE_TARGET_FRACTION,
            "meets_target": "failed" if c["status"] != "ok" else _meets(fraction, ROOFLINE_TARGET_FRACTION, "not computed (no link rate or resident step)"),
            "reason": c["reason"], "cell_id": c["cell_id"],
        })
    return pd.DataFrame(rows)


def resident_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Every resident decode cell against the HBM bound (weights touched per step / device copy rate)."""
    rows = []
    for _, c in _per_cell(cells, "resident").iterrows():
        b = bench(c)
        target = RESIDENT_TARGET_TOK_S_B1 if int(c["concurrency"]) == 1 else None
        tok_s = _num(c["output_tok_s"]) if c["status"] == "ok" else None
        rows.append({
            "routing": routing_text(c["routing"]), "batch": int(c["concurrency"]), "configuration": c["column"], "status": c["status"],
            "tok_per_s": tok_s, "ms_per_step": b.get("ms_per_step"), "hbm_bound_tok_per_s": b.get("hbm_bound_tok_per_s"),
            "hbm_fraction": b.get("hbm_fraction"), "target_tok_per_s": target,
            "meets_target": "failed" if c["status"] != "ok" else _meets(tok_s, target, "not measured"),
            "reason": c["reason"], "cell_id": c["cell_id"],
        })
    return pd.DataFrame(rows)


def published_offload_ratio() -> tuple[float | None, str]:
    """PR #42557's headline single-stream paged / offload ratio (its first single-stream row, about 12x)
    and the row it comes from, the other published single-stream ratios named beside it."""
    rows = [r for r in load_reference("pr42557").decode if r.concurrency == 1 and r.paged_vs_offload is not None]
    if not rows:
        return None, "no published single-stream offload figure"
    head = rows[0]
    others = ", ".join(f"{r.paged_vs_offload:.1f}x ({r.machine} {r.quant} K={r.resident_experts})" for r in rows[1:])
    text = f"pr42557 {head.machine} {head.quant} K={head.resident_experts}: {head.paged_tok_s:g} / {head.offload_tok_s:g} tok/s"
    return head.paged_vs_offload, text + (f"; other published: {others}" if others else "")


def _best_ok(group: pd.DataFrame) -> pd.Series | None:
    ok = group[(group["status"] == "ok") & group["output_tok_s"].notna()]
    return None if ok.empty else ok.loc[ok["output_tok_s"].astype(float).idxmax()]


def paged_vs_offload_table(cells: pd.DataFrame) -> pd.DataFrame:
    """At batch 1, per routing source: each paged configuration / the best offload configuration."""
    target, _ = published_offload_ratio()
    decode = _decode_cells(cells)
    decode = decode[(decode["concurrency"] == 1) & (decode["engine_kind"] == "builtin")]
    rows = []
    for routing in _routings(decode):
        here = decode[decode["routing"] == routing]
        offload = _best_ok(here[here["mode"] == "offload"])
        for column, paged in here[here["mode"] == "paged"].groupby("column", sort=True):
            value = outcome(paged)
            ratio = value / offload["output_tok_s"] if isinstance(value, float) and offload is not None else None
            rows.append({
                "routing": routing_text(routing), "paged_config": column, "paged_tok_per_s": value,
                "offload_config": NOT_RUN if offload is None else offload["column"],
                "offload_tok_per_s": outcome(here[here["mode"] == "offload"]),
                "paged_vs_offload": ratio, "published_paged_vs_offload": target,
                "meets_published": _meets(ratio, target, "no ratio (a side failed or was not run)"),
                "cell_ids": " ".join([*paged["cell_id"], *([] if offload is None else [offload["cell_id"]])]),
            })
    return pd.DataFrame(rows)


def _gb(value: Any) -> float | None:
    number = _num(value)
    return None if number is None else number / GB


def _paged_memory_gb(cell: pd.Series, h200: dict[str, Any]) -> tuple[float | None, str]:
    """Measured GPU peak when the benchmark wrote one, else slot arithmetic (weights only)."""
    b = bench(cell)
    if _num(b.get("gpu_mem_peak_bytes")) is not None:
        return _gb(b["gpu_mem_peak_bytes"]), "measured: gpu_mem_peak_bytes (decode_h200: torch allocator peak, CUDA context not included)"
    sizes = (h200.get("decode") or {}).get("bytes") or {}
    expert, dense, layers = _num(sizes.get("expert")), _num(sizes.get("dense_touched_per_step")), _num(b.get("layers"))
    if expert is None or dense is None or layers is None:
        return None, "not measured, no sizes to estimate from"
    k = cell["params"].get("resident_experts")
    return (k * layers * expert + dense) / GB, "estimate: K x layers x expert bytes + non-expert weights (no KV, no activations)"


def _within_budget(cell: pd.Series, budget_gb: float | None) -> bool:
    if "fit_budget_gb" in cell["params"]:
        return True  # llama.cpp's own memory projection chose this N for the budget
    used = _gb(bench(cell).get("gpu_mem_bytes"))
    return used is not None and budget_gb is not None and used <= budget_gb


def _measured_within(cell: pd.Series, budget_gb: float | None, h200: dict[str, Any]) -> bool:
    mem, source = _paged_memory_gb(cell, h200)
    return budget_gb is not None and mem is not None and source.startswith("measured") and mem <= budget_gb


def _best_paged_within(paged: pd.DataFrame, budget_gb: float | None, h200: dict[str, Any]) -> pd.Series | None:
    fits = [_measured_within(c, budget_gb, h200) for _, c in paged.iterrows()]
    best = _best_ok(paged[fits]) if any(fits) else None
    if best is not None:
        return best
    return _best_ok(paged[paged["params"].map(lambda p: p.get("resident_experts") == EQUAL_BUDGET_K).astype(bool)])


def equal_budget_table(cells: pd.DataFrame, h200: dict[str, Any]) -> pd.DataFrame:
    """Per routing source and batch: the fastest paged cell whose measured GPU memory fits llama.cpp's
    fit budget (else paged K=32, flagged over budget) against llama.cpp's best within it, whichever wins."""
    llama_meta = h200.get("llamacpp") or {}
    budget_gb = _num((llama_meta.get("fit") or {}).get("budget_gb"))
    expert_type = (llama_meta.get("gguf") or {}).get("expert_type")
    llama_expert, bf16_expert = _num((llama_meta.get("gguf") or {}).get("expert_bytes")), _num(((h200.get("decode") or {}).get("bytes") or {}).get("expert"))
    quant_note = ""
    if expert_type:
        sizes = (f" ({llama_expert:.0f} bytes per expert vs {bf16_expert:.0f} bf16: {llama_expert / bf16_expert:.2f}x)"
                 if llama_expert and bf16_expert else "")
        quant_note = f"llama.cpp's experts are {expert_type}{sizes}; the paged runtime's are bf16. "
    decode = _decode_cells(cells)
    builtin, llama = decode[decode["engine_kind"] == "builtin"], decode[decode["engine_kind"] == "llamacpp"]
    rows = []
    for routing in _routings(builtin):
        for batch in sorted(set(REQUIRED_BATCHES) | {int(b) for b in builtin["concurrency"]}):
            paged = builtin[(builtin["routing"] == routing) & (builtin["concurrency"] == batch) & (builtin["mode"] == "paged")]
            best_paged = _best_paged_within(paged, budget_gb, h200)
            mem, mem_source = _paged_memory_gb(best_paged, h200) if best_paged is not None else (None, "")
            mine = llama[llama["concurrency"] == batch]
            within = [_within_budget(c, budget_gb) for _, c in mine.iterrows()]
            best_llama = _best_ok(mine[within]) if len(mine) else None
            excluded = [c["column"] for (_, c), ok in zip(mine.iterrows(), within) if not ok]
            ratio = best_paged["output_tok_s"] / best_llama["output_tok_s"] if best_paged is not None and best_llama is not None else None
            winner = "no comparison (a side failed or was not run)" if ratio is None else (
                f"paged faster ({ratio:.2f}x)" if ratio > 1 else f"llama.cpp faster ({1 / ratio:.2f}x)")
            caveat = "" if routing == "model" else "llama.cpp ran its own (near-uniform) router, not this routing source. "
            rows.append({
                "routing": routing_text(routing), "batch": batch,
                "paged_config": outcome(paged) if best_paged is None else best_paged["column"],
                "paged_tok_per_s": None if best_paged is None else best_paged["output_tok_s"],
                "paged_gpu_gb": mem, "paged_gpu_memory_source": mem_source or "—",
                "paged_within_budget": "unknown" if mem is None or budget_gb is None else ("yes" if mem <= budget_gb else "no"),
                "budget_gb": budget_gb,
                "llamacpp_config": (NOT_RUN if mine.empty else "none within budget") if best_llama is None else best_llama["column"],
                "llamacpp_n_cpu_moe": None if best_llama is None else best_llama["params"].get("n_cpu_moe"),
                "llamacpp_tok_per_s": None if best_llama is None else best_llama["output_tok_s"],
                "llamacpp_gpu_gb": None if best_llama is None else _gb(bench(best_llama).get("gpu_mem_bytes")),
                "paged_vs_llamacpp": ratio, "winner": winner,
                "note": (quant_note + caveat + (f"Not counted (GPU memory over budget or not recorded): {', '.join(excluded)}." if excluded else "")).strip(),
                "cell_ids": " ".join([*paged["cell_id"], *mine["cell_id"]]),
            })
    return pd.DataFrame(rows)


def serve_table(cells: pd.DataFrame) -> pd.DataFrame:
    """The built-in server over HTTP, per config and concurrency; configs the suite runs but that are absent say so."""
    serve = cells[cells["workload"] == "serve_decode"]
    names = list(SERVE_CONFIGS) + sorted({str(e.get("config_name")) for e in serve["extras"]} - set(SERVE_CONFIGS))
    rows = []
    for name in names:
        mine = serve[serve["extras"].map(lambda e, n=name: e.get("config_name") == n).astype(bool)]
        for concurrency in sorted(set(REQUIRED_BATCHES) | {int(x) for x in mine["concurrency"]}):
            here = mine[mine["concurrency"] == concurrency]
            if here.empty:
                rows.append({"config": name, "concurrency": concurrency, "status": NOT_RUN, "reason": f"no serve_{name}.json given"})
                continue
            c = here.iloc[0]
            b = bench(c)
            rows.append({
                "config": name, "concurrency": concurrency, "status": c["status"], "routing": routing_text(c["routing"]),
                "decode_tok_s_aggregate": b.get("decode_tok_s_aggregate_median"), "decode_tok_s_per_stream": c["decode_tok_s_p50"],
                "output_tok_s_wall": c["output_tok_s"], "ttft_p50_ms": None if _num(c["ttft_p50_s"]) is None else c["ttft_p50_s"] * 1e3,
                "hit_rate": b.get("hit_rate"), "rounds": b.get("rounds"), "reason": c["reason"], "cell_id": c["cell_id"],
            })
    return pd.DataFrame(rows, columns=list(_SERVE_COLUMNS))


_SERVE_COLUMNS = ("config", "concurrency", "status", "routing", "decode_tok_s_aggregate", "decode_tok_s_per_stream", "output_tok_s_wall",
                  "ttft_p50_ms", "hit_rate", "rounds", "reason", "cell_id")
