"""The engine contract is complete: outside the engine wings, nothing knows an engine by name.

Every adapter is a `base.EngineAdapter` whose hooks keep the base's parameters; the pipeline calls
hooks directly (no `getattr`/`hasattr` naming an adapter member); and no engine-kind string or
engine option name appears as a string constant outside the places that own them:
`benchsuite/engines/` (the wings and the contract), `benchsuite/config/schema.py` (the `kind:` the
matrix may name) and the tests. Each exception below says why it is not an engine name.

Option names are the fields of every adapter's `options_model`. The placement vocabulary
(`base.Placement`: mode, resident_experts, n_cpu_moe, routing) is also what every cell records under
those names, so those few may appear where stored cells are read as records (RECORD_READERS), and
nowhere else: the plan, the search and the CLI take them from the contract (SearchKnob, SHORT_NAMES).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchsuite.engines import ADAPTERS, KINDS
from benchsuite.engines.base import EngineAdapter, Placement

ROOT = Path(__file__).resolve().parents[1]
OWNERS = ("benchsuite/engines/", "benchsuite/config/schema.py")

# (file, string): a constant equal to an engine name that means something else there.
NOT_ENGINE_NAMES = {
    ("benchsuite/tools/machine.py", "sglang"): "the Python package whose installed version the manifest records",
    ("benchsuite/tools/machine.py", "python"): "the interpreter's version in the machine facts",
    ("benchsuite/results/fingerprint.py", "binary"): "a key of an adapter's version facts (the file it fingerprints)",
    ("benchsuite/tools/linkbw.py", "device"): "the link probe's own CLI flag and JSON key",
    ("benchsuite/tools/reference.py", "cpu_offload_gb"): "a column of the published reference file, not our option",
    ("benchsuite/config/env_refs.py", "model"): "a hint keyed by the YAML key an unset ${VAR} fills (matrix boundary)",
    (
        "benchsuite/config/env_refs.py",
        "model_path",
    ): "a hint keyed by the YAML key an unset ${VAR} fills (matrix boundary)",
}
# The OpenAI request's and the records' `model` field, a model config's key: not the engine option.
GENERIC = {"model"}
PLACEMENT = {f.name for f in dataclasses.fields(Placement)}
# Readers of stored cells and manifests, whose columns carry the placement's names: the report, the
# upgrade of schema-1 records, the run folder's `routing/` directory.
RECORD_READERS = ("benchsuite/report/", "benchsuite/results/schema_v1.py", "benchsuite/results/stored_files.py")


def option_names() -> set[str]:
    fields: set[str] = set()
    for kind in KINDS:
        fields |= set(ADAPTERS[kind].options_model.model_fields)
    return fields - PLACEMENT - GENERIC


def constants_outside_owners(names: set[str], also: tuple[str, ...] = ()) -> Iterator[tuple[str, int, str]]:
    for path in sorted((ROOT / "benchsuite").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(OWNERS + also):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                if (rel, node.value) not in NOT_ENGINE_NAMES:
                    yield rel, node.lineno, node.value


def test_no_engine_kind_outside_the_wings() -> None:
    found = list(constants_outside_owners(set(KINDS)))
    assert not found, "engine kinds named outside benchsuite/engines (give the fact a typed home there):\n" + "\n".join(
        f"{f}:{line}: {value!r}" for f, line, value in found
    )


def test_no_engine_option_name_outside_the_wings() -> None:
    names = option_names()
    assert {"offload_layers", "cpu_offload_gb", "model_path", "n_gpu_layers"} <= names  # the scan sees the options
    found = list(constants_outside_owners(names))
    assert not found, "engine option names outside benchsuite/engines:\n" + "\n".join(
        f"{f}:{line}: {value!r}" for f, line, value in found
    )


def test_the_placement_vocabulary_is_named_only_where_records_are_read() -> None:
    assert PLACEMENT == {"mode", "resident_experts", "n_cpu_moe", "routing"}
    found = list(constants_outside_owners(PLACEMENT, RECORD_READERS))
    assert not found, "placement names outside the contract and the record readers:\n" + "\n".join(
        f"{f}:{line}: {value!r}" for f, line, value in found
    )


def test_the_scan_finds_a_kind_string(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planted = ROOT / "benchsuite" / "report" / "_planted_for_test.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: 'KIND = "llamacpp"\n' if self == planted else "")
    monkeypatch.setattr(Path, "rglob", lambda self, pattern: iter([planted, ROOT / "benchsuite/engines/x.py"]))
    assert list(constants_outside_owners(set(KINDS))) == [("benchsuite/report/_planted_for_test.py", 1, "llamacpp")]


def hook_names() -> set[str]:
    return {name for name, _ in inspect.getmembers(EngineAdapter) if not name.startswith("_")}


def test_the_pipeline_calls_hooks_without_getattr() -> None:
    """`getattr(x, "<hook>")` / `hasattr(x, "<hook>")` outside the wings would mean a hook the contract
    does not declare (or an adapter that does not inherit it)."""
    hooks = hook_names()
    found = []
    for path in sorted((ROOT / "benchsuite").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("benchsuite/engines/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in hooks
            ):
                found.append(f"{rel}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    assert not found, "adapter members looked up by name:\n" + "\n".join(found)


@pytest.mark.parametrize("kind", KINDS)
def test_every_adapter_inherits_the_contract_and_keeps_its_hook_signatures(kind: str) -> None:
    adapter = ADAPTERS[kind]
    assert isinstance(adapter, EngineAdapter) and adapter.kind == kind
    for name in hook_names():
        base, mine = getattr(EngineAdapter, name), getattr(type(adapter), name)
        if callable(base) and mine is not base:
            assert list(inspect.signature(mine).parameters) == list(inspect.signature(base).parameters), (
                f"{type(adapter).__name__}.{name} takes other parameters than EngineAdapter.{name}"
            )
