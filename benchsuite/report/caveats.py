"""The caveats that change how a verdict reads, stated beside it (not at the bottom of the page):

- different kinds of machine: a setup's cells measured on Ray nodes of more than one kind
  (report/nodes.py): a ratio between them compares the machines as well;
- device cpu: the built-in engine's paging and offload on a CPU copy experts within host RAM (no
  PCIe link), and llama.cpp without a GPU computes everything on the CPU: the ranking says nothing
  about a GPU;
- random-weight model (the generated `tiny`, `synth:` presets, weightless checkpoints, checkpoints
  under benchsuite's model cache): its untrained router's expert reuse is not a trained model's, and
  the caveat says what this run saw of it (report/locality.py: looping output, miss rates on the
  model's routing beside calibrated routing);
- synthetic routing: the cells' routing came from a generator, not the model's router;
- not the same model: servers whose recorded source-weights fingerprints (`version.weights.source.id`,
  paged_experts.weights.weights_id) differ, or where one is unknown (an old run, a GGUF without facts), are
  named: a comparison of them is not one model served two ways;
- bytes per expert that differ between engines (float32 vs bf16 vs FP8 vs a GGUF quantization): a
  faster engine may only be moving fewer bytes;
- configurations over the run's GPU budget (report/budget.py): named with their measured memory;
- device memory judged against the budget by different figures (report/budget.mixed_figures: peak
  per process, peak as the device's delta, an older run's after-cell or log figure): named;
- a busy machine (benchsuite.report.noise) and a client that could not keep up (metrics' client_flag);
- figures timed by text chunks (runs stored at a schema version before token-accurate timing,
  records.TEXT_CHUNK_VERSIONS): TTFT and decode rates of an engine whose tokens carry no text are biased.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from benchsuite.engines import adapter_of
from benchsuite.records import TEXT_CHUNK_VERSIONS
from benchsuite.report.budget import mixed_figures, over_budget
from benchsuite.report.groups import is_synthetic
from benchsuite.report.locality import random_model_caveat
from benchsuite.report.nodes import mixed_machines_caveat
from benchsuite.report.noise import busy_cells
from benchsuite.results.manifest import ServerRecord

_GENERATED_MODELS = ("tiny",)
_CACHE_MARK = "/.cache/benchsuite/models/"


_WEIGHTLESS_MARKER = (
    "synthetic_weights.json"  # paged_experts.weights.synth_memory.write_weightless: weights built at load
)


def _random_weights(model: str) -> bool:
    path = Path(model).expanduser()
    return (
        model in _GENERATED_MODELS
        or model.startswith("synth:")
        or _CACHE_MARK in str(path)
        or (path / _WEIGHTLESS_MARKER).is_file()
    )


def _recorded_random(server: ServerRecord) -> bool:
    """What the server's adapter recorded of its model: built-in synthetic weights, a GGUF that
    `benchsuite gguf synth` wrote or exported from a generated checkpoint (seeded values)."""
    version = server.version or {}
    facts = version.get("model_facts") or {}
    return (
        bool(version.get("random_weights"))
        or bool(facts.get("random_weights"))  # a GGUF exported from a generated checkpoint too
        or facts.get("made_by") == "benchsuite gguf synth"
    )


def budget_exclusions(cells: pd.DataFrame) -> list[tuple[str, int, int]]:
    """(configuration label, budget bytes, measured bytes) of the configurations over their run's
    GPU budget (report/budget.py), largest first."""
    if "budget_bytes" not in cells or "label" not in cells:
        return []
    out = []
    for label, mine in cells.groupby("label", sort=True):
        used = over_budget(mine)
        if used is not None:
            out.append((str(label), int(mine["budget_bytes"].iloc[0]), used))
    return sorted(out, key=lambda x: -x[2])


def expert_format(server: ServerRecord) -> str | None:
    """How one server stores expert weights: its adapter's record, else as its options name it."""
    recorded = (server.version or {}).get("expert_format")
    if recorded:
        return str(recorded)
    adapter = adapter_of(str(server.kind))
    return adapter.recorded_expert_format(server.options) if adapter is not None else None


def source_id(server: ServerRecord) -> str | None:
    """The fingerprint of the source weights a server ran (its adapter's `weights.source.id`), or None."""
    weights = (server.version or {}).get("weights")
    source = weights.get("source") if isinstance(weights, dict) else None
    found = source.get("id") if isinstance(source, dict) else None
    return str(found) if found else None


def same_model_caveat(servers: list[tuple[str, ServerRecord]]) -> str | None:
    """A caveat naming the servers when two or more were compared and their source weights are not
    known to be the same: fingerprints that differ, or one that is unknown."""
    if len(servers) < 2:
        return None
    by_name: dict[str, set[str | None]] = {}
    for server_id, record in servers:
        by_name.setdefault(record.engine or server_id, set()).add(source_id(record))
    ids = set().union(*by_name.values())
    if len(ids) == 1 and None not in ids:
        return None
    named = ", ".join(
        f"{name} ({' / '.join(sorted(i or 'unknown' for i in found))})" for name, found in sorted(by_name.items())
    )
    why = "unknown for some" if len(ids - {None}) <= 1 else "they differ"
    return (
        f"Not shown to be the same model: the servers' source-weight fingerprints are {why}: {named}. "
        f"A difference between them may be a difference of weights, not of engines."
    )


