"""Run comparison: `benchsuite compare RUN_A RUN_B` (or several runs a side: `RUN_A1 RUN_A2 --vs RUN_B1
RUN_B2`). Configurations are matched by their resolved spec (engine, kind, mode, params, workload,
prompt class, concurrency, routing), which also matches identical cell ids. Per matched
configuration and metric (decode tok/s p50, TTFT p50, output tok/s of each cell):

- the level tested is where the noise lives: with two or more runs a side, the RUN (each run's value
  is the median of its ok repeats), else the REPEAT (every ok cell is one value); never the request
  (requests of one cell share its machine state: testing them called between-run noise significant);
- change = B / A - 1 with its interval: benchsuite.report.stats.ratio_estimate of B over A (Welch t on log
  values); fewer than stats.MIN_REPEATS values a side: "not enough repeats", never flagged;
- flagged only when the change is a discovery after Benjamini-Hochberg over all rows at alpha AND
  |change| > threshold; the page says when A and B ran the same commit and matrix (an A/A comparison:
  every flag there is a false alarm) and which rows were measured on a busy machine;
- outputs: whether the configuration's requests generated the same text on both sides, prompt by prompt
  (benchsuite.report.outputs): where they differ, a decode figure's change is partly other work measured.

Printed, a comparison reads as one line of counts and the flagged rows only
(benchsuite.report.compare_text); `--columns all` prints the full table of one row per configuration
and metric, as compare.md always has; `summary_frame` (one row per configuration with the columns a
user reads first: decode tok/s, TTFT, output tok/s, each "A → B (change [interval])", peak device
memory, the flags) is the markdown's default table.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from benchsuite.report import stats
from benchsuite.report.budget import device_bytes
from benchsuite.report.groups import annotate_cells, is_synthetic
from benchsuite.report.load import RunData, load_run
from benchsuite.report.noise import busy_cells
from benchsuite.report.outputs import outputs_status, texts_by_prompt
from benchsuite.report.textout import markdown_table

MATCH_KEYS: tuple[str, ...] = (
    "engine",
    "engine_kind",
    "mode",
    "params_key",
    "workload",
    "prompt_class",
    "concurrency",
    "routing",
)
PEAK_MEMORY = "peak_device_memory_bytes"
LEVEL_RUNS = "runs"
LEVEL_REPEATS = "repeats"


@dataclass(frozen=True)
class MetricSpec:
    name: str  # column in the comparison
    cell_metric: str  # CellResult column
    higher_is_better: bool
    scale: float  # display scale (s -> ms)


METRIC_SPECS: tuple[MetricSpec, ...] = (
    MetricSpec("decode_tok_s", "decode_tok_s_p50", True, 1.0),
    MetricSpec("ttft_p50_ms", "ttft_p50_s", False, 1000.0),
    MetricSpec("output_tok_s", "output_tok_s", True, 1.0),
)


MEMORY_SPEC = MetricSpec("peak_gb", PEAK_MEMORY, False, 1.0)
COLUMNS_DEFAULT = "default"
COLUMNS_ALL = "all"


@dataclass(frozen=True)
class Comparison:
    run_a: str  # run ids of side A joined by '+'
    run_b: str
    threshold: float
    alpha: float
    level: str  # LEVEL_RUNS or LEVEL_REPEATS
    same_source: str | None  # "same commit and matrix" statement, None when they differ
    rows: pd.DataFrame  # one row per matched configuration x metric
    only_a: list[str]  # configuration labels measured only in A
    only_b: list[str]

    @property
    def flagged(self) -> pd.DataFrame:
        return self.rows[self.rows["flagged"]] if len(self.rows) else self.rows


@dataclass(frozen=True)
class _Side:
    """One side's ok cells per configuration key, and which of them ran on a busy machine."""

    run_ids: tuple[str, ...]
    cells: pd.DataFrame  # annotated cells of every run of the side
    labels: dict[tuple[Any, ...], str]
    busy: set[str]  # cell ids measured while the machine was busy
    requests: pd.DataFrame  # every run's requests (their texts: benchsuite.report.outputs)


