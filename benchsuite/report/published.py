"""Published reference figures (e.g. PR #42557) beside the user's own numbers.

The figures are read by benchsuite.tools.reference (typed rows, shipped in benchsuite/data/reference/);
this module only finds the reference a matrix names (`reference: pr42557`: the shipped data through
benchsuite.tools.reference; a search path seam lets tests use a hand-made file) and lines the published rows
up with the user's configurations at the same K and concurrency. A matrix may narrow the rows with
`reference: {name, machine, quant}`.
Nothing here invents a number: a published row without a matching configuration says "not measured".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from benchsuite.engines import traits_of
from benchsuite.report.groups import Spread
from benchsuite.report.tables import baselines_for, headline_metric, prompt_classes
from benchsuite.tools.reference import Reference, read_reference_file


def find_reference(name: str, search_dirs: list[Path]) -> Path | None:
    for directory in search_dirs:
        candidate = Path(directory) / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    return None


def load_published(name: str, path: Path) -> Reference:
    return read_reference_file(name, path)


def _machine_text(reference: Reference, key: str) -> str:
    machine = next((m for m in reference.machines if m.key == key), None)
    return key if machine is None else f"{key} ({machine.gpu}, PCIe {machine.pcie})"


def _selected(rows: tuple[Any, ...], row_filter: dict[str, str]) -> list[Any]:
    return [r for r in rows if all(getattr(r, key) == value for key, value in row_filter.items())]


def _pick_paged(groups: pd.DataFrame, k: int | None, concurrency: int, prompt_class: str | None) -> pd.Series | None:
    paged = groups[(groups["mode"] == "paged") & (groups["concurrency"] == concurrency)]
    if prompt_class is not None:
        paged = paged[paged["prompt_class"] == prompt_class]
    if k is not None:
        paged = paged[paged["k"] == k]
    if paged.empty:
        return None

    def rank(i: Any) -> tuple[int, Any]:  # the engines' preference (EngineTraits.published_rank), then the largest K
        return traits_of(str(paged.loc[i, "engine_kind"])).published_rank, -(paged.loc[i, "k"] or 0)

    order = sorted(paged.index, key=rank)
    return paged.loc[order[0]]


def _median(spread: Spread | None) -> float | None:
    return None if spread is None else spread.median


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def decode_prompt_class(groups: pd.DataFrame) -> str | None:
    """The prompt class decode figures are compared on: sharegpt, else the short class."""
    classes = {str(c) for c in groups["prompt_class"]}
    return "sharegpt" if "sharegpt" in classes else prompt_classes(groups)[0]


def reference_decode_table(
    published: Reference, row_filter: dict[str, str], groups: pd.DataFrame, cells: pd.DataFrame
) -> pd.DataFrame:
    """Each published decode row beside the user's paged / offload / llama.cpp best at the same K and concurrency."""
    prompt_class = decode_prompt_class(groups)
    rows = []
    for ref in _selected(published.decode, row_filter):
        paged = _pick_paged(groups, ref.resident_experts, ref.concurrency, prompt_class)
        base = baselines_for(groups, cells, paged) if paged is not None else {}
        offload_row, llama_row = base.get("offload"), base.get("llamacpp_best")
        metric = headline_metric(ref.concurrency)
        mine = _median(None if paged is None else paged[metric])
        offload = _median(None if offload_row is None else offload_row[metric])
        llama = _median(None if llama_row is None else llama_row[metric])
        ids = [i for g in (paged, offload_row, llama_row) if g is not None for i in g["cell_ids"]]
        rows.append(
            {
                "machine": _machine_text(published, ref.machine),
                "quant": ref.quant,
                "K": ref.resident_experts,
                "concurrency": ref.concurrency,
                "metric": metric,
                "published_paged": ref.paged_tok_s,
                "published_paged_high": ref.paged_high_tok_s,
                "published_offload": ref.offload_tok_s,
                "published_llamacpp_best": ref.llamacpp_best_tok_s,
                "published_paged_vs_offload": ref.paged_vs_offload,
                "published_paged_vs_llamacpp": ref.paged_vs_llamacpp,
                "your_paged_config": "not measured" if paged is None else paged["label"],
                "your_paged": mine,
                "your_offload": offload,
                "your_llamacpp_best": llama,
                "your_paged_vs_offload": _ratio(mine, offload),
                "your_paged_vs_llamacpp": _ratio(mine, llama),
                "yours_vs_published_paged": _ratio(mine, ref.paged_tok_s),
                "cell_ids": " ".join(ids),
            }
        )
    return pd.DataFrame(rows)


def reference_ttft_table(
    published: Reference, row_filter: dict[str, str], groups: pd.DataFrame, cells: pd.DataFrame
) -> pd.DataFrame:
    """Published TTFT p50 (short / 2,048-token prompts) beside the user's paged and llama.cpp best at concurrency 1."""
    short, long = prompt_classes(groups)
    ks: dict[tuple[str, str], int] = {}
    for r in published.decode:
        if r.concurrency == 1:
            ks.setdefault((r.machine, r.quant), r.resident_experts)  # the setup's first published single-stream K
    rows = []
    for ref in _selected(published.ttft, row_filter):
        paged_short = _pick_paged(groups, ks.get((ref.machine, ref.quant)), 1, short)
        config = paged_short
        if ref.engine == "llamacpp_best":
            config = None if paged_short is None else baselines_for(groups, cells, paged_short)["llamacpp_best"]
        long_row = None
        if config is not None:
            same = groups[
                (groups["run_id"] == config["run_id"])
                & (groups["engine"] == config["engine"])
                & (groups["params_key"] == config["params_key"])
                & (groups["mode"] == config["mode"])
                & (groups["concurrency"] == 1)
                & (groups["prompt_class"] == long)
            ]
            long_row = None if same.empty else same.iloc[0]
        short_ms = _median(None if config is None else config["ttft_p50_s"])
        long_ms = _median(None if long_row is None else long_row["ttft_p50_s"])
        rows.append(
            {
                "machine": _machine_text(published, ref.machine),
                "quant": ref.quant,
                "engine": ref.engine,
                "published_short_ms": ref.short_ms,
                "published_long_ms": ref.long_2048_ms,
                "your_config": "not measured" if config is None else config["label"],
                "your_short_ms": None if short_ms is None else short_ms * 1000.0,
                "your_long_ms": None if long_ms is None else long_ms * 1000.0,
                "cell_ids": " ".join(
                    ([] if config is None else list(config["cell_ids"]))
                    + ([] if long_row is None else list(long_row["cell_ids"]))
                ),
            }
        )
    return pd.DataFrame(rows)
