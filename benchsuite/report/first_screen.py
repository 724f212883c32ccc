"""The report's first screen rendered: per setup, its caveats, then one row per concurrency and metric
with the fastest configuration and "A is N x B [low–high], verdict" against every other mode, headed
per concurrency by an "Unverified figures" row naming the configurations whose cells failed the
cross-check against the engine's own timings or went untimed (Verdict.yardstick) (HTML,
with the numbers also in data- attributes so a browser test can check them against cells.parquet;
and markdown lines for tables.md)."""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Mapping

from benchsuite import stats
from benchsuite.report.verdict import Verdict

HOW_TO_READ = (
    "A is N x B: N = A / B, the ratio of geometric means over each configuration's ok repeats, with its 95% "
    "interval (Welch t on log values); significant when it is a discovery after Benjamini-Hochberg over every "
    "comparison on this page at 5% (among many comparisons an interval can miss 1 by chance). With fewer than "
    f"{stats.MIN_REPEATS} ok repeats on a side there is no verdict. Each mode is represented by its best "
    "configuration (best K, best N). c=1: decode tok/s of one stream; c>=2: decode tok/s of all streams (tokens "
    "after each stream's first token over the time any stream was decoding), then output tok/s of all streams "
    "(which counts prefill); TTFT: the median time to token 1 for that prompt class (lower is faster). "
    "Unverified: a cell whose requests' decode rate disagreed with the engine's own timings, or whose tokens "
    "could not be timed."
)


def _setup_key(v: Verdict) -> tuple[str, str, str]:
    return v.run_id, v.workload, v.prompt_class


def _fmt(value: float, ttft: bool) -> str:
    return f"{value:.1f} ms" if ttft else f"{value:.1f} tok/s"


def _versus_html(v: Verdict) -> str:
    parts = []
    for vs in v.versus:
        e = vs.estimate
        css = "na" if e is None else ("sig" if vs.discovery else "ns")
        data = (
            f' data-metric="{v.metric}" data-winner="{html.escape(v.winner)}" data-other="{html.escape(vs.other)}"'
            f' data-winner-cells="{html.escape(" ".join(vs.winner_cells))}"'
            f' data-other-cells="{html.escape(" ".join(vs.other_cells))}"'
        )
        if e is not None:
            data += f' data-ratio="{e.ratio!r}" data-low="{e.low!r}" data-high="{e.high!r}"'
        parts.append(
            f'<div class="vs {css}"{data}>{html.escape(vs.text(v.winner, v.ttft))} '
            f'<span class="other">({html.escape(vs.other)}: {_fmt(vs.other_median, v.ttft)})</span></div>'
        )
    return "".join(parts)


def _yardstick_row(v: Verdict) -> str:
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in v.yardstick)
    return (
        f'<tr class="yardstick-flag" data-concurrency="{v.concurrency}"><td>c={v.concurrency}</td>'
        f'<td colspan="3"><strong>Unverified figures</strong> (the verdicts below use them):<ul>{notes}</ul></td></tr>'
    )


def verdict_html(found: list[Verdict], caveats: Mapping[tuple[str, str, str], list[str]]) -> str:
    """The first screen: one block per setup (caveats first, then the verdict table)."""
    if not found:
        return (
            '<section id="verdict"><h2>Verdict</h2><p>No verdict: fewer than two modes have an ok measurement in '
            "any setup (see the tables below).</p></section>"
        )
    by_setup: dict[tuple[str, str, str], list[Verdict]] = defaultdict(list)
    for v in found:
        by_setup[_setup_key(v)].append(v)
    parts = [
        '<section id="verdict"><h2>Verdict: which mode is fastest, by how much</h2>',
        f'<p class="caption">{html.escape(HOW_TO_READ)}</p>',
    ]
    for index, (key, items) in enumerate(by_setup.items()):
        run_id, workload, prompt_class = key
        parts.append(f"<h3>{html.escape(run_id)} · {html.escape(workload)} · {html.escape(prompt_class)} prompts</h3>")
        notes = caveats.get(key) or []
        if notes:
            parts.append('<ul class="caveats">' + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
        rows = []
        shown: set[int] = set()
        for v in items:
            if v.yardstick and v.concurrency not in shown:  # once per concurrency, above its verdicts
                shown.add(v.concurrency)
                rows.append(_yardstick_row(v))
            rows.append(
                f"<tr><td>c={v.concurrency}</td><td>{html.escape(v.metric_name)}</td>"
                f'<td class="winner" data-metric="{v.metric}" data-value="{v.winner_median!r}"'
                f' data-cells="{html.escape(" ".join(v.versus[0].winner_cells))}">'
                f"<strong>{html.escape(v.winner)}</strong>: {_fmt(v.winner_median, v.ttft)}</td>"
                f"<td>{_versus_html(v)}</td></tr>"
            )
        parts.append(
            f'<table class="verdict" id="verdict-{index}"><colgroup><col style="width:7%"><col style="width:16%">'
            f'<col style="width:22%"><col style="width:55%"></colgroup><thead><tr><th>streams</th><th>metric</th>'
            f"<th>fastest (median)</th><th>against each other mode</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>"
        )
    parts.append("</section>")
    return "\n".join(parts)


def verdict_markdown(found: list[Verdict], caveats: Mapping[tuple[str, str, str], list[str]]) -> list[str]:
    """The same screen as markdown lines, for tables.md."""
    lines = ["## Verdict", "", HOW_TO_READ, ""]
    seen: set[tuple[str, str, str]] = set()
    flagged: set[tuple[str, str, str, int]] = set()
    for v in found:
        key = _setup_key(v)
        if key not in seen:
            seen.add(key)
            lines += [f"### {v.run_id} · {v.workload} · {v.prompt_class} prompts", ""]
            lines += [f"- caveat: {note}" for note in caveats.get(key) or []]
        if v.yardstick and (*key, v.concurrency) not in flagged:
            flagged.add((*key, v.concurrency))
            lines += [f"- UNVERIFIED, c={v.concurrency}: {note}" for note in v.yardstick]
        lines.append(
            f"- c={v.concurrency}, {v.metric_name}: fastest {v.winner} ({_fmt(v.winner_median, v.ttft)}); "
            + "; ".join(vs.text(v.winner, v.ttft) for vs in v.versus)
        )
    return lines