def _model(server: ServerRecord) -> str | None:
    adapter = adapter_of(str(server.kind))
    return adapter.recorded_model(server.options) if adapter is not None else None


def _on_cpu(server: ServerRecord, has_gpu: bool) -> bool:
    adapter = adapter_of(str(server.kind))
    return adapter.recorded_on_cpu(server.options, has_gpu) if adapter is not None else not has_gpu


def random_weight_models(servers: Iterable[ServerRecord]) -> list[str]:
    """The random-weight models among the servers' models (named as their adapters record them)."""
    mine = list(servers)
    models = sorted({_model(s) or "" for s in mine} - {""})
    found = [m for m in models if _random_weights(m)]
    return found + sorted({str(_model(s)) for s in mine if _recorded_random(s)} - set(found))


def setup_servers(cells: pd.DataFrame, servers: Mapping[str, ServerRecord]) -> list[ServerRecord]:
    """The manifest records of the servers behind a setup's cells (an empty record where unknown)."""
    return [servers.get(str(s)) or ServerRecord() for s in dict.fromkeys(cells["server_id"])]


def setup_caveats(
    cells: pd.DataFrame,
    servers: Mapping[str, ServerRecord],
    has_gpu: bool,
    nodes: Mapping[str, Mapping[str, Any]] | None = None,
    requests: pd.DataFrame | None = None,
) -> list[str]:
    """The caveats of one setup's cells; `servers`: server_id -> manifest server record; `nodes`: the
    run's Ray nodes -> machine facts (report/nodes.py), empty without --ray; `requests`: the run's
    request rows (their output text shows whether a random model's output looped)."""
    mine = setup_servers(cells, servers)
    out: list[str] = []
    machines = mixed_machines_caveat(cells, nodes or {})
    if machines:
        out.append(machines)
    if any(_on_cpu(s, has_gpu) for s in mine):
        out.append(
            "Device CPU: paging and offload here copy experts within host RAM, not over a PCIe link, so this "
            "ranking says nothing about a GPU."
        )
    random_models = random_weight_models(mine)
    if random_models:
        out.append(random_model_caveat(random_models, cells, requests))
    synthetic = sorted({str(r) for r in cells["routing"] if is_synthetic(r)})
    if synthetic:
        varied = {(m, k) for m, k, r in zip(cells["mode"], cells["engine_kind"], cells["routing"]) if is_synthetic(r)}
        unvaried = sorted({str(e) for e, m, k in zip(cells["engine"], cells["mode"], cells["engine_kind"])
                           if (m, k) not in varied})  # fmt: skip
        verb, its = ("was", "its") if len(unvaried) == 1 else ("were", "their")
        beside = (
            f" In every routing's comparison {', '.join(unvaried)} {verb} measured on the model's own routing: "
            f"{its} speed does not depend on which experts are chosen."
            if unvaried
            else ""
        )
        out.append(
            f"Synthetic routing ({', '.join(synthetic)}): experts were chosen by a generator, not the model's "
            f"router.{beside}"
        )
    ids = [str(s) for s in dict.fromkeys(cells["server_id"])]
    same = same_model_caveat([(s, servers.get(s) or ServerRecord()) for s in ids])
    if same:
        out.append(same)
    formats = {f"{s.kind} {fmt}" for s in mine if (fmt := expert_format(s)) is not None}
    if len({f.split(" ", 1)[1] for f in formats}) > 1:
        out.append(
            f"Bytes per expert differ between engines ({', '.join(sorted(formats))}): a faster engine may only be "
            f"moving fewer bytes."
        )
    over = budget_exclusions(cells)
    if over:
        out.append(
            f"Over the run's {over[0][1] / 1e9:.0f} GB GPU budget (measured device memory), so not contenders: "
            + ", ".join(f"{label} ({used / 1e9:.1f} GB)" for label, _, used in over)
            + "."
        )
    mixed = mixed_figures(cells)
    if mixed:
        out.append(
            "Device memory against the budget is not one figure for every configuration ("
            + "; ".join(f"{figure}: {', '.join(labels)}" for figure, labels in mixed.items())
            + "): which of them fits is not measured alike."
        )
    if "schema_version" in cells and cells["schema_version"].isin(TEXT_CHUNK_VERSIONS).any():
        out.append(
            "Timed by text chunks (a run stored before token-accurate timing): where an engine's tokens carry no "
            "text, its TTFT is late and its decode rate high (llama.cpp's measured +12% to +40% on a padded "
            "vocabulary, 2026-12-01); re-run to compare."
        )
    busy = busy_cells(cells)
    if busy:
        out.append(
            f"Busy machine during {len(busy)} of {len(cells)} cells: other processes took CPU time; small "
            f"differences are not to be trusted."
        )
    behind = [c for c, e in zip(cells["cell_id"], cells["extras"]) if isinstance(e, dict) and e.get("client_flag")]
    if behind:
        out.append(
            f"The client could not keep up in {len(behind)} cells (chunks arrived together): their ITL is understated."
        )
    return out
