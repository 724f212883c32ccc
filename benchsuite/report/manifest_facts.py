"""What the report reads out of a run's manifest.json: machine facts, servers with their exact
commands and versions, fairness settings, engines named by the matrix, the published reference a
matrix names, and model shape facts (top_k, number of experts).

The manifest is written by benchsuite.store; this module tolerates the shapes that layout allows
(servers as a list or a dict keyed by server id, engines as a list or a dict keyed by name) and
never invents a value: a fact that is absent is reported as absent.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENGINE_KINDS: tuple[str, ...] = ("builtin", "llamacpp", "sglang")
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
    expert_format: str | None = None  # how the engine stores one expert (version.expert_format: float8_e4m3fn, q8_0, ...)
    expert_bytes: int | None = None  # one expert's gate + up + down bytes as served (FP8: block scales included)

    @property
    def canary_failed(self) -> bool:
        return self.canary.startswith("FAILED")


def canary_text(record: Any) -> str:
    """A server's `canary` manifest entry (benchsuite.canary.CanaryReport.to_dict, or {error})."""
    if not isinstance(record, dict):
        return "not run"
    if "error" in record or "passed" not in record:
        return f"not run ({record.get('error', 'no verdict')})"
    if record["passed"]:
        return f"passed ({record.get('requests_checked', '?')} responses checked)"
    return f"FAILED (leaks {len(record.get('leaks') or [])})"


def _scalar_text(value: Any, key: str = "") -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and not isinstance(value, bool) and key.endswith("_bytes"):
        return f"{value} ({value / 2**30:.1f} GiB)"
    return str(value)


def flatten_facts(obj: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Nested dicts as (dotted.key, text) pairs; lists of scalars joined by ', '."""
    if isinstance(obj, dict):
        pairs: list[tuple[str, str]] = []
        for key, value in obj.items():
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


def machine_facts(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    return flatten_facts(manifest.get("machine") or {})


def git_facts(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    return flatten_facts(manifest.get("git") or {})


def matrix(manifest: dict[str, Any]) -> dict[str, Any]:
    value = manifest.get("matrix")
    return value if isinstance(value, dict) else {}


def fairness_facts(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    return flatten_facts(matrix(manifest).get("fairness") or {})


def server_records(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """server_id -> the manifest's record of that server (argv, options, version, ...)."""
    raw = manifest.get("servers") or []
    if isinstance(raw, dict):
        return {str(v.get("server_id", k)): v for k, v in raw.items() if isinstance(v, dict)}
    return {str(v.get("server_id", "")): v for v in raw if isinstance(v, dict)}


def servers(manifest: dict[str, Any]) -> list[ServerFacts]:
    out = []
    for server_id, item in server_records(manifest).items():
        item = {**item, "server_id": server_id}
        argv = item.get("argv") or []
        command = shlex.join(str(a) for a in argv) if isinstance(argv, list) else str(argv)
        version = item.get("version")
        version_text = ", ".join(f"{k}={_scalar_text(v)}" for k, v in version.items()) if isinstance(version, dict) else str(version or "absent")
        expert = version if isinstance(version, dict) else {}
        out.append(ServerFacts(str(item.get("server_id", "")), str(item.get("engine", "")), str(item.get("kind", "")), command, version_text,
                               canary_text(item.get("canary")), expert.get("expert_format"),
                               int(expert["expert_bytes"]) if isinstance(expert.get("expert_bytes"), int) else None))
    return out


def matrix_engines(manifest: dict[str, Any]) -> dict[str, str]:
    """Engine entry name -> kind, as the matrix names them."""
    raw = matrix(manifest).get("engines") or []
    if isinstance(raw, dict):
        return {str(name): str((entry or {}).get("kind", "")) for name, entry in raw.items()}
    return {str(entry.get("name", "")): str(entry.get("kind", "")) for entry in raw if isinstance(entry, dict)}


def reference_name(manifest: dict[str, Any]) -> str | None:
    value = matrix(manifest).get("reference")
    if isinstance(value, dict):
        value = value.get("name")
    return str(value) if value else None


def reference_filter(manifest: dict[str, Any]) -> dict[str, str]:
    """Published-row filter a matrix may give beside its reference (machine, quant)."""
    value = matrix(manifest).get("reference")
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


_MODEL_FLAGS = ("--model-path", "--model", "-m")


def _model_dirs(manifest: dict[str, Any], run_dir: Path) -> list[Path]:
    """Checkpoint directories the servers were started with, resolved as given, then beside the run."""
    names: list[str] = []
    for record in server_records(manifest).values():
        argv = [str(a) for a in record.get("argv") or []]
        names.extend(argv[i + 1] for i, a in enumerate(argv[:-1]) if a in _MODEL_FLAGS)
        model = (record.get("options") or {}).get("model")
        if isinstance(model, str):
            names.append(model)
    candidates = [Path(n) if Path(n).is_absolute() else base / n for n in names for base in (Path.cwd(), run_dir)]
    return [c for c in candidates if (c / "config.json").is_file()]


def _model_configs(manifest: dict[str, Any], run_dir: Path) -> list[dict[str, Any]]:
    configs = []
    for directory in _model_dirs(manifest, run_dir):
        try:
            configs.append(json.loads((directory / "config.json").read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return configs


def model_top_k(manifest: dict[str, Any], run_dir: Path) -> int | None:
    """num_experts_per_tok anywhere in the manifest (HF config name), else `top_k` inside a model
    block (a sampling top_k elsewhere must not be mistaken for the router's), else the config.json
    of the checkpoint a server was started with."""
    return (_find_int(manifest, ("num_experts_per_tok",)) or _find_int(_model_subtrees(manifest), _TOP_K_KEYS)
            or _find_int(_model_configs(manifest, run_dir), ("num_experts_per_tok",)))


def model_num_experts(manifest: dict[str, Any], run_dir: Path) -> int | None:
    return _find_int(_model_subtrees(manifest), _NUM_EXPERTS_KEYS) or _find_int(_model_configs(manifest, run_dir), _NUM_EXPERTS_KEYS)
