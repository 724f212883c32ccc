"""What the report reads out of a run's manifest.json: machine facts, servers with their exact
commands and versions, fairness settings, engines named by the matrix, the published reference a
matrix names, and model shape facts (top_k, number of experts).

The manifest is written by benchsuite.store; this module tolerates the shapes that layout allows
(servers as a list or a dict keyed by server id, engines as a list or a dict keyed by name) and
never invents a value: a fact that is absent is reported as absent.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
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


def _scalar_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def flatten_facts(obj: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Nested dicts as (dotted.key, text) pairs; lists of scalars joined by ', '."""
    if isinstance(obj, dict):
        pairs: list[tuple[str, str]] = []
        for key, value in obj.items():
            pairs.extend(flatten_facts(value, f"{prefix}{key}."))
        return pairs
    if isinstance(obj, list) and all(not isinstance(v, (dict, list)) for v in obj):
        return [(prefix[:-1], ", ".join(_scalar_text(v) for v in obj))]
    if isinstance(obj, list):
        pairs = []
        for index, value in enumerate(obj):
            pairs.extend(flatten_facts(value, f"{prefix}{index}."))
        return pairs
    return [(prefix[:-1], "absent" if obj is None else _scalar_text(obj))]


def machine_facts(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    return flatten_facts(manifest.get("machine") or {})


def git_facts(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    return flatten_facts(manifest.get("git") or {})


def matrix(manifest: dict[str, Any]) -> dict[str, Any]:
    value = manifest.get("matrix")
    return value if isinstance(value, dict) else {}


def fairness_facts(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    return flatten_facts(matrix(manifest).get("fairness") or {})


def servers(manifest: dict[str, Any]) -> list[ServerFacts]:
    raw = manifest.get("servers") or []
    items = [dict(v, server_id=v.get("server_id", k)) for k, v in raw.items()] if isinstance(raw, dict) else list(raw)
    out = []
    for item in items:
        argv = item.get("argv") or []
        command = shlex.join(str(a) for a in argv) if isinstance(argv, list) else str(argv)
        version = item.get("version")
        version_text = ", ".join(f"{k}={_scalar_text(v)}" for k, v in version.items()) if isinstance(version, dict) else str(version or "absent")
        out.append(ServerFacts(str(item.get("server_id", "")), str(item.get("engine", "")), str(item.get("kind", "")), command, version_text))
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


def model_top_k(manifest: dict[str, Any]) -> int | None:
    """num_experts_per_tok anywhere (HF config name), else `top_k` inside a model block (a sampling
    top_k elsewhere in the matrix must not be mistaken for the router's)."""
    return _find_int(manifest, ("num_experts_per_tok",)) or _find_int(_model_subtrees(manifest), _TOP_K_KEYS)


def model_num_experts(manifest: dict[str, Any]) -> int | None:
    return _find_int(manifest, _NUM_EXPERTS_KEYS)