def _side(runs: list[RunData]) -> _Side:
    frames = [annotate_cells(r.cells, many_runs=False) for r in runs]
    cells = pd.concat(frames, ignore_index=True)
    labels = {tuple(row[k] for k in MATCH_KEYS): f"{row['label']}" for _, row in cells.iterrows()}
    requests = pd.concat([r.requests for r in runs if r.requests is not None], ignore_index=True)
    return _Side(tuple(r.run_id for r in runs), cells, labels, busy_cells(cells), requests)


def _ok_cell_ids(side: _Side, key: tuple[Any, ...]) -> list[str]:
    mask = side.cells["status"] == "ok"
    for column, value in zip(MATCH_KEYS, key):
        mask &= side.cells[column] == value
    return [str(c) for c in side.cells[mask]["cell_id"]]


def _values(side: _Side, key: tuple[Any, ...], spec: MetricSpec, level: str) -> tuple[list[float], list[str]]:
    mask = pd.Series(True, index=side.cells.index)
    for column, value in zip(MATCH_KEYS, key):
        mask &= side.cells[column] == value
    ok = side.cells[mask & (side.cells["status"] == "ok")]
    if spec.cell_metric == PEAK_MEMORY:  # no test, a figure beside the tested ones
        found = [m for m in (device_bytes(c) for _, c in ok.iterrows()) if m is not None]
        return ([max(found) / 1e9] if found else []), list(ok["cell_id"])
    ok = ok[ok[spec.cell_metric].notna()]
    ids = list(ok["cell_id"])
    if level == LEVEL_REPEATS:
        return [float(v) * spec.scale for v in ok[spec.cell_metric]], ids
    per_run = ok.groupby("run_id")[spec.cell_metric].median()
    return [float(v) * spec.scale for v in per_run], ids


def _verdict(
    estimate: stats.RatioEstimate | None, n: tuple[int, int], discovery: bool, spec: MetricSpec, threshold: float
) -> tuple[bool, str]:
    if min(n) == 0:
        return False, "no ok value on one side"
    if estimate is None:
        return False, stats.not_enough_text(*n)
    if not discovery:
        return False, "not significant"
    if abs(estimate.ratio - 1.0) <= threshold:
        return False, "significant, below threshold"
    better = (estimate.ratio > 1.0) == spec.higher_is_better
    return True, "IMPROVED" if better else "REGRESSED"


def same_source(a: list[RunData], b: list[RunData]) -> str | None:
    """'same commit and matrix' when every run of both sides ran one clean commit (or one dirty tree) and
    one matrix hash; 'same measuring code and matrix' when their commits differ (or were not recorded) but every
    run recorded the same trees of benchsuite and paged_experts (GitFacts.code) and one matrix hash."""
    runs = [*a, *b]
    aa = "this is an A/A comparison, so any flagged row is a false alarm of the method (or a machine that changed "
    aa += "between runs)."
    facts = {r.facts.identity for r in runs}
    if len(facts) == 1:
        commit, _, matrix_hash = next(iter(facts))
        if commit is not None and matrix_hash:
            return (
                f"A and B ran the same commit ({str(commit)[:12]}) and the same matrix ({str(matrix_hash)[:8]}): {aa}"
            )
    # other commits (or none: a run from an unpacked archive) whose measuring code is the same tree for tree
    codes, matrices = {r.facts.code for r in runs}, {r.facts.identity[2] for r in runs}
    if len(codes) != 1 or None in codes or len(matrices) != 1 or not next(iter(matrices)):
        return None
    trees = ", ".join(f"{name} {tree[:7]}" for name, tree in next(iter(codes)) or ())
    commits = sorted({str(r.facts.identity[0])[:12] if r.facts.identity[0] else "none recorded" for r in runs})
    return (
        f"A and B ran the same measuring code ({trees}; commits {', '.join(commits)}) and the same matrix "
        f"({str(next(iter(matrices)))[:8]}): {aa}"
    )


