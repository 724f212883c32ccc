"""Table builders: result frames in, pandas frames of exact numbers out (rendering to HTML,
markdown and CSV is textout's and html's business).

Every table keeps the cell ids its numbers come from, so any figure can be traced back to the raw
rows. Ratios compare repeats and carry a verdict from benchsuite.report.stats: the ratio of geometric means
over ok repeats with its 95% interval, "significant" when that interval excludes 1, "not enough
repeats" when a side has fewer than stats.MIN_REPEATS ok repeats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from benchsuite.engines import traits_of
from benchsuite.engines.base import FIRST_SEARCH_OPTION
from benchsuite.report import stats
from benchsuite.report.budget import over_budget
from benchsuite.report.groups import Spread, is_synthetic, routing_label
from benchsuite.report.noise import busy_cells, load_text

LONG_PROMPT_PREFERENCE = "2048"
SIGNIFICANT = stats.SIGNIFICANT
NOT_SIGNIFICANT = stats.NOT_SIGNIFICANT
SPREAD_UNKNOWN = stats.NOT_ENOUGH
# Aggregate output tok/s is the published metric with several requests; per-request decode tok/s single-stream.
SINGLE_STREAM_METRIC = "decode_tok_s_p50"
MULTI_STREAM_METRIC = "output_tok_s"


def headline_metric(concurrency: int) -> str:
    return SINGLE_STREAM_METRIC if int(concurrency) == 1 else MULTI_STREAM_METRIC


def ratio_estimate(numerator: Spread, denominator: Spread) -> stats.RatioEstimate | None:
    """numerator / denominator over repeats (benchsuite.report.stats); None with too few repeats."""
    return stats.ratio_estimate(numerator.values, denominator.values)


def ratio_verdict(numerator: Spread, denominator: Spread) -> str:
    """'significant [lo–hi]', 'not significant [lo–hi]' or 'not enough repeats (...)'."""
    estimate = ratio_estimate(numerator, denominator)
    if estimate is None:
        return stats.not_enough_text(len(numerator.values), len(denominator.values))
    return f"{estimate.verdict()} {estimate.interval_text()}"


def _batch_cap(k: Any, top_k: int | None) -> int | None:
    if top_k is None or k is None or (isinstance(k, float) and math.isnan(k)):
        return None
    return int(k) // top_k


def _spread_cols(prefix: str, spread: Spread | None, scale: float = 1.0) -> dict[str, float | None]:
    if spread is None:
        return {f"{prefix}_min": None, f"{prefix}_median": None, f"{prefix}_max": None}
    return {
        f"{prefix}_min": spread.min * scale,
        f"{prefix}_median": spread.median * scale,
        f"{prefix}_max": spread.max * scale,
    }


def summary_table(groups: pd.DataFrame, top_k: int | None) -> pd.DataFrame:
    """One row per configuration with the spread of its headline metrics over ok repeats."""
    rows = []
    for _, g in groups.iterrows():
        rows.append(
            {
                "configuration": g["label"],
                "run_id": g["run_id"],
                "engine": g["engine"],
                "mode": g["mode"],
                "routing": routing_label(g["routing"]),
                "workload": g["workload"],
                "prompt_class": g["prompt_class"],
                "concurrency": int(g["concurrency"]),
                "K": g["k"],
                "K_div_top_k": _batch_cap(g["k"], top_k),
                "repeats_ok": int(g["repeats_ok"]),
                "repeats_not_ok": int(g["repeats_not_ok"]),
                **_spread_cols("decode_tok_s", g["decode_tok_s_p50"]),
                # the engine's own decode rate where it reports one (llama.cpp, builtin timings): a cross-check of ours
                **_spread_cols("timings_decode_tok_s", g["timings_decode_tok_s_p50"]),
                # all streams: tokens after each first over the time any stream decoded (metrics.decode_agg_tok_s)
                **_spread_cols("decode_agg_tok_s", g["decode_agg_tok_s"]),
                **_spread_cols("output_tok_s", g["output_tok_s"]),
                **_spread_cols("ttft_p50_ms", g["ttft_p50_s"], 1000.0),
                "flags": " | ".join(g["flags"]),
                "cell_ids": " ".join(g["cell_ids"]),
            }
        )
    return pd.DataFrame(rows)


def failures_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Every failed or invalid cell with its reason."""
    bad = cells[cells["status"] != "ok"].sort_values(["label", "concurrency", "repeat"])
    return pd.DataFrame(
        {
            "cell_id": bad["cell_id"],
            "configuration": bad["label"],
            "workload": bad["workload"],
            "prompt_class": bad["prompt_class"],
            "concurrency": bad["concurrency"].astype(int),
            "repeat": bad["repeat"].astype(int),
            "status": bad["status"],
            "reason": bad["reason"].fillna("no reason recorded"),
        }
    ).reset_index(drop=True)


