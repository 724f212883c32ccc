"""Warnings attached to cells, collected for the report: engine flags the runner stored in a cell's
extras (`extras["flags"]`, a list of one-line strings, or any `*_flag` string such as SGLang's
batch_cap_flag / kv_capacity_flag and metrics' client_flag / engine_timings_flag, also inside
`extras["engine_log"]`), usage mismatches (the server's completion token count disagreed with the
streamed chunks), and prompts that reached different engines as different prompt lengths
(templates differ: the comparison is then unfair)."""

from __future__ import annotations

from typing import Any

import pandas as pd


def _flag_strings(extras: dict[str, Any]) -> list[str]:
    found = [str(f) for f in extras.get("flags") or [] if f]
    found.extend(str(v) for k, v in extras.items() if k.endswith("_flag") and isinstance(v, str) and v)
    log = extras.get("engine_log")
    if isinstance(log, dict):
        found.extend(_flag_strings({k: v for k, v in log.items() if k != "engine_log"}))
    return found


def cell_flags(row: pd.Series) -> list[str]:
    """Every warning of one cell, in a stable order."""
    flags = _flag_strings(row["extras"])
    mismatches = row.get("usage_mismatches")
    if mismatches is not None and not pd.isna(mismatches) and int(mismatches) > 0:
        flags.append(f"{int(mismatches)} requests: usage token count disagrees with streamed chunks")
    return list(dict.fromkeys(flags))


def prompt_length_mismatches(cells: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """One row per (prompt_id, prompt class) whose server-reported prompt_tokens differ between engines."""
    columns = ["prompt_id", "prompt_class", "prompt_tokens_by_engine"]
    if requests.empty:
        return pd.DataFrame(columns=columns)
    joined = requests[requests["prompt_tokens"].notna()].merge(cells[["cell_id", "engine"]], on="cell_id")
    rows = []
    for (prompt_id, cls), group in joined.groupby(["prompt_id", "prompt_class"], sort=True):
        per_engine = {
            engine: sorted({int(t) for t in g["prompt_tokens"]}) for engine, g in group.groupby("engine", sort=True)
        }
        if len(per_engine) > 1 and len({tuple(v) for v in per_engine.values()}) > 1:
            text = "; ".join(f"{engine}: {', '.join(map(str, tokens))}" for engine, tokens in per_engine.items())
            rows.append({"prompt_id": prompt_id, "prompt_class": cls, "prompt_tokens_by_engine": text})
    return pd.DataFrame(rows, columns=columns)
