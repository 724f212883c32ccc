"""What `benchsuite compare` prints by default: one line of counts, then only the flagged rows.

Owns the terminal reading of a `Comparison` (benchsuite.report.compare): how many configurations
were compared and how their comparisons (one per configuration and metric) came out: flagged
faster, flagged slower, not significant, significant but within the threshold, not comparable (too
few repeats, or no ok value on one side); then each flagged comparison with its change and
interval, or one line saying nothing was flagged; and which configurations generated other text on the two
sides (benchsuite.report.outputs: their decode figures measured other tokens). The full tables stay in compare.md
and `--columns all`.
"""

from __future__ import annotations

from collections import Counter

import pandas as pd

from benchsuite.report.compare import SUMMARY_METRICS, Comparison, change_text
from benchsuite.report.outputs import changes_work
from benchsuite.report.textout import markdown_table

IMPROVED, REGRESSED = "IMPROVED", "REGRESSED"
NOT_SIGNIFICANT = "not significant"
BELOW_THRESHOLD = "significant, below threshold"


def outcome(verdict: str) -> str:
    """A comparison's verdict as counted: faster, slower, not significant, within, not comparable."""
    return {
        IMPROVED: "faster",  # every metric compared is a speed: higher tok/s or lower TTFT
        REGRESSED: "slower",
        NOT_SIGNIFICANT: "not significant",
        BELOW_THRESHOLD: "within",
    }.get(verdict, "not comparable")  # too few repeats, or no ok value on one side


def counts_line(c: Comparison) -> str:
    """One line: configurations compared, then their comparisons by outcome."""
    rows = c.rows
    configurations = len(rows.groupby(["configuration", "workload", "prompt_class", "concurrency"])) if len(rows) else 0
    counted = Counter(outcome(str(v)) for v in rows["verdict"]) if len(rows) else Counter()
    metrics = ", ".join(title for _, title in SUMMARY_METRICS)
    parts = [
        f"{counted['faster']} flagged faster",
        f"{counted['slower']} flagged slower",
        f"{counted['not significant']} not significant",
    ]
    if counted["within"]:
        parts.append(f"{counted['within']} significant but within {c.threshold * 100:g}%")
    parts.append(f"{counted['not comparable']} not comparable (too few repeats or no ok value)")
    line = (
        f"{c.run_a} (A) -> {c.run_b} (B): {configurations} configuration{'' if configurations == 1 else 's'} compared "
        f"({len(rows)} comparisons: {metrics}): {', '.join(parts)}"
    )
    unmatched = [f"{len(labels)} only in {run}" for run, labels in ((c.run_a, c.only_a), (c.run_b, c.only_b)) if labels]
    return line + (f"; {', '.join(unmatched)}" if unmatched else "")


def differing_outputs(c: Comparison) -> list[str]:
    """'configuration · workload · prompt class · c=N (differ: k of n prompts)' where the sides' texts differ in a
    paged configuration under the model's routing (under synthetic routing other text routes to the same experts;
    outside paged mode a token of other text costs the same work)."""
    if not len(c.rows) or "outputs" not in c.rows:
        return []
    keys = ["configuration", "workload", "prompt_class", "concurrency"]
    return [
        f"{label} · {workload} · {prompt_class} · c={concurrency} ({group.iloc[0]['outputs']})"
        for (label, workload, prompt_class, concurrency), group in c.rows.groupby(keys, sort=False)
        if changes_work(str(group.iloc[0]["outputs"]))
    ]


def flagged_frame(c: Comparison) -> pd.DataFrame:
    """One row per flagged comparison: where, which metric, A -> B (change [interval]), faster or slower, and
    whether the two sides generated the same text (the column left out where no flagged row's texts were known)."""
    titles = dict(SUMMARY_METRICS)
    out = [
        {
            "configuration": f"{r['configuration']} · {r['workload']} · {r['prompt_class']} · c={r['concurrency']}",
            "metric": titles.get(r["metric"], r["metric"]),
            "A → B (change [interval])": change_text(r),
            "flagged": outcome(str(r["verdict"])),
            "outputs": r.get("outputs", ""),
        }
        for _, r in c.flagged.iterrows()
    ]
    frame = pd.DataFrame(out, columns=["configuration", "metric", "A → B (change [interval])", "flagged", "outputs"])
    # the outputs column only where a flagged row's texts were compared (an engine that streams none says nothing)
    return frame if (frame["outputs"].fillna("") != "").any() else frame.drop(columns=["outputs"])


def terminal_text(c: Comparison) -> str:
    """The counts, the A/A statement where it applies, then the flagged rows or why there are none."""
    lines = [counts_line(c)]
    if c.same_source:
        lines.append(c.same_source)
    rule = f"significant after Benjamini-Hochberg at {c.alpha:g} and over {c.threshold * 100:g}%"
    if len(c.flagged):
        lines += ["", f"flagged ({rule}, tested over {c.level}):", markdown_table(flagged_frame(c)).rstrip("\n")]
    else:
        lines.append(f"nothing flagged: no change is {rule} (tested over {c.level})")
    differ = differing_outputs(c)
    if differ:
        lines += [
            "",
            f"generated other text in A and B ({len(differ)}): their decode figures measured other tokens, so a "
            "change there is partly other work, not only the engine (benchsuite.report.outputs):",
        ]
        lines += [f"- {entry}" for entry in differ]
    return "\n".join(lines)
