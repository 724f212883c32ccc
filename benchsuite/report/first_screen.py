"""The report's first screen rendered: per setup, its caveats, then one row per concurrency and metric
with the fastest configuration and "A is N x B [low–high], verdict" against every other mode, headed
per concurrency by an "Unverified figures" row naming the configurations whose cells failed the
cross-check against the engine's own timings or went untimed (Verdict.yardstick) (HTML,
with the numbers also in data- attributes so a browser test can check them against cells.parquet;
and markdown lines for tables.md)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from benchsuite.report import stats
from benchsuite.report.headline import headline
from benchsuite.report.template_env import render
from benchsuite.report.verdict import Verdict, Versus, routing_phrase

HOW_TO_READ = (
    "A is N x B: N = A / B, the ratio of geometric means over each configuration's ok repeats, with its 95% "
    "interval (Welch t on log values); significant when it is a discovery after Benjamini-Hochberg over every "
    "comparison on this page at 5% (among many comparisons some intervals miss 1 by chance, so an interval that "
    "excludes 1 can still be not significant: the line says so). The best median is in bold only when it is "
    "significantly better than every other mode. With fewer than "
    f"{stats.MIN_REPEATS} ok repeats on a side there is no verdict. Configurations are named short (engine, "
    "K resident experts, N layers' experts on the CPU; the full label on hover). Each mode is represented by its best "
    "configuration (best K, best N). c=1: decode tok/s of one stream; c>=2: decode tok/s of all streams (tokens "
    "after each stream's first token over the time any stream was decoding), then output tok/s of all streams "
    "(which counts prefill); TTFT: the median time to token 1 for that prompt class, said as N x faster or slower. "
    "A setup measured under synthetic routing too is judged per routing: a paged mode under synthetic routing is "
    "compared with the other modes there (those measured only under the model's routing, whose speed does not "
    "depend on which experts are chosen, stand in every routing), never with itself under the model's routing. "
    "A configuration with fewer repeats (a search's one-cell probe) stands for its mode only where none has more. "
    "Unverified: a cell whose requests' decode rate disagreed with the engine's own timings, or whose tokens "
    "could not be timed."
)


def _setup_key(v: Verdict) -> tuple[str, str, str]:
    return v.run_id, v.workload, v.prompt_class


def _fmt(value: float, ttft: bool) -> str:
    return f"{value:.1f} ms" if ttft else f"{value:.1f} tok/s"


def _versus_view(v: Verdict, vs: Versus) -> dict[str, Any]:
    return {
        "css": "na" if vs.estimate is None else ("sig" if vs.discovery else "ns"),
        "other": vs.other_name,
        "other_label": vs.other,
        "winner_cells": " ".join(vs.winner_cells),
        "other_cells": " ".join(vs.other_cells),
        "estimate": vs.estimate,
        "text": vs.text(v.winner_name, v.ttft, vs.other_name),
        "corrected_away": vs.corrected_away,
        "other_median": _fmt(vs.other_median, v.ttft),
    }


def _setup_view(
    key: tuple[str, str, str], items: list[Verdict], caveats: list[str], budget_bytes: int | None
) -> dict[str, Any]:
    rows = []
    shown: set[tuple[str, int]] = set()
    for v in items:
        rows.append(
            {
                "verdict": v,
                # once per routing world and concurrency, above
                "yardstick_first": bool(v.yardstick) and (v.routing, v.concurrency) not in shown,
                "winner_median": _fmt(v.winner_median, v.ttft),
                "winner_cells": " ".join(v.versus[0].winner_cells),
                "versus": [_versus_view(v, vs) for vs in v.versus],
            }
        )
        if v.yardstick:
            shown.add((v.routing, v.concurrency))
    run_id, workload, prompt_class = key
    return {
        "run_id": run_id,
        "workload": workload,
        "prompt_class": prompt_class,
        "answer": headline(items, budget_bytes),
        "caveats": caveats,
        "rows": rows,
    }


def verdict_html(
    found: list[Verdict],
    caveats: Mapping[tuple[str, str, str], list[str]],
    budgets: Mapping[str, int | None] | None = None,
) -> str:
    """The first screen (templates/verdict.html.j2): one block per setup (its answer in a sentence, caveats,
    then the verdict table). `budgets`: each run's GPU memory budget (run id -> bytes), named in the answer."""
    by_setup: dict[tuple[str, str, str], list[Verdict]] = defaultdict(list)
    for v in found:
        by_setup[_setup_key(v)].append(v)
    setups = [
        _setup_view(key, items, caveats.get(key) or [], (budgets or {}).get(key[0])) for key, items in by_setup.items()
    ]
    return render("verdict.html.j2", setups=setups, how_to_read=HOW_TO_READ)


def verdict_markdown(
    found: list[Verdict],
    caveats: Mapping[tuple[str, str, str], list[str]],
    budgets: Mapping[str, int | None] | None = None,
) -> list[str]:
    """The same screen as markdown lines, for tables.md."""
    lines = ["## Verdict", "", HOW_TO_READ, ""]
    seen: set[tuple[str, str, str]] = set()
    flagged: set[tuple[str, str, str, str, int]] = set()
    for v in found:
        key = _setup_key(v)
        if key not in seen:
            seen.add(key)
            lines += [f"### {v.run_id} · {v.workload} · {v.prompt_class} prompts", ""]
            mine = [x for x in found if _setup_key(x) == key]
            lines += [" ".join(headline(mine, (budgets or {}).get(key[0]))), ""]
            lines += [f"- caveat: {note}" for note in caveats.get(key) or []]
        if v.yardstick and (*key, v.routing, v.concurrency) not in flagged:
            flagged.add((*key, v.routing, v.concurrency))
            where = f", {routing_phrase(v.routing)}" if v.routing else ""
            lines += [f"- UNVERIFIED, c={v.concurrency}{where}: {note}" for note in v.yardstick]
        best = "fastest" if v.significant else "best median (not significantly)"
        lines.append(
            f"- c={v.concurrency}, {v.metric_name}: {best} {v.winner_name} ({_fmt(v.winner_median, v.ttft)}); "
            + "; ".join(vs.text(v.winner_name, v.ttft, vs.other_name) for vs in v.versus)
        )
    return lines
