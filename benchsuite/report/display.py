"""Display form of a table (HTML and markdown); the CSV keeps the exact columns.

- each `<x>_min / <x>_median / <x>_max` triple becomes one `<x>` column written "median [min–max]"
  (just "median" when min = max);
- in the ratio table, each baseline's `<b>_config`, its spread, `paged_vs_<b>` and the verdict become
  one `vs <b>` column: "is 2.00 x offload [1.50–2.67], significant · tiny · offload: 21.00 [20.00–22.00]";
- a `vs <b>` column whose every row is "not run" is left out (`not_run_baselines` names them, so the
  page says so once instead of in every row);
- other columns pass through, formatted by fmt.format_value.
"""

from __future__ import annotations

import pandas as pd

from benchsuite.report.fmt import ABSENT, format_value


def _spread_text(column: str, low: object, mid: object, high: object) -> str:
    median = format_value(column, mid)
    if median == ABSENT:
        return ABSENT
    low_text, high_text = format_value(column, low), format_value(column, high)
    if low_text == high_text == median:  # one repeat (or identical ones): no range to show
        return median
    return f"{median} [{low_text}–{high_text}]"


def _baselines(columns: list[str]) -> list[str]:
    return [
        c[: -len("_config")]
        for c in columns
        if c.endswith("_config")
        and f"paged_vs_{c[: -len('_config')]}" in columns
        and f"paged_vs_{c[: -len('_config')]}_verdict" in columns
    ]


def _baseline_text(row: pd.Series, name: str) -> str:
    config = str(row[f"{name}_config"])
    if config == NOT_RUN:
        return NOT_RUN
    spread = _spread_text(name, row[f"{name}_min"], row[f"{name}_median"], row[f"{name}_max"])
    ratio = row[f"paged_vs_{name}"]
    verdict = str(row[f"paged_vs_{name}_verdict"])
    if ratio is None or pd.isna(ratio):
        return f"{verdict} · {config}: {spread}"
    # "[low–high]" leads the verdict text when there is an interval: "is N x B [low–high], significant"
    head, _, interval = verdict.partition(" [")
    said = f"is {ratio:.2f} x {name} [{interval}, {head}" if interval else f"is {ratio:.2f} x {name}, {verdict}"
    return f"{said} · {config}: {spread}"


NOT_RUN = "not run"


def not_run_baselines(frame: pd.DataFrame) -> list[str]:
    """The baselines of a ratio table that no row ran (every `<b>_config` is "not run")."""
    return [b for b in _baselines(list(frame.columns)) if len(frame) and all(frame[f"{b}_config"] == NOT_RUN)]


def display_frame(frame: pd.DataFrame) -> pd.DataFrame:
    out: dict[str, list[object]] = {}
    columns = list(frame.columns)
    baselines = _baselines(columns)
    absent = set(not_run_baselines(frame))
    merged = {f"{b}{suffix}" for b in baselines for suffix in ("_config", "_min", "_median", "_max")}
    merged |= {f"paged_vs_{b}{suffix}" for b in baselines for suffix in ("", "_verdict")}
    for column in columns:
        if column in merged:
            if column.endswith("_config") and column[: -len("_config")] not in absent:
                name = column[: -len("_config")]
                out[f"vs {name}"] = [_baseline_text(row, name) for _, row in frame.iterrows()]
            continue
        if column.endswith("_median"):
            base = column[: -len("_median")]
            if f"{base}_min" in columns and f"{base}_max" in columns:
                out[base] = [
                    _spread_text(base, lo, mid, hi)
                    for lo, mid, hi in zip(frame[f"{base}_min"], frame[column], frame[f"{base}_max"])
                ]
                continue
        if (column.endswith(("_min", "_max"))) and f"{column[:-4]}_median" in columns:
            continue
        out[column] = [format_value(column, v) for v in frame[column]]
    return pd.DataFrame(out, index=frame.index)
