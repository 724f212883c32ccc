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
test can make writes fail. Files carry SCHEMA_VERSION; reading them back (version 1 read, not
resumed, through benchsuite.results.schema_v1; other versions refused with a fix-it message; damaged files
detected) is benchsuite.results.stored_files. The manifest is the typed
benchsuite.results.manifest.Manifest and this store is its only writer. In the tables, dict-valued columns
(params, options, extras, engine_timings) are JSON text.

One runner at a time: `open` holds the directory's lock (benchsuite.results.runlock) until `close`.
Each invocation is appended to the manifest's `invocations` and its plan merged into `planned` (a resume
with other `--only` selectors plans other cells of the same run). A resume must match what the run was
measured with: the matrix hash and the manifest's `fingerprint` (model files, datasets, engine builds:
benchsuite.results.fingerprint); a difference is a UserError naming what changed, unless `new_run` moves
the old directory aside first.
A run directory is only ever one this suite created (`stored_files.not_a_run_dir`: a manifest with
the run marker keys): any other existing, non-empty folder is refused (UserError naming it) before
anything is written into it, and `new_run` never moves it.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

import pandas as pd

from benchsuite.errors import RunError, UserError
from benchsuite.records import SCHEMA_VERSION, CellResult, RequestRecord
from benchsuite.results.fingerprint import Fingerprint, fingerprint_changes
from benchsuite.results.manifest import Invocation, Manifest, Planned
from benchsuite.results.runlock import RunLock
from benchsuite.results.stored_files import (
    SERVER_FILE_DIRS,
    DamagedFile,
    cell_payloads,
    not_a_run_dir,
    note_to_stderr,
    read_cell_file,
    read_manifest_file,
)
from benchsuite.tools.machine import MachineFacts, other_kind

