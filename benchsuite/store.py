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

One runner at a time: `open` holds the directory's lock (benchsuite.runlock) until `close`.
A resume must match what the run was measured with: the matrix hash and the manifest's
`fingerprint` (model files, datasets, engine builds: benchsuite.fingerprint); a difference is a
UserError naming what changed, unless `new_run` moves the old directory aside first.

Damage: a cell file that is not a valid cell record (`[]`, `null`, garbage bytes, a missing field,
wrong types, another cell's id) is reported in one line naming it (the `notify` seam), moved to
attempts/ like a failed attempt, and its cell counts as not measured, so the run measures it
again. A damaged manifest is refused in one line instead of rebuilt: it holds the provenance of
the cells already stored (machine, git, fingerprint, engine command lines), which a rebuild would
invent; `--new-run` (or another --run-id) starts a run whose provenance is known.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import pydantic

from benchsuite.errors import RunError, UserError
from benchsuite.records import SCHEMA_VERSION, CellResult, RequestRecord
from benchsuite.runlock import RunLock

Writer = Callable[[Path, bytes], None]
Notify = Callable[[str], None]
_CELL = pydantic.TypeAdapter(CellResult)
_REQUESTS = pydantic.TypeAdapter(list[RequestRecord])
_REQUIRED_FIELDS = {f.name for f in dataclasses.fields(RequestRecord) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING}  # fmt: skip
_ATTEMPT_FILE = re.compile(r"^(?P<cell>[^.]+)\.(?P<n>\d+)\.json$")


class DamagedFile(Exception):
    """A stored file that is not what it should hold; the message says why, in a few words."""


def note_to_stderr(line: str) -> None:
    print(line, file=sys.stderr)
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

    def __init__(self, run_dir: Path, *, write: Writer = atomic_write_bytes, notify: Notify = note_to_stderr) -> None:
        self.run_dir = Path(run_dir)
        self._write_raw = write
        self._notify = notify
        self._lock: RunLock | None = None

    @classmethod
    def open(cls, run_dir: Path, manifest: dict[str, Any], *, write: Writer = atomic_write_bytes,
             new_run: bool = False, notify: Notify = note_to_stderr) -> RunStore:  # fmt: skip
        """Lock the run directory, then create it, or resume it when it holds a run of the same
        matrix measured with the same inputs; `new_run` first moves an existing run aside."""
        store = cls(run_dir, write=write, notify=notify)
        store._lock = store._take_lock()
        try:
            if new_run and store.manifest_path.exists() or new_run and (store.run_dir / "cells").is_dir():
                store._move_aside()
            store._open(manifest)
        except BaseException:
            store.close()
            raise
        return store

    def close(self) -> None:
        """Release the run directory's lock (also released when the process ends)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _take_lock(self) -> RunLock:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunError(f"cannot create the run directory {self.run_dir}: {exc.strerror or exc}") from None
        return RunLock.acquire(self.run_dir, self._notify)

    def _move_aside(self) -> None:
        aside = self.run_dir.with_name(f"{self.run_dir.name}.replaced-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}")
        old_lock = self._lock
        try:
            os.rename(self.run_dir, aside)
            self.run_dir.mkdir()
        except OSError as exc:
            raise RunError(f"cannot move {self.run_dir} aside to {aside}: {exc.strerror or exc}") from None
        self._lock = RunLock.acquire(self.run_dir, self._notify)
        if old_lock is not None:
            old_lock.release()
        self._notify(f"benchsuite: --new-run: the earlier run is kept in {aside}")

    def _open(self, manifest: dict[str, Any]) -> None:
        invocation = {"started_utc": utc_now(), "git": manifest.get("git"), "host": manifest.get("machine", {}).get("hostname")}
        if self.manifest_path.exists():
            existing = read_manifest(self.run_dir)
            self._check_resumable(existing, manifest)
            existing.setdefault("invocations", []).append(invocation)
            self._write_json(self.manifest_path, existing)
            return
        try:
            for sub in ("cells", "logs", "engine_metrics", "attempts"):
                (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunError(f"cannot create the run directory {self.run_dir}: {exc.strerror or exc}") from None
        self._write_json(self.manifest_path, {**manifest, "schema_version": SCHEMA_VERSION, "invocations": [invocation]})

    def _check_resumable(self, existing: dict[str, Any], manifest: dict[str, Any]) -> None:
        fix = "pass --new-run to start a new run here (the old one is moved aside, never deleted) or another --run-id"
        if existing.get("matrix_hash") != manifest.get("matrix_hash"):
            raise UserError(f"{self.run_dir} holds a run of a different matrix; pass another --run-id, or {fix}")
        old, new = existing.get("fingerprint"), manifest.get("fingerprint")
        if new is None:  # the caller records no inputs (tests, imported results): nothing to compare
            return
        if old is None:
            self._notify(f"benchsuite: {self.manifest_path}: no input fingerprint recorded by the earlier run; recording it now")
        changes = fingerprint_changes(old or {}, new or {})
        stored = [self.stored_cell(p.stem) for p in sorted((self.run_dir / "cells").glob("*.json"))] if changes else []
        done = [c.result for c in stored if c is not None and c.result.status in FINISHED_STATUSES]
        blocking = [f"{phrase} ({group[:-1]} {name})" for (group, name), phrases in changes.items() for phrase in phrases
                    if old is not None and any(name == (c.engine if group == "engines" else c.workload) for c in done)]  # fmt: skip
        if blocking:
            shown = "; ".join(blocking[:3]) + (f"; and {len(blocking) - 3} more" if len(blocking) > 3 else "")
            raise UserError(f"{self.run_dir} was measured with other inputs, resuming would mix them: {shown}; {fix}")
        if changes and old is not None:
            self._notify(f"benchsuite: {self.manifest_path}: inputs changed only for cells not finished yet; recorded anew")
        kept = old or {}
        existing["fingerprint"] = {group: {**(kept.get(group) or {}), **(new.get(group) or {})} for group in new}

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
        attempt = self._last_archived(result.cell_id) + 1
        if previous is not None:
            attempt = max(attempt, previous.attempt + 1)
            archived = self.run_dir / "attempts" / f"{result.cell_id}.{attempt - 1}.json"
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

    def _last_archived(self, cell_id: str) -> int:
        numbers = [int(m["n"]) for p in (self.run_dir / "attempts").glob(f"{cell_id}.*.json")
                   if (m := _ATTEMPT_FILE.match(p.name)) and m["cell"] == cell_id]  # fmt: skip
        return max(numbers, default=0)

    def _set_aside(self, path: Path, why: str) -> None:
        """A damaged cell file goes to attempts/ under the next attempt number, with one line."""
        cell_id = path.stem
        target = self.run_dir / "attempts" / f"{cell_id}.{self._last_archived(cell_id) + 1}.json"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        except OSError as exc:
            raise RunError(f"{path} is damaged ({why}) and cannot be moved aside: {exc.strerror or exc}") from None
        self._notify(f"benchsuite: {path} is damaged ({why}); moved to {target.relative_to(self.run_dir)}, the cell runs again")

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
        """The stored cell, or None when it was never stored or its file was damaged (set aside)."""
        path = self.cell_path(cell_id)
        if not path.exists():
            return None
        try:
            payload, cell = _read_cell(path, with_requests=False)
        except DamagedFile as exc:
            self._set_aside(path, str(exc))
            return None
        return StoredCell(cell, payload["attempt"])

    def finished(self, cell_id: str) -> bool:
        """True when the cell is stored ok or invalid (a rerun skips it); failed cells run again."""
        stored = self.stored_cell(cell_id)
        return stored is not None and stored.result.status in FINISHED_STATUSES

    def _cell_payloads(self, set_aside: bool = True) -> list[dict[str, Any]]:
        """Every readable cell file; damaged ones are set aside (or, read-only, skipped with a note)."""
        payloads = []
        for path in sorted((self.run_dir / "cells").glob("*.json")):
            try:
                payloads.append(_read_cell(path, with_requests=True)[0])
            except DamagedFile as exc:
                if set_aside:
                    self._set_aside(path, str(exc))
                else:
                    self._notify(f"benchsuite: {path} is damaged ({exc}); left out")
        return payloads


def read_manifest(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / "manifest.json"
    try:
        return _read_versioned(path)
    except DamagedFile as exc:
        raise UserError(
            f"{path} is damaged ({exc}); without it the stored cells' provenance is unknown: pass --new-run to "
            "start a new run (the old directory is moved aside) or another --run-id"
        ) from None


def read_cells(run_dir: Path) -> list[CellResult]:
    return [_CELL.validate_python(p["cell"]) for p in RunStore(run_dir)._cell_payloads(set_aside=False)]


def read_requests(run_dir: Path) -> list[RequestRecord]:
    return [r for p in RunStore(run_dir)._cell_payloads(set_aside=False) for r in _REQUESTS.validate_python(p["requests"])]


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[tuple[str, str], list[str]]:
    """(group, name) -> one phrase per input whose recorded facts differ, for the groups `engines`
    and `workloads` of benchsuite.fingerprint, e.g. `model /m/x.safetensors: bytes 1 -> 2`. Only
    names in both count: a run of part of the matrix (--only) fingerprints that part."""
    changes: dict[tuple[str, str], list[str]] = {}
    for group in ("engines", "workloads"):
        before_all, after_all = old.get(group) or {}, new.get(group) or {}
        for name in sorted(set(before_all) & set(after_all)):  # a part left out (--only) is not a change
            phrases = _fact_changes(before_all.get(name) or {}, after_all.get(name) or {})
            if phrases:
                changes[(group, name)] = phrases
    return changes


def _fact_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    phrases = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, "absent"), new.get(key, "absent")
        if before == after:
            continue
        if isinstance(before, dict) and isinstance(after, dict):
            diffs = [f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in sorted(set(before) | set(after))
                     if before.get(k) != after.get(k)]  # fmt: skip
            phrases.append(f"{key}: {', '.join(diffs)}")
        else:
            phrases.append(f"{key}: {_short(before)} -> {_short(after)}")
    return phrases


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


def _read_versioned(path: Path) -> dict[str, Any]:
    """The JSON object of a stored file; UserError for another schema version, DamagedFile for the rest."""
    try:
        payload = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise UserError(f"{path}: not found; is this a benchsuite results directory?") from None
    except OSError as exc:
        raise RunError(f"{path}: unreadable ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, absurd nesting
        raise DamagedFile(f"not JSON: {str(exc)[:80]}") from None
    if not isinstance(payload, dict):
        raise DamagedFile(f"a JSON {type(payload).__name__}, not an object")
    version = payload.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise DamagedFile(f"schema_version {version!r} is not a version number")
    if version != SCHEMA_VERSION:
        raise UserError(
            f"{path} has results schema version {version}, this benchsuite reads version {SCHEMA_VERSION}: "
            "rerun the matrix with this version into a new --run-id, or read it with the benchsuite "
            "release that wrote it"
        )
    return payload


def _read_cell(path: Path, *, with_requests: bool) -> tuple[dict[str, Any], CellResult]:
    """A cell file's payload and its CellResult, checked: attempt, the cell of this file, request records."""
    payload = _read_versioned(path)
    attempt = payload.get("attempt")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
        raise DamagedFile(f"attempt {attempt!r} is not a number >= 1")
    if not isinstance(payload.get("requests"), list):
        raise DamagedFile("no request list")
    cell = _validated(_CELL, payload.get("cell"), "cell")
    if cell.cell_id != path.stem:
        raise DamagedFile(f"it holds cell {cell.cell_id!r}")
    for i, row in enumerate(payload["requests"]):  # the cheap shape check; types below when asked
        if not isinstance(row, dict) or not _REQUIRED_FIELDS <= row.keys() or row["cell_id"] != cell.cell_id:
            raise DamagedFile(f"requests.{i} is not a request record of this cell")
    if with_requests:
        _validated(_REQUESTS, payload["requests"], "requests")
    return payload, cell


def _validated(adapter: pydantic.TypeAdapter[Any], value: Any, what: str) -> Any:
    try:
        return adapter.validate_python(value)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join([what, *(str(p) for p in err["loc"])])
        raise DamagedFile(f"{where}: {err['msg']}") from None


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
