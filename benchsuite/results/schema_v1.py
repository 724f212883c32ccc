"""Results written with schema version 1 (before options were typed), read as version 2.

Version 1 stored the manifest as an untyped dict and no K / N / options on a cell: the report
then guessed them from params, extras, server options and argv. Reading a version-1 run here
fills those typed fields once, from the keys version-1 writers actually used (the runner:
params and server options `resident_experts` / `n_cpu_moe`, search cells' extras `search_n`;
benchmarks/h200_cells.py: params `cpu_expert_layers`), never from a command line. A version-1 run
can be reported and compared; resuming one is refused (store.RunStore.open).
"""

from __future__ import annotations

from typing import Any

from benchsuite.results.manifest import Manifest, ServerRecord

VERSION = 1
_K_KEYS_V1 = ("resident_experts",)
_N_KEYS_V1 = ("search_n", "n_cpu_moe", "cpu_expert_layers")


def manifest_from_v1(raw: dict[str, Any]) -> Manifest:
    """A version-1 manifest as the typed model: keys the model does not name move to `extra` (top
    level) or the server's `facts` (e.g. SGLang's routing_trace); nothing is dropped."""
    top = set(Manifest.model_fields) - {"extra", "schema_version"}
    servers_raw = raw.get("servers") or {}
    if isinstance(servers_raw, list):  # hand-written v1 files listed servers with their ids
        servers_raw = {str(s.get("server_id", i)): s for i, s in enumerate(servers_raw)}
    servers = {str(sid): _server_from_v1(entry) for sid, entry in servers_raw.items() if isinstance(entry, dict)}
    body = {k: v for k, v in raw.items() if k in top and k != "servers"}
    body.setdefault("created_utc", "unknown")
    body.setdefault("matrix_source", "unknown")
    body.setdefault("matrix_hash", "")
    body.setdefault("matrix", {})
    extra = {k: v for k, v in raw.items() if k not in top and k not in ("schema_version", "servers")}
    # schema_version stays 1: the model says which layout the file on disk has
    return Manifest.model_validate({**body, "schema_version": VERSION, "servers": servers, "extra": extra})


def _server_from_v1(entry: dict[str, Any]) -> ServerRecord:
    named = set(ServerRecord.model_fields) - {"facts"}
    body = {k: v for k, v in entry.items() if k in named and v is not None}
    body["argv"] = [str(a) for a in body.get("argv") or []]
    facts = {k: v for k, v in entry.items() if k not in named and k != "server_id"}
    return ServerRecord.model_validate({**body, "facts": facts})


def cell_from_v1(cell: dict[str, Any], server: ServerRecord) -> dict[str, Any]:
    """A version-1 CellResult row with K, N and the server's options filled in."""
    params, extras, options = cell.get("params") or {}, cell.get("extras") or {}, server.options
    k = _first_int((params, options), _K_KEYS_V1)
    n = _first_int((extras, params, options), _N_KEYS_V1)
    return {**cell, "resident_experts": k, "n_cpu_moe": n, "options": dict(options)}


def _first_int(sources: tuple[dict[str, Any], ...], keys: tuple[str, ...]) -> int | None:
    for source in sources:
        for key in keys:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None