def compare_runs(
    run_a: Path | Sequence[Path],
    run_b: Path | Sequence[Path],
    threshold: float = 0.05,
    alpha: float = stats.DEFAULT_ALPHA,
) -> Comparison:
    """Compare side A with side B; each side is one results run directory or several (reruns of one matrix)."""
    runs_a = [load_run(Path(p)) for p in ([run_a] if isinstance(run_a, (str, Path)) else run_a)]
    runs_b = [load_run(Path(p)) for p in ([run_b] if isinstance(run_b, (str, Path)) else run_b)]
    a, b = _side(runs_a), _side(runs_b)
    level = LEVEL_RUNS if min(len(runs_a), len(runs_b)) >= 2 else LEVEL_REPEATS
    rows, estimates = [], []
    for key in sorted(set(a.labels) & set(b.labels), key=str):
        texts_a, texts_b = (texts_by_prompt(side.requests, _ok_cell_ids(side, key)) for side in (a, b))
        routing, mode = (str(key[MATCH_KEYS.index(k)]) for k in ("routing", "mode"))
        outputs = outputs_status(texts_a, texts_b, synthetic=is_synthetic(routing), paged=mode == "paged")
        for spec in METRIC_SPECS:
            (xs, ids_a), (ys, ids_b) = _values(a, key, spec, level), _values(b, key, spec, level)
            estimate = stats.ratio_estimate(ys, xs, alpha)
            estimates.append((spec, estimate, (len(xs), len(ys))))
            median_a = float(pd.Series(xs).median()) if xs else None
            median_b = float(pd.Series(ys).median()) if ys else None
            busy = sorted((set(ids_a) & a.busy) | (set(ids_b) & b.busy))
            memory = [_values(side, key, MEMORY_SPEC, level)[0] for side in (a, b)]
            rows.append(
                {
                    "configuration": a.labels[key],
                    "workload": key[4],
                    "prompt_class": key[5],
                    "concurrency": int(key[6]),
                    "metric": spec.name,
                    "a": median_a,
                    "b": median_b,
                    "change": None if estimate is None else estimate.ratio - 1.0,
                    "interval": None if estimate is None else f"{estimate.low - 1.0:+.1%} … {estimate.high - 1.0:+.1%}",
                    "p_value": None if estimate is None else estimate.p_value,
                    "level": level,
                    "n_a": len(xs),
                    "n_b": len(ys),
                    "machine_busy": f"{len(busy)} cells" if busy else "",
                    "outputs": outputs,
                    "a_cell_ids": " ".join(ids_a),
                    "b_cell_ids": " ".join(ids_b),
                    "a_peak_gb": max(memory[0]) if memory[0] else None,
                    "b_peak_gb": max(memory[1]) if memory[1] else None,
                }
            )
    discoveries = stats.benjamini_hochberg([None if e is None else e.p_value for _, e, _ in estimates], alpha)
    for row, (spec, estimate, n), discovery in zip(rows, estimates, discoveries):
        row["flagged"], row["verdict"] = _verdict(estimate, n, discovery, spec, threshold)
    columns = [
        "configuration",
        "workload",
        "prompt_class",
        "concurrency",
        "metric",
        "a",
        "b",
        "change",
        "interval",
        "p_value",
        "level",
        "n_a",
        "n_b",
        "flagged",
        "verdict",
        "outputs",
        "machine_busy",
        "a_peak_gb",
        "b_peak_gb",
        "a_cell_ids",
        "b_cell_ids",
    ]
    frame = pd.DataFrame(rows, columns=columns)
    return Comparison(
        "+".join(a.run_ids),
        "+".join(b.run_ids),
        threshold,
        alpha,
        level,
        same_source(runs_a, runs_b),
        frame,
        _only(a, b),
        _only(b, a),
    )


