"""A run's facts, read once from its manifest (benchsuite.results.manifest.Manifest, typed) into one typed
value, `RunFacts`: machine, source (git), fairness, servers with their exact commands and versions,
the engines the matrix names and the cells the run planned, the published reference it names, the
measured link, the GPU budget, and the model (top_k, number of experts). Every report section takes
these from `RunData.facts`; none looks into the manifest again.

The model comes from the servers' typed `model` records (EngineAdapter.model_shape, at launch). A run
stored before those were recorded is read the old way, here only: `num_experts_per_tok` anywhere in
its manifest, `top_k` / `num_experts` inside a model block, else the config.json of a checkpoint a
server names. Never invents a value: a fact that is absent is reported as absent.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchsuite.engines import adapter_of
from benchsuite.report.budget import run_budget_bytes
from benchsuite.report.planned import PlannedCells, read_planned
from benchsuite.results.manifest import Manifest, ServerRecord
from benchsuite.results.server_facts import CanaryResult
from benchsuite.tools.machine import MachineFacts, machine_kind
from paged_experts.shape import ModelShape

_TOP_K_KEYS = ("top_k", "num_experts_per_tok")
_NUM_EXPERTS_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


@dataclass(frozen=True)
class ServerFacts:
    server_id: str
    engine: str
    kind: str
    command: str  # shell-quoted argv, exactly as launched
    version: str
    canary: str = "not run"  # the leak canary after the server's cells: passed / FAILED (leaks n) / not run
    expert_format: str | None = None  # how the engine stores one expert (version.expert_format: float8_e4m3fn, q8_0)
    expert_bytes: int | None = None  # one expert's gate + up + down bytes as served (FP8: block scales included)
    startup: str = "not recorded"  # launch to ready, and the engine's own breakdown where it reports one

    @property
    def canary_failed(self) -> bool:
        return self.canary.startswith("FAILED")


def canary_text(record: CanaryResult | None) -> str:
    """A server's `canary` manifest entry in words: passed / FAILED (leaks n) / not run (why)."""
    if record is None:
        return "not run"
    given = record.model_fields_set
    if "error" in given or record.passed is None:
        return f"not run ({record.error if 'error' in given else 'no verdict'})"
    if record.passed:
        checked = record.requests_checked if "requests_checked" in given else "?"
        return f"passed ({checked} responses checked)"
    return f"FAILED (leaks {len(record.leaks)})"


def _scalar_text(value: Any, key: str = "") -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and not isinstance(value, bool) and key.endswith("_bytes"):
        return f"{value} ({value / 2**30:.1f} GiB)"
    return str(value)