def best_config(candidates: pd.DataFrame, metric: str, lower_is_better: bool = False) -> pd.Series | None:
    """The best configuration by median, among those with enough repeats for an interval when any
    has them: a search's one-cell probe of a value (1 repeat) must not stand for a mode beside that
    value's full repeats and leave its comparison with "not enough repeats"."""
    scored = [(row[metric].median, row[metric].n, idx) for idx, row in candidates.iterrows() if row[metric] is not None]
    if not scored:
        return None
    enough = [s for s in scored if s[1] >= stats.MIN_REPEATS] or scored
    pick = min if lower_is_better else max
    return candidates.loc[pick(enough, key=lambda s: s[0])[2]]


def fits(row: pd.Series, cells: pd.DataFrame) -> bool:
    """A configuration counts (as a contender or a baseline) unless one of its cells says it does not
    fit: a llama.cpp search candidate its projection ruled out, or a measured device memory over the
    run's budget (report/budget.py)."""
    mine = cells[cells["cell_id"].isin(row["cell_ids"])]
    if any(e.get("fits") is False for e in mine["extras"]):
        return False
    return "budget_bytes" not in mine or over_budget(mine) is None


def baselines_for(groups: pd.DataFrame, cells: pd.DataFrame, paged: pd.Series) -> dict[str, pd.Series | None]:
    """The best offload, llama.cpp and cpu-experts configuration comparable with one paged configuration."""
    same_setup = groups[
        (groups["run_id"] == paged["run_id"])
        & (groups["workload"] == paged["workload"])
        & (groups["prompt_class"] == paged["prompt_class"])
        & (groups["concurrency"] == paged["concurrency"])
    ]
    same_engine = same_setup[
        (same_setup["engine_kind"] == paged["engine_kind"]) & (same_setup["routing"] == paged["routing"])
    ]
    baseline_kind = [traits_of(str(k)).is_cpu_expert_baseline for k in same_setup["engine_kind"]]
    llama = same_setup[baseline_kind] if len(same_setup) else same_setup
    llama = llama[[fits(row, cells) for _, row in llama.iterrows()]] if len(llama) else llama
    metric = headline_metric(paged["concurrency"])
    return {
        "offload": best_config(same_engine[same_engine["mode"] == "offload"], metric),
        "llamacpp_best": best_config(llama, metric),
        "cpu_experts_best": best_config(same_engine[same_engine["mode"] == "cpu-experts"], metric),
    }


