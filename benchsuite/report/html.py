"""The report page: one self-contained HTML file. plotly.js is embedded inline once (the offline
bundle shipped with the plotly package); no CDN, no web fonts, no request leaves the page.

Every table cell holding cell ids links to that cell's row in the raw cells table (#cell-<id>);
every figure links to the same table and lists the cells it was drawn from.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import pandas as pd
from markupsafe import Markup
from plotly.offline import get_plotlyjs

from benchsuite.report.display import display_frame, not_run_baselines
from benchsuite.report.plot import Figure
from benchsuite.report.tables import NOT_SIGNIFICANT, SPREAD_UNKNOWN
from benchsuite.report.template_env import render


@dataclass(frozen=True)
class Section:
    title: str
    anchor: str
    intro: str  # trusted HTML built by this package
    table: pd.DataFrame | None


def _id_links(text: str) -> str:
    return " ".join(f'<a href="#cell-{html.escape(i)}">{html.escape(i)}</a>' for i in str(text).split())


_WRAP_COLUMNS = (
    "cell_ids",
    "reason",
    "command",
    "configuration",
    "your_config",
    "your_paged_config",
    "paged_config",
    "params",
    "machine",
    "flags",
    "setup",
    "routing",
    "prompt_tokens_by_engine",
)


_LONG_TEXT_CHARS = 40  # a value longer than this wraps in any column (notes, reasons a table did not foresee)


def _wraps(column: str, text: str) -> bool:
    return column in _WRAP_COLUMNS or column.startswith("vs ") or len(text) > _LONG_TEXT_CHARS


def _ratio_of(column: str, raw: pd.Series) -> float | None:
    """The paged-vs-baseline ratio behind a `vs <b>` (or `paged_vs_<b>_verdict`) column, where the row has one."""
    name = column[len("vs ") :] if column.startswith("vs ") else column[len("paged_vs_") : -len("_verdict")]
    value = raw.get(f"paged_vs_{name}")
    return None if value is None or pd.isna(value) else float(value)


def _cell_class(column: str, text: str, raw: pd.Series | None = None) -> str:
    """CSS classes of a table cell: colour by meaning, never by position: a significant paged win is
    green (sig), a significant paged loss red (loss), anything not significant amber (ns)."""
    classes = []
    if _wraps(column, text):
        classes.append("wrap")
    if column.endswith("_verdict") or column.startswith("vs "):
        if NOT_SIGNIFICANT in text or SPREAD_UNKNOWN in text:
            classes.append("ns")
        elif "significant" in text:
            ratio = None if raw is None else _ratio_of(column, raw)
            classes.append("loss" if ratio is not None and ratio < 1.0 else "sig")
    return f' class="{" ".join(classes)}"' if classes else ""


TABLE_BUDGET_PX = 1300  # the page is 1,400 px wide at most (body margins and cell padding included)
_CHAR_PX, _CELL_PAD_PX, _WRAP_CHARS = 7, 12, 24


def _column_px(frame: pd.DataFrame, column: str) -> int:
    """A column's width estimate: its widest value (wrapping columns capped), or its longest header segment."""
    values = [min(len(str(v)), _WRAP_CHARS) if _wraps(column, str(v)) else len(str(v)) for v in frame[column]] or [0]
    chars = min(max(values), _WRAP_CHARS) if column in _WRAP_COLUMNS or column.startswith("vs ") else max(values)
    return max(chars, *(len(part) + 1 for part in column.split("_"))) * _CHAR_PX + _CELL_PAD_PX


def column_groups(shown: pd.DataFrame, budget_px: int = TABLE_BUDGET_PX) -> list[list[str]]:
    """The columns split into groups that each fit the budget; every group after the first starts with the
    key column (cell_id, else configuration, else the first) so its rows still say what they are."""
    columns = list(shown.columns)
    key = next((c for c in ("cell_id", "configuration") if c in columns), columns[0])
    groups: list[list[str]] = [[]]
    width = 0
    for column in columns:
        px = _column_px(shown, column)
        if groups[-1] and width + px > budget_px:
            groups.append([key] if column != key else [])
            width = _column_px(shown, key) if column != key else 0
        groups[-1].append(column)
        width += px
    return groups


