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
test can make writes fail. Files carry SCHEMA_VERSION; other versions are refused with a fix-it
message. In the tables, dict-valued columns (params, extras, engine_timings) are JSON text.
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

from benchsuite.errors import RunError, UserError
from benchsuite.records import SCHEMA_VERSION, CellResult, RequestRecord

Writer = Callable[[Path, bytes], None]
FINISHED_STATUSES = ("ok", "invalid")  # a rerun skips these; `failed` cells run again
_JSON_COLUMNS = ("params", "extras", "engine_timings")


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
    def open(cls, run_dir: Path, manifest: dict[str, Any], *, write: Writer = atomic_write_bytes) -> RunStore:
        """Create the run directory, or resume it when its manifest has the same matrix hash."""
        store = cls(run_dir, write=write)
        invocation = {"started_utc": utc_now(), "git": manifest.get("git"), "host": manifest.get("machine", {}).get("hostname")}
        if store.manifest_path.exists():
            existing = read_manifest(store.run_dir)
            if existing.get("matrix_hash") != manifest.get("matrix_hash"):
                raise UserError(
                    f"{store.run_dir} holds a run of a different matrix; pass another --run-id "
                    "(or delete that directory) to start a new run"
                )
            existing.setdefault("invocations", []).append(invocation)
            store._write_json(store.manifest_path, existing)
            return store
        try:
            for sub in ("cells", "logs", "engine_metrics", "attempts"):
                (store.run_dir / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunError(f"cannot create the run directory {store.run_dir}: {exc.strerror or exc}") from None
        store._write_json(store.manifest_path, {**manifest, "schema_version": SCHEMA_VERSION, "invocations": [invocation]})
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

    def record_server(self, server_id: str, facts: dict[str, Any]) -> None:
        """Merge launch facts (exact argv, env, engine version, start time) into manifest.servers."""
        manifest = read_manifest(self.run_dir)
        servers = manifest.setdefault("servers", {})
        servers[server_id] = {**servers.get(server_id, {}), **facts}
        self._write_json(self.manifest_path, manifest)

    def record_run(self, key: str, facts: dict[str, Any]) -> None:
        """Set a run-level fact of the manifest (e.g. `link_bandwidth`, the run's link probe)."""
        manifest = read_manifest(self.run_dir)
        manifest[key] = facts
        self._write_json(self.manifest_path, manifest)

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
        payload = _read_versioned(path)
        return StoredCell(CellResult(**payload["cell"]), int(payload["attempt"]))

    def finished(self, cell_id: str) -> bool:
        """True when the cell is stored ok or invalid (a rerun skips it); failed cells run again."""
        stored = self.stored_cell(cell_id)
        return stored is not None and stored.result.status in FINISHED_STATUSES

    def _cell_payloads(self) -> list[dict[str, Any]]:
        return [_read_versioned(p) for p in sorted((self.run_dir / "cells").glob("*.json"))]


def read_manifest(run_dir: Path) -> dict[str, Any]:
    return _read_versioned(Path(run_dir) / "manifest.json")


def read_cells(run_dir: Path) -> list[CellResult]:
    return [CellResult(**p["cell"]) for p in RunStore(run_dir)._cell_payloads()]


def read_requests(run_dir: Path) -> list[RequestRecord]:
    return [RequestRecord(**r) for p in RunStore(run_dir)._cell_payloads() for r in p["requests"]]


def _read_versioned(path: Path) -> dict[str, Any]:
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: not found; is this a benchsuite results directory?") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise RunError(f"{path}: unreadable ({exc})") from None
    version = payload.get("schema_version")
    if version != SCHEMA_VERSION:
        raise UserError(
            f"{path} has results schema version {version}, this benchsuite reads version {SCHEMA_VERSION}: "
            "rerun the matrix with this version into a new --run-id, or read it with the benchsuite "
            "release that wrote it"
        )
    return payload


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
