"""Repeats of one configuration folded into one row with their spread, and the labels every
table and figure shares.

A configuration is a cell spec without its repeat: (run, engine, kind, mode, params, workload,
prompt class, concurrency, routing). Only `ok` cells enter a spread; failed and invalid repeats
are counted beside it, never averaged in as zeros. K (resident experts) and N (--n-cpu-moe) are
the cell's own typed fields (CellResult.resident_experts / n_cpu_moe, from the server's options).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from benchsuite.engines import adapter_of
from benchsuite.report.flags import cell_flags
from paged_experts.routing.specs import is_calibrated as calibrated_preset

GROUP_KEYS: tuple[str, ...] = (
    "run_id",
    "engine",
    "engine_kind",
    "mode",
    "params_key",
    "workload",
    "prompt_class",
    "concurrency",
    "routing",
)
METRICS: tuple[str, ...] = (
    "decode_tok_s_p50",
    "timings_decode_tok_s_p50",
    "decode_agg_tok_s",
    "output_tok_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "tpot_p50_s",
    "itl_p50_s",
    "miss_rate",
    "bytes_paged_per_token",
    "waves_per_step",
    "union_mean",
)
# params that already show N (the runner, the search, the H200 converter)
_N_PARAMS = ("n_cpu_moe", "search_n", "cpu_expert_layers")


@dataclass(frozen=True)
class Spread:
    """min / median / max of one metric over a configuration's ok repeats, and the repeat values
    themselves (sorted) for the intervals of benchsuite.report.stats."""

    min: float
    median: float
    max: float
    n: int
    values: tuple[float, ...] = field(default=(), compare=False)

    @staticmethod
    def of(values: list[float]) -> Spread | None:
        clean = sorted(float(v) for v in values if v is not None and not math.isnan(float(v)))
        if not clean:
            return None
        return Spread(clean[0], float(pd.Series(clean).median()), clean[-1], len(clean), tuple(clean))

    def overlaps(self, other: Spread) -> bool:
        return self.min <= other.max and other.min <= self.max


def params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def params_label(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "defaults"


def is_synthetic(routing: str) -> bool:
    return str(routing).startswith("synthetic")


def synthetic_spec(routing: str) -> str:
    """`synthetic:qwen3-30b-a3b` -> `qwen3-30b-a3b` (the spec as the matrix wrote it)."""
    return routing.split(":", 1)[1] if ":" in routing else routing


def is_calibrated(routing: str) -> bool:
    """A synthetic routing calibrated to a trained model's measured routing (a preset), not a hand-set
    uniform, Zipf or reuse process."""
    return is_synthetic(routing) and calibrated_preset(synthetic_spec(str(routing)))


def routing_label(routing: str) -> str:
    if not is_synthetic(routing):
        return "model routing"
    return f"SYNTHETIC routing ({synthetic_spec(routing)})"


def config_label(row: pd.Series, many_runs: bool) -> str:
    # An engine entry named after its mode (quickstart: engines "paged", "offload") is named once.
    parts = [str(row["engine"])] if str(row["engine"]) == str(row["mode"]) else [str(row["engine"]), str(row["mode"])]
    parts.append(params_label(row["params"]))
    if many_runs:
        parts.insert(0, str(row["run_id"]))
    label = " · ".join(parts)
    return f"{label} · {routing_label(row['routing'])}" if is_synthetic(row["routing"]) else label


def _ints(values: pd.Series) -> pd.Series:
    """object dtype: ints stay ints and absent values None (a float column would print K=8.0, K=nan)."""
    return pd.Series([None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v) for v in values],
                     index=values.index, dtype=object)  # fmt: skip


def annotate_cells(cells: pd.DataFrame, many_runs: bool) -> pd.DataFrame:
    """Cells with params_key, label and the K (`k`) and N (`n_cpu_moe`) columns of their typed fields."""
    out = cells.copy()
    out["k"] = _ints(out["resident_experts"])
    out["n_cpu_moe"] = _ints(out["n_cpu_moe"])
    placed = zip(out["params"], out["k"], out["n_cpu_moe"], out["options"], out["engine_kind"])
    out["params"] = [effective_params(p, k, n, _label_options(kind, o)) for p, k, n, o, kind in placed]
    out["params_key"] = [params_key(p) for p in out["params"]]
    out["label"] = [config_label(row, many_runs) for _, row in out.iterrows()]
    return out


def _label_options(kind: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The fixed options the server's engine names its configurations by (the amount offloaded)."""
    adapter = adapter_of(str(kind))
    return adapter.recorded_label_options(options) if adapter is not None else {}


def effective_params(
    params: dict[str, Any], k: int | None, n: int | None, label_options: dict[str, Any]
) -> dict[str, Any]:
    """Sweep params plus K, N and the offload amount when params do not name them, so configurations
    that differ only in a fixed option (e.g. each --n-cpu-moe of a search) stay apart and say what they ran."""
    out = dict(params)
    for key, value in label_options.items():
        if key not in params:
            out[key] = value
    if k is not None and "resident_experts" not in params:
        out["K"] = k
    if n is not None and not set(_N_PARAMS) & set(params):
        out["n_cpu_moe"] = n
    return out


def group_configs(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: labels, K / N, cell ids, ok / not-ok counts, flags, a Spread per metric."""
    rows = []
    for key, group in cells.groupby(list(GROUP_KEYS), sort=True, dropna=False):
        ok = group[group["status"] == "ok"]
        row: dict[str, Any] = dict(zip(GROUP_KEYS, key))
        first = group.iloc[0]
        row.update(
            label=first["label"],
            params=first["params"],
            k=first["k"],
            n_cpu_moe=first["n_cpu_moe"],
            cell_ids=list(group.sort_values("repeat")["cell_id"]),
            ok_cell_ids=list(ok.sort_values("repeat")["cell_id"]),
            repeats_ok=len(ok),
            repeats_not_ok=len(group) - len(ok),
            flags=list(dict.fromkeys(f for _, c in group.iterrows() for f in cell_flags(c))),
        )
        for metric in METRICS:
            row[metric] = Spread.of(list(ok[metric].dropna())) if metric in ok else None
        rows.append(row)
    frame = pd.DataFrame(
        rows,
        columns=[
            *GROUP_KEYS,
            "label",
            "params",
            "k",
            "n_cpu_moe",
            "cell_ids",
            "ok_cell_ids",
            "repeats_ok",
            "repeats_not_ok",
            "flags",
            *METRICS,
        ],
    )
    for column in ("k", "n_cpu_moe"):  # ints stay ints (K=8, not K=8.0), absent stays None
        frame[column] = pd.Series([r[column] for r in rows], index=frame.index, dtype=object)
    return frame