def render_table(frame: pd.DataFrame, table_id: str, row_anchor_column: str | None = None) -> str:
    """One table, split into several (ids table_id, table_id-2, ...) when it would be wider than the page."""
    if frame.empty:
        return "<p><em>no rows</em></p>"
    shown = display_frame(frame)
    absent = not_run_baselines(frame)
    parts = [f"<p>Not run in any row, so not shown: {html.escape(', '.join(absent))}.</p>"] if absent else []
    for number, columns in enumerate(column_groups(shown), start=1):
        part_id = table_id if number == 1 else f"{table_id}-{number}"
        parts.append(_render_part(frame, shown[columns], part_id, row_anchor_column if number == 1 else None))
    return "".join(parts)


def _render_part(frame: pd.DataFrame, shown: pd.DataFrame, table_id: str, row_anchor_column: str | None) -> str:
    # headers break at their underscores, so a column is as wide as its values, not its name
    head = "".join(f"<th>{html.escape(c).replace('_', '_<wbr>')}</th>" for c in shown.columns)
    rows = []
    for index, row in shown.iterrows():
        classes = []
        raw = frame.loc[index]
        if any("SYNTHETIC" in str(v) for v in frame.loc[index].values) or str(raw.get("routing", "")).startswith(
            "synthetic"
        ):
            classes.append("synthetic")
        if "status" in frame.columns:
            classes.append(f"status-{html.escape(str(raw['status']))}")
        attrs = f' class="{" ".join(classes)}"' if classes else ""
        if row_anchor_column is not None:
            attrs += f' id="cell-{html.escape(str(raw[row_anchor_column]))}"'
        tds = []
        for column, text in row.items():
            body = (
                _id_links(text)
                if column in ("cell_ids", "cell_id") and row_anchor_column != column
                else html.escape(str(text))
            )
            tds.append(f"<td{_cell_class(column, str(text), raw)}>{body}</td>")
        rows.append(f"<tr{attrs}>{''.join(tds)}</tr>")
    tall = " tall" if len(frame) > 40 else ""
    return (
        f'<div class="scroll{tall}"><table id="{table_id}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def _figure_view(fig: Figure) -> dict[str, Any]:
    div = fig.figure.to_html(
        full_html=False, include_plotlyjs=False, div_id=fig.anchor, config={"displaylogo": False, "responsive": True}
    )
    links = _id_links(" ".join(fig.cell_ids))
    return {
        "anchor": fig.anchor,
        "title": fig.title,
        "caption": fig.caption,
        "div": Markup(div),
        "cell_links": Markup(links),
    }


def _section_view(section: Section) -> dict[str, Any]:
    anchor_column = "cell_id" if section.anchor == "raw-cells" else None
    table = "" if section.table is None else render_table(section.table, f"table-{section.anchor}", anchor_column)
    return {"anchor": section.anchor, "title": section.title, "intro": Markup(section.intro), "table": Markup(table)}


def render_page(
    title: str,
    header_html: str,
    sections_before: list[Section],
    figures: list[Figure],
    missing_figures: list[str],
    sections_after: list[Section],
    first_screen: str = "",
    lead_figures: tuple[Figure, ...] = (),
    lead_missing: str = "",
) -> str:
    """The page (templates/page.html.j2): the verdict first (first_screen), the speed-against-memory
    figures (lead_figures, or the one line saying why there are none), then banners, engines, machine
    and provenance (header_html), the sections before the figures, the figures, the sections after."""
    toc = [
        Section("Verdict", "verdict", "", None),
        *sections_before,
        Section("Figures", "figures", "", None),
        *sections_after,
    ]
    return render(
        "page.html.j2",
        title=title,
        plotly_js=Markup(get_plotlyjs()),
        toc=toc,
        first_screen=Markup(first_screen),
        lead_figures=[_figure_view(f) for f in lead_figures],
        lead_missing=lead_missing,
        header=Markup(header_html),
        before=[_section_view(s) for s in sections_before],
        missing_figures=missing_figures,
        figures=[_figure_view(f) for f in figures],
        after=[_section_view(s) for s in sections_after],
    )
