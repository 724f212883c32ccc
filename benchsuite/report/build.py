"""write_report: results run directories in, reports/<run-id>/{index.html, tables.md, tables.csv} out.

Pipeline: load runs -> annotate cells (labels, K, N) -> fold repeats into configurations ->
verdicts (the first screen, with their caveats) + tables + figures -> one HTML page, one markdown
file, one CSV file.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from benchsuite.errors import UserError
from benchsuite.report import decode_bounds, nodes, prefill, prefill_requests, roofline, search_section, unmeasured
from benchsuite.report import tables as tb
from benchsuite.report.caveats import random_weight_models, setup_caveats, setup_servers
from benchsuite.report.display import display_frame
from benchsuite.report.figures import all_figures, missing_figures
from benchsuite.report.first_screen import verdict_html, verdict_markdown
from benchsuite.report.groups import annotate_cells, group_configs
from benchsuite.report.header import header_html, header_markdown
from benchsuite.report.html import Section, render_page
from benchsuite.report.load import RunData, load_run
from benchsuite.report.memory_figure import MISSING as MEMORY_MISSING
from benchsuite.report.memory_figure import speed_memory_figures
from benchsuite.report.paging_figures import HIT_RATE_NOTE, HIT_RATE_TITLE, hit_rate_table
from benchsuite.report.plot import Figure
from benchsuite.report.publish import report_folder
from benchsuite.report.published import (
    find_reference,
    load_published,
    reference_decode_table,
    reference_ttft_table,
)
from benchsuite.report.samples import request_samples
from benchsuite.report.textout import write_csv, write_markdown
from benchsuite.report.verdict import Verdict, verdict_table, verdicts
from benchsuite.tools.reference import Reference, load_reference

INDEX_NAME = "index.html"


@dataclass(frozen=True)
class ReportData:
    title: str
    runs: list[RunData]
    cells: pd.DataFrame  # annotated cells of all runs
    groups: pd.DataFrame  # one row per configuration
    samples: pd.DataFrame  # per-request samples
    top_k: int | None
    num_experts: int | None
    published: Reference | None
    reference_note: str  # why the published view is (not) shown
    tables: dict[str, pd.DataFrame]
    figures: list[Figure]
    verdicts: list[Verdict]  # the first screen
    caveats: dict[tuple[str, str, str], list[str]]  # (run, workload, prompt class) -> caveats beside its verdict


def _report_id(runs: list[RunData]) -> str:
    return "+".join(r.run_id for r in runs)


def _reference(runs: list[RunData], reference_dirs: list[Path] | None) -> tuple[Reference | None, dict[str, str], str]:
    """The published reference the first run's matrix names: the shipped data (benchsuite.tools.reference),
    or a file found in `reference_dirs` when given (tests, a user's own figures)."""
    for run in runs:
        name = run.facts.reference_name
        if name is None:
            continue
        if reference_dirs is None:
            try:
                published = load_reference(name)
            except UserError as exc:
                return None, {}, f"The matrix names reference '{name}': {exc}."
            return (
                published,
                run.facts.reference_filter,
                f"Published figures from {name} ({name}.yaml, shipped).",
            )
        path = find_reference(name, reference_dirs)
        if path is None:
            return (
                None,
                {},
                f"The matrix names reference '{name}', but no {name}.yaml was found in "
                f"{', '.join(map(str, reference_dirs))}.",
            )
        return (
            load_published(name, path),
            run.facts.reference_filter,
            f"Published figures from {name} ({path.name}).",
        )
    return None, {}, "The matrix names no published reference."


def build_report_data(run_dirs: list[Path], reference_dirs: list[Path] | None = None) -> ReportData:
    if not run_dirs:
        raise UserError("report: give at least one results run directory")
    runs = [load_run(Path(d)) for d in run_dirs]
    many = len(runs) > 1
    # each cell carries its run's GPU memory budget: configurations over it are no contenders (report/budget.py)
    cells = pd.concat([annotate_cells(r.cells, many).assign(budget_bytes=r.facts.budget_bytes)
                       for r in runs], ignore_index=True)  # fmt: skip
    groups = group_configs(cells)
    samples = pd.concat([request_samples(r.requests) for r in runs], ignore_index=True)
    top_k = next((r.facts.model.top_k for r in runs if r.facts.model.top_k), None)
    num_experts = next((r.facts.model.num_experts for r in runs if r.facts.model.num_experts), None)
    published, row_filter, note = _reference(runs, reference_dirs)
    if published is not None and (top_k is None or num_experts is None) and _serves_model(runs, published.model):
        shape = published.raw.get("model_shape") or {}  # a hub id (no local config.json) of the published model
        top_k = top_k or shape.get("top_k")
        num_experts = num_experts or shape.get("num_experts")
    found = verdicts(groups, cells, synthetic_first=_random_weight_setups(runs, cells))
    caveats = {key: _caveats(runs, cells, key) for key in {(v.run_id, v.workload, v.prompt_class) for v in found}}
    tables: dict[str, pd.DataFrame] = {
        "Verdict": verdict_table(found),
        "Paged vs baselines (published layout)": tb.ratio_table(groups, cells),
    }
    if published is not None:
        tables[f"Published {published.name} vs yours: decode"] = reference_decode_table(
            published, row_filter, groups, cells
        )
        tables[f"Published {published.name} vs yours: TTFT p50"] = reference_ttft_table(
            published, row_filter, groups, cells
        )
    tables.update(
        {
            "Configurations (repeats with spread)": tb.summary_table(groups, top_k),
            "TTFT p50 short vs long prompts": tb.ttft_table(groups),
            "Paging counters": tb.paging_table(groups, num_experts),
            HIT_RATE_TITLE: hit_rate_table(cells),
            roofline.TITLE: roofline.roofline_table(cells, runs),
            decode_bounds.TITLE: decode_bounds.decode_bounds_table(cells, runs),
            prefill.TITLE: prefill.prefill_table(cells, runs),
            prefill_requests.TITLE: prefill_requests.prefill_requests_table(cells, runs),
            search_section.TITLE: search_section.search_table(cells, runs),
        }
    )
    by_node = nodes.nodes_table(cells, runs)
    if not by_node.empty:  # only a run spread over several machines (run --ray)
        tables[nodes.TITLE] = by_node
    tables.update(
        {
            "Failed and invalid cells": tb.failures_table(cells),
            "Raw cells": tb.raw_cells_table(cells),
        }
    )
    figures = all_figures(groups, cells, samples, top_k, num_experts, tables[search_section.TITLE])
    title = f"benchsuite report: {_report_id(runs)}"
    return ReportData(
        title, runs, cells, groups, samples, top_k, num_experts, published, note, tables, figures, found, caveats
    )


def _random_weight_setups(runs: list[RunData], cells: pd.DataFrame) -> set[tuple[str, str, str]]:
    """Setups that served a random-weight model: their synthetic-routing verdicts lead (its own routing
    stands for no trained model's; report/locality.py)."""
    out = set()
    for run in runs:
        for (workload, prompt_class), mine in cells[cells["run_id"] == run.run_id].groupby(
            ["workload", "prompt_class"]
        ):
            if random_weight_models(setup_servers(mine, run.facts.records)):
                out.add((run.run_id, str(workload), str(prompt_class)))
    return out


def _caveats(runs: list[RunData], cells: pd.DataFrame, key: tuple[str, str, str]) -> list[str]:
    run = next(r for r in runs if r.run_id == key[0])
    mine = cells[(cells["run_id"] == key[0]) & (cells["workload"] == key[1]) & (cells["prompt_class"] == key[2])]
    return setup_caveats(mine, run.facts.records, run.facts.has_gpu, run.facts.nodes, run.requests)


_ANCHORS = {
    "Paged vs baselines (published layout)": "ratios",
    "Configurations (repeats with spread)": "configurations",
    "TTFT p50 short vs long prompts": "ttft",
    "Paging counters": "paging",
    HIT_RATE_TITLE: "hit-rate-optimal",
    search_section.TITLE: "search",
    nodes.TITLE: "nodes",
    roofline.TITLE: "roofline",
    decode_bounds.TITLE: decode_bounds.ANCHOR,
    prefill.TITLE: "prefill",
    prefill_requests.TITLE: prefill_requests.ANCHOR,
    "Failed and invalid cells": "failures",
    "Raw cells": "raw-cells",
}
_INTROS = {
    "roofline": roofline.INTRO,
    decode_bounds.ANCHOR: decode_bounds.INTRO,
    "prefill": prefill.INTRO,
    prefill_requests.ANCHOR: prefill_requests.INTRO,
    "hit-rate-optimal": f"<p>{html.escape(HIT_RATE_NOTE)}</p>",
    "ratios": "<p>One row per paged configuration: the best offload, llama.cpp and cpu-experts configuration "
    "measured in the same setup and concurrency. Medians over repeats, [min–max] beside them; ratio verdicts say "
    "whether the spreads overlap.</p>",
    "search": search_section.INTRO,
    "nodes": nodes.INTRO,
    "failures": "<p>Cells that failed or were invalidated, with the reason recorded by the runner. "
    "They are not in any figure.</p>",
    "raw-cells": "<p>Every cell as stored in cells.parquet; every figure and table above links here by cell id.</p>",
}


# Why a section has nothing to show, said in one line instead of an empty table (anchor -> reason).
_EMPTY = {
    "ratios": "no paged configuration was measured",
    "configurations": "no configuration was measured",
    "ttft": "no configuration has a TTFT for a short or a long prompt class",
    "paging": "no engine reported paging counters",
    "hit-rate-optimal": "no paged cell reported paging counters",
    "roofline": "no paged or offload cell with paging counters and a measured link",
    decode_bounds.ANCHOR: "no paged cell",
    "prefill": "no paged cell recorded its prefill page-in",
    prefill_requests.ANCHOR: prefill_requests.EMPTY,
    "search": "no budget search ran",
    "failures": "every cell was ok",
    "raw-cells": "no cell",
}
NOT_SHOWN = "not-shown"


def _one_note(frame: pd.DataFrame) -> str | None:
    """The note every row of a table carries, when they all carry the same one and the table holds no
    measurement: the table is filler (each row says why its figure is missing), said once instead. A
    shared note often explains one missing column beside measured ones (the link bound of a run with no
    resident cell, a hit rate stored before its optimum was): such a table is shown."""
    if "note" not in frame or frame.empty or _measured(frame):
        return None
    notes = {str(n) for n in frame["note"]}
    note = next(iter(notes))
    return note if len(notes) == 1 and note.strip() and note != "nan" else None


def _measured(frame: pd.DataFrame) -> bool:
    """Whether any cell of a float column (rates, seconds, fractions, bytes per token: what tables
    measure; their labels, K, N and concurrency, are integers or text) holds a value."""
    floats = frame.drop(columns="note").select_dtypes(include="floating")
    return bool(floats.notna().to_numpy().any())


def _not_shown(empty: list[tuple[str, str]], not_measured: list[tuple[str, list[str]]]) -> Section:
    """The sections with nothing to show, one line each (title: why), then the planned cells no run
    measured (report.unmeasured), one line per run with its cells below it."""
    items = "".join(f"<li>{html.escape(title)}: {html.escape(why)}.</li>" for title, why in empty)
    intro = f"<p>Sections with nothing to show in these runs:</p><ul>{items}</ul>" if empty else ""
    runs = ""
    for line, cells in not_measured:
        listed = "".join(f"<li>{html.escape(cell)}</li>" for cell in cells)
        runs += f"<li>{html.escape(line)}:<ul>{listed}</ul></li>"
    return Section("Not shown", NOT_SHOWN, intro + (f"<ul>{runs}</ul>" if runs else ""), None)


def _not_shown_markdown(empty: list[tuple[str, str]], not_measured: list[tuple[str, list[str]]]) -> list[str]:
    """tables.md's "Not shown": the same lines as the page's, as a (nested) list."""
    if not (empty or not_measured):
        return []
    lines = ["## Not shown", "", *(f"- {title}: {why}." for title, why in empty)]
    for line, cells in not_measured:
        lines += [f"- {line}:", *(f"  - {cell}" for cell in cells)]
    return lines


def nothing_to_show(data: ReportData) -> list[tuple[str, str]]:
    """(title, why) of each table with nothing to show: empty, filler (one note on every row), or the
    published reference the matrix does not name. The page and tables.md list them once, not as tables."""
    empty: list[tuple[str, str]] = []
    if data.published is None:
        note = data.reference_note.rstrip(".")
        empty.append(("Published reference", note[:1].lower() + note[1:]))
    for name, frame in data.tables.items():
        if name == "Verdict" or name.startswith("Published"):
            continue
        if frame.empty:
            empty.append((name, _EMPTY[_ANCHORS[name]]))
            continue
        filler = _one_note(frame)
        if filler is not None:
            empty.append((name, f"{filler} (so every one of its {len(frame)} rows said)"))
    return empty


def _sections(data: ReportData) -> tuple[list[Section], list[Section]]:
    before: list[Section] = []
    after: list[Section] = []
    empty = nothing_to_show(data)
    hidden = {title for title, _ in empty}
    for name, frame in data.tables.items():
        if name == "Verdict" or name in hidden:
            continue  # the first screen (rendered by first_screen), or listed under "Not shown"
        if name.startswith("Published"):
            anchor = "reference-ttft" if name.endswith("TTFT p50") else "reference-decode"
            intro = (
                f"<p>{html.escape(data.reference_note)} "
                "Published values are transcribed facts; 'yours' come from this run.</p>"
            )
            before.append(Section(name, anchor, intro, frame))
            continue
        anchor = _ANCHORS[name]
        section = Section(name, anchor, _INTROS.get(anchor, ""), frame)
        (before if anchor == "ratios" else after).append(section)
    not_measured = unmeasured.not_measured_items(data.runs, data.cells)
    if empty or not_measured:
        after.append(_not_shown(empty, not_measured))
    return before, after


def _serves_model(runs: list[RunData], model: str) -> bool:
    """Whether some server was started on the named model (its name appears in the exact command)."""
    return bool(model) and any(model.lower() in s.command.lower() for r in runs for s in r.facts.servers)


def default_out_dir(runs: list[RunData]) -> Path:
    return Path.cwd() / "reports" / _report_id(runs)


def write_report(run_dirs: list[Path], out_dir: Path | None = None, reference_dirs: list[Path] | None = None) -> Path:
    """Write index.html, tables.md and tables.csv for the given results runs; return index.html's path."""
    data = build_report_data(run_dirs, reference_dirs)
    target = Path(out_dir) if out_dir is not None else default_out_dir(data.runs)
    before, after = _sections(data)
    budgets = {r.run_id: r.facts.budget_bytes for r in data.runs}
    first = verdict_html(data.verdicts, data.caveats, budgets)
    answered = tuple(dict.fromkeys((v.run_id, v.workload, v.prompt_class) for v in data.verdicts))
    lead = speed_memory_figures(data.groups, data.cells, answered)
    page = render_page(
        data.title,
        header_html(data.runs, data.cells),
        before,
        data.figures,
        missing_figures(data.figures),
        after,
        first_screen=first,
        lead_figures=tuple(lead),
        lead_missing="" if lead else MEMORY_MISSING,
    )
    preamble = [
        *verdict_markdown(data.verdicts, data.caveats, budgets),
        "",
        *header_markdown(data.runs, data.cells),
        "",
        data.reference_note,
    ]
    empty = nothing_to_show(data)
    hidden = {title for title, _ in empty} | {"Verdict"}
    shown = {k: display_frame(v) for k, v in data.tables.items() if k not in hidden}
    trailer = _not_shown_markdown(empty, unmeasured.not_measured_items(data.runs, data.cells))
    with report_folder(target) as staging:  # moved into place whole (report.publish)
        (staging / INDEX_NAME).write_text(page, encoding="utf-8")
        write_markdown(staging / "tables.md", data.title, preamble, shown, trailer)
        write_csv(staging / "tables.csv", data.tables)
    index = target / INDEX_NAME
    return index
