"""The report's search figures: one per searched option, the K one with its launches measured over
the budget crossed and the chosen K starred."""

from __future__ import annotations

import pandas as pd

from benchsuite.report.search_figure import search_curves
from benchsuite.report.tables import SEARCH_COLUMNS

GB = 10**9


def row(option: str, n: int, tok_s: float | None, status: str = "ok", chosen: bool = False) -> dict:
    base = dict.fromkeys(SEARCH_COLUMNS)
    return {**base, "run_id": "r", "engine": "e" if option == "resident_experts" else "llama", "option": option,
            "concurrency": 4, "N": n, "fits": status != "ruled out", "chosen": chosen, "decode_tok_s": tok_s,
            "status": status, "cell_id": "" if tok_s is None else f"{option}{n}"}  # fmt: skip


def test_one_figure_per_option_with_over_budget_launches_crossed() -> None:
    table = pd.DataFrame([
        row("resident_experts", 32, 70.0), row("resident_experts", 40, 80.0, chosen=True),
        row("resident_experts", 41, 80.5, status="over budget"), row("resident_experts", 60, None, "ruled out"),
        row("n_cpu_moe", 30, 36.0, chosen=True), row("n_cpu_moe", 0, None, "ruled out"),
    ])  # fmt: skip
    figures = {f.anchor: f for f in search_curves(table)}
    assert set(figures) == {"fig-search", "fig-search-k"}
    k = figures["fig-search-k"]
    names = [t.name for t in k.figure.data]
    assert "e · c=4 · measured over the budget" in names and "e · c=4 · chosen K" in names
    crossed = next(t for t in k.figure.data if t.name.endswith("over the budget"))
    assert list(crossed.x) == [41]
    assert set(k.cell_ids) == {"resident_experts32", "resident_experts40", "resident_experts41"}
    assert "K=60: does not fit" in str(k.figure.layout.shapes) + str(k.figure.layout.annotations)