Writer = Callable[[Path, bytes], None]
Notify = Callable[[str], None]
_ATTEMPT_FILE = re.compile(r"^(?P<cell>[^.]+)\.(?P<n>\d+)\.json$")
FINISHED_STATUSES = ("ok", "invalid")  # a rerun skips these; `failed` cells run again
_JSON_COLUMNS = ("params", "options", "extras", "engine_timings")


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
    return datetime.now(UTC).isoformat(timespec="seconds")


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
    def open(cls, run_dir: Path, manifest: Manifest, *, write: Writer = atomic_write_bytes,
             new_run: bool = False, notify: Notify = note_to_stderr) -> Self:  # fmt: skip
        """Lock the run directory, then create it, or resume it when it holds a run of the same
        matrix measured with the same inputs; `new_run` first moves an existing run aside."""
        problem = not_a_run_dir(run_dir)  # before the lock file: nothing is written into another's folder
        if problem is not None:
            raise UserError(problem)
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
        aside = self.run_dir.with_name(f"{self.run_dir.name}.replaced-{datetime.now(UTC):%Y%m%dT%H%M%SZ}")
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

    def _open(self, manifest: Manifest) -> None:
        recorded = {"machine": manifest.machine} if _recorded(manifest.machine) else {}  # never a null `machine`
        invocation = Invocation(started_utc=utc_now(), git=manifest.git, host=manifest.machine.hostname, **recorded)
        if self.manifest_path.exists():
            existing = self._check_resumable(read_manifest_file(self.manifest_path, writable=True), manifest)
            # this invocation's plan joins the earlier ones' (`--only A`, then `--only B`: both planned)
            planned = existing.planned.merged(manifest.planned)
            update = {"invocations": [*existing.invocations, invocation], "planned": planned}
            self._write_manifest(existing.model_copy(update=update))
            return
        try:
            for sub in ("cells", "logs", "engine_metrics", "attempts"):
                (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunError(f"cannot create the run directory {self.run_dir}: {exc.strerror or exc}") from None
        first = manifest.model_copy(update={"schema_version": SCHEMA_VERSION, "invocations": [invocation]})
        self._write_manifest(first)

    def _check_resumable(self, existing: Manifest, manifest: Manifest) -> Manifest:
        """`existing` with the new input fingerprint merged in; UserError when resuming would mix inputs."""
        fix = "pass --new-run to start a new run here (the old one is moved aside, never deleted) or another --run-id"
        if existing.matrix_hash != manifest.matrix_hash:
            raise UserError(f"{self.run_dir} holds a run of a different matrix; pass another --run-id, or {fix}")
        if self._code_changed_before_any_cell(existing, manifest, fix):
            existing = existing.model_copy(update={"git": manifest.git})  # the run is this code's from here
        if self._machine_changed_before_any_cell(existing, manifest, fix):
            # the run is this machine's from here: its link probe too (the runner probes again where none is kept)
            existing = existing.model_copy(update={"machine": manifest.machine, "link_bandwidth": None})
        old, new = existing.fingerprint, manifest.fingerprint
        if new is None:  # the caller records no inputs (tests, imported results): nothing to compare
            return existing
        if old is None:
            self._notify(
                f"benchsuite: {self.manifest_path}: no input fingerprint recorded by the earlier run; recording it now"
            )
        changes = fingerprint_changes(old or Fingerprint(), new)
        stored = [self.stored_cell(p.stem) for p in sorted((self.run_dir / "cells").glob("*.json"))] if changes else []
        done = [c.result for c in stored if c is not None and c.result.status in FINISHED_STATUSES]
        blocking = [f"{phrase} ({group[:-1]} {name})" for (group, name), phrases in changes.items()
                    for phrase in phrases
                    if old is not None and any(name == (c.engine if group == "engines" else c.workload) for c in done)
                    ]  # fmt: skip
        if blocking:
            shown = "; ".join(blocking[:3]) + (f"; and {len(blocking) - 3} more" if len(blocking) > 3 else "")
            raise UserError(f"{self.run_dir} was measured with other inputs, resuming would mix them: {shown}; {fix}")
        if changes and old is not None:
            self._notify(
                f"benchsuite: {self.manifest_path}: inputs changed only for cells not finished yet; recorded anew"
            )
        kept = old or Fingerprint()
        merged = Fingerprint(engines={**kept.engines, **new.engines}, workloads={**kept.workloads, **new.workloads})
        return existing.model_copy(update={"fingerprint": merged})

    def _code_changed_before_any_cell(self, existing: Manifest, manifest: Manifest, fix: str) -> bool:
        """UserError when finished cells were measured by other code than this invocation's (the package
        trees of benchsuite and paged_experts, GitFacts.code): a run carried to another machine or resumed
        after a change would otherwise report cells of two code versions as one run. True when the code
        changed but no cell has finished (the run is then the new code's). Runs recorded before the code
        trees, or without git, are not compared."""
        before, now = existing.git.code, manifest.git.code
        if not before or not now or before == now:
            return False
        if not self._any_cell_finished():
            return True
        changed = ", ".join(f"{name} {before.get(name)} -> {now.get(name)}" for name in sorted(set(before) | set(now))
                            if before.get(name) != now.get(name))  # fmt: skip
        commits = f"measured at commit {existing.git.commit or 'unknown'}, this is {manifest.git.commit or 'unknown'}"
        raise UserError(f"{self.run_dir} was measured by other code ({commits}; trees {changed}); resuming would "
                        f"mix code versions in one run; {fix}")  # fmt: skip

    def _machine_changed_before_any_cell(self, existing: Manifest, manifest: Manifest, fix: str) -> bool:
        """UserError when finished cells were measured on another kind of machine than this invocation's
        (tools.machine.other_kind: the CPU model and its logical cores, each GPU's name and memory): a run
        carried from an H100 to an H200, say, would otherwise report cells of two machines as one run under the
        first one's facts and link probe. Another machine of the same kind resumes, and its invocation records
        it. True when the kind changed but no cell has finished (the run is then this machine's). Not compared:
        a run spread over Ray nodes (each cell names its node, report.nodes) and a record without machine facts;
        a failed GPU probe on either side compares the CPUs only."""
        if existing.nodes or not _recorded(existing.machine) or not _recorded(manifest.machine):
            return False
        kinds = other_kind(existing.machine, manifest.machine)
        if kinds is None:
            return False
        if not self._any_cell_finished():
            return True
        raise UserError(f"{self.run_dir} was measured on another kind of machine ({kinds[0]}; this is {kinds[1]}); "
                        f"resuming would mix machines in one run; {fix}")  # fmt: skip

    def _any_cell_finished(self) -> bool:
        stored = [self.stored_cell(p.stem) for p in sorted((self.run_dir / "cells").glob("*.json"))]
        return any(c is not None and c.result.status in FINISHED_STATUSES for c in stored)

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
        manifest = read_manifest_file(self.manifest_path, writable=True)
        self._write_manifest(manifest.with_server(server_id, **facts))

    def record_planned(self, planned: Planned) -> None:
        """Merge what the run plans once it knows it (a search's chosen server and its cells) into the
        manifest's `planned`."""
        manifest = read_manifest_file(self.manifest_path, writable=True)
        self._write_manifest(manifest.model_copy(update={"planned": manifest.planned.merged(planned)}))

    def record_run(self, **facts: Any) -> None:
        """Set run-level facts of the manifest (Manifest fields, e.g. `link_bandwidth`)."""
        manifest = read_manifest_file(self.manifest_path, writable=True)
        self._write_manifest(Manifest.model_validate({**manifest.model_dump(), **facts}))

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

    def update_cell(self, result: CellResult) -> None:
        """Rewrite a stored cell's result in place (same attempt, same request records): fields that
        are known only after its server stopped (paging.optimal_hit_rate)."""
        path = self.cell_path(result.cell_id)
        payload = json.loads(path.read_bytes())
        payload["cell"] = result.to_row()
        self._write_json(path, payload)

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
        moved = target.relative_to(self.run_dir)
        self._notify(f"benchsuite: {path} is damaged ({why}); moved to {moved}, the cell runs again")

    def write_engine_metrics(self, cell_id: str, metrics: dict[str, Any]) -> None:
        self._write_json(self.engine_metrics_path(cell_id), metrics)

    def write_server_file(self, relative: str, data: bytes) -> None:
        """A file a server wrote on another machine (`run --ray`: a node's engine log or routing
        trace), under its place in this run directory: `logs/` or `routing/` only. A log is appended
        to what earlier launches of that server wrote (as a local run's log grows launch by launch);
        a trace replaces the earlier one (as a local relaunch rewrites it)."""
        path = self.run_dir / relative
        if path.parent.name not in SERVER_FILE_DIRS or path.parent.parent != self.run_dir:
            raise RunError(f"{relative}: not a server file of a run directory ({', '.join(SERVER_FILE_DIRS)})")
        if path.parent.name == "logs" and path.is_file():
            data = path.read_bytes() + data
        self._write(path, data)

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
            payload, cell = read_cell_file(path, with_requests=False)
        except DamagedFile as exc:
            self._set_aside(path, str(exc))
            return None
        return StoredCell(cell, payload["attempt"])

    def finished(self, cell_id: str) -> bool:
        """True when the cell is stored ok or invalid (a rerun skips it); failed cells run again."""
        stored = self.stored_cell(cell_id)
        return stored is not None and stored.result.status in FINISHED_STATUSES

    def _cell_payloads(self) -> list[dict[str, Any]]:
        """Every readable cell file at the current schema; damaged ones are set aside."""
        return cell_payloads(self.run_dir, lambda path, exc: self._set_aside(path, str(exc)), writable=True)


def _recorded(machine: MachineFacts) -> bool:
    """Whether a manifest's machine facts were probed (a manifest built by hand, in tests or imports, has none)."""
    return machine.cpu_model is not None or bool(machine.gpus)


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
