"""Display form of a table (HTML and markdown): each `<x>_min / <x>_median / <x>_max` triple
becomes one `<x>` column written "median [min–max]"; other columns pass through unchanged."""

from __future__ import annotations

import pandas as pd

from benchsuite.report.fmt import ABSENT, format_value


def _spread_text(column: str, low: object, mid: object, high: object) -> str:
    median = format_value(column, mid)
    if median == ABSENT:
        return ABSENT
    return f"{median} [{format_value(column, low)}–{format_value(column, high)}]"


def display_frame(frame: pd.DataFrame) -> pd.DataFrame:
    out: dict[str, list[object]] = {}
    columns = list(frame.columns)
    for column in columns:
        if column.endswith("_median"):
            base = column[: -len("_median")]
            if f"{base}_min" in columns and f"{base}_max" in columns:
                out[base] = [_spread_text(base, lo, mid, hi) for lo, mid, hi in zip(frame[f"{base}_min"], frame[column], frame[f"{base}_max"])]
                continue
        if (column.endswith("_min") and f"{column[:-4]}_median" in columns) or (column.endswith("_max") and f"{column[:-4]}_median" in columns):
            continue
        out[column] = [format_value(column, v) for v in frame[column]]
    return pd.DataFrame(out, index=frame.index)
