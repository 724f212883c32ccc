"""Published reference figures (e.g. PR #42557) beside the user's own numbers.

The seam is a YAML file per reference name: `<name>.yaml` in benchsuite/data/reference/ (written
by the SGLang adapter's owner; its layout is /shared/reference/pr42557.yaml: single_stream_decode,
four_requests_decode, ttft_p50_ms rows keyed by machine, quant and K). A matrix names the
reference (`reference: pr42557`, or `reference: {name: pr42557, machine: ..., quant: ...}` to pick
the published rows of one setup). Nothing here invents a number: a published row without a
matching measured configuration shows "not measured".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from benchsuite.report.groups import Spread
from benchsuite.report.tables import baselines_for, headline_metric, prompt_classes

_ENGINE_PREFERENCE = ("sglang", "builtin", "llamacpp")


@dataclass(frozen=True)
class PublishedDecodeRow:
    machine: str
    quant: str
    k: int
    concurrency: int
    paged: float
    llamacpp_best: float | None
    offload: float | None


@dataclass(frozen=True)
class PublishedTtftRow:
    machine: str
    quant: str
    role: str  # "paged" or "llamacpp_best"
    short_ms: float
    long_ms: float


@dataclass(frozen=True)
class Published:
    name: str
    source: Path
    model: str
    decode: tuple[PublishedDecodeRow, ...]
    ttft: tuple[PublishedTtftRow, ...]


def default_reference_dirs() -> list[Path]:
    return [Path(__file__).resolve().parent.parent / "data" / "reference"]


def find_reference(name: str, search_dirs: list[Path]) -> Path | None:
    for directory in search_dirs:
        candidate = Path(directory) / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    return None


def load_published(name: str, path: Path) -> Published:
    data: dict[str, Any] = yaml.safe_load(Path(path).read_text())
    decode = []
    for section, concurrency in (("single_stream_decode", 1), ("four_requests_decode", 4)):
        for row in data.get(section) or []:
            decode.append(PublishedDecodeRow(
                machine=str(row["machine"]), quant=str(row["quant"]), k=int(row["K"]), concurrency=concurrency,
                paged=float(row["paged"]), llamacpp_best=_opt_float(row.get("llamacpp_best")),
                offload=_opt_float(row.get("cpu_offload_gb")),
            ))
    ttft = []
    for row in data.get("ttft_p50_ms") or []:
        for role in ("paged", "llamacpp_best"):
            if row.get(role) is not None:
                short_ms, long_ms = row[role]
                ttft.append(PublishedTtftRow(str(row["machine"]), str(row["quant"]), role, float(short_ms), float(long_ms)))
    return Published(name, Path(path), str(data.get("model", "")), tuple(decode), tuple(ttft))


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


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
    rank = {kind: i for i, kind in enumerate(_ENGINE_PREFERENCE)}
    order = sorted(paged.index, key=lambda i: (rank.get(paged.loc[i, "engine_kind"], 99), -(paged.loc[i, "k"] or 0)))
    return paged.loc[order[0]]


def _median(spread: Spread | None) -> float | None:
    return None if spread is None else spread.median


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def decode_prompt_class(groups: pd.DataFrame) -> str | None:
    """The prompt class decode figures are compared on: sharegpt, else the short class."""
    classes = {str(c) for c in groups["prompt_class"]}
    return "sharegpt" if "sharegpt" in classes else prompt_classes(groups)[0]


def reference_decode_table(published: Published, row_filter: dict[str, str], groups: pd.DataFrame, cells: pd.DataFrame) -> pd.DataFrame:
    """Each published decode row beside the user's paged / offload / llama.cpp best at the same K and concurrency."""
    prompt_class = decode_prompt_class(groups)
    rows = []
    for ref in _selected(published.decode, row_filter):
        paged = _pick_paged(groups, ref.k, ref.concurrency, prompt_class)
        base = baselines_for(groups, cells, paged) if paged is not None else {}
        metric = headline_metric(ref.concurrency)
        mine = _median(None if paged is None else paged[metric])
        offload = _median(None if base.get("offload") is None else base["offload"][metric])
        llama = _median(None if base.get("llamacpp_best") is None else base["llamacpp_best"][metric])
        ids = [] if paged is None else list(paged["cell_ids"])
        for b in base.values():
            ids.extend([] if b is None else b["cell_ids"])
        rows.append({
            "machine": ref.machine, "quant": ref.quant, "K": ref.k, "concurrency": ref.concurrency, "metric": metric,
            "published_paged": ref.paged, "published_offload": ref.offload, "published_llamacpp_best": ref.llamacpp_best,
            "published_paged_vs_offload": _ratio(ref.paged, ref.offload),
            "published_paged_vs_llamacpp": _ratio(ref.paged, ref.llamacpp_best),
            "your_paged_config": "not measured" if paged is None else paged["label"],
            "your_paged": mine, "your_offload": offload, "your_llamacpp_best": llama,
            "your_paged_vs_offload": _ratio(mine, offload), "your_paged_vs_llamacpp": _ratio(mine, llama),
            "yours_vs_published_paged": _ratio(mine, ref.paged),
            "cell_ids": " ".join(ids),
        })
    return pd.DataFrame(rows)


def reference_ttft_table(published: Published, row_filter: dict[str, str], groups: pd.DataFrame, cells: pd.DataFrame) -> pd.DataFrame:
    """Published TTFT p50 (short / 2,048-token prompts) beside the user's paged and llama.cpp best at concurrency 1."""
    short, long = prompt_classes(groups)
    ks = {(r.machine, r.quant): r.k for r in published.decode if r.concurrency == 1}
    rows = []
    for ref in _selected(published.ttft, row_filter):
        paged_short = _pick_paged(groups, ks.get((ref.machine, ref.quant)), 1, short)
        config = paged_short
        if ref.role == "llamacpp_best":
            config = None if paged_short is None else baselines_for(groups, cells, paged_short)["llamacpp_best"]
        long_row = None
        if config is not None:
            same = groups[(groups["run_id"] == config["run_id"]) & (groups["engine"] == config["engine"])
                          & (groups["params_key"] == config["params_key"]) & (groups["mode"] == config["mode"])
                          & (groups["concurrency"] == 1) & (groups["prompt_class"] == long)]
            long_row = None if same.empty else same.iloc[0]
        short_ms = _median(None if config is None else config["ttft_p50_s"])
        long_ms = _median(None if long_row is None else long_row["ttft_p50_s"])
        rows.append({
            "machine": ref.machine, "quant": ref.quant, "role": ref.role,
            "published_short_ms": ref.short_ms, "published_long_ms": ref.long_ms,
            "your_config": "not measured" if config is None else config["label"],
            "your_short_ms": None if short_ms is None else short_ms * 1000.0,
            "your_long_ms": None if long_ms is None else long_ms * 1000.0,
            "cell_ids": " ".join(([] if config is None else list(config["cell_ids"])) + ([] if long_row is None else list(long_row["cell_ids"]))),
        })
    return pd.DataFrame(rows)
