"""Loading a matrix file: read, expand, validate in one pass, resolve; the frozen `ValidatedMatrix`.

`load_matrix(path)` reads the YAML (bounded, duplicate keys refused: benchsuite.config.yaml_safe), expands
`${VAR}` / `${VAR:-default}` environment references in its string values (benchsuite.config.env_refs),
refuses numbers no machine could run (every number finite and within MAX_NUMBER, sizes and counts
within the per-field bounds of benchsuite.config.schema, the whole run within MAX_CELLS and
MAX_RUN_REQUESTS), validates its structure (benchsuite.config.schema), refuses two workloads with
identical settings (they would plan the same cells), expands every engine's option sweeps and
validates each resolved combination (benchsuite.config.sweeps), refuses `env:` that sets what an
adapter owns, and resolves workload paths against the matrix file. Every problem becomes one line
naming its YAML path (benchsuite.config.problems), e.g. `engines.paged.options.resident_experts[1]:
must be >= 1`; all of them in one pass (top-level keys and engine options together).
The result is a frozen `ValidatedMatrix` the planner consumes; its hash is the run id's.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic

from benchsuite.config.engine_env import recorded
from benchsuite.config.env_refs import expand_env_refs, expand_with_placeholders
from benchsuite.config.problems import format_errors, yaml_path
from benchsuite.config.schema import MAX_CELLS, MAX_NUMBER, MAX_RUN_REQUESTS, Matrix
from benchsuite.config.sweeps import OptionSet, raw_engine_problems, resolve_options
from benchsuite.config.yaml_safe import YamlError, read_yaml
from benchsuite.engines import ADAPTERS
from benchsuite.errors import UserError


class MatrixError(UserError):
    """A matrix that cannot run; the message has one line per problem."""


@dataclass(frozen=True)
class ValidatedMatrix:
    matrix: Matrix
    option_sets: Mapping[str, tuple[OptionSet, ...]]  # engine name -> its resolved combinations
    source: Path
    matrix_hash: str  # sha256 of the canonical JSON of the matrix (output_root excluded), hex
    # what a dry run (load_matrix placeholders=True) left unresolved: unset variables, missing files
    unresolved: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The matrix as the manifest records it: `env:` values of secret-looking names left out."""
        dump = self.matrix.model_dump(mode="json")
        for holder in (dump, *dump["engines"].values()):
            holder["env"] = recorded(holder.get("env") or {})
        return dump


def load_matrix(path: str | Path, *, placeholders: bool = False) -> ValidatedMatrix:
    """Read, validate and resolve a matrix file; raises MatrixError naming every problem.

    `placeholders` (a dry run): an unset variable stays `${NAME}` in its value and a workload file
    that does not exist is kept as written; both are listed in `ValidatedMatrix.unresolved` instead
    of stopping the load, so the plan of a matrix meant for another machine can be read."""
    source = Path(path)
    unresolved: list[str] = []
    if placeholders:
        raw, env_problems, unset = expand_with_placeholders(_read_yaml(source))
        unresolved += [f"{yaml_path(loc)}: {problem}" for loc, problem in unset]
    else:
        raw, env_problems = expand_env_refs(_read_yaml(source))
    early = env_problems + _number_problems(raw, ())
    problems = [f"{source}: {yaml_path(loc)}: {problem}" for loc, problem in early]
    try:
        matrix = Matrix.model_validate(raw)
    except pydantic.ValidationError as exc:
        # one pass: the engines whose own entry is well formed get their options checked too
        problems += [*format_errors(source, exc, Matrix, ()).splitlines(), *raw_engine_problems(source, raw)]
        raise MatrixError("\n".join(_without_repeats(problems, source, early))) from None
    if problems:  # numbers or ${...} references wrong, the rest well formed: the engines' options still checked
        problems += raw_engine_problems(source, raw)
        raise MatrixError("\n".join(_without_repeats(problems, source, early)))
    option_sets: dict[str, tuple[OptionSet, ...]] = {}
    for name, entry in matrix.engines.items():
        sets, errors = resolve_options(source, name, entry)
        problems.extend(errors)
        option_sets[name] = sets
    problems += _size_problems(source, matrix, option_sets)
    problems += _owned_env_problems(source, matrix)
    digest = _matrix_hash(matrix)
    workloads = dict(matrix.workloads)
    for name, workload in matrix.workloads.items():
        if workload.path is not None:  # relative to the matrix file, checked before anything starts
            path = Path(workload.path).expanduser()
            path = path if path.is_absolute() else source.parent / path
            what = f"{path} is a directory, not a file" if path.is_dir() else f"no such file: {path}"
            if not path.is_file() and placeholders:
                if "${" not in workload.path:  # an unset variable is listed once, as unset
                    unresolved.append(f"workloads.{name}.path: {what}")
                continue
            if not path.is_file():
                problems.append(f"{source}: workloads.{name}.path: {what}")
            workloads[name] = workload.model_copy(update={"path": str(path)})
    if problems:
        raise MatrixError("\n".join(dict.fromkeys(problems)))
    matrix = matrix.model_copy(update={"workloads": workloads})
    return ValidatedMatrix(matrix, option_sets, source, digest, tuple(unresolved))


