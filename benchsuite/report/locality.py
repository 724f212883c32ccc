"""What a random-weight model's own routing was like in a run, measured rather than assumed.

An untrained router has no fixed character: the old generated models routed near-uniformly (little
reuse for paging), the seeded models of 2026-12 (paged_experts.weights.weightgen) drive greedy
decoding into loops: the same few tokens repeat, each step routes the experts of the last, and
paging looks nearly free (H200, 2026-12-02: paged FP8 K=42 at 151-178 tok/s on the model's own
routing, 92-94 on routing calibrated to Qwen3-30B-A3B; a request whose loop was longer ran at 71),
while at four streams the streams' different loops missed more than calibrated routing does (29% vs
24%, 85 vs 122 tok/s). So the report states what it saw, in whichever direction:
- `looped(text)`: whether a request's output text mostly repeats itself (the share of its
  `WINDOW_CHARS`-character windows seen earlier in the same text is at least `LOOP_SHARE`; plain
  prose repeats few 12-character windows, a loop nearly all of them);
- `miss_rates(cells)`: paged miss rate on the model's routing beside synthetic routing, for the
  same engine, mode, K and concurrency, where a run measured both (search probes left out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from benchsuite.report.groups import is_calibrated, is_synthetic, synthetic_spec

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
    """Requests (not warm-ups, ok, long enough to judge) of model-routed cells whose text looped, and
    how many distinct prompts those were."""

    looped: int
    judged: int
    prompts: int  # distinct prompts among the looped requests (0 where requests carry no prompt id)


def output_loops(cells: pd.DataFrame, requests: pd.DataFrame) -> Loops:
    """Loops among the model-routed cells' measured requests."""
    if requests is None or requests.empty or "output_text" not in requests or cells.empty:
        return Loops(0, 0, 0)
    model_routed = {str(c) for c, r in zip(cells["cell_id"], cells["routing"]) if not is_synthetic(str(r))}
    mine = requests[requests["cell_id"].astype(str).isin(model_routed)]
    if "warmup" in mine:
        mine = mine[~mine["warmup"].fillna(False).astype(bool)]
    if "ok" in mine:
        mine = mine[mine["ok"].fillna(False).astype(bool)]
    judged = [(looped(str(t)), p) for t, p in zip(mine["output_text"], mine.get("prompt_id", [None] * len(mine)))]
    judged = [(v, p) for v, p in judged if v is not None]
    prompts = {str(p) for v, p in judged if v and p is not None}
    return Loops(sum(1 for v, _ in judged if v), len(judged), len(prompts))


@dataclass(frozen=True)
class MissPair:
    """Median miss rate of one paged configuration on the model's routing and on synthetic routing."""

    engine: str
    resident_experts: int
    concurrency: int
    routing: str  # the synthetic routing's label
    model_miss_rate: float
    synthetic_miss_rate: float


def _probe(params: object) -> bool:
    return isinstance(params, dict) and "search_n" in params


def miss_rates(cells: pd.DataFrame) -> list[MissPair]:
    """Pairs of ok paged cells that differ only in routing (engine kind, mode, K, concurrency; a search's
    one-cell probes left out), lowest concurrency first."""
    need = {"engine_kind", "mode", "resident_experts", "concurrency", "routing", "miss_rate", "status"}
    if cells.empty or not need <= set(cells.columns):
        return []
    ok = cells[(cells["status"] == "ok") & cells["resident_experts"].notna() & cells["miss_rate"].notna()]
    if "params" in ok:
        ok = ok[[not _probe(p) for p in ok["params"]]]
    keys = ["engine_kind", "mode", "resident_experts", "concurrency"]
    medians: dict[tuple[str, str, int, int], dict[str, float]] = {}
    for (kind, mode, k, conc, routing), rows in ok.groupby([*keys, "routing"]):
        value = float(rows["miss_rate"].median())
        if not math.isnan(value):
            medians.setdefault((str(kind), str(mode), int(k), int(conc)), {})[str(routing)] = value
    out = []
    for (kind, mode, k, conc), by_routing in sorted(medians.items(), key=lambda kv: (kv[0][3], kv[0][2])):
        model = next((v for r, v in by_routing.items() if not is_synthetic(r)), None)
        for routing, synthetic in sorted(by_routing.items()):
            if model is not None and is_synthetic(routing):
                out.append(MissPair(f"{mode} ({kind})", k, conc, routing, model, synthetic))
    return out


def _miss_text(pairs: list[MissPair]) -> str:
    """The first configuration's pairs at its lowest and highest concurrency, in words."""
    first = pairs[0]
    same = (first.engine, first.resident_experts, first.routing)
    mine = [p for p in pairs if (p.engine, p.resident_experts, p.routing) == same]
    shown = [mine[0], mine[-1]] if len(mine) > 1 else mine
    at = ", ".join(f"{p.model_miss_rate:.1%} and {p.synthetic_miss_rate:.1%} at c={p.concurrency}" for p in shown)
    return (
        f"paged K={first.resident_experts} missed {at} of expert activations (the model's routing, then "
        f"{synthetic_spec(first.routing)} routing)"
    )


def random_model_caveat(models: list[str], cells: pd.DataFrame, requests: pd.DataFrame | None) -> str:
    """The caveat of a setup that served a random-weight model: what its routing was like here."""
    said = [
        f"Random-weight model ({', '.join(models)}): its router is untrained, so which experts its tokens share is an "
        "artifact of random weights, not a trained model's routing"
    ]
    loops = output_loops(cells, requests if requests is not None else pd.DataFrame())
    if loops.judged and loops.looped:
        prompts = f", {loops.prompts} distinct prompts" if loops.prompts else ""
        said.append(
            f"here its greedy output looped in {loops.looped} of {loops.judged} requests on its own routing{prompts} "
            f"(a lower bound: a loop that drifts is not counted), and a loop routes the same experts step after step"
        )
    pairs = miss_rates(cells)
    if pairs:
        said.append(_miss_text(pairs))
    calibrated = sorted({synthetic_spec(str(r)) for r in cells.get("routing", []) if is_calibrated(str(r))})
    if calibrated:
        names = ", ".join(calibrated)
        tail = f"judge paging by the rows on {names} routing, calibrated to a trained model's measured routing."
    else:
        tail = "a trained model's routing can be more or less local."
    return "; ".join(said) + "; " + tail
