"""What a random-weight model's own routing was like in a run, measured rather than assumed.

An untrained router has no fixed character: the old generated models routed near-uniformly (little
reuse for paging), the seeded models of 2026-12 (paged_experts.weights.weightgen) drive greedy
decoding into loops: the same few tokens repeat, each step routes the experts of the last, and
paging looks nearly free (H200, 2026-12-02: paged FP8 K=42 at 151-178 tok/s on the model's own
routing, 92-94 on routing calibrated to Qwen3-30B-A3B; one request whose text did not loop ran at 71).
So the report states what it saw:
- `looped(text)`: whether a request's output text mostly repeats itself (the share of its
  `WINDOW_CHARS`-character windows seen earlier in the same text is at least `LOOP_SHARE`; plain
  prose repeats few 12-character windows, a loop nearly all of them);
- `miss_rates(cells)`: paged miss rate on the model's routing beside calibrated routing, for the
  same engine kind, K and concurrency, where a run measured both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from benchsuite.report.groups import is_synthetic

WINDOW_CHARS = 12
LOOP_SHARE = 0.5
MIN_TEXT_CHARS = 4 * WINDOW_CHARS  # shorter texts are not judged


def repeated_share(text: str, window: int = WINDOW_CHARS) -> float:
    """The share of the text's `window`-character windows that occurred earlier in it (0 for a text
    shorter than two windows)."""
    count = len(text) - window + 1
    if count < 2:
        return 0.0
    seen: set[str] = set()
    repeats = 0
    for i in range(count):
        piece = text[i : i + window]
        repeats += piece in seen
        seen.add(piece)
    return repeats / count


def looped(text: str) -> bool | None:
    """Whether the text mostly repeats itself; None when it is too short to judge."""
    if len(text) < MIN_TEXT_CHARS:
        return None
    return repeated_share(text) >= LOOP_SHARE


@dataclass(frozen=True)
class Loops:
    """Requests (not warm-ups, ok, long enough to judge) of model-routed cells whose text looped."""

    looped: int
    judged: int


def output_loops(cells: pd.DataFrame, requests: pd.DataFrame) -> Loops:
    """Loops among the model-routed cells' measured requests."""
    if requests is None or requests.empty or "output_text" not in requests or cells.empty:
        return Loops(0, 0)
    model_routed = {str(c) for c, r in zip(cells["cell_id"], cells["routing"]) if not is_synthetic(str(r))}
    mine = requests[requests["cell_id"].astype(str).isin(model_routed)]
    if "warmup" in mine:
        mine = mine[~mine["warmup"].fillna(False).astype(bool)]
    if "ok" in mine:
        mine = mine[mine["ok"].fillna(False).astype(bool)]
    verdicts = [looped(str(t)) for t in mine["output_text"] if isinstance(t, str)]
    judged = [v for v in verdicts if v is not None]
    return Loops(sum(judged), len(judged))


@dataclass(frozen=True)
class MissPair:
    """Median miss rate of one paged configuration on the model's routing and on synthetic routing."""

    engine_kind: str
    resident_experts: int
    concurrency: int
    routing: str  # the synthetic routing's label
    model_miss_rate: float
    synthetic_miss_rate: float


def miss_rates(cells: pd.DataFrame) -> list[MissPair]:
    """Pairs of ok paged cells that differ only in routing (engine kind, K, concurrency), lowest
    concurrency first."""
    need = {"engine_kind", "resident_experts", "concurrency", "routing", "miss_rate", "status"}
    if cells.empty or not need <= set(cells.columns):
        return []
    ok = cells[(cells["status"] == "ok") & cells["resident_experts"].notna() & cells["miss_rate"].notna()]
    medians: dict[tuple[str, int, int, str], float] = {}
    for (kind, k, conc, routing), rows in ok.groupby(["engine_kind", "resident_experts", "concurrency", "routing"]):
        value = float(rows["miss_rate"].median())
        if not math.isnan(value):
            medians[(str(kind), int(k), int(conc), str(routing))] = value
    out = []
    for (kind, k, conc, routing), synthetic in sorted(medians.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if not is_synthetic(routing):
            continue
        model = next(
            (v for (k2, kk, c2, r2), v in medians.items() if (k2, kk, c2) == (kind, k, conc) and not is_synthetic(r2)),
            None,
        )
        if model is not None:
            out.append(MissPair(kind, k, conc, routing, model, synthetic))
    return out


def random_model_caveat(models: list[str], cells: pd.DataFrame, requests: pd.DataFrame | None) -> str:
    """The caveat of a setup that served a random-weight model: what its routing was like here."""
    said = [
        f"Random-weight model ({', '.join(models)}): its router is untrained, so how much its tokens share experts is "
        "not a trained model's"
    ]
    loops = output_loops(cells, requests if requests is not None else pd.DataFrame())
    if loops.judged and loops.looped:
        said.append(
            f"here its greedy output looped in {loops.looped} of {loops.judged} requests on its own routing (a loop "
            f"routes the same experts step after step, so paging looks cheaper than it is)"
        )
    pairs = miss_rates(cells)
    if pairs:
        p = pairs[0]
        label = p.routing.split(":", 1)[1] if ":" in p.routing else p.routing
        said.append(
            f"paged K={p.resident_experts} at c={p.concurrency} missed {p.model_miss_rate:.1%} of expert "
            f"activations on the model's routing against {p.synthetic_miss_rate:.1%} on {label} routing"
        )
    tail = (
        "judge paging by the synthetic-routing rows, calibrated to a trained model's measured locality."
        if pairs or any(is_synthetic(str(r)) for r in cells.get("routing", []))
        else "a trained model's routing can be more or less local."
    )
    return "; ".join(said) + "; " + tail
