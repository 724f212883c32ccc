"""The results store: `results/<run-id>/` (layout in docs/ARCHITECTURE.md).

    manifest.json                 schema_version, resolved matrix, machine, git, servers (argv, version)
    cells/<cell-id>.json          one finished cell: its CellResult and its RequestRecords (resume unit)
    attempts/<cell-id>.<n>.json   earlier failed attempts of a cell, kept when it is retried
    cells.parquet, cells.csv      one CellResult per row, rebuilt from cells/
    requests.parquet              one RequestRecord per row, rebuilt from cells/
    logs/<server-id>.log          engine logs
    engine_metrics/<cell-id>.json engine counters scraped before/after the cell

Every write goes through one injectable `write(path, data)` seam, atomic by default (temporary
file in the same directory, fsync, os.replace), so a crash never leaves half a file and a fault
test can make writes fail. Files carry SCHEMA_VERSION; version 1 is read (not resumed) through
benchsuite.schema_v1, other versions are refused with a fix-it message. The manifest is the typed
benchsuite.manifest.Manifest and this store is its only writer. In the tables, dict-valued columns
(params, options, extras, engine_timings) are JSON text.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import ValidationError

from benchsuite import schema_v1
from benchsuite.errors import RunError, UserError
from benchsuite.manifest import Invocation, Manifest
from benchsuite.records import SCHEMA_VERSION, CellResult, RequestRecord

Writer = Callable[[Path, bytes], None]
FINISHED_STATUSES = ("ok", "invalid")  # a rerun skips these; `failed` cells run again
_JSON_COLUMNS = ("params", "options", "extras", "engine_timings")
_READABLE_VERSIONS = (schema_v1.VERSION, SCHEMA_VERSION)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class StoredCell:
    result: CellResult
    attempt: int  # 1 for the first try of the cell


class RunStore:
    """One run directory. Open it with `RunStore.open`, which creates or resumes it."""

    def __init__(self, run_dir: Path, *, write: Writer = atomic_write_bytes) -> None:
        self.run_dir = Path(run_dir)
        self._write_raw = write

    @classmethod
    def open(cls, run_dir: Path, manifest: Manifest, *, write: Writer = atomic_write_bytes) -> RunStore:
        """Create the run directory, or resume it when its manifest has the same matrix hash."""
        store = cls(run_dir, write=write)
        invocation = Invocation(started_utc=utc_now(), git=manifest.git, host=manifest.machine.get("hostname"))
        if store.manifest_path.exists():
            existing = _read_manifest_file(store.manifest_path, writable=True)
            if existing.matrix_hash != manifest.matrix_hash:
                raise UserError(
                    f"{store.run_dir} holds a run of a different matrix; pass another --run-id "
                    "(or delete that directory) to start a new run"
                )
            store._write_manifest(existing.model_copy(update={"invocations": [*existing.invocations, invocation]}))
            return store
        try:
            for sub in ("cells", "logs", "engine_metrics", "attempts"):
                (store.run_dir / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunError(f"cannot create the run directory {store.run_dir}: {exc.strerror or exc}") from None
        first = manifest.model_copy(update={"schema_version": SCHEMA_VERSION, "invocations": [invocation]})
        store._write_manifest(first)
        return store

    # ---- paths ---------------------------------------------------------------------------------

    @property
    def manifest_path(self) -> Path:
        return self.run_dir / "manifest.json"

    def cell_path(self, cell_id: str) -> Path:
        return self.run_dir / "cells" / f"{cell_id}.json"

    def log_path(self, server_id: str) -> Path:
        return self.run_dir / "logs" / f"{server_id}.log"

    def engine_metrics_path(self, cell_id: str) -> Path:
        return self.run_dir / "engine_metrics" / f"{cell_id}.json"

    # ---- writes --------------------------------------------------------------------------------

    def _write(self, path: Path, data: bytes) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._write_raw(path, data)
        except OSError as exc:
            raise RunError(f"cannot write {path}: {exc.strerror or exc}") from exc

    def _write_json(self, path: Path, payload: Any) -> None:
        self._write(path, json.dumps(payload, indent=1, sort_keys=True, default=str).encode())

    def _write_manifest(self, manifest: Manifest) -> None:
        self._write_json(self.manifest_path, manifest.to_json())

    def record_server(self, server_id: str, **facts: Any) -> None:
        """Merge facts (ServerRecord fields: argv, env, version, canary, ...) into manifest.servers."""
        manifest = _read_manifest_file(self.manifest_path, writable=True)
        self._write_manifest(manifest.with_server(server_id, **facts))

    def write_cell(self, result: CellResult, records: Iterable[RequestRecord]) -> StoredCell:
        """Store one finished cell; a previous failed attempt is moved to attempts/, never lost."""
        previous = self.stored_cell(result.cell_id)
        attempt = 1
        if previous is not None:
            attempt = previous.attempt + 1
            archived = self.run_dir / "attempts" / f"{result.cell_id}.{previous.attempt}.json"
            self._write(archived, self.cell_path(result.cell_id).read_bytes())
        payload = {
            "schema_version": SCHEMA_VERSION,
            "attempt": attempt,
            "written_utc": utc_now(),
            "cell": result.to_row(),
            "requests": [r.to_row() for r in records],
        }
        self._write_json(self.cell_path(result.cell_id), payload)
        return StoredCell(result, attempt)

    def write_engine_metrics(self, cell_id: str, metrics: dict[str, Any]) -> None:
        self._write_json(self.engine_metrics_path(cell_id), metrics)

    def rebuild_tables(self) -> None:
        """cells.parquet, cells.csv and requests.parquet from every cells/<cell-id>.json."""
        cells, requests = [], []
        for payload in self._cell_payloads():
            cells.append(payload["cell"])
            requests.extend(payload["requests"])
        cell_frame = _frame(cells, CellResult)
        self._write(self.run_dir / "cells.parquet", _parquet_bytes(cell_frame))
        self._write(self.run_dir / "cells.csv", cell_frame.to_csv(index=False).encode())
        self._write(self.run_dir / "requests.parquet", _parquet_bytes(_frame(requests, RequestRecord)))

    # ---- reads ---------------------------------------------------------------------------------

    def stored_cell(self, cell_id: str) -> StoredCell | None:
        path = self.cell_path(cell_id)
        if not path.exists():
            return None
        payload = _read_versioned(path, writable=True)
        return StoredCell(CellResult(**payload["cell"]), int(payload["attempt"]))

    def finished(self, cell_id: str) -> bool:
        """True when the cell is stored ok or invalid (a rerun skips it); failed cells run again."""
        stored = self.stored_cell(cell_id)
        return stored is not None and stored.result.status in FINISHED_STATUSES

    def _cell_payloads(self) -> list[dict[str, Any]]:
        """Every stored cell at the current schema (version-1 cells upgraded with their server record)."""
        payloads = [_read_versioned(p) for p in sorted((self.run_dir / "cells").glob("*.json"))]
        if all(p["schema_version"] == SCHEMA_VERSION for p in payloads):
            return payloads
        manifest = read_manifest(self.run_dir)
        return [p if p["schema_version"] == SCHEMA_VERSION
                else {**p, "cell": schema_v1.cell_from_v1(p["cell"], manifest.server(str(p["cell"].get("server_id"))))}
                for p in payloads]  # fmt: skip


def read_manifest(run_dir: Path) -> Manifest:
    return _read_manifest_file(Path(run_dir) / "manifest.json")


def read_cells(run_dir: Path) -> list[CellResult]:
    return [CellResult(**p["cell"]) for p in RunStore(run_dir)._cell_payloads()]


def read_requests(run_dir: Path) -> list[RequestRecord]:
    return [RequestRecord(**r) for p in RunStore(run_dir)._cell_payloads() for r in p["requests"]]


def _read_manifest_file(path: Path, *, writable: bool = False) -> Manifest:
    payload = _read_versioned(path, writable=writable)
    if payload["schema_version"] == schema_v1.VERSION:
        return schema_v1.manifest_from_v1(payload)
    try:
        return Manifest.model_validate(payload)
    except ValidationError as exc:
        raise RunError(f"{path}: not a valid version-{SCHEMA_VERSION} manifest ({exc.error_count()} problems: "
                       f"{exc.errors()[0]['loc']}: {exc.errors()[0]['msg']})") from None


def _read_versioned(path: Path, *, writable: bool = False) -> dict[str, Any]:
    """A stored JSON file of a version this benchsuite reads (`writable`: one it may also resume)."""
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: not found; is this a benchsuite results directory?") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise RunError(f"{path}: unreadable ({exc})") from None
    version = payload.get("schema_version") if isinstance(payload, dict) else None
    if version == SCHEMA_VERSION or (version in _READABLE_VERSIONS and not writable):
        return payload
    if version in _READABLE_VERSIONS:
        raise UserError(
            f"{path} has results schema version {version}; this benchsuite reports it but writes only version "
            f"{SCHEMA_VERSION}: rerun the matrix into a new --run-id to resume it"
        )
    raise UserError(
        f"{path} has results schema version {version}, this benchsuite reads versions "
        f"{', '.join(map(str, _READABLE_VERSIONS))}: rerun the matrix with this version into a new --run-id, "
        "or read it with the benchsuite release that wrote it"
    )


def _frame(rows: list[dict[str, Any]], row_type: type) -> pd.DataFrame:
    columns = [f.name for f in dataclasses.fields(row_type)]
    frame = pd.DataFrame(rows, columns=columns)
    for column in _JSON_COLUMNS:
        if column in frame:
            frame[column] = [json.dumps(v, sort_keys=True, default=str) for v in frame[column]]
    return frame


def _parquet_bytes(frame: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    return buffer.getvalue()
