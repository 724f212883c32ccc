"""The H200 report: the standard report of a run (build.build_report_data, html.render_page,
textout) with the H200 sections in front: the tok/s grid, targets, ratios, every key each benchmark
wrote, and one provenance row per exact command.

    write_h200_report(run_dir, out_dir) -> Path   # out_dir/index.html, tables.md, tables.csv
"""

from __future__ import annotations

import html
import json
import shlex
from pathlib import Path
from typing import Any

import pandas as pd

from benchsuite.report import h200_tables as ht
from benchsuite.report.build import _sections, build_report_data
from benchsuite.report.display import display_frame
from benchsuite.report.figures import missing_figures
from benchsuite.report.header import header_html, header_markdown
from benchsuite.report.html import Section, render_page
from benchsuite.report.manifest_facts import flatten_facts
from benchsuite.report.textout import write_csv, write_markdown

_TARGET_NOTE = (f"Targets: roofline fraction >= {ht.ROOFLINE_TARGET_FRACTION} (DESIGN.md section 5); resident >= "
                f"{ht.RESIDENT_TARGET_TOK_S_B1:g} tok/s at batch 1 (the H200 issue).")


def _text(value: Any) -> Any:
    """Table-safe form of a benchmark value: dicts and lists as compact JSON, scalars as they are."""
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else value


def bench_keys_table(cells: pd.DataFrame, source: str) -> pd.DataFrame:
    """Every key one benchmark wrote for each of its cells, keys added later included, absent keys left empty."""
    mine = cells[cells["extras"].map(lambda e: e.get("source") == source).astype(bool)]  # bool: an empty mask still selects rows
    rows = [{"cell_id": c["cell_id"], "status": c["status"], **{k: _text(v) for k, v in (c["extras"].get("bench") or {}).items()}}
            for _, c in mine.iterrows()]
    return pd.DataFrame(rows)