def _only(side: _Side, other: _Side) -> list[str]:
    return sorted({f"{side.labels[k]} · {k[5]} · c={k[6]}" for k in set(side.labels) - set(other.labels)})


def _display(rows: pd.DataFrame) -> pd.DataFrame:
    if rows.empty:
        return rows
    out = rows.copy()
    out["change"] = ["—" if c is None or pd.isna(c) else f"{c * 100:+.1f}%" for c in out["change"]]
    out["interval"] = ["—" if i is None or pd.isna(i) else i for i in out["interval"]]
    out["p_value"] = ["—" if p is None or pd.isna(p) else f"{p:.3g}" for p in out["p_value"]]
    for col in ("a", "b"):
        out[col] = ["—" if v is None or pd.isna(v) else f"{v:.2f}" for v in out[col]]
    out["flagged"] = ["YES" if f else "" for f in out["flagged"]]
    for col in ("a_peak_gb", "b_peak_gb"):
        out[col] = [_number(v) for v in out[col]]
    return out


def method_text(c: Comparison) -> str:
    unit = (
        "each run's median over its ok repeats is one value (two or more runs a side)"
        if c.level == LEVEL_RUNS
        else "each ok repeat (cell) is one value; with one run a side, noise shared by a whole run is not covered: "
        "give reruns of each side (`compare A1 A2 --vs B1 B2`) to test over runs"
    )
    return (
        f"Tested over {c.level}: {unit}. change = B / A - 1 (ratio of geometric means) "
        f"with its {1 - c.alpha:.0%} interval "
        f"(Welch t on log values); flagged when significant after Benjamini-Hochberg over all {len(c.rows)} rows at "
        f"{c.alpha:g} and |change| > {c.threshold * 100:g}%. Fewer than {stats.MIN_REPEATS} values a side: not enough "
        f"repeats, never flagged. a / b: medians of those values."
    )


SUMMARY_METRICS = (("decode_tok_s", "decode tok/s"), ("ttft_p50_ms", "TTFT p50 ms"), ("output_tok_s", "output tok/s"))


def _number(value: Any) -> str:
    return "—" if value is None or pd.isna(value) else f"{value:.4g}"


def change_text(row: pd.Series) -> str:
    """ "A → B (change [interval])" of one metric row; "—" where a side has no value."""
    if row["a"] is None or row["b"] is None or pd.isna(row["a"]) or pd.isna(row["b"]):
        return "—"
    said = f"{_number(row['a'])} → {_number(row['b'])}"
    if row["change"] is None or pd.isna(row["change"]):
        return f"{said} ({row['verdict']})"
    return f"{said} ({row['change'] * 100:+.1f}% [{row['interval']}])"