def _without_repeats(problems: list[str], source: Path, early: list[tuple[tuple[str | int, ...], str]]) -> list[str]:
    """Each problem once; a place already named for its number or ${...} reference is not named
    again by the schema (which sees the same bad value)."""
    early_lines = {f"{source}: {yaml_path(loc)}: {problem}" for loc, problem in early}
    places = tuple(f"{source}: {yaml_path(loc)}:" for loc, _ in early)
    kept = [line for line in problems if line in early_lines or not line.startswith(places)]
    return list(dict.fromkeys(kept))


def _matrix_hash(matrix: Matrix) -> str:
    # output_root is where results go, linkbw a run-level probe, inputs words for a reader: none is
    # what a cell measures, all keep the run id. An empty `env:` is left out so matrices written
    # before it existed keep theirs.
    dump = matrix.model_dump(mode="json", exclude={"output_root", "linkbw", "inputs"})
    for holder in (dump, *dump["engines"].values()):
        if not holder.get("env"):
            holder.pop("env", None)
    canonical = json.dumps(dump, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _owned_env_problems(source: Path, matrix: Matrix) -> list[str]:
    """`env:` may not set what an engine's adapter owns (e.g. LLAMA_ARG_CTX_SIZE is -c)."""
    problems = []
    for name, entry in matrix.engines.items():
        try:
            owned = ADAPTERS[entry.kind].owned_env
        except UserError:
            continue  # an unavailable kind has its own error
        for where, env in (("env", matrix.env), (f"engines.{name}.env", entry.env)):
            for var in sorted(set(env) & set(owned)):
                problems.append(f"{source}: {where}.{var}: sets {owned[var]}, which the {entry.kind} adapter owns")
    return problems


def _number_problems(value: Any, loc: tuple[str | int, ...]) -> list[tuple[tuple[str | int, ...], str]]:
    """Every number must be finite and within MAX_NUMBER (YAML reads .inf, .nan and 1e30 as floats)."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _number_problems(v, loc + (str(k),))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _number_problems(v, loc + (i,))]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return []
    if isinstance(value, float) and not math.isfinite(value):
        return [(loc, f"{value!r} is not a finite number")]
    if abs(value) > MAX_NUMBER:
        return [(loc, f"{value:g} is beyond any real setting (at most {MAX_NUMBER:,} in size)")]
    return []


def _size_problems(source: Path, matrix: Matrix, option_sets: Mapping[str, tuple[OptionSet, ...]]) -> list[str]:
    """Identical workloads (same cells twice), and runs past MAX_CELLS cells or MAX_RUN_REQUESTS requests."""
    problems = []
    seen: dict[str, str] = {}
    for name, workload in matrix.workloads.items():
        key = json.dumps(workload.model_dump(mode="json"), sort_keys=True)
        if key in seen:
            problems.append(
                f"{source}: workloads.{name}: the same settings as workloads.{seen[key]} (it would measure the same "
                "cells again under the same ids); remove one, or change a setting such as seed"
            )
        seen.setdefault(key, name)
    servers = sum(len(sets) for sets in option_sets.values())
    cells = requests = 0
    for workload in matrix.workloads.values():
        n = len(workload.prompt_classes) * matrix.repeats * servers  # cells per concurrency
        cells += n * len(workload.concurrency)
        requests += n * sum(workload.num_requests + workload.warmups_at(c) for c in workload.concurrency)
    if cells > MAX_CELLS:
        problems.append(
            f"{source}: (top level): the matrix makes {cells} cells (engines x workloads x repeats); "
            f"at most {MAX_CELLS}"
        )
    elif requests > MAX_RUN_REQUESTS:
        problems.append(
            f"{source}: (top level): the matrix sends {requests:,} requests "
            f"(cells x (num_requests + warm-ups, at least one per stream)); at most {MAX_RUN_REQUESTS:,}"
        )
    return problems


def _read_yaml(source: Path) -> Any:
    try:
        raw = read_yaml(source)
    except YamlError as exc:
        raise MatrixError(str(exc)) from None
    if not isinstance(raw, dict):
        raise MatrixError(f"{source}: the matrix must be a YAML mapping (name, engines, workloads, ...)")
    return raw
