"""The report's opening: which engines really ran (and a plain statement for those that did not, and
for the planned cells a stopped run never measured: report.unmeasured), machine facts, git provenance,
fairness settings, every server's exact command and version, the metric definitions, and warnings
(synthetic routing, failed cells). HTML and markdown lines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from benchsuite.engines import KINDS
from benchsuite.measure import metrics
from benchsuite.report import unmeasured
from benchsuite.report.flags import cell_flags, prompt_length_mismatches
from benchsuite.report.groups import is_synthetic
from benchsuite.report.load import RunData
from benchsuite.report.names import server_names
from benchsuite.report.noise import busy_warning
from benchsuite.report.template_env import render

REPORT_DEFINITIONS: tuple[tuple[str, str], ...] = (
    (
        "spread",
        "min / median / max over a configuration's ok repeats; failed or invalid repeats are never counted as 0",
    ),
    (
        "ratio",
        "A / B = ratio of the geometric means over ok repeats, written 'A is N x B'; the interval is 95% "
        "(Welch t on log values over repeats, benchsuite.report.stats): significant when it excludes 1; fewer than 2 "
        "ok repeats a side: not enough repeats",
    ),
    ("headline metric", "decode_tok_s_p50 at concurrency 1, output_tok_s above 1 (the published layout)"),
    ("per-request figures", "warm requests only (warmup and the cold first request after a start excluded)"),
)


def definitions() -> list[tuple[str, str]]:
    """Every metric's formula, as benchsuite.measure.metrics defines it, then the report's own terms."""
    return [*metrics.DEFINITIONS.items(), *REPORT_DEFINITIONS]


@dataclass(frozen=True)
class EngineStatus:
    kind: str
    engines: tuple[str, ...]
    ok_cells: int
    other_cells: int
    # planned cells with no stored result, of how many planned (report.unmeasured); none in a manifest older
    # than `planned`
    gap: unmeasured.Gap = unmeasured.Gap()

    @property
    def ran(self) -> bool:
        return self.ok_cells + self.other_cells > 0

    def statement(self) -> str:
        gap = self.gap.clause()
        if not self.ran:
            text = (
                f"{self.kind}: NOT RUN. These results contain no {self.kind} cell; "
                f"nothing in this report describes {self.kind}."
            )
            return f"{text} {gap}." if gap else text
        names = ", ".join(self.engines)
        if self.ok_cells == 0:
            text = (
                f"{self.kind}: attempted ({names}) but NO cell succeeded ({self.other_cells} failed or invalid); "
                f"no {self.kind} number appears in this report."
            )
            return f"{text} {gap}." if gap else text
        counts = f"{self.kind}: run ({names}): {self.ok_cells} ok cells, {self.other_cells} failed or invalid"
        return f"{counts}, {gap}." if gap else f"{counts}."


def engine_statuses(cells: pd.DataFrame, gaps: Sequence[unmeasured.RunGaps]) -> list[EngineStatus]:
    by_kind = unmeasured.kind_gaps(gaps)
    out = []
    for kind in KINDS:
        mine = cells[cells["engine_kind"] == kind]
        ok = int((mine["status"] == "ok").sum())
        gap = by_kind.get(kind, unmeasured.Gap())
        out.append(EngineStatus(kind, tuple(sorted(set(mine["engine"]))), ok, len(mine) - ok, gap))
    return out


def unmeasured_matrix_engines(runs: list[RunData], cells: pd.DataFrame) -> list[str]:
    measured = set(cells["engine"])
    return sorted(
        {f"{name} ({kind})" for run in runs for name, kind in run.facts.matrix_engines.items() if name not in measured}
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def warnings(cells: pd.DataFrame, requests: pd.DataFrame) -> list[tuple[str, str]]:
    """(css class, text) banners."""
    out = []
    synthetic = sorted({r for r in cells["routing"] if is_synthetic(r)})
    if synthetic:
        out.append(
            (
                "warn",
                (
                    f"SYNTHETIC ROUTING: {int(cells['routing'].map(is_synthetic).sum())} cells used synthetic routing "
                    f"({', '.join(synthetic)}), not a real model's router. "
                    "Paging results from synthetic routing do not "
                    f"predict real-model paging; they are labelled SYNTHETIC wherever they appear."
                ),
            )
        )
    bad = cells[cells["status"] != "ok"]
    if len(bad):
        out.append(
            (
                "bad",
                (
                    f"{len(bad)} of {len(cells)} cells failed or are invalid; they are excluded from every figure and "
                    f"listed with their reasons under 'Failed and invalid cells'."
                ),
            )
        )
    busy = busy_warning(cells)
    if busy:
        out.append(("warn", busy))
    flagged = [c for _, c in cells.iterrows() if cell_flags(c)]
    if flagged:
        out.append(
            (
                "warn",
                (
                    f"Warnings (engine, client, engine timings) on {_count(len(flagged), 'cell')} "
                    "(see the 'flags' column of the configurations table), "
                    f"for example {flagged[0]['cell_id']}: {cell_flags(flagged[0])[0]}"
                ),
            )
        )
    lengths = prompt_length_mismatches(cells, requests)
    if len(lengths):
        first = lengths.iloc[0]
        out.append(
            (
                "bad",
                (
                    f"{_count(len(lengths), 'prompt')} reached the engines as different prompt lengths "
                    "(server usage.prompt_tokens), "
                    f"e.g. {first['prompt_id']} ({first['prompt_class']}): {first['prompt_tokens_by_engine']}. "
                    f"Engines did not do the same work for these prompts."
                ),
            )
        )
    return out


def _requests(runs: list[RunData]) -> pd.DataFrame:
    return pd.concat([r.requests for r in runs], ignore_index=True)


def canary_warnings(runs: list[RunData]) -> list[tuple[str, str]]:
    """A red banner per server whose leak canary failed (no cell is marked failed for it)."""
    return [
        (
            "bad",
            (
                f"LEAK CANARY FAILED on server {s.server_id} ({s.engine}, run {run.run_id}): {s.canary}. "
                "A marker planted "
                f"in one request came back in another request's response: this engine served one request's state to "
                f"another. The canary's responses are in manifest.json (servers.{s.server_id}.canary)."
            ),
        )
        for run in runs
        for s in run.facts.servers
        if s.canary_failed
    ]


def _run_view(run: RunData, cells: pd.DataFrame) -> dict[str, Any]:
    facts = run.facts
    return {
        "names": server_names(run.run_id, cells),
        "run_id": run.run_id,
        "run_dir": run.run_dir,
        "machine": facts.machine,
        "invocations": facts.invocations,
        "source": facts.source,
        "fairness": facts.fairness,
        "servers": facts.servers,
        "sized": [s for s in facts.servers if s.expert_bytes],  # byte-matched experts (FP8 against Q8_0, ...)
    }


def header_html(runs: list[RunData], cells: pd.DataFrame) -> str:
    """The opening as HTML (templates/header.html.j2)."""
    gaps = [unmeasured.run_gaps(run) for run in runs]
    return render(
        "header.html.j2",
        banners=canary_warnings(runs) + warnings(cells, _requests(runs)),
        statuses=engine_statuses(cells, gaps),
        gaps=unmeasured.statements(gaps, cells),
        unmeasured=unmeasured_matrix_engines(runs, cells),
        runs=[_run_view(run, cells) for run in runs],
        definitions=definitions(),
    )


def header_markdown(runs: list[RunData], cells: pd.DataFrame) -> list[str]:
    lines = [f"> **{text}**" for _, text in canary_warnings(runs) + warnings(cells, _requests(runs))]
    lines.append("")
    gaps = [unmeasured.run_gaps(run) for run in runs]
    lines.extend(f"- {s.statement()}" for s in engine_statuses(cells, gaps))
    lines.extend(f"- {text}" for text in unmeasured.statements(gaps, cells))
    lines.extend(
        f"- {name}: named by the matrix but has no results (not run)."
        for name in unmeasured_matrix_engines(runs, cells)
    )
    for run in runs:
        names = server_names(run.run_id, cells)
        lines.append(
            f"\n**Run {run.run_id}**: " + "; ".join(f"{k}={v}" for k, v in run.facts.machine + run.facts.source)
        )
        lines.extend(f"- invocation {i}: {line}" for i, line in enumerate(run.facts.invocations, start=1))
        lines.extend(
            f"- `{names.get(s.server_id, s.engine)}` ({s.kind}, {s.version}, {s.startup}, canary: {s.canary}): "
            f"`{s.command}`"
            for s in run.facts.servers
        )
    return lines
