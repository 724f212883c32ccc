"""Validation errors as the matrix's author reads them: one line per problem naming its YAML path.

`format_errors` turns a pydantic ValidationError into lines such as
`m.yaml: engines.paged.options.resident_experts[1]: must be >= 1`, with the closest allowed key
(difflib) and all the allowed keys of an unknown key, the choices of a literal and the bound a number
crossed; `yaml_path` spells a location.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic
from pydantic import BaseModel


def yaml_path(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def format_errors(
    source: Path,
    exc: pydantic.ValidationError,
    model: type[BaseModel],
    prefix: tuple[str | int, ...],
    sweep_index: Mapping[str, int] | None = None,
) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        if err["type"] == "invalid_key" or (loc and loc[-1] == "[key]"):
            # a non-text mapping key: in a dict the loc ends (key, "[key]"), in a model with (key,)
            where = loc[:-2] if loc and loc[-1] == "[key]" else loc[:-1]
            lines.append(
                f"{source}: {yaml_path(prefix + where)}: key {err.get('input')!r} is not text; quote it "
                "(YAML reads unquoted on/off/yes/no as booleans)"
            )
            continue
        shown = loc
        if sweep_index and loc and loc[0] in sweep_index:
            shown = (loc[0], sweep_index[str(loc[0])]) + loc[1:]
        lines.append(f"{source}: {yaml_path(prefix + shown)}: {_describe(err, model, loc)}")
    return "\n".join(dict.fromkeys(lines))


def _describe(err: Mapping[str, Any], model: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        if not allowed:
            return "unknown key"
        # a key another engine spells shorter (`model` where SGLang has `model_path`) is a prefix of the
        # right one, which spelling distance ranks below a short neighbour (`mode`)
        longer = [key for key in allowed if key.startswith(f"{loc[-1]}_")]
        close = longer or difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.6)
        guess = f"; did you mean {close[0]}?" if close else ""
        return f"unknown key{guess} (allowed: {', '.join(allowed)})"
    if kind == "missing":
        return "required"
    if kind == "string_pattern_mismatch":
        return f"{err.get('input')!r}: use letters, digits, '.', '_' and '-', starting with a letter or digit"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected', '')}"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()), "")
        return f"must be {bounds[kind]} {limit} (got {err.get('input')!r})"
    message = str(err["msg"])
    return message.removeprefix("Value error, ")


def _allowed_keys(model: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """Field names of the model found by walking `loc` through nested models and dicts."""
    annotation: Any = model
    for part in loc:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return []
            annotation = field.annotation
        elif typing.get_origin(annotation) is dict:
            annotation = typing.get_args(annotation)[1]
        else:
            return []
    if typing.get_origin(annotation) is dict:
        return []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return sorted(annotation.model_fields)
    return []