def ratio_table(groups: pd.DataFrame, cells: pd.DataFrame) -> pd.DataFrame:
    """Published layout: per setup and concurrency, paged vs offload and vs llama.cpp best (and cpu-experts)."""
    rows = []
    paged_groups = groups[groups["mode"] == "paged"].sort_values(
        ["run_id", "workload", "prompt_class", "concurrency", "k"]
    )
    for _, paged in paged_groups.iterrows():
        metric = headline_metric(paged["concurrency"])
        spread = paged[metric]
        row: dict[str, Any] = {
            "setup": f"{paged['run_id']} · {paged['workload']} · {paged['prompt_class']}",
            "concurrency": int(paged["concurrency"]),
            "paged_config": paged["label"],
            "K": paged["k"],
            "metric": metric,
            "synthetic": is_synthetic(paged["routing"]),
            **_spread_cols("paged", spread),
        }
        ids = list(paged["cell_ids"])
        for name, base in baselines_for(groups, cells, paged).items():
            base_spread = None if base is None else base[metric]
            row[f"{name}_config"] = "not run" if base is None else base["label"]
            row.update(_spread_cols(name, base_spread))
            if spread is not None and base_spread is not None and base_spread.median > 0:
                estimate = ratio_estimate(spread, base_spread)
                row[f"paged_vs_{name}"] = spread.median / base_spread.median if estimate is None else estimate.ratio
                row[f"paged_vs_{name}_verdict"] = ratio_verdict(spread, base_spread)
            else:
                row[f"paged_vs_{name}"] = None
                row[f"paged_vs_{name}_verdict"] = "no ok measurement" if base is not None else "not run"
            if base is not None:
                ids.extend(base["cell_ids"])
        row["cell_ids"] = " ".join(ids)
        rows.append(row)
    return pd.DataFrame(rows)


def prompt_classes(groups: pd.DataFrame) -> tuple[str | None, str | None]:
    """(short class, long class): "short" (else the first non-numeric) and "2048" (else the longest numeric)."""
    classes = sorted({str(c) for c in groups["prompt_class"]})
    numeric = sorted((c for c in classes if c.isdigit()), key=int)
    short = "short" if "short" in classes else next((c for c in classes if not c.isdigit()), None)
    long = LONG_PROMPT_PREFERENCE if LONG_PROMPT_PREFERENCE in classes else (numeric[-1] if numeric else None)
    return short, long


def ttft_table(groups: pd.DataFrame) -> pd.DataFrame:
    """TTFT p50 (ms) for short and long prompts side by side, per configuration and concurrency."""
    short, long = prompt_classes(groups)
    rows = []
    keys = ["run_id", "engine", "engine_kind", "mode", "params_key", "workload", "concurrency", "routing"]
    for _, group in groups.groupby(keys, sort=True):
        by_class = {str(r["prompt_class"]): r for _, r in group.iterrows()}
        if short not in by_class and long not in by_class:
            continue
        first = group.iloc[0]
        row = {"configuration": first["label"], "workload": first["workload"], "concurrency": int(first["concurrency"])}
        ids: list[str] = []
        for name, cls in (("short", short), ("long", long)):
            g = by_class.get(cls) if cls is not None else None
            row[f"{name}_class"] = cls
            row.update(_spread_cols(f"ttft_{name}_ms", None if g is None else g["ttft_p50_s"], 1000.0))
            ids.extend([] if g is None else g["cell_ids"])
        row["cell_ids"] = " ".join(ids)
        rows.append(row)
    return pd.DataFrame(rows)


def paging_table(groups: pd.DataFrame, num_experts: int | None) -> pd.DataFrame:
    """Paging counters where reported: miss rate (with 1 - K/E), bytes paged per token, waves, union size."""
    counters = ["miss_rate", "bytes_paged_per_token", "waves_per_step", "union_mean"]
    rows = []
    for _, g in groups.iterrows():
        if all(g[c] is None for c in counters):
            continue
        k = g["k"]
        random_miss = None if num_experts is None or k is None or math.isnan(k) else 1.0 - float(k) / num_experts
        row = {
            "configuration": g["label"],
            "K": k,
            "concurrency": int(g["concurrency"]),
            "prompt_class": g["prompt_class"],
            "random_miss": random_miss,
        }
        for c in counters:
            row[c] = None if g[c] is None else g[c].median
        row["cell_ids"] = " ".join(g["ok_cell_ids"])
        rows.append(row)
    return pd.DataFrame(rows)


SEARCH_COLUMNS = [
    "run_id", "engine", "option", "workload", "prompt_class", "concurrency", "N", "fits", "chosen", "decode_tok_s",
    "projected_bytes", "peak_device_memory_bytes", "budget_bytes", "search_launches", "linear_scan_launches",
    "status", "reason", "cell_id",
]  # fmt: skip


