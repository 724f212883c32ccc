"""Reading what a run directory holds: each file checked before anything trusts it.

A stored file is read only at a schema version this benchsuite reads (SCHEMA_VERSION; version 1
through benchsuite.results.schema_v1, read but never resumed); other versions are a UserError with a fix-it
message. A file that is not what it should hold (not JSON, not an object, a bad version number, a
cell record with a missing field, wrong types or another cell's id) raises `DamagedFile` naming why
in a few words: the writing store (benchsuite.results.store) sets such a cell aside, a read-only reader
leaves it out with one line; a damaged manifest is refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic

from benchsuite.errors import RunError, UserError
from benchsuite.records import SCHEMA_VERSION, CellResult, RequestRecord
from benchsuite.results import schema_v1
from benchsuite.results.manifest import Manifest

_CELL = pydantic.TypeAdapter(CellResult)
_REQUESTS = pydantic.TypeAdapter(list[RequestRecord])
_REQUIRED_FIELDS = {f.name for f in dataclasses.fields(RequestRecord) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING}  # fmt: skip
_READABLE_VERSIONS = (schema_v1.VERSION, 2, SCHEMA_VERSION)  # 2: today's layout less fields with defaults


class DamagedFile(Exception):
    """A stored file that is not what it should hold; the message says why, in a few words."""


def note_to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def read_manifest(run_dir: Path) -> Manifest:
    return read_manifest_file(Path(run_dir) / "manifest.json")


# What a run directory holds (benchsuite.results.store's layout, plus its lock and atomic-write temporaries)
RUN_LAYOUT = frozenset({"manifest.json", ".lock", "cells", "attempts", "logs", "engine_metrics", "routing",
                        "cells.parquet", "cells.csv", "requests.parquet"})  # fmt: skip
# What engine servers write into a run directory beside the store's own files: logs, routing traces
SERVER_FILE_DIRS = ("logs", "routing")
# The manifest's marker: every manifest this suite writes has these keys (version 1 included)
_MANIFEST_MARKER = ("schema_version", "run_id", "matrix_hash")


def not_a_run_dir(run_dir: Path) -> str | None:
    """Why `run_dir` must not be used as a run directory, or None: it does not exist, is empty, or
    is one this suite created (its manifest carries the marker keys; or, while the manifest is
    missing or damaged, it holds nothing but the store's own layout, with its `cells` or its
    `.lock`: a run stopped between its lock and its manifest leaves the lock alone). Anything else
    is someone else's folder, which a run must neither write into nor move aside."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return None
    if not run_dir.is_dir():
        return f"{run_dir} is a file, not a run directory"
    names = sorted(p.name for p in run_dir.iterdir())
    if not names or _has_run_manifest(run_dir / "manifest.json"):
        return None
    foreign = [n for n in names if n not in RUN_LAYOUT and not (n.startswith(".") and n.endswith(".tmp"))]
    if not foreign and ("cells" in names or ".lock" in names):  # the store's own, stopped before its manifest
        return None
    shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    return (
        f"{run_dir} exists and is not a run directory benchsuite created (no run manifest; it holds {shown}); "
        "benchsuite neither writes into nor moves it: pass another --run-id or output_root"
    )


def _has_run_manifest(path: Path) -> bool:
    try:
        payload = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(payload, dict) and all(key in payload for key in _MANIFEST_MARKER)


def read_manifest_file(path: Path, *, writable: bool = False) -> Manifest:
    """The typed manifest (a version-1 file through schema_v1, unless it is to be written)."""
    fix = ("without it the stored cells' provenance is unknown: pass --new-run to start a new run (the old "
           "directory is moved aside) or another --run-id")  # fmt: skip
    try:
        payload = read_versioned(path, writable=writable)
    except DamagedFile as exc:
        raise UserError(f"{path} is damaged ({exc}); {fix}") from None
    if payload["schema_version"] == schema_v1.VERSION:
        return schema_v1.manifest_from_v1(payload)
    try:
        return Manifest.model_validate(payload)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise UserError(f"{path} is damaged ({where}: {err['msg']}); {fix}") from None


def read_cells(run_dir: Path) -> list[CellResult]:
    return [_CELL.validate_python(p["cell"]) for p in cell_payloads(Path(run_dir), _left_out, writable=False)]


def read_requests(run_dir: Path) -> list[RequestRecord]:
    payloads = cell_payloads(Path(run_dir), _left_out, writable=False)
    return [r for p in payloads for r in _REQUESTS.validate_python(p["requests"])]


def cell_payloads(
    run_dir: Path, on_damaged: Callable[[Path, DamagedFile], None], *, writable: bool
) -> list[dict[str, Any]]:
    """Every readable cell file at the current schema (version-1 cells upgraded with their server
    record, when not `writable`); each damaged one is handed to `on_damaged` and left out."""
    payloads = []
    for path in sorted((run_dir / "cells").glob("*.json")):
        try:
            payloads.append(read_cell_file(path, with_requests=True, writable=writable)[0])
        except DamagedFile as exc:
            on_damaged(path, exc)
    if all(p["schema_version"] != schema_v1.VERSION for p in payloads):
        return payloads
    manifest = read_manifest(run_dir)
    return [p if p["schema_version"] != schema_v1.VERSION
            else {**p, "cell": schema_v1.cell_from_v1(p["cell"], manifest.server(str(p["cell"].get("server_id"))))}
            for p in payloads]  # fmt: skip


def _left_out(path: Path, exc: DamagedFile) -> None:
    """A read-only reader skips a damaged cell file with one line (a writing store sets it aside)."""
    note_to_stderr(f"benchsuite: {path} is damaged ({exc}); left out")


def read_versioned(path: Path, *, writable: bool = False) -> dict[str, Any]:
    """The JSON object of a stored file of a version this benchsuite reads (`writable`: one it may
    also resume); UserError for another schema version, DamagedFile for the rest."""
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


def read_cell_file(path: Path, *, with_requests: bool, writable: bool = True) -> tuple[dict[str, Any], CellResult]:
    """A cell file's payload and its CellResult, checked: attempt, the cell of this file, request records."""
    payload = read_versioned(path, writable=writable)
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