def flatten_facts(obj: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Nested dicts as (dotted.key, text) pairs, keys sorted as the manifest stores them; lists of
    scalars joined by ', '."""
    if isinstance(obj, dict):
        pairs: list[tuple[str, str]] = []
        for key, value in sorted(obj.items()):
            pairs.extend(flatten_facts(value, f"{prefix}{key}."))
        return pairs
    if isinstance(obj, list) and not obj:
        return [(prefix[:-1], "none")]
    if isinstance(obj, list) and all(not isinstance(v, (dict, list)) for v in obj):
        return [(prefix[:-1], ", ".join(_scalar_text(v) for v in obj))]
    if isinstance(obj, list):
        pairs = []
        for index, value in enumerate(obj):
            pairs.extend(flatten_facts(value, f"{prefix}{index}."))
        return pairs
    return [(prefix[:-1], "absent" if obj is None else _scalar_text(obj, prefix[:-1]))]


def _machine_facts(manifest: Manifest) -> list[tuple[str, str]]:
    return flatten_facts(manifest.machine.model_dump(mode="json"))


def _git_facts(manifest: Manifest) -> list[tuple[str, str]]:
    return flatten_facts(manifest.git.model_dump(mode="json"))


def _fairness_facts(manifest: Manifest) -> list[tuple[str, str]]:
    return flatten_facts(manifest.matrix.get("fairness") or {})


def _servers(manifest: Manifest) -> list[ServerFacts]:
    out = []
    for server_id, record in manifest.servers.items():
        version = ", ".join(f"{k}={_scalar_text(v)}" for k, v in record.version.items()) if record.version else "absent"
        expert_bytes = record.version.get("expert_bytes")
        out.append(ServerFacts(server_id, record.engine, record.kind, shlex.join(record.argv), version,
                               canary_text(record.canary), record.version.get("expert_format"),
                               expert_bytes if isinstance(expert_bytes, int) else None,
                               startup_text(record)))  # fmt: skip
    return out


def startup_text(record: ServerRecord) -> str:
    """'ready in 53.1 s (load 37.8 s, 4 graphs captured in 11.3 s)': the runner's launch-to-ready time
    and the built-in server's own breakdown (startup_facts.engine_startup_s)."""
    total = record.startup_s
    if total is None:
        return "not recorded"
    facts = record.startup_facts.get("engine_startup_s") or {}
    parts = []
    if facts.get("load_s") is not None:
        parts.append(f"load {facts['load_s']:.1f} s")
    if facts.get("capture_s") is not None:
        parts.append(f"{int(facts.get('graphs', 0))} graphs captured in {facts['capture_s']:.1f} s")
    return f"ready in {total:.1f} s" + (f" ({', '.join(parts)})" if parts else "")


def _matrix_engines(manifest: Manifest) -> dict[str, str]:
    """Engine entry name -> kind, as the matrix names them."""
    engines = manifest.matrix.get("engines") or {}
    return {str(name): str((entry or {}).get("kind", "")) for name, entry in engines.items()}


def _reference_name(manifest: Manifest) -> str | None:
    value = manifest.matrix.get("reference")
    if isinstance(value, dict):
        value = value.get("name")
    return str(value) if value else None


def _reference_filter(manifest: Manifest) -> dict[str, str]:
    """Published-row filter a matrix may give beside its reference (machine, quant)."""
    value = manifest.matrix.get("reference")
    if not isinstance(value, dict):
        return {}
    return {key: str(value[key]) for key in ("machine", "quant") if value.get(key) is not None}


def _find_int(obj: Any, keys: tuple[str, ...]) -> int | None:
    if isinstance(obj, dict):
        for key in keys:
            value = obj.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        for value in obj.values():
            found = _find_int(value, keys)
            if found is not None:
                return found
    if isinstance(obj, list):
        for value in obj:
            found = _find_int(value, keys)
            if found is not None:
                return found
    return None


def _model_subtrees(obj: Any) -> list[Any]:
    """Values stored under keys that name a model (model, model_config, ...), at any depth."""
    found: list[Any] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if "model" in str(key).lower() and isinstance(value, dict):
                found.append(value)
            found.extend(_model_subtrees(value))
    elif isinstance(obj, list):
        for value in obj:
            found.extend(_model_subtrees(value))
    return found


def _model_dirs(manifest: Manifest, run_dir: Path) -> list[Path]:
    """Checkpoint directories the servers' options name, resolved as given, then beside the run."""
    adapters = [(adapter_of(r.kind), r.options) for r in manifest.servers.values()]
    names = [name for adapter, o in adapters if adapter is not None and (name := adapter.recorded_model(o)) is not None]
    candidates = [Path(n) if Path(n).is_absolute() else base / n for n in names for base in (Path.cwd(), run_dir)]
    return [c for c in candidates if (c / "config.json").is_file()]


def _model_shapes(manifest: Manifest, run_dir: Path) -> list[ModelShape]:
    shapes = []
    for directory in _model_dirs(manifest, run_dir):
        try:
            shapes.append(ModelShape.from_dir(directory))
        except (OSError, ValueError, TypeError):  # unreadable or not a MoE config: no shape from it
            continue
    return shapes


def _legacy_top_k(manifest: Manifest, run_dir: Path) -> int | None:
    """num_experts_per_tok anywhere in the manifest (HF config name), else `top_k` inside a model
    block (a sampling top_k elsewhere must not be mistaken for the router's), else the config.json
    of the checkpoint a server was started with."""
    raw = manifest.to_json()
    return (
        _find_int(raw, ("num_experts_per_tok",))
        or _find_int(_model_subtrees(raw), _TOP_K_KEYS)
        or next((s.top_k for s in _model_shapes(manifest, run_dir)), None)
    )


def _legacy_num_experts(manifest: Manifest, run_dir: Path) -> int | None:
    raw = manifest.to_json()
    found = _find_int(_model_subtrees(raw), _NUM_EXPERTS_KEYS)
    return found or next((s.num_experts for s in _model_shapes(manifest, run_dir)), None)


def _link_gb_per_s(manifest: Manifest) -> tuple[float | None, str]:
    """The run's measured paging bandwidth (GB/s), or None and why there is none."""
    link = manifest.link_bandwidth
    if link is None:
        return None, "no link bandwidth in this run (matrix `linkbw: true` measures it)"
    if link.paging_gb_per_s is not None and link.paging_gb_per_s > 0:
        return link.paging_gb_per_s, ""
    return None, f"the run's link probe failed: {link.error if 'error' in link.model_fields_set else 'no figure'}"


def _kernel_gb_per_s(manifest: Manifest) -> float | None:
    """The copy kernel's rate the run's probe measured beside the DMAs (its report's `kernel_gb_per_s`)."""
    report = manifest.link_bandwidth.report if manifest.link_bandwidth is not None else None
    value = (report or {}).get("kernel_gb_per_s")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


@dataclass(frozen=True)
class RunModel:
    """The model a run served, as far as its manifest says (None: not recorded)."""

    top_k: int | None
    num_experts: int | None


def _model(manifest: Manifest, run_dir: Path) -> RunModel:
    shapes = [r.model for r in manifest.servers.values() if r.model is not None]
    if shapes:
        return RunModel(shapes[0].top_k, shapes[0].num_experts)
    return RunModel(_legacy_top_k(manifest, run_dir), _legacy_num_experts(manifest, run_dir))


@dataclass(frozen=True)
class RunFacts:
    """One run's facts as the report shows and uses them, read once (`read_run_facts`)."""

    machine: list[tuple[str, str]]  # flattened: (dotted.key, text)
    source: list[tuple[str, str]]  # git: commit, tree, dirty
    fairness: list[tuple[str, str]]
    servers: list[ServerFacts]
    records: Mapping[str, ServerRecord]  # server id -> the typed record (caveats, budget, searches)
    matrix_engines: dict[str, str]  # entry name -> kind, as the matrix names them
    reference_name: str | None
    reference_filter: dict[str, str]
    link: tuple[float | None, str]  # measured paging GB/s, or None and why
    budget_bytes: int | None  # the run's GPU memory budget (report/budget.py)
    has_gpu: bool
    model: RunModel
    identity: tuple[str | None, str | None, str]  # (git commit, git tree, matrix hash): compare's A/A check
    # the measuring code's trees (GitFacts.code: benchsuite, paged_experts), sorted; None where the run did not
    # record them: compare's A/A check across commits that changed none of that code
    code: tuple[tuple[str, str], ...] | None = None
    # `run --ray`: node id -> its machine facts (Manifest.nodes; report/nodes.py); empty without --ray
    nodes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # the cells the run planned, named (report/planned.py); none in a manifest older than `planned`
    planned: PlannedCells = field(default_factory=PlannedCells)
    # one line per invocation (when, where, which kind of machine, which commit) of a run resumed on another machine
    # (results.manifest.Invocation.machine): its cells come from more than one box (of one kind: results.store)
    invocations: list[str] = field(default_factory=list)
    # the probe's copy-kernel GB/s (the built-in runtime's decode page-in path, tools.linkbw); None where the run's
    # probe did not time it (before 2026-12-07, no Triton, or the probe failed)
    kernel_gb_per_s: float | None = None


def invocation_lines(manifest: Manifest) -> list[str]:
    """'2026-12-07T13:40:00+00:00 on vm: Intel(R) Xeon(R) Processor x16, NVIDIA H100 80GB HBM3 80 GiB, driver
    580.159.04; commit 8e12bba0178a (dirty)' per invocation, for a run resumed on another machine than the manifest's
    (`machine`): another host, kind or GPU driver. None for a run measured on one machine, in one go or resumed
    there (a GPU's current PCIe generation, which drops while it idles, or a package version is no other machine)."""
    if not any(i.machine is not None and _box(i.machine) != _box(manifest.machine) for i in manifest.invocations):
        return []
    lines = []
    for invocation in manifest.invocations:
        machine = invocation.machine
        kind = ", ".join(_box(machine)[1:]) if machine is not None else "machine not recorded"
        git = invocation.git
        commit = f"commit {git.commit[:12]}{' (dirty)' if git.dirty else ''}" if git and git.commit else "no commit"
        host = machine.hostname if machine is not None and machine.hostname else invocation.host
        lines.append(f"{invocation.started_utc} on {host or '?'}: {kind}; {commit}")
    return lines


def _box(machine: MachineFacts) -> tuple[str, ...]:
    """What tells one machine from another in a resumed run: its host, its kind, its GPUs' drivers and the cards
    themselves (their uuids: the device machines of one kind share a host name and a driver)."""
    drivers = ", ".join(dict.fromkeys(g.driver for g in machine.gpus if g.driver))
    cards = ", ".join(g.uuid for g in machine.gpus if g.uuid)
    return (machine.hostname or "?", machine_kind(machine.model_dump(mode="json")),
            *([f"driver {drivers}"] if drivers else []), *([f"card {cards}"] if cards else []))  # fmt: skip


def read_run_facts(manifest: Manifest, run_dir: Path) -> RunFacts:
    return RunFacts(
        machine=_machine_facts(manifest),
        source=_git_facts(manifest),
        fairness=_fairness_facts(manifest),
        servers=_servers(manifest),
        records=dict(manifest.servers),
        matrix_engines=_matrix_engines(manifest),
        reference_name=_reference_name(manifest),
        reference_filter=_reference_filter(manifest),
        link=_link_gb_per_s(manifest),
        budget_bytes=run_budget_bytes(manifest.servers),
        # under --ray the machines that measured are the nodes, not the driver
        has_gpu=any(bool(m.get("gpus")) for m in manifest.nodes.values())
        if manifest.nodes
        else bool(manifest.machine.gpus),
        model=_model(manifest, run_dir),
        identity=(manifest.git.commit, manifest.git.tree, manifest.matrix_hash),
        code=tuple(sorted(manifest.git.code.items())) if manifest.git.code else None,
        nodes=dict(manifest.nodes),
        planned=read_planned(manifest),
        invocations=invocation_lines(manifest),
        kernel_gb_per_s=_kernel_gb_per_s(manifest),
    )