def is_search_launch(extras: Mapping[str, Any]) -> bool:
    """A cell one launch of a budget search measured: its extras carry search_n (the searched value), fits
    or chosen (cells stored before search_n existed)."""
    return any(k in extras for k in ("search_n", "fits", "chosen"))


def search_table(cells: pd.DataFrame) -> pd.DataFrame:
    """The budget searches' launched candidates (llama.cpp n_cpu_moe, built-in resident_experts): cells
    whose extras carry search_n (the searched value, column N whatever the option), fits or chosen.
    `status` is the search's outcome where it stored one (`over budget`: measured peak over the budget)."""
    found = cells[[is_search_launch(e) for e in cells["extras"]]]
    rows = []
    for _, c in found.iterrows():
        extras = c["extras"]
        chosen = extras.get("chosen")
        n = extras.get("search_n", c["n_cpu_moe"])  # cells stored before search_n existed: their N
        n = None if n is None or (isinstance(n, float) and math.isnan(n)) else int(n)
        outcome = extras.get("search_outcome")
        rows.append(
            {
                "run_id": c["run_id"], "engine": c["engine"],
                "option": extras.get("search_option", FIRST_SEARCH_OPTION),
                "workload": c["workload"], "prompt_class": c["prompt_class"], "concurrency": int(c["concurrency"]),
                "N": n, "fits": extras.get("fits"),
                "chosen": bool(
                    chosen is True or (isinstance(chosen, int) and not isinstance(chosen, bool) and chosen == n)
                ),
                "decode_tok_s": c["decode_tok_s_p50"], "projected_bytes": extras.get("projected_bytes"),
                "peak_device_memory_bytes": c.get("peak_device_memory_bytes"),
                "budget_bytes": extras.get("budget_bytes"), "search_launches": extras.get("search_launches"),
                "linear_scan_launches": extras.get("linear_scan_launches"),
                "status": outcome if outcome == "over budget" else c["status"], "reason": c["reason"],
                "cell_id": c["cell_id"],
            }
        )  # fmt: skip
    return (
        pd.DataFrame(rows, columns=SEARCH_COLUMNS)
        .sort_values(["run_id", "engine", "concurrency", "N"])
        .reset_index(drop=True)
    )


RAW_COLUMNS: tuple[str, ...] = (
    "cell_id",
    "run_id",
    "engine",
    "engine_kind",
    "mode",
    "params",
    "workload",
    "prompt_class",
    "concurrency",
    "repeat",
    "status",
    "reason",
    "routing",
    "num_requests",
    "num_errors",
    "decode_tok_s_p50",
    "timings_decode_tok_s_p50",
    "engine_timings_ratio_p50",
    "engine_timings_outside",
    "decode_agg_tok_s",
    "output_tok_s",
    "ttft_p50_s",
    "ttft_text_p50_s",
    "ttft_p90_s",
    "tpot_p50_s",
    "itl_p50_s",
    "itl_per_token_p50_s",
    "tokens_per_chunk_mean",
    "coalesced_gaps",
    "untimed_requests",
    "ttft_late_requests",
    "miss_rate",
    "bytes_paged_per_token",
    "waves_per_step",
    "union_mean",
    "usage_mismatches",
)


def raw_cells_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Every cell as stored, the table every figure links to; `machine`: its load, clock and busy flag."""
    busy = busy_cells(cells)
    out = cells.sort_values(["run_id", "engine", "mode", "prompt_class", "concurrency", "repeat"])[
        list(RAW_COLUMNS)
    ].copy()
    out["params"] = [", ".join(f"{k}={v}" for k, v in sorted(p.items())) or "none" for p in out["params"]]
    ordered = cells.loc[out.index]
    out["machine"] = [
        ("BUSY: " if i in busy else "") + load_text(e) for i, e in zip(ordered["cell_id"], ordered["extras"])
    ]
    return out.reset_index(drop=True)