def summary_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration (workload, prompt class and concurrency in its name) with the columns a
    user reads first: decode tok/s, TTFT p50, output tok/s as "A → B (change [interval])", the peak
    device memory of each side (GB), the metrics flagged with their verdict, and whether the two sides generated
    the same text (benchsuite.report.outputs)."""
    columns = ["configuration", *(title for _, title in SUMMARY_METRICS), "peak memory GB", "flagged", "outputs"]
    out = []
    keys = ["configuration", "workload", "prompt_class", "concurrency"]
    for (label, workload, prompt_class, concurrency), group in rows.groupby(keys, sort=False):
        by_metric = {r["metric"]: r for _, r in group.iterrows()}
        first = group.iloc[0]
        memory = (
            "—"
            if pd.isna(first["a_peak_gb"]) and pd.isna(first["b_peak_gb"])
            else f"{_number(first['a_peak_gb'])} → {_number(first['b_peak_gb'])}"
        )
        entry = {"configuration": f"{label} · {workload} · {prompt_class} · c={concurrency}"}
        for metric, title in SUMMARY_METRICS:
            entry[title] = change_text(by_metric[metric]) if metric in by_metric else "—"
        entry["peak memory GB"] = memory
        titles = dict(SUMMARY_METRICS)
        entry["flagged"] = ", ".join(
            f"{titles.get(r['metric'], r['metric']).split()[0]} {r['verdict']}"
            for _, r in group.iterrows()
            if r["flagged"]
        )
        entry["outputs"] = first.get("outputs", "")
        out.append(entry)
    return pd.DataFrame(out, columns=columns)


def comparison_markdown(comparison: Comparison, columns: str = COLUMNS_DEFAULT) -> str:
    """The comparison as markdown: with `columns` "default" one row per configuration (summary_frame),
    with "all" one row per configuration and metric with every column."""
    c = comparison
    shown = summary_frame if columns == COLUMNS_DEFAULT else _display
    lines = [f"# Compare {c.run_a} (A) -> {c.run_b} (B)\n", f"{method_text(c)}\n"]
    if c.same_source:
        lines.append(f"**{c.same_source}**\n")
    lines.append(f"{len(c.flagged)} flagged of {len(c.rows)} comparisons.\n")
    if len(c.flagged):
        lines.append("## Flagged\n\n" + markdown_table(shown(c.flagged)))
    lines.append(
        "## All matched configurations\n\n"
        + (markdown_table(shown(c.rows)) if len(c.rows) else "_no configuration matched_\n")
    )
    for title, labels in ((f"Only in {c.run_a}", c.only_a), (f"Only in {c.run_b}", c.only_b)):
        if labels:
            lines.append(f"## {title}\n\n" + "".join(f"- {label}\n" for label in labels))
    return "\n".join(lines)


def comparison_html(comparison: Comparison) -> str:
    c = comparison
    shown = _display(c.rows)
    head = "".join(f"<th>{html.escape(col)}</th>" for col in shown.columns)
    body = []
    for (_, row), flagged in zip(shown.iterrows(), c.rows["flagged"] if len(c.rows) else []):
        style = (
            ' style="background:#fde2e2"'
            if flagged and row["verdict"] == "REGRESSED"
            else (' style="background:#e3f6e8"' if flagged else "")
        )
        body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row.values) + "</tr>")
    only = "".join(
        f"<h2>{html.escape(t)}</h2><ul>{''.join(f'<li>{html.escape(x)}</li>' for x in labels)}</ul>"
        for t, labels in ((f"Only in {c.run_a}", c.only_a), (f"Only in {c.run_b}", c.only_b))
        if labels
    )
    same = f'<p class="aa"><strong>{html.escape(c.same_source)}</strong></p>' if c.same_source else ""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>compare {html.escape(c.run_a)} vs {html.escape(c.run_b)}</title><style>"
        "body{font-family:system-ui,sans-serif;margin:24px;max-width:1400px}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:3px 6px;overflow-wrap:anywhere}</style></head><body>"
        f"<h1>Compare {html.escape(c.run_a)} (A) → {html.escape(c.run_b)} (B)</h1>"
        f"<p>{html.escape(method_text(c))}</p>{same}<p>{len(c.flagged)} flagged of {len(c.rows)}.</p>"
        f'<table id="compare"><tr>{head}</tr>{"".join(body)}</table>{only}</body></html>'
    )


def default_compare_dir(comparison: Comparison) -> Path:
    return Path.cwd() / "reports" / f"compare-{comparison.run_a}-vs-{comparison.run_b}"


def write_comparison(comparison: Comparison, out_dir: Path | None = None) -> tuple[Path, Path]:
    """Write compare.md and compare.html; return their paths."""
    target = Path(out_dir) if out_dir is not None else default_compare_dir(comparison)
    target.mkdir(parents=True, exist_ok=True)
    md, page = target / "compare.md", target / "compare.html"
    md.write_text(comparison_markdown(comparison, COLUMNS_ALL), encoding="utf-8")  # the file keeps every column
    page.write_text(comparison_html(comparison), encoding="utf-8")
    return md, page