def provenance_table(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per exact command (and input file): engine, version, build flags, machine, git, date, routing source."""
    groups: dict[str, dict[str, Any]] = {}
    for _, c in cells.iterrows():
        p = c["extras"].get("provenance") or {}
        command = shlex.join(str(a) for a in p.get("command") or [])
        key = json.dumps([p.get("input_file"), command, p.get("server_argv")], default=str)
        version = dict(p.get("engine_version") or {})
        build_flags = version.pop("build_flags", None)
        row = groups.setdefault(key, {
            "engine": p.get("engine", "absent"), "engine_version": _text(version) if version else "absent",
            "build_flags": _text(build_flags) if build_flags else "—", "command": command or "absent",
            "server_command": shlex.join(p["server_argv"]) if p.get("server_argv") else "—",
            "gpu": (p.get("machine") or {}).get("gpu") or "absent", "pcie_link": (p.get("machine") or {}).get("pcie_link") or "absent",
            "git_commit": (p.get("git") or {}).get("commit") or "absent", "git_dirty": (p.get("git") or {}).get("dirty"),
            "date_utc": p.get("date_utc") or "absent", "routing_sources": [], "input_file": p.get("input_file", "absent"),
            "input_sha256": str(p.get("input_sha256", ""))[:16], "cell_ids": [],
        })
        if p.get("routing_source") not in row["routing_sources"]:
            row["routing_sources"].append(p.get("routing_source"))
        row["cell_ids"].append(c["cell_id"])
    return pd.DataFrame([{**r, "routing_sources": "; ".join(map(str, r["routing_sources"])), "cell_ids": " ".join(r["cell_ids"])}
                         for r in groups.values()])


def run_facts_tables(h200: dict[str, Any], role: str, file_name: str) -> list[tuple[str, str, str, pd.DataFrame]]:
    """A benchmark file's run-level keys: scalars and dicts as one key / value table, each list of records
    (e.g. decode_h200's pagein_paths) as its own table, so keys added later show without code here."""
    facts = h200.get(role) or {}
    pairs = flatten_facts({k: v for k, v in facts.items() if not _records(v)})
    out = [(f"{file_name}: run-level facts", f"h200-{role}-facts", "",
            pd.DataFrame(pairs, columns=["key", "value"]))]
    for key, value in facts.items():
        if _records(value):
            out.append((f"{file_name}: {key}", f"h200-{role}-{key}", "", pd.DataFrame([{k: _text(v) for k, v in r.items()} for r in value])))
    return out


def _records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


_GRID_INTRO = (
    "<p>Aggregate decode tok/s (decode loop: batch x steps / decode seconds; llama.cpp: its reported rate), median over a "
    "configuration's ok cells, per routing source and batch; each mode's fastest variant, named in best_variant (every "
    "variant is in the next table). 'FAILED: reason' marks a configuration that ran and failed, 'not run' one that was never "
    "measured, 'n/a: own router' a llama.cpp column in a synthetic-routing row (llama.cpp routes with the model's own "
    "router: its figures are in the model-routing row).</p>"
)
_VARIANT_INTRO = (
    "<p>The same figures per variant: [graphs] CUDA-graph decode steps, [compile] the per-layer blocks (and the paged LRU "
    "plan) through torch.compile before capture, [triton] routing, the expert pass and decode attention as Triton kernels "
    "(paged_experts.kernels.moe_triton, attn_triton), [host] host-planned paging, [overlap] hits computed while misses copy, [loop] "
    "the per-expert reference kernel, [prefetch] the next layer's predicted experts paged in while a layer computes; no "
    "bracket = the default path (grouped GEMM, eager).</p>"
)
_ROOFLINE_INTRO = (
    "<p>roofline_step = max(resident step at the same batch and routing, misses per step x expert bytes / link rate); "
    f"roofline_fraction = roofline_step / measured step (1.0 = at the roofline). {html.escape(_TARGET_NOTE)} "
    "serial_fraction = (resident step + link step) / measured step: the bound of a step that pages each layer's misses "
    "only after its router ran (no prediction); [prefetch] cells page the next layer's predicted experts ahead "
    "(prefetched_per_step, prefetch_accuracy = share of them the layer then routed to), and their misses for the "
    "roofline are the LRU planner's replayed over the cell's own routed ids (misses_source).</p>"
)
_RESIDENT_INTRO = (
    "<p>hbm_bound = (union of experts touched x layers x expert bytes + non-expert weights) / measured device copy rate; "
    "hbm_fraction = bound step / measured step.</p>"
)
_BUDGET_INTRO = (
    "<p>The fastest paged cell (bf16) whose measured GPU memory (torch allocator peak) is within llama.cpp's fit budget "
    f"(if none is, paged K={ht.EQUAL_BUDGET_K}, flagged over budget) against the fastest llama.cpp configuration within it (the "
    "N its own projection chose, keeping its 1024 MiB margin, or a fixed N whose recorded GPU buffers are within the "
    "budget), whichever wins. GB are decimal (10^9 bytes), as llamacpp_h200's budget is.</p>"
)
_SERVE_INTRO = "<p>benchmarks/serve_decode.py per server configuration; aggregate = sum of the requests' decode rates per round.</p>"
_PROVENANCE_INTRO = "<p>Every cell's record carries this in extras.provenance (cells/&lt;cell-id&gt;.json).</p>"


def _offload_intro() -> str:
    return (
        "<p>Each paged configuration over the best offload configuration of the same routing source, beside PR #42557's "
        f"headline single-stream ratio ({html.escape(ht.published_offload_ratio()[1])}): another GPU and quantization, a "
        "target rather than a like-for-like figure.</p>"
    )


def h200_tables(cells: pd.DataFrame, h200: dict[str, Any]) -> list[tuple[str, str, str, pd.DataFrame]]:
    """(title, anchor, intro HTML, table) of every H200 section, in page order."""
    return [
        ("H200 decode tok/s by mode (fastest variant)", "h200-grid", _GRID_INTRO, ht.tok_s_grid(cells)),
        ("H200 decode tok/s by variant", "h200-variants", _VARIANT_INTRO, ht.tok_s_variant_grid(cells)),
        ("Paged cells against the link roofline", "h200-roofline", _ROOFLINE_INTRO, ht.roofline_table(cells)),
        ("Resident against the HBM bound", "h200-resident", _RESIDENT_INTRO, ht.resident_table(cells)),
        ("Paged vs offload at batch 1", "h200-offload", _offload_intro(), ht.paged_vs_offload_table(cells)),
        ("Paged vs llama.cpp at an equal GPU memory budget", "h200-budget", _BUDGET_INTRO, ht.equal_budget_table(cells, h200)),
        ("Built-in server over HTTP", "h200-serve", _SERVE_INTRO, ht.serve_table(cells)),
        ("Provenance: one row per exact command", "h200-provenance", _PROVENANCE_INTRO, provenance_table(cells)),
        ("decode_h200.json: every key of every cell", "h200-decode-keys", "", bench_keys_table(cells, "decode_h200")),
        ("llamacpp_h200.json: every key of every cell", "h200-llamacpp-keys", "", bench_keys_table(cells, "llamacpp_h200")),
        *run_facts_tables(h200, "decode", "decode_h200.json"),
        *run_facts_tables(h200, "llamacpp", "llamacpp_h200.json"),
    ]


def write_h200_report(run_dir: Path, out_dir: Path) -> Path:
    """index.html, tables.md and tables.csv of one converted H200 run; returns index.html's path."""
    data = build_report_data([Path(run_dir)])
    run = data.runs[0]
    sections = h200_tables(run.cells, run.manifest.extra.get("h200") or {})
    before, after = _sections(data)
    mine = [Section(title, anchor, intro, frame) for title, anchor, intro, frame in sections]
    title = f"H200 results: {run.run_id}"
    page = render_page(title, header_html(data.runs, data.cells), [*mine, *before], data.figures, missing_figures(data.figures), after)
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    index = target / "index.html"
    tmp = index.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(index)
    tables = {**{t: f for t, _, _, f in sections}, **data.tables}
    preamble = [*header_markdown(data.runs, data.cells), "", _TARGET_NOTE, data.reference_note]
    write_markdown(target / "tables.md", title, preamble, {k: display_frame(v) if not v.empty else v for k, v in tables.items()})
    write_csv(target / "tables.csv", tables)
    return index
