"""What a cell's result depends on beyond the matrix text, recorded so a resume cannot mix runs.

`plan_fingerprint(plan)` -> `{"engines": {entry name: {input: facts}}, "workloads": {name: {input:
facts}}}`, stored in the manifest and compared by the store on resume (benchsuite.results.store):
- an engine entry's model: every file of the checkpoint directory (or the GGUF file), by size and
  modification time, so a checkpoint regenerated at the same path is seen (a hash of 60 GB would
  cost minutes per resume; size + mtime is what make and rsync trust); a file of at most
  HASHED_FILE_BYTES also by its content's sha256, which then decides alone with the size: a config,
  a tokenizer or a synthetic model's recipe written again with the same bytes (a device machine
  taken back, the model generated anew on the next one) resumes. `tiny` is the generated
  checkpoint in the cache. A model that is not a local path (an HF repo id) is recorded as such;
- the engine build: the adapter's own version facts (llama-server's `--version` and build stamp,
  the SGLang package version, benchsuite and torch for the built-in engine), plus the binary's
  size and modification time where there is one;
- a workload's dataset file (ShareGPT JSON), by size and modification time (and content, as above).
Cells name their engine entry and workload, so the store refuses only when an input of a stored
finished cell changed. `fingerprint_changes(old, new)` says, in one phrase per input, what changed.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import Field

from benchsuite.config.plan import Plan
from benchsuite.engines import ADAPTERS
from benchsuite.engines.base import ServerSpec
from benchsuite.records import StoredFacts

MAX_FILES_PER_MODEL = 4096  # a checkpoint has tens of files; past this, the count alone is recorded
# Files up to this size are hashed too (a tokenizer.json is ~10 MB, hashed in ~20 ms); weight shards are GBs.
HASHED_FILE_BYTES = 64 * 2**20
_MTIME = "modified_utc"
_VOLATILE = ("started_utc", "error")


class Fingerprint(StoredFacts):
    """The manifest's `fingerprint`: per engine entry and per workload, {input label: its facts}. A
    label names its input (`model <path>/<file>`, `engine <kind>`, `dataset <path>`); its facts are
    a file's {bytes, modified_utc[, sha256]}, the engine's version facts (its own keys), or a phrase
    ("missing", "not a local path ...")."""

    engines: dict[str, dict[str, Any]] = Field(default_factory=dict)
    workloads: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def groups(self) -> dict[str, dict[str, dict[str, Any]]]:
        return {"engines": self.engines, "workloads": self.workloads}


def plan_fingerprint(plan: Plan) -> Fingerprint:
    engines: dict[str, dict[str, Any]] = {}
    for spec in [*plan.servers, *(task.spec for task in plan.searches)]:
        facts = engines.setdefault(spec.name, {})
        facts.update(_model_facts(spec))
        facts.update(_engine_facts(spec))
    workloads: dict[str, dict[str, Any]] = {}
    for name, workload in plan.matrix.matrix.workloads.items():
        workloads[name] = path_facts(f"dataset {workload.path}", Path(workload.path)) if workload.path else {}
    return Fingerprint(engines=engines, workloads=workloads)


def path_facts(label: str, path: Path) -> dict[str, Any]:
    """{label-with-file: {bytes, modified_utc[, sha256]}} for a file, or for every file under a directory."""
    if path.is_file():
        return {label: _stat(path, hashed=True)}
    if not path.is_dir():
        return {label: "missing"}
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if len(files) > MAX_FILES_PER_MODEL:
        return {label: f"{len(files)} files"}
    return {f"{label}/{p.relative_to(path)}": _stat(p, hashed=True) for p in files} or {label: "empty directory"}


def _stat(path: Path, hashed: bool = False) -> dict[str, Any]:
    """{bytes, modified_utc}, and with `hashed` the content's sha256 where the file is small enough."""
    st = path.stat()
    modified = datetime.fromtimestamp(st.st_mtime_ns / 1e9, UTC).isoformat(timespec="microseconds")
    facts: dict[str, Any] = {"bytes": st.st_size, _MTIME: modified}
    if hashed and st.st_size <= HASHED_FILE_BYTES:
        facts["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return facts


def _model_facts(spec: ServerSpec) -> dict[str, Any]:
    source = spec.options.model_source()
    if source is None:
        return {}
    if source == "tiny":
        from paged_experts.weights.synth import ensure_tiny

        path = Path(ensure_tiny())
    else:
        path = Path(source).expanduser()
    if not path.exists() and not source.startswith(("/", ".", "~")) and source.count("/") == 1:
        return {f"model {source}": "not a local path (a hub id): its files are not checked"}
    return path_facts(f"model {path}", path)


def _engine_facts(spec: ServerSpec) -> dict[str, Any]:
    try:
        version = ADAPTERS[spec.kind].version(spec)
    except Exception as exc:  # noqa: BLE001 -- e.g. a model that does not exist yet: its launch says so
        return {f"engine {spec.kind}": f"version facts unavailable ({type(exc).__name__})"}
    facts = {k: v for k, v in version.items() if k not in _VOLATILE}
    binary = facts.get("binary")
    if isinstance(binary, str) and Path(binary).is_file():
        facts["binary_file"] = _stat(Path(binary))
    return {f"engine {spec.kind}": facts}


def fingerprint_changes(old: Fingerprint, new: Fingerprint) -> dict[tuple[str, str], list[str]]:
    """(group, name) -> one phrase per input whose recorded facts differ, for the groups `engines`
    and `workloads` of benchsuite.results.fingerprint, e.g. `model /m/x.safetensors: bytes 1 -> 2`. Only
    names in both count: a run of part of the matrix (--only) fingerprints that part."""
    changes: dict[tuple[str, str], list[str]] = {}
    old_groups, new_groups = old.groups(), new.groups()
    for group in ("engines", "workloads"):
        before_all, after_all = old_groups[group], new_groups[group]
        for name in sorted(set(before_all) & set(after_all)):  # a part left out (--only) is not a change
            phrases = _fact_changes(before_all.get(name) or {}, after_all.get(name) or {})
            if phrases:
                changes[(group, name)] = phrases
    return changes


def _compared(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The facts two records are compared by. A file's (bytes and modified_utc both sides): the facts both
    record, by content where both hashed it (the modification time then says nothing), so a manifest
    written before files were hashed still resumes; anything else: every fact either records."""
    if not all("bytes" in facts and _MTIME in facts for facts in (before, after)):
        return sorted(set(before) | set(after))
    common = set(before) & set(after)
    return sorted(common - {_MTIME} if "sha256" in common else common)


def _fact_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    phrases = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, "absent"), new.get(key, "absent")
        if before == after:
            continue
        if isinstance(before, dict) and isinstance(after, dict):
            diffs = [f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in _compared(before, after)
                     if before.get(k) != after.get(k)]  # fmt: skip
            if diffs:
                phrases.append(f"{key}: {', '.join(diffs)}")
        else:
            phrases.append(f"{key}: {_short(before)} -> {_short(after)}")
    return phrases


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 120 else text[:117] + "..."
