"""tables.md (GitHub markdown) and tables.csv: the report's tables without the figures.

tables.csv is one long CSV: a `table` column names the table each row belongs to, the remaining
columns are the union of all tables' columns with exact (unrounded) numbers.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from benchsuite.report.fmt import format_value


def markdown_table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "_no rows_\n"
    columns = list(frame.columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for _, row in frame.iterrows():
        cells = [format_value(c, row[c]).replace("|", "\\|").replace("\n", " ") for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(
    path: Path, title: str, preamble: list[str], tables: dict[str, pd.DataFrame], trailer: list[str] | None = None
) -> None:
    """The title, the preamble lines, one section per table, then the trailer lines (the "Not shown" list)."""
    parts = [f"# {title}\n", *[f"{line}\n" for line in preamble]]
    for name, frame in tables.items():
        parts.append(f"\n## {name}\n\n{markdown_table(frame)}")
    if trailer:
        parts += ["\n", *[f"{line}\n" for line in trailer]]
    path.write_text("".join(parts))


def write_csv(path: Path, tables: dict[str, pd.DataFrame]) -> None:
    frames = [frame.assign(table=name) for name, frame in tables.items() if not frame.empty]
    combined = pd.concat(frames, ignore_index=True, sort=False) if frames else pd.DataFrame(columns=["table"])
    ordered = ["table", *[c for c in combined.columns if c != "table"]]
    combined[ordered].to_csv(path, index=False)
