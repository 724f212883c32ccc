"""Run comparison: `benchsuite compare RUN_A RUN_B`. Configurations are matched by their resolved
spec (engine, kind, mode, params, workload, prompt class, concurrency, routing; repeats pooled),
which also matches identical cell ids. Per matched configuration and metric:

- change = (B - A) / A of the median over ok repeats of the cell metric;
- a two-sided Mann-Whitney U test on the raw per-request samples of both runs (warm requests only):
  decode tok/s <- per-request decode rate, TTFT p50 <- per-request TTFT, output tok/s <- per-request
  output tokens / request latency;
- flagged only when p < alpha AND |change| > threshold. Fewer than 3 samples a side: never flagged.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from scipy.stats import mannwhitneyu

from benchsuite.report.groups import annotate_cells, group_configs
from benchsuite.report.load import RunData, load_run
from benchsuite.report.samples import request_samples
from benchsuite.report.textout import markdown_table

MATCH_KEYS: tuple[str, ...] = ("engine", "engine_kind", "mode", "params_key", "workload", "prompt_class", "concurrency", "routing")
MIN_SAMPLES = 3
SAMPLES_NOTE = ("Test samples (warm requests): decode_tok_s <- each request's decode rate; ttft_p50_ms <- each request's TTFT; "
                "output_tok_s <- each request's output tokens / latency. Values a / b are medians over ok repeats of the cell metric.")


@dataclass(frozen=True)
class MetricSpec:
    name: str  # column in the comparison
    cell_metric: str  # CellResult column
    sample: str  # request_samples column
    higher_is_better: bool
    scale: float  # display scale (s -> ms)


METRIC_SPECS: tuple[MetricSpec, ...] = (
    MetricSpec("decode_tok_s", "decode_tok_s_p50", "decode_tok_s", True, 1.0),
    MetricSpec("ttft_p50_ms", "ttft_p50_s", "ttft_s", False, 1000.0),
    MetricSpec("output_tok_s", "output_tok_s", "e2e_output_tok_s", True, 1.0),
)


@dataclass(frozen=True)
class Comparison:
    run_a: str
    run_b: str
    threshold: float
    alpha: float
    rows: pd.DataFrame  # one row per matched configuration x metric
    only_a: list[str]  # configuration labels measured only in A
    only_b: list[str]

    @property
    def flagged(self) -> pd.DataFrame:
        return self.rows[self.rows["flagged"]] if len(self.rows) else self.rows


def _prepared(run: RunData) -> tuple[pd.DataFrame, pd.DataFrame]:
    cells = annotate_cells(run.cells, many_runs=False)
    return group_configs(cells), request_samples(run.requests)


def _samples(samples: pd.DataFrame, cell_ids: list[str], column: str) -> list[float]:
    values = samples.loc[samples["cell_id"].isin(cell_ids), column].dropna()
    return [float(v) for v in values]


def _verdict(change: float | None, p_value: float | None, spec: MetricSpec, threshold: float, alpha: float) -> tuple[bool, str]:
    if change is None:
        return False, "no ok value on one side"
    if p_value is None:
        return False, f"too few samples (< {MIN_SAMPLES})"
    if p_value >= alpha:
        return False, "not significant"
    if abs(change) <= threshold:
        return False, "significant, below threshold"
    better = (change > 0) == spec.higher_is_better
    return True, "IMPROVED" if better else "REGRESSED"


def compare_runs(run_a: Path, run_b: Path, threshold: float = 0.05, alpha: float = 0.05) -> Comparison:
    a, b = load_run(Path(run_a)), load_run(Path(run_b))
    (groups_a, samples_a), (groups_b, samples_b) = _prepared(a), _prepared(b)
    keyed_b = {tuple(r[k] for k in MATCH_KEYS): r for _, r in groups_b.iterrows()}
    keys_a = set()
    rows = []
    for _, ga in groups_a.iterrows():
        key = tuple(ga[k] for k in MATCH_KEYS)
        keys_a.add(key)
        gb = keyed_b.get(key)
        if gb is None:
            continue
        for spec in METRIC_SPECS:
            sa, sb = ga[spec.cell_metric], gb[spec.cell_metric]
            value_a = None if sa is None else sa.median * spec.scale
            value_b = None if sb is None else sb.median * spec.scale
            change = None if value_a is None or value_b is None or value_a == 0 else (value_b - value_a) / value_a
            xs, ys = _samples(samples_a, ga["ok_cell_ids"], spec.sample), _samples(samples_b, gb["ok_cell_ids"], spec.sample)
            p_value = None
            if len(xs) >= MIN_SAMPLES and len(ys) >= MIN_SAMPLES:
                p_value = float(mannwhitneyu(xs, ys, alternative="two-sided").pvalue)
                p_value = None if math.isnan(p_value) else p_value
            flagged, verdict = _verdict(change, p_value, spec, threshold, alpha)
            rows.append({
                "configuration": ga["label"], "workload": ga["workload"], "prompt_class": ga["prompt_class"],
                "concurrency": int(ga["concurrency"]), "metric": spec.name, "a": value_a, "b": value_b, "change": change,
                "p_value": p_value, "n_a": len(xs), "n_b": len(ys), "flagged": flagged, "verdict": verdict,
                "a_cell_ids": " ".join(ga["ok_cell_ids"]), "b_cell_ids": " ".join(gb["ok_cell_ids"]),
            })
    only_a = sorted({f"{r['label']} · {r['prompt_class']} · c={r['concurrency']}" for _, r in groups_a.iterrows()
                     if tuple(r[k] for k in MATCH_KEYS) not in keyed_b})
    only_b = sorted({f"{r['label']} · {r['prompt_class']} · c={r['concurrency']}" for _, r in groups_b.iterrows()
                     if tuple(r[k] for k in MATCH_KEYS) not in keys_a})
    return Comparison(a.run_id, b.run_id, threshold, alpha, pd.DataFrame(rows), only_a, only_b)


def _display(rows: pd.DataFrame) -> pd.DataFrame:
    if rows.empty:
        return rows
    out = rows.copy()
    out["change"] = ["—" if c is None or pd.isna(c) else f"{c * 100:+.1f}%" for c in out["change"]]
    out["p_value"] = ["—" if p is None or pd.isna(p) else f"{p:.3g}" for p in out["p_value"]]
    for col in ("a", "b"):
        out[col] = ["—" if v is None or pd.isna(v) else f"{v:.2f}" for v in out[col]]
    out["flagged"] = ["YES" if f else "" for f in out["flagged"]]
    return out


def comparison_markdown(comparison: Comparison) -> str:
    c = comparison
    lines = [f"# Compare {c.run_a} (A) -> {c.run_b} (B)\n",
             (f"Flagged when a two-sided Mann-Whitney U test on per-request samples gives p < {c.alpha} "
             f"and the relative change of the median exceeds {c.threshold * 100:g}%.\n"),
             f"{SAMPLES_NOTE}\n", f"{len(c.flagged)} flagged of {len(c.rows)} comparisons.\n"]
    if len(c.flagged):
        lines.append("## Flagged\n\n" + markdown_table(_display(c.flagged)))
    lines.append("## All matched configurations\n\n" + (markdown_table(_display(c.rows)) if len(c.rows) else "_no configuration matched_\n"))
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
        style = ' style="background:#fde2e2"' if flagged and row["verdict"] == "REGRESSED" else (' style="background:#e3f6e8"' if flagged else "")
        body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row.values) + "</tr>")
    only = "".join(f"<h2>{html.escape(t)}</h2><ul>{''.join(f'<li>{html.escape(x)}</li>' for x in labels)}</ul>"
                   for t, labels in ((f"Only in {c.run_a}", c.only_a), (f"Only in {c.run_b}", c.only_b)) if labels)
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>compare {html.escape(c.run_a)} vs {html.escape(c.run_b)}</title><style>"
            "body{font-family:system-ui,sans-serif;margin:24px}table{border-collapse:collapse;font-size:12px}"
            "td,th{border:1px solid #ccc;padding:3px 6px}</style></head><body>"
            f"<h1>Compare {html.escape(c.run_a)} (A) → {html.escape(c.run_b)} (B)</h1>"
            f"<p>Flagged when Mann-Whitney U p &lt; {c.alpha} on per-request samples and |change| &gt; {c.threshold * 100:g}%. "
            f"{len(c.flagged)} flagged of {len(c.rows)}.</p><p>{html.escape(SAMPLES_NOTE)}</p>"
            f"<table id=\"compare\"><tr>{head}</tr>{''.join(body)}</table>{only}</body></html>")


def default_compare_dir(comparison: Comparison) -> Path:
    return Path.cwd() / "reports" / f"compare-{comparison.run_a}-vs-{comparison.run_b}"


def write_comparison(comparison: Comparison, out_dir: Path | None = None) -> tuple[Path, Path]:
    """Write compare.md and compare.html; return their paths."""
    target = Path(out_dir) if out_dir is not None else default_compare_dir(comparison)
    target.mkdir(parents=True, exist_ok=True)
    md, page = target / "compare.md", target / "compare.html"
    md.write_text(comparison_markdown(comparison), encoding="utf-8")
    page.write_text(comparison_html(comparison), encoding="utf-8")
    return md, page
