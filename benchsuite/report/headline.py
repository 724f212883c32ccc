"""The first sentence of each setup on the report's first screen: the answer in plain words, before any
table ("paged-fp8 K=40 decodes 1.34 x faster than llamacpp-16gb N=30 [1.33–1.35] at a 16 GB budget" or
"No mode is significantly faster here (3 repeats)").

It reads the setup's verdicts (report.verdict): the single-stream decode verdict (the lowest
concurrency measured when c=1 was not), then output tok/s at the highest concurrency; where the setup
was measured under synthetic routing too, those of the leading routing world (verdict.routing_worlds),
named, and a pointer to the others' rows. A mode is named
faster only when it is a discovery against every other mode after the page's correction
(`Verdict.significant`); the ratio quoted is against the runner-up, the closest other mode. Where
figures behind the verdict failed the cross-check against an engine's own timings or went untimed
(`Verdict.yardstick`), the sentence says so at once: an answer never reads plainer than its table.
"""

from __future__ import annotations

from benchsuite.report import stats
from benchsuite.report.verdict import DECODE_AGG_METRIC, TTFT_METRIC, Verdict, routing_phrase
from benchsuite.run.search import GB


def _repeats(v: Verdict) -> str:
    counts = sorted({v.versus[0].n_winner, *(vs.n_other for vs in v.versus)})
    return f"{counts[0]} repeats" if len(counts) == 1 else f"{counts[0]}–{counts[-1]} repeats"


def _ratio(v: Verdict) -> tuple[str, str]:
    e = v.versus[0].estimate
    assert e is not None  # only called for a significant verdict
    return f"{stats.times_text(e.ratio)} x", f"[{stats.times_text(e.low)}–{stats.times_text(e.high)}]"


def _unverified(v: Verdict) -> str:
    if not v.yardstick:
        return ""
    n = len(v.yardstick)
    figures, disagree = ("figure", "disagrees") if n == 1 else ("figures", "disagree")
    return (
        f" Unverified: {n} {figures} behind it {disagree} with the engine's own timings or went untimed (listed below)."
    )


def _sentence(v: Verdict, budget_bytes: int | None, streams: str) -> str:
    return _answer(v, budget_bytes, streams) + _unverified(v)


def _answer(v: Verdict, budget_bytes: int | None, streams: str) -> str:
    runner_up = v.versus[0]
    if runner_up.estimate is None:
        return f"{streams}, too few repeats to name a faster mode: {runner_up.verdict()}."
    if not v.significant:
        if runner_up.corrected_away:
            ratio, interval = _ratio(v)
            within = (
                f"{ratio} {runner_up.other_name} {interval}, an interval that excludes 1 but no discovery after "
                f"the page's correction"
            )
        elif not runner_up.discovery:
            within = f"within noise of {runner_up.other_name}"
        else:
            within = "within noise of another mode"
        return (
            f"{streams}, no mode is significantly faster here ({_repeats(v)}): {v.winner_name} has the highest "
            f"median, {within}."
        )
    ratio, interval = _ratio(v)
    budget = f" at a {budget_bytes / GB:.3g} GB budget" if budget_bytes else ""
    if v.metric == "decode_tok_s_p50" or v.metric == DECODE_AGG_METRIC:
        what = f"decodes {ratio} faster than"
    else:
        what = f"outputs {ratio} the tokens/s of"
    return f"{streams}, {v.winner_name} {what} {runner_up.other_name} {interval}{budget} ({_repeats(v)})."


def _streams(concurrency: int, routing: str = "") -> str:
    streams = "With one stream" if concurrency == 1 else f"With {concurrency} streams"
    return f"{streams} {routing_phrase(routing)}" if routing else streams


def headline(items: list[Verdict], budget_bytes: int | None) -> list[str]:
    """The setup's answer for the verdicts in the order report.verdict.verdicts gives them: the first
    routing world's single-stream sentence and its highest concurrency's; a setup measured under
    other routings too says where their verdicts are, with no sentence of their own (the first
    world is the one to judge by: report.verdict.routing_worlds)."""
    worlds = [r for r in dict.fromkeys(v.routing for v in items)
              if any(v.routing == r and v.metric != TTFT_METRIC and v.versus for v in items)]  # fmt: skip
    if not worlds:
        return []
    lead = worlds[0]
    throughput = [v for v in items if v.routing == lead and v.metric != TTFT_METRIC and v.versus]
    lowest = min(v.concurrency for v in throughput)
    first = next(v for v in throughput if v.concurrency == lowest)
    out = [_sentence(first, budget_bytes, _streams(lowest, lead))]
    highest = max(v.concurrency for v in throughput)
    if highest > lowest:
        last = next(
            (v for v in throughput if v.concurrency == highest and v.metric == "output_tok_s"),
            next(v for v in throughput if v.concurrency == highest),
        )
        out.append(_sentence(last, budget_bytes, _streams(highest, lead)))
    if len(worlds) > 1:
        out.append(f"The table below also compares the modes {' and '.join(routing_phrase(r) for r in worlds[1:])}.")
    return out
