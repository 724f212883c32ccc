"""An engine entry's option sweeps expanded, each combination validated into the engine's options object.

An option whose value is a list is a sweep (unless the option itself takes a list, which sweeps as a
list of lists); `resolve_options` makes every combination, validates it with that engine kind's
`options_model` and against the model's shape where it is known without loading it
(benchsuite.config.model_checks: K between top_k and E), and names a bad value by its sweep index
(`engines.paged.options.resident_experts[1]`). Each combination becomes an `OptionSet`.
"""

from __future__ import annotations

import itertools
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic

from benchsuite.config import model_checks
from benchsuite.config.problems import format_errors, yaml_path
from benchsuite.config.schema import MAX_CELLS, EngineEntry
from benchsuite.engines import ADAPTERS
from benchsuite.engines.base import EngineOptions
from benchsuite.errors import UserError


@dataclass(frozen=True)
class OptionSet:
    """One resolved combination of an engine entry's options.

    `params` holds only the swept keys (for report labels); `options` is the engine's validated
    options object, carried as is by the plan (ServerSpec.options).
    """

    params: Mapping[str, Any]
    options: EngineOptions


def raw_engine_problems(source: Path, raw: dict[str, Any]) -> list[str]:
    """Option problems of every well-formed engine entry of a matrix that failed elsewhere."""
    engines = raw.get("engines")
    if not isinstance(engines, dict):
        return []
    problems: list[str] = []
    for name, body in engines.items():
        try:
            entry = EngineEntry.model_validate(body)
        except pydantic.ValidationError:
            continue  # the matrix's own errors already name it
        problems.extend(resolve_options(source, str(name), entry)[1])
    return problems


def resolve_options(source: Path, name: str, entry: EngineEntry) -> tuple[tuple[OptionSet, ...], list[str]]:
    """Expand the sweeps of one engine entry and validate every combination."""
    prefix: tuple[str | int, ...] = ("engines", name, "options")
    try:
        model = ADAPTERS[entry.kind].options_model
    except UserError as exc:
        return (), [f"{source}: engines.{name}.kind: {exc}"]
    list_fields = {n for n, f in model.model_fields.items() if _accepts_list(f.annotation)}
    axes: list[tuple[str, list[Any], bool]] = []  # (key, values, is_sweep)
    errors: list[str] = []
    for key, value in entry.options.items():
        sweep = isinstance(value, list) and (
            key not in list_fields or (bool(value) and all(isinstance(v, list) for v in value))
        )
        if sweep and not value:
            errors.append(
                f"{source}: {yaml_path(prefix + (key,))}: an empty list sweeps nothing; give at least one value"
            )
        axes.append((key, value if sweep else [value], sweep))
    if errors:
        return (), errors
    swept = {key for key, _, sweep in axes if sweep}
    combinations = math.prod(len(values) for _, values, _ in axes)
    if combinations > MAX_CELLS:
        return (), [f"{source}: {yaml_path(prefix)}: the sweeps make {combinations} servers; at most {MAX_CELLS}"]
    sets: list[OptionSet] = []
    for combo in itertools.product(*(range(len(values)) for _, values, _ in axes)):
        chosen = {key: values[i] for (key, values, _), i in zip(axes, combo)}
        try:
            validated = model.model_validate(chosen)
        except pydantic.ValidationError as exc:
            index_of = {key: i for (key, _, sweep), i in zip(axes, combo) if sweep}
            errors.extend(format_errors(source, exc, model, prefix, index_of).splitlines())
            continue
        dumped = validated.model_dump(mode="json")
        index_of = {key: i for (key, _, sweep), i in zip(axes, combo) if sweep}
        shape = model_checks.shape_problems(validated)  # K against the model's E and top_k
        errors.extend(
            f"{source}: {yaml_path(prefix + (key, *([index_of[key]] if key in index_of else [])))}: {message}"
            for key, message in shape
        )
        params = {key: value for key, value in dumped.items() if key in swept}
        sets.append(OptionSet(params=params, options=validated))
    return tuple(sets), errors


def _accepts_list(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, set, frozenset):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_accepts_list(arg) for arg in typing.get_args(annotation))
    return False
