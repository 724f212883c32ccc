"""Reading one results run directory (docs/ARCHITECTURE.md, "Results store layout") into frames
the report and compare can use: the typed manifest (benchsuite.results.manifest.Manifest), one row
per CellResult, one row per RequestRecord.

The store may write `params` / `options` / `extras` as JSON strings (parquet) or as dicts; all come
out as dicts here. A run without cells.parquet (interrupted before the store's final write) is read from
its cells/<cell-id>.json files, and so is a version-1 run (upgraded by benchsuite.results.schema_v1); other
schema versions are refused with the store's fix-it message (benchsuite.results.stored_files.read_manifest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchsuite.errors import UserError
from benchsuite.records import CellResult, RequestRecord
from benchsuite.report.manifest_facts import RunFacts, read_run_facts
from benchsuite.results import schema_v1
from benchsuite.results.manifest import Manifest
from benchsuite.results.stored_files import read_cells, read_manifest, read_requests

CELL_COLUMNS: tuple[str, ...] = tuple(CellResult.__dataclass_fields__)
REQUEST_COLUMNS: tuple[str, ...] = tuple(RequestRecord.__dataclass_fields__)
_DICT_COLUMNS = ("params", "options", "extras")


@dataclass(frozen=True)
class RunData:
    """One results run as read from disk."""

    run_id: str
    run_dir: Path
    manifest: Manifest
    cells: pd.DataFrame  # one row per CellResult; params / extras are dicts
    requests: pd.DataFrame  # one row per RequestRecord; chunk_times_s is a list of floats
    facts: RunFacts = field(init=False)  # the manifest's facts, read once: every section takes them from here

    def __post_init__(self) -> None:
        object.__setattr__(self, "facts", read_run_facts(self.manifest, self.run_dir))


def as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return {}
    if isinstance(value, (str, bytes)):
        text = value.decode() if isinstance(value, bytes) else value
        if not text.strip():
            return {}
        parsed = json.loads(text)
        if parsed is None:  # a stored None (the store writes JSON columns' None as 'null')
            return {}
        if not isinstance(parsed, dict):
            raise TypeError(f"expected a JSON object, got {text[:60]!r}")
        return parsed
    raise TypeError(f"expected a dict or a JSON object string, got {type(value).__name__}")


def _as_float_list(value: Any) -> list[float]:
    if value is None:
        return []
    if isinstance(value, str):
        return [float(v) for v in json.loads(value)] if value.strip() else []
    if isinstance(value, float) and np.isnan(value):
        return []
    return [float(v) for v in value]


def normalize_cells(frame: pd.DataFrame) -> pd.DataFrame:
    """Cells frame with every CellResult column present and params / options / extras as dicts."""
    cells = frame.copy()
    for column in CELL_COLUMNS:
        if column not in cells.columns:
            cells[column] = None
    for column in _DICT_COLUMNS:
        cells[column] = [as_dict(v) for v in cells[column]]
    cells["concurrency"] = cells["concurrency"].astype(int)
    cells["repeat"] = cells["repeat"].astype(int)
    cells["routing"] = cells["routing"].fillna("model").astype(str)
    return cells.reset_index(drop=True)


def normalize_requests(frame: pd.DataFrame) -> pd.DataFrame:
    """Requests frame with every RequestRecord column present and chunk_times_s as lists."""
    requests = frame.copy()
    for column in REQUEST_COLUMNS:
        if column not in requests.columns:
            requests[column] = None
    requests["chunk_times_s"] = [_as_float_list(v) for v in requests["chunk_times_s"]]
    return requests.reset_index(drop=True)


def _tables_current(run_dir: Path) -> bool:
    """Whether cells.parquet holds every cell stored in cells/: the store rebuilds the tables when an
    invocation ends, so one killed later (its machine taken back) leaves tables without the cells it
    measured since, which a report from them would leave out or call not measured. Tables without a
    cells/ directory (results imported as tables) are all there is."""
    parquet = run_dir / "cells.parquet"
    if not parquet.is_file():
        return False
    stored = {p.stem for p in (run_dir / "cells").glob("*.json")}
    return stored <= set(pd.read_parquet(parquet, columns=["cell_id"])["cell_id"])


def _read_cells(run_dir: Path, schema_version: int, tables: bool) -> pd.DataFrame:
    parquet = run_dir / "cells.parquet"
    # version 1 tables lack columns: read cells/ upgraded; version 2's are today's less columns with defaults
    if tables and schema_version != schema_v1.VERSION:
        return pd.read_parquet(parquet)
    cells = read_cells(run_dir)
    if not cells:
        raise UserError(f"{run_dir}: no cells.parquet and no cells/*.json; has this run finished any cell?")
    return pd.DataFrame([c.to_row() for c in cells])


def _read_requests(run_dir: Path, tables: bool) -> pd.DataFrame:
    parquet = run_dir / "requests.parquet"
    if tables and parquet.is_file():
        return pd.read_parquet(parquet)
    return pd.DataFrame([r.to_row() for r in read_requests(run_dir)])


def load_run(run_dir: Path) -> RunData:
    """Read results/<run-id>/ (manifest, cells, requests)."""
    run_dir = Path(run_dir)
    if not (run_dir / "manifest.json").is_file():
        raise UserError(f"{run_dir}: no manifest.json; pass a results/<run-id>/ directory")
    manifest = read_manifest(run_dir)
    tables = _tables_current(run_dir)  # else every cell from cells/ (a later invocation was killed)
    cells = normalize_cells(_read_cells(run_dir, manifest.schema_version, tables))
    cells["schema_version"] = manifest.schema_version  # the caveats name figures timed by text chunks
    run_id = manifest.run_id or run_dir.name
    return RunData(run_id, run_dir, manifest, cells, normalize_requests(_read_requests(run_dir, tables)))
