"""The report page: one self-contained HTML file. plotly.js is embedded inline once (the offline
bundle shipped with the plotly package); no CDN, no web fonts, no request leaves the page.

Every table cell holding cell ids links to that cell's row in the raw cells table (#cell-<id>);
every figure links to the same table and lists the cells it was drawn from.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import pandas as pd
from plotly.offline import get_plotlyjs

from benchsuite.report.display import display_frame
from benchsuite.report.figures import Figure
from benchsuite.report.tables import NOT_SIGNIFICANT, SPREAD_UNKNOWN

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1500px}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}h3{font-size:1em}
table{border-collapse:collapse;font-size:12px;margin:6px 0}th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3;position:sticky;top:0}td{white-space:nowrap}td.wrap{white-space:normal;min-width:220px;max-width:460px}
.scroll{overflow-x:auto}.scroll.tall{max-height:700px;overflow-y:auto}
code{font-size:11px;word-break:break-all}.banner{padding:8px 12px;margin:8px 0;border-radius:4px}
.warn{background:#fff3cd;border:1px solid #e0c36a}.bad{background:#fde2e2;border:1px solid #e3a0a0}.info{background:#e8f1fb;border:1px solid #9cc0e8}
td.ns{color:#8a5a00;font-weight:bold}td.sig{color:#11602a}tr.synthetic td{background:#fff8e6}tr.status-failed td,tr.status-invalid td{background:#fdecec}
.caption{font-size:12px;color:#555}.figure{margin:18px 0;border-top:1px dashed #ddd;padding-top:8px}
"""


@dataclass(frozen=True)
class Section:
    title: str
    anchor: str
    intro: str  # trusted HTML built by this package
    table: pd.DataFrame | None


def _id_links(text: str) -> str:
    return " ".join(f'<a href="#cell-{html.escape(i)}">{html.escape(i)}</a>' for i in str(text).split())


_WRAP_COLUMNS = ("cell_ids", "reason", "command", "configuration", "your_config", "your_paged_config")


def _cell_class(column: str, text: str) -> str:
    classes = []
    if column in _WRAP_COLUMNS or column.startswith("vs "):
        classes.append("wrap")
    if column.endswith("_verdict") or column.startswith("vs "):
        if NOT_SIGNIFICANT in text or SPREAD_UNKNOWN in text:
            classes.append("ns")
        elif "significant" in text:
            classes.append("sig")
    return f' class="{" ".join(classes)}"' if classes else ""


def render_table(frame: pd.DataFrame, table_id: str, row_anchor_column: str | None = None) -> str:
    if frame.empty:
        return "<p><em>no rows</em></p>"
    shown = display_frame(frame)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in shown.columns)
    rows = []
    for index, row in shown.iterrows():
        classes = []
        raw = frame.loc[index]
        if any("SYNTHETIC" in str(v) for v in row.values) or str(raw.get("routing", "")).startswith("synthetic"):
            classes.append("synthetic")
        if "status" in frame.columns:
            classes.append(f"status-{html.escape(str(raw['status']))}")
        attrs = f' class="{" ".join(classes)}"' if classes else ""
        if row_anchor_column is not None:
            attrs += f' id="cell-{html.escape(str(raw[row_anchor_column]))}"'
        tds = []
        for column, text in row.items():
            body = _id_links(text) if column in ("cell_ids", "cell_id") and row_anchor_column != column else html.escape(str(text))
            tds.append(f"<td{_cell_class(column, str(text))}>{body}</td>")
        rows.append(f"<tr{attrs}>{''.join(tds)}</tr>")
    tall = " tall" if len(frame) > 40 else ""
    return f'<div class="scroll{tall}"><table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'


def render_figure(fig: Figure) -> str:
    div = fig.figure.to_html(full_html=False, include_plotlyjs=False, div_id=fig.anchor,
                             config={"displaylogo": False, "responsive": True})
    ids = " ".join(fig.cell_ids)
    return (f'<div class="figure" id="{fig.anchor}-box"><h3>{html.escape(fig.title)}</h3>{div}'
            f'<p class="caption">{html.escape(fig.caption)} Raw data: <a href="#raw-cells">raw cells table</a>; '
            f'cells: {_id_links(ids) or "none"}</p></div>')


def render_page(title: str, header_html: str, sections_before: list[Section], figures: list[Figure],
                missing_figures: list[str], sections_after: list[Section]) -> str:
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>",
             f"<style>{_CSS}</style><script type=\"text/javascript\">{get_plotlyjs()}</script></head><body>",
             f"<h1>{html.escape(title)}</h1>", header_html]
    toc = [*(s for s in sections_before), Section("Figures", "figures", "", None), *sections_after]
    parts.append("<nav><strong>Contents:</strong> " + " · ".join(f'<a href="#{s.anchor}">{html.escape(s.title)}</a>' for s in toc) + "</nav>")
    for section in sections_before:
        parts.append(_render_section(section))
    parts.append('<h2 id="figures">Figures</h2>')
    if missing_figures:
        parts.append("<p>Not drawn, for lack of data: " + "; ".join(html.escape(m) for m in missing_figures) + ".</p>")
    parts.extend(render_figure(f) for f in figures)
    for section in sections_after:
        parts.append(_render_section(section))
    parts.append("</body></html>")
    return "\n".join(parts)


def _render_section(section: Section) -> str:
    anchor_column = "cell_id" if section.anchor == "raw-cells" else None
    table = "" if section.table is None else render_table(section.table, f"table-{section.anchor}", anchor_column)
    return f'<h2 id="{section.anchor}">{html.escape(section.title)}</h2>{section.intro}{table}'
