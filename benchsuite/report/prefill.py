"""Prefill against its page-in floor: every built-in cell with prompt chunks, its TTFT beside what the
engine's counters say its prefill moved and how (paging.paging_delta's prefill fields), the floor
those bytes set on the run's measured link (manifest `link_bandwidth`, matrix `linkbw: true`), and the
same run's resident cell with the same workload, routing, concurrency and prompt class.
At concurrency N > 1 the N prompts arrive together and the server prefills them a chunk per step
(`--chunked-prefill-size`, 2,048 tokens), so the TTFT p50 holds about (N + 1) / 2 chunks: the row says
so, and span_of_floor (one chunk's span, queue-free) is the figure to hold against the floor:

    floor_s        = prefill_bytes_per_chunk / link_B_per_s      (the page-in alone, nothing else)
    ttft_of_floor  = ttft_p50_s / floor_s                         (issue 20's target: <= 1.3 at 2,048 tokens)
    router_s       = host time of a synthetic router per chunk   (in every mode's TTFT alike: not paging)
    paging_of_floor = (ttft_p50_s - router_s) / floor_s           (the same without the synthetic router's draws)
    span_of_floor  = prefill_span_s_per_chunk / floor_s          (one chunk's device span: no queue in it)
    resident_ttft_s = median TTFT p50 of the matching resident cells (the compute with nothing to page)
    ttft_p90_of_p50 = ttft_p90_s / ttft_p50_s                     (the spread of the cell's own requests)
    gc_ms_per_request = the server's garbage-collection time over the cell (prefill and decode) / its requests

Without a link figure the row shows bytes and times only, and says why. The decode columns show what
the prefill left: decode tok/s (p50 over requests) and the miss rate outside prefill steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

import pandas as pd

from benchsuite.engines import traits_of
from benchsuite.report.fmt import number
from benchsuite.report.load import RunData
from benchsuite.report.roofline import GB, MATCH_KEYS

TITLE = "Prefill against its page-in floor"
TARGET_OF_FLOOR = 1.3
COLUMNS = (
    "run_id", "configuration", "routing", "workload", "prompt_class", "concurrency", "repeat", "ttft_p50_s",
    "prefill_gb_per_chunk", "link_gb_per_s", "floor_s", "ttft_of_floor", "router_s", "paging_of_floor",
    "resident_ttft_s", "copy_s", "span_s", "span_of_floor", "copy_busy", "idle_before_layer_ms", "idle_waves_ms",
    "host_wait_ms", "host_plan_ms", "waves_per_layer", "staged_unused_per_layer", "ttft_p90_of_p50",
    "gc_ms_per_request", "gc_full_collections",
    "decode_tok_s_p50", "decode_miss_rate", "note", "cell_id",
)  # fmt: skip
INTRO = (
    "<p>Every built-in cell that prefilled prompts: its TTFT p50 beside what the engine counted per prompt chunk "
    "(expert bytes paged in, the page-in copy time and the prefill's device span, the copy engine's busy share, "
    "waves per layer) and the floor those bytes set on the link measured at the start of the run "
    f"(floor = bytes / link; ttft_of_floor = TTFT / floor, target &le; {TARGET_OF_FLOOR}). router_s is the host "
    "time a synthetic router spent drawing the chunk's routing: every mode's TTFT carries it, paging does not "
    "cause it (a model's own router runs on the GPU); paging_of_floor = (TTFT - router_s) / floor. "
    "resident_ttft_s is the same run's resident cell (same workload, routing, concurrency, prompt class). "
    "span_of_floor = the chunk's device span / floor: at concurrency N &gt; 1 the prompts arrive together and "
    "prefill a chunk per step, so the TTFT p50 waits for about (N + 1) / 2 chunks and span_of_floor is the "
    "queue-free figure. idle_before_layer_ms is the link idle before each paged layer's first page-in (the "
    "layer's serial chain: the previous layer's last waves, its attention and routing, the host's plan, its "
    "first wave) and idle_waves_ms the idle between one layer's page-ins (copies waiting for a wave's compute), "
    "each per layer-step; host_wait_ms and host_plan_ms are the server's host time per layer-step, blocked on "
    "the device (reading the routed ids and residency states) and the rest (plan, launches, write-backs): an "
    "idle before a layer that grows with host_plan_ms points to the host's own work, one that grows with "
    "host_wait_ms to the device's queue (the launches between layers are in neither). "
    "ttft_p90_of_p50 is the spread of the cell's own requests (a p50 of few requests moves "
    "with it); gc_ms_per_request is the server's time in Python garbage collections over the cell (prefill and "
    "decode) per measured request, gc_full_collections the cell's collections of every tracked object. "
    "decode_miss_rate is the miss rate outside prefill steps: what the prefill residency left for the decode.</p>"
)


def _value(cell: pd.Series, name: str) -> float | None:
    return number(cell.get(name))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _resident_ttft(cells: pd.DataFrame) -> dict[tuple[Any, ...], float]:
    found: dict[tuple[Any, ...], list[float]] = {}
    for _, c in cells.iterrows():
        ttft = _value(c, "ttft_p50_s")
        if c["status"] == "ok" and c["mode"] == "resident" and ttft is not None:
            found.setdefault(tuple(c[k] for k in MATCH_KEYS), []).append(ttft)
    return {key: statistics.median(values) for key, values in found.items()}


def _row(c: pd.Series, link: float | None, link_why: str, resident: float | None) -> dict[str, Any]:
    ttft, per_chunk, router = (
        _value(c, "ttft_p50_s"),
        _value(c, "prefill_bytes_per_chunk"),
        _value(c, "prefill_router_s_per_chunk"),
    )
    floor_s = per_chunk / (link * GB) if link and per_chunk else None
    notes = [f"cell {c['status']}"] if c["status"] != "ok" else []
    if link is None and per_chunk:
        notes.append(link_why)
    span = _value(c, "prefill_span_s_per_chunk")
    concurrency = int(c["concurrency"])
    if concurrency > 1 and ttft is not None and floor_s:
        notes.append(
            f"c={concurrency}: the TTFT p50 holds ~{(concurrency + 1) / 2:g} chunks (prompts prefill a chunk a step); "
            "span_of_floor is one chunk's"
        )
    if c["mode"] == "paged" and not per_chunk:
        notes.append("no prefill page-in counted (prompts small enough for one device-planned wave, or an older run)")
    return {
        "run_id": c["run_id"], "configuration": c["label"], "routing": c["routing"], "workload": c["workload"],
        "prompt_class": c["prompt_class"], "concurrency": int(c["concurrency"]), "repeat": int(c["repeat"]),
        "ttft_p50_s": ttft, "prefill_gb_per_chunk": None if per_chunk is None else per_chunk / GB,
        "link_gb_per_s": link, "floor_s": floor_s,
        "ttft_of_floor": ttft / floor_s if ttft is not None and floor_s else None,
        "router_s": router,
        "paging_of_floor": (ttft - (router or 0.0)) / floor_s if ttft is not None and floor_s else None,
        "resident_ttft_s": resident,
        "copy_s": _value(c, "prefill_copy_s_per_chunk"), "span_s": span,
        "span_of_floor": span / floor_s if span is not None and floor_s else None,
        "copy_busy": _value(c, "prefill_copy_busy"),
        "idle_before_layer_ms": _ms(_value(c, "prefill_idle_before_layer_s")),
        "idle_waves_ms": _ms(_value(c, "prefill_idle_between_waves_s")),
        "host_wait_ms": _ms(_value(c, "prefill_host_wait_s")),
        "host_plan_ms": _ms(_value(c, "prefill_host_plan_s")),
        "waves_per_layer": _value(c, "prefill_waves_per_layer"),
        "staged_unused_per_layer": _value(c, "prefill_staged_unused_per_layer"),
        "ttft_p90_of_p50": _ratio(_value(c, "ttft_p90_s"), ttft),
        "gc_ms_per_request": _ms(_ratio(_value(c, "gc_pause_s"), _value(c, "num_requests"))),
        "gc_full_collections": _value(c, "gc_full_collections"),
        "decode_tok_s_p50": _value(c, "decode_tok_s_p50"), "decode_miss_rate": _value(c, "decode_miss_rate"),
        "note": "; ".join(notes), "cell_id": c["cell_id"],
    }  # fmt: skip


def prefill_table(cells: pd.DataFrame, runs: Iterable[RunData]) -> pd.DataFrame:
    """One row per built-in cell with prompt chunks (every repeat), resident ones included."""
    if "prefill_chunks" not in cells.columns:
        return pd.DataFrame(columns=list(COLUMNS))  # runs stored before the prefill counters
    links = {run.run_id: run.facts.link for run in runs}
    resident = _resident_ttft(cells)
    chunking = pd.Series([traits_of(str(k)).chunks_prefill for k in cells["engine_kind"]], cells.index, bool)
    chunked = cells[chunking & (pd.to_numeric(cells["prefill_chunks"]).fillna(0) > 0)]
    rows = []
    for _, c in chunked.sort_values(["run_id", "prompt_class", "routing", "label", "concurrency", "repeat"]).iterrows():
        link, link_why = links.get(str(c["run_id"]), (None, "run not loaded"))
        rows.append(_row(c, link, link_why, resident.get(tuple(c[k] for k in MATCH_KEYS))))
    return pd.DataFrame(rows, columns=list(COLUMNS))
