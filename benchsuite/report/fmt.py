"""How a table value is written, once for HTML and markdown: the unit in a column's name picks
the precision, absent values are written as an em dash (never as 0)."""

from __future__ import annotations

import math
from typing import Any

ABSENT = "—"


def _is_absent(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def format_value(column: str, value: Any) -> str:
    if _is_absent(value):
        return ABSENT
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if column.startswith("paged_vs_") or "_vs_" in column:
            return f"{value:.2f}×"
        if column.endswith("_ms"):
            return f"{value:.1f}"
        if column in ("miss_rate", "random_miss") or column.endswith("_rate"):
            return f"{value:.3f}"
        if column in ("K", "N", "K_div_top_k", "concurrency") and value.is_integer():
            return str(int(value))
        return f"{value:.2f}"
    return str(value)
