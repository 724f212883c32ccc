"""Where a paged decode token's time goes: link, compute and how much of the copy was hidden, per cell.

The link and serial bounds section (roofline.py) bounds whole requests (output tok/s, prefill
included). A paging engine's decode targets are decode rates, so this section bounds the decode
alone, from stored data only:

    decode rate       = decode_agg_tok_s: the decode tokens (after each stream's first) over the time any
                        stream was decoding. At c=1 that is the time of the tokens decode_bytes_per_token
                        divides, so link_ms and measured_ms describe one mean token; one stream's median
                        (decode_tok_s_p50, the verdict's c=1 figure) would pair a median request with mean
                        bytes (h200-paged16's 2,048-token c=1 cell: 236 tok/s median, 178 aggregate, and
                        copy time "hidden" that was not). A cell stored without the aggregate falls back to
                        the median at c=1, said in the note; a c=1 median over 10% off the aggregate is said.
                        At c>=2 the window also holds the steps where other streams' prompts were prefilled
                        (decode_bytes_per_token leaves those out): where the engine's own all-decode rate
                        (engine_decode_tok_s) is over 10% above the aggregate, the note gives it, and the
                        negative hidden time is then mostly those prefills (and time between the engine's
                        steps), not planning or launches.
    prefetch_accuracy = of the experts next-layer prefetch paged in, the share their layer then routed to
                        (empty with prefetch off); the misses it saved are in decode_miss_rate, its wasted
                        bytes in decode_mb_per_tok
    decode_mb_per_tok = decode_bytes_per_token: expert bytes paged in all-decode steps (prefetches
                        included) / the tokens those steps generated (measure/paging.py). A cell stored
                        before that field: (bytes_paged - prefill bytes) / (output tokens - requests),
                        each request's first token being its prefill step's (exact at c=1; at c>=2 a
                        step mixing a prompt chunk with decode tokens counts as prefill, so slightly
                        fewer bytes per token), said in the note. Not miss rate x top_k x layers x
                        expert bytes: with several streams the tokens of a step share experts.
    link_ms           = decode_mb_per_tok / link GB/s          (the run's measured paging rate: DMAs)
    kernel_link_ms    = decode_mb_per_tok / the probe's copy-kernel GB/s: the same bytes at the rate of the path a
                        built-in decode step pages with (tools.linkbw; empty where the run's probe did not time it)
    compute_ms        = 1 / the decode rate of the same run's unpaged reference cells (builtin resident;
                        same workload, routing, concurrency, prompt class; median over their repeats)
    measured_ms       = 1 / the cell's decode rate
    hidden_ms         = link_ms + compute_ms - measured_ms: copy time hidden behind compute; negative
                        when the token took longer than copy then compute (planning, launches, waits)
    link_bound = 1 / link_ms; roofline = 1 / max(link_ms, compute_ms); serial = 1 / (link_ms + compute_ms)

A figure that cannot be computed says why; nothing is written as 0.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

import pandas as pd

from benchsuite.engines import traits_of
from benchsuite.report.fmt import number
from benchsuite.report.load import RunData

TITLE = "Decode per token: link, compute and overlap (paged)"
ANCHOR = "decode-bounds"
MATCH_KEYS = ("run_id", "engine_kind", "workload", "routing", "concurrency", "prompt_class")
COLUMNS = (
    "run_id", "configuration", "routing", "workload", "prompt_class", "concurrency", "repeat", "decode_figure",
    "decode_tok_s", "decode_miss_rate", "prefetch_accuracy", "decode_mb_per_token", "link_ms", "kernel_link_ms",
    "compute_ms",
    "measured_ms", "hidden_ms", "link_bound_tok_s", "roofline_tok_s", "serial_tok_s", "of_link_bound", "of_roofline",
    "of_serial", "note", "compute_cell_ids", "cell_id",
)  # fmt: skip
INTRO = (
    "<p>Each paged cell's decode (not its prefill) against the link and the compute of this run: link_ms = expert "
    "bytes paged in per decode token (the bytes of the steps without a prompt chunk over their tokens) over the "
    "run's measured link; compute_ms = 1 / the decode rate of the same run's resident cell with the same workload, "
    "routing, concurrency and prompt class; measured_ms = 1 / the cell's decode rate: its decode tokens over the "
    "time any stream was decoding (decode_agg_tok_s, at c=1 too: the same tokens and time the bytes per token are "
    "counted over, where one stream's median would pair a median request with mean bytes; at c&ge;2 the window also "
    "holds other streams' prefills, and a note gives the engine's own all-decode rate where it is over 10% higher). "
    "hidden_ms = link_ms + compute_ms - measured_ms is the copy time hidden behind compute; a negative value is time "
    "beyond copy-then-compute (planning, launches, waits, or at c&ge;2 prefills).</p>"
)
MEDIAN_APART = 0.10  # a figure this far from the aggregate (c=1 median, c>=2 engine rate) is said


def decode_rate(cell: pd.Series) -> tuple[float | None, str]:
    """(the cell's decode rate, which figure it is): the decode-phase aggregate; at c=1 one stream's median
    where a cell stored no aggregate."""
    agg = number(cell.get("decode_agg_tok_s"))
    if agg is None and int(cell["concurrency"]) <= 1:
        return number(cell.get("decode_tok_s_p50")), "decode_tok_s_p50"
    return agg, "decode_agg_tok_s"


def _figure_note(cell: pd.Series, figure: str) -> str:
    """Why the decode figure of a cell may not describe its mean decode token."""
    if int(cell["concurrency"]) > 1:
        agg, engine = number(cell.get("decode_agg_tok_s")), number(cell.get("engine_decode_tok_s"))
        if agg and engine and engine > (1 + MEDIAN_APART) * agg:
            return (
                f"the engine's own all-decode rate is {engine:.1f} tok/s ({engine / agg:.2f}x): the decode window "
                "also held other streams' prefills and time between the engine's steps"
            )
        return ""
    if figure == "decode_tok_s_p50":
        return "no decode_agg_tok_s stored: one stream's median stands in (it pairs a median request with mean bytes)"
    median, agg = number(cell.get("decode_tok_s_p50")), number(cell.get("decode_agg_tok_s"))
    if median and agg and abs(median - agg) > MEDIAN_APART * agg:
        return f"one stream's median {median:.1f} tok/s is {median / agg:.2f}x the aggregate: its requests differ"
    return ""


def _references(cells: pd.DataFrame) -> dict[tuple[Any, ...], tuple[float, list[str], str]]:
    """Match key -> (median decode rate, cell ids, a note on their spread) of the ok unpaged reference cells."""
    found: dict[tuple[Any, ...], list[tuple[float, str]]] = {}
    for _, c in cells.iterrows():
        rate, _figure = decode_rate(c)
        if c["status"] == "ok" and c["mode"] == traits_of(str(c["engine_kind"])).reference_mode and rate:
            found.setdefault(tuple(c[k] for k in MATCH_KEYS), []).append((rate, str(c["cell_id"])))
    return {
        k: (statistics.median(r for r, _ in v), [i for _, i in v], _reference_spread([r for r, _ in v]))
        for k, v in found.items()
    }


def _decode_bytes_per_token(cell: pd.Series) -> tuple[float | None, str]:
    """Expert bytes paged in per decode token, and a note when it is the estimate of an older cell."""
    measured = number(cell.get("decode_bytes_per_token"))
    if measured is not None:
        return measured, ""
    paged, chunks, per_chunk = (
        number(cell.get(k)) for k in ("bytes_paged", "prefill_chunks", "prefill_bytes_per_chunk")
    )
    tokens, requests = number(cell.get("output_tokens_total")), number(cell.get("num_requests"))
    if paged is None or tokens is None or requests is None:
        return None, "no paging counters"
    if chunks is None:  # no prefill counters: every prefill byte would count as decode
        return None, "no decode bytes counted and no prefill counters to estimate them"
    decode_tokens = tokens - requests
    if decode_tokens <= 0:
        return None, "no decode token"
    decode_bytes = paged - chunks * (per_chunk or 0)
    if decode_bytes < 0:
        return None, "inconsistent paging counters (more prefill bytes than bytes paged)"
    return decode_bytes / decode_tokens, "decode bytes per token estimated (a cell stored before the engine's count)"


def _reference_spread(rates: list[float]) -> str:
    """A note when the reference's repeats disagree (its median then stands for neither)."""
    if len(rates) > 1 and max(rates) > 1.25 * min(rates):
        return f"the reference's repeats range {min(rates):.0f}-{max(rates):.0f} tok/s"
    return ""


def _bounds(measured: float | None, per_token: float | None, link: float | None, compute: float | None) -> dict:
    out: dict[str, Any] = {k: None for k in ("link_ms", "compute_ms", "measured_ms", "hidden_ms", "link_bound_tok_s",
                                             "roofline_tok_s", "serial_tok_s", "of_link_bound", "of_roofline",
                                             "of_serial")}  # fmt: skip
    if measured:
        out["measured_ms"] = 1e3 / measured
    if compute:
        out["compute_ms"] = 1e3 / compute
    if per_token is None or not link:
        return out
    link_s = per_token / (link * 1e9)
    out["link_ms"] = 1e3 * link_s
    if link_s > 0:
        out["link_bound_tok_s"] = 1 / link_s
        if measured:
            out["of_link_bound"] = measured / out["link_bound_tok_s"]
    if not compute:
        return out
    compute_s = 1 / compute
    out["roofline_tok_s"] = 1 / max(compute_s, link_s)
    out["serial_tok_s"] = 1 / (compute_s + link_s)
    if measured:
        out["hidden_ms"] = 1e3 * (link_s + compute_s - 1 / measured)
        out["of_roofline"] = measured / out["roofline_tok_s"]
        out["of_serial"] = measured / out["serial_tok_s"]
    return out


def _kernel_link_ms(per_token: float | None, kernel_gb_per_s: float | None) -> float | None:
    return None if per_token is None or not kernel_gb_per_s else 1e3 * per_token / (kernel_gb_per_s * 1e9)


def decode_bounds_table(cells: pd.DataFrame, runs: Iterable[RunData]) -> pd.DataFrame:
    """One row per paged cell (every repeat): its decode per-token breakdown, or why a part is missing."""
    by_id = {run.run_id: run for run in runs}
    references = _references(cells)
    rows = []
    paged = cells[cells["mode"] == "paged"].sort_values(["run_id", "label", "routing", "prompt_class", "concurrency",
                                                          "repeat"])  # fmt: skip
    for _, c in paged.iterrows():
        run = by_id.get(str(c["run_id"]))
        link, link_why = run.facts.link if run is not None else (None, "run not loaded")
        compute, compute_ids, spread = references.get(tuple(c[k] for k in MATCH_KEYS), (None, [], ""))
        measured, figure = decode_rate(c) if c["status"] == "ok" else (None, decode_rate(c)[1])
        per_token, bytes_why = _decode_bytes_per_token(c)
        status = f"cell {c['status']}" if c["status"] != "ok" else ""
        figure_why = _figure_note(c, figure) if c["status"] == "ok" else ""
        reasons = [why for why in (status, figure_why, bytes_why, link_why, spread) if why]
        if measured is None and c["status"] == "ok":
            reasons.append(f"no {figure}")
        if compute is None:
            reference = traits_of(str(c["engine_kind"])).reference_mode or "resident"
            reasons.append(f"no ok {reference} cell with the same workload, routing, concurrency and prompt class")
        rows.append({
            "run_id": c["run_id"], "configuration": c["label"], "routing": c["routing"], "workload": c["workload"],
            "prompt_class": c["prompt_class"], "concurrency": int(c["concurrency"]), "repeat": int(c["repeat"]),
            "decode_figure": figure, "decode_tok_s": measured, "decode_miss_rate": number(c.get("decode_miss_rate")),
            "prefetch_accuracy": number(c.get("prefetch_accuracy")),
            "decode_mb_per_token": None if per_token is None else per_token / 1e6,
            "kernel_link_ms": _kernel_link_ms(per_token, run.facts.kernel_gb_per_s if run is not None else None),
            **_bounds(measured, per_token, link, compute), "note": "; ".join(reasons),
            "compute_cell_ids": " ".join(compute_ids), "cell_id": c["cell_id"],
        })  # fmt: skip
    return pd.DataFrame(rows, columns=list(COLUMNS))
