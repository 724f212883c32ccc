"""How a table value is written, once for HTML and markdown: the unit in a column's name picks
the precision, absent values are written as an em dash (never as 0), a time in seconds keeps three
significant digits in the unit that suits it (`seconds_text`: 12.3 ms, never 0.00), and a small
nonzero value keeps two significant digits rather than rounding to 0.00."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

ABSENT = "—"


def _is_absent(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def number(value: Any) -> float | None:
    """A stored cell value as a float, or None when it is absent (None, NaN, pandas' NA) or a flag (a bool)."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return None
    try:
        result = float(value)
    except TypeError:  # pandas' NA of a nullable column
        return None
    return None if math.isnan(result) else result


_NOT_SECONDS = ("tok_s", "per_s")  # decode_tok_s, gb_per_s: rates whose names also end in _s


def is_seconds(column: str) -> bool:
    return column.endswith("_s") and not column.endswith(_NOT_SECONDS)


def seconds_text(value: float) -> str:
    """A duration with three significant digits: s from 1 s up, ms below (0.0123 -> "12.3 ms")."""
    if value == 0:
        return "0 s"
    if abs(value) >= 100:
        return f"{value:.0f} s"
    if abs(value) >= 1:
        return f"{value:.3g} s"
    ms = value * 1000.0
    return f"{ms:.0f} ms" if abs(ms) >= 100 else f"{ms:.3g} ms"


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
        if is_seconds(column):
            return seconds_text(value)
        if value == 0:  # an exact zero (nothing paged), not a value rounded to 0.00
            return "0"
        if 0 < abs(value) < 0.01:
            return f"{value:.2g}"
        return f"{value:.2f}"
    return str(value)
