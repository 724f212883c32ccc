"""Short names of configurations for sentences, legends and figure points: what a configuration is
(`paged-fp8 K=40`, `llamacpp-16gb N=30`, `resident`), never `K=None` and never a hash.

The long label (report.groups.config_label) stays in tables, where its every parameter matters; a short
name keeps the engine entry's name, K (resident experts) or N (--n-cpu-moe) where the configuration has
one, the mode where the engine's name does not say it, and any other parameter as key=value.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from benchsuite.report.groups import is_synthetic

# params already said by K or N (report.groups.effective_params adds K and n_cpu_moe from the typed fields)
_SAID_BY_K_OR_N = ("resident_experts", "K", "n_cpu_moe", "search_n", "cpu_expert_layers")


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def short_name(row: pd.Series) -> str:
    """`<engine>[ (<mode>)][ K=<k>][ N=<n>][ key=value...][ (synthetic routing)]` of a cell or group row."""
    engine, mode = str(row["engine"]), str(row["mode"])
    k_or_n = _present(row.get("k")) or _present(row.get("n_cpu_moe"))  # K says paged, N says experts on the CPU
    parts = [engine if mode in engine or k_or_n else f"{engine} ({mode})"]
    if _present(row.get("k")):
        parts.append(f"K={int(row['k'])}")
    if _present(row.get("n_cpu_moe")):
        parts.append(f"N={int(row['n_cpu_moe'])}")
    params = row.get("params") if isinstance(row.get("params"), dict) else {}
    parts += [f"{key}={value}" for key, value in sorted(params.items()) if key not in _SAID_BY_K_OR_N]
    if "search_n" in params:  # a budget search's candidate, apart from the same N run as a configuration
        parts.append("(search)")
    name = " ".join(parts)
    return f"{name} (synthetic routing)" if is_synthetic(str(row.get("routing", "model"))) else name


def short_names(frame: pd.DataFrame) -> list[str]:
    return [short_name(row) for _, row in frame.iterrows()]


def server_names(run_id: str, cells: pd.DataFrame) -> dict[str, str]:
    """server id -> what the server ran, named as its configurations are (short_name: "paged K=8"):
    every distinct name of the run's cells on that server, joined (a budget search's server runs several)."""
    names: dict[str, list[str]] = {}
    if not len(cells) or "server_id" not in cells:
        return {}
    for _, cell in cells[cells["run_id"] == run_id].iterrows():
        found = names.setdefault(str(cell["server_id"]), [])
        name = short_name(cell)
        if name not in found:
            found.append(name)
    return {server: ", ".join(found) for server, found in names.items()}
