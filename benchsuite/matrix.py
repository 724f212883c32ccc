"""The matrix.yaml schema (pydantic, at the boundary) and its validation errors.

`load_matrix(path)` reads the YAML (bounded, duplicate keys refused: benchsuite.matrix_yaml), expands
`${VAR}` / `${VAR:-default}` environment references in its string values (benchsuite.matrix_env),
refuses numbers no machine could run (every number finite and within MAX_NUMBER, sizes and counts
within the per-field bounds below, the whole run within MAX_CELLS and MAX_RUN_REQUESTS),
validates its structure, refuses two workloads with identical settings (they would plan the same
cells), expands every engine's option
sweeps (an option whose value is a list is a sweep) and validates each resolved combination with
that engine kind's `options_model` and against the model's shape where it is known without loading
it (benchsuite.model_checks: K between top_k and E). Every problem becomes one line naming its YAML
path and, where it helps, the allowed values, e.g. `engines.paged.options.resident_experts[1]: must
be >= 1`; all of them in one pass (top-level keys and engine options together).
The result is a frozen `ValidatedMatrix` the planner consumes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer, model_validator

from benchsuite import model_checks, reference
from benchsuite.engine_env import NAME as ENV_NAME
from benchsuite.engine_env import recorded
from benchsuite.engines import ADAPTERS
from benchsuite.engines.base import EngineOptions
from benchsuite.errors import UserError
from benchsuite.matrix_env import expand_env_refs
from benchsuite.matrix_yaml import YamlError, read_yaml

ENGINE_KINDS = ("builtin", "llamacpp", "sglang")
MAX_CELLS = 100_000  # a matrix past this is a typo (or a week of GPU time); refuse it before planning
MAX_RUN_REQUESTS = 10_000_000  # warmup + measured over all cells: ~28 h at 100 requests/s
MAX_NUMBER = 2**63 - 1  # any number anywhere: what a 64-bit engine flag can hold; 1e30 is a typo
MAX_TOKENS = 2**24  # 16.8 M tokens: above any model's context or any GPU's KV (98 KB/token -> 1.6 TB)
MAX_CONCURRENCY = 65_536  # open streams from one load generator
MAX_REQUESTS_PER_CELL = 1_000_000


class MatrixError(UserError):
    """A matrix that cannot run; the message has one line per problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _env_vars(value: Any) -> Any:
    """`env:` values as text (YAML reads 4 and true as numbers and booleans); names as the shell spells them."""
    if not isinstance(value, dict):
        return value
    out = {}
    for name, item in value.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise ValueError(f"{name!r} is not an environment variable name (letters, digits, _)")
        if isinstance(item, bool):
            item = "1" if item else "0"
        out[name] = str(item) if isinstance(item, int | float) else item
    return out


class EngineEntry(_Strict):
    kind: Literal["builtin", "llamacpp", "sglang"]
    options: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)  # this engine's environment beyond what engines need

    _text_env = field_validator("env", mode="before")(_env_vars)


class Workload(_Strict):
    dataset: Literal["bundled", "sharegpt", "random"] = "bundled"
    path: str | None = None  # ShareGPT JSON file (dataset: sharegpt), relative to the matrix file
    output_tokens: int = Field(256, ge=1, le=MAX_TOKENS)
    # "short" = natural prompts from the dataset; a number = exact-length prompts of that many tokens.
    prompt_classes: list[str] = Field(default_factory=lambda: ["short"], min_length=1)
    concurrency: list[int] = Field(default_factory=lambda: [1], min_length=1)
    num_requests: int = Field(8, ge=1, le=MAX_REQUESTS_PER_CELL)
    warmup_requests: int = Field(1, ge=0, le=MAX_REQUESTS_PER_CELL)
    arrival: Literal["closed", "poisson"] = "closed"
    rate_rps: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False)
    seed: int = Field(0, ge=-MAX_NUMBER, le=MAX_NUMBER)
    # fraction of a cell's measured requests allowed to fail before the cell is `invalid`
    max_error_rate: float = Field(0.0, ge=0.0, le=1.0)

    @field_validator("prompt_classes", mode="before")
    @classmethod
    def _classes_as_text(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [str(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
        return value

    @field_validator("prompt_classes")
    @classmethod
    def _known_classes(cls, value: list[str]) -> list[str]:
        for item in value:
            if item != "short" and not (item.isdigit() and 1 <= int(item) <= MAX_TOKENS):
                raise ValueError(f"prompt class {item!r} must be 'short' or a token count in [1, {MAX_TOKENS}]")
        if len(set(value)) != len(value):
            raise ValueError("prompt classes must be distinct")
        return value

    @field_validator("concurrency")
    @classmethod
    def _positive_concurrency(cls, value: list[int]) -> list[int]:
        if any(c < 1 or c > MAX_CONCURRENCY for c in value):
            raise ValueError(f"every concurrency must be in [1, {MAX_CONCURRENCY}]")
        if len(set(value)) != len(value):
            raise ValueError("concurrency levels must be distinct")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Workload:
        if self.arrival == "poisson" and self.rate_rps is None:
            raise ValueError("arrival: poisson needs rate_rps (requests per second)")
        if self.dataset == "sharegpt" and not self.path:
            raise ValueError("dataset: sharegpt needs path (a ShareGPT JSON file)")
        return self


class Fairness(_Strict):
    """Settings every engine gets alike (DESIGN.md section 2)."""

    kv_capacity_tokens: int = Field(10240, ge=1, le=MAX_TOKENS)
    prefix_caching: bool = False


class ReferenceChoice(_Strict):
    """`reference: pr42557` or `reference: {name: pr42557, machine: ..., quant: ...}`: the published
    figures the report compares against, narrowed to one published setup (benchsuite.reference data)."""

    name: Literal["pr42557"]  # benchsuite.reference.REFERENCE_NAMES
    machine: str | None = None  # a machine key of the reference, e.g. desktop_16gb
    quant: str | None = None  # a published quantization, e.g. gptq_int4

    @field_validator("machine", "quant")
    @classmethod
    def _published_value(cls, value: str | None, info: ValidationInfo) -> str | None:
        name = info.data.get("name")
        if value is None or name is None:  # an invalid name has its own error
            return value
        published = reference.load_reference(name)
        if info.field_name == "machine":
            known = sorted(m.key for m in published.machines)
        else:
            known = sorted({r.quant for r in published.decode})
        if value not in known:
            raise ValueError(f"{value!r} is not a {info.field_name} of {name} (known: {', '.join(known)})")
        return value

    @model_validator(mode="after")
    def _published_setup(self) -> ReferenceChoice:
        pair = (self.machine, self.quant)
        if None not in pair and not reference.load_reference(self.name).decode_rows(*pair):
            raise ValueError(f"{self.name} published no figures for machine {self.machine} with quant {self.quant}")
        return self

    @model_serializer(mode="wrap")
    def _as_name_when_bare(self, handler: Any) -> Any:
        # the plain string form stays a string in the manifest (and in the run id hash)
        return self.name if self.machine is None and self.quant is None else handler(self)


class Matrix(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=80)
    output_root: str = "results"
    engines: dict[str, EngineEntry] = Field(min_length=1)
    workloads: dict[str, Workload] = Field(min_length=1)
    repeats: int = Field(1, ge=1, le=1000)
    # consecutive: a server's repeats run back to back (one launch). interleaved: repeat r of every server
    # runs before repeat r + 1 of any (one launch per server and repeat), so repeats see the machine at
    # different times and their spread covers its drift: what makes an interval over repeats honest.
    repeat_order: Literal["consecutive", "interleaved"] = "consecutive"
    fairness: Fairness = Field(default_factory=Fairness)
    reference: ReferenceChoice | None = None
    canary: bool = False  # the leak canary on every server after its cells (manifest + report)
    env: dict[str, str] = Field(default_factory=dict)  # every engine's environment beyond what engines need

    _text_env = field_validator("env", mode="before")(_env_vars)
    # measure the host->device link once per run before the first server (benchsuite linkbw; needs
    # CUDA): the report's link-bound section divides by it. Not part of the run id (no cell changes).
    linkbw: bool = False

    @field_validator("reference", mode="before")
    @classmethod
    def _reference_by_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


@dataclass(frozen=True)
class OptionSet:
    """One resolved combination of an engine entry's options.

    `params` holds only the swept keys (for report labels); `options` is the engine's validated
    options object, carried as is by the plan (ServerSpec.options).
    """

    params: Mapping[str, Any]
    options: EngineOptions


@dataclass(frozen=True)
class ValidatedMatrix:
    matrix: Matrix
    option_sets: Mapping[str, tuple[OptionSet, ...]]  # engine name -> its resolved combinations
    source: Path
    matrix_hash: str  # sha256 of the canonical JSON of the matrix (output_root excluded), hex

    def as_json(self) -> dict[str, Any]:
        """The matrix as the manifest records it: `env:` values of secret-looking names left out."""
        dump = self.matrix.model_dump(mode="json")
        for holder in (dump, *dump["engines"].values()):
            holder["env"] = recorded(holder.get("env") or {})
        return dump


def load_matrix(path: str | Path) -> ValidatedMatrix:
    """Read, validate and resolve a matrix file; raises MatrixError naming every problem."""
    source = Path(path)
    raw, env_problems = expand_env_refs(_read_yaml(source))
    problems = [f"{source}: {_path(loc)}: {problem}" for loc, problem in env_problems + _number_problems(raw, ())]
    if problems:
        raise MatrixError("\n".join(problems))
    try:
        matrix = Matrix.model_validate(raw)
    except pydantic.ValidationError as exc:
        # one pass: the engines whose own entry is well formed get their options checked too
        problems = [*_format_errors(source, exc, Matrix, ()).splitlines(), *_raw_engine_problems(source, raw)]
        raise MatrixError("\n".join(dict.fromkeys(problems))) from None
    option_sets: dict[str, tuple[OptionSet, ...]] = {}
    for name, entry in matrix.engines.items():
        sets, errors = _resolve_options(source, name, entry)
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
            if not path.is_file():
                problems.append(f"{source}: workloads.{name}.path: no such file: {path}")
            workloads[name] = workload.model_copy(update={"path": str(path)})
    if problems:
        raise MatrixError("\n".join(dict.fromkeys(problems)))
    matrix = matrix.model_copy(update={"workloads": workloads})
    return ValidatedMatrix(matrix, option_sets, source, digest)


def _matrix_hash(matrix: Matrix) -> str:
    # output_root is where results go, linkbw a run-level probe, neither what a cell measures: both
    # keep the run id. An empty `env:` is left out so matrices written before it existed keep theirs.
    dump = matrix.model_dump(mode="json", exclude={"output_root", "linkbw"})
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
            owned = getattr(ADAPTERS[entry.kind], "owned_env", frozenset())
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
        n = len(workload.prompt_classes) * len(workload.concurrency) * matrix.repeats * servers
        cells += n
        requests += n * (workload.num_requests + workload.warmup_requests)
    if cells > MAX_CELLS:
        problems.append(
            f"{source}: (top level): the matrix makes {cells} cells (engines x workloads x repeats); "
            f"at most {MAX_CELLS}"
        )
    elif requests > MAX_RUN_REQUESTS:
        problems.append(
            f"{source}: (top level): the matrix sends {requests:,} requests "
            f"(cells x (num_requests + warmup_requests)); at most {MAX_RUN_REQUESTS:,}"
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


def _raw_engine_problems(source: Path, raw: dict[str, Any]) -> list[str]:
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
        problems.extend(_resolve_options(source, str(name), entry)[1])
    return problems


def _resolve_options(source: Path, name: str, entry: EngineEntry) -> tuple[tuple[OptionSet, ...], list[str]]:
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
            errors.append(f"{source}: {_path(prefix + (key,))}: an empty list sweeps nothing; give at least one value")
        axes.append((key, value if sweep else [value], sweep))
    if errors:
        return (), errors
    swept = {key for key, _, sweep in axes if sweep}
    combinations = math.prod(len(values) for _, values, _ in axes)
    if combinations > MAX_CELLS:
        return (), [f"{source}: {_path(prefix)}: the sweeps make {combinations} servers; at most {MAX_CELLS}"]
    sets: list[OptionSet] = []
    for combo in itertools.product(*(range(len(values)) for _, values, _ in axes)):
        chosen = {key: values[i] for (key, values, _), i in zip(axes, combo)}
        try:
            validated = model.model_validate(chosen)
        except pydantic.ValidationError as exc:
            index_of = {key: i for (key, _, sweep), i in zip(axes, combo) if sweep}
            errors.extend(_format_errors(source, exc, model, prefix, index_of).splitlines())
            continue
        dumped = validated.model_dump(mode="json")
        index_of = {key: i for (key, _, sweep), i in zip(axes, combo) if sweep}
        shape = model_checks.shape_problems(entry.kind, dumped)  # K against the model's E and top_k
        errors.extend(
            f"{source}: {_path(prefix + (key, *([index_of[key]] if key in index_of else [])))}: {message}"
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


def _path(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _format_errors(
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
                f"{source}: {_path(prefix + where)}: key {err.get('input')!r} is not text; quote it "
                "(YAML reads unquoted on/off/yes/no as booleans)"
            )
            continue
        shown = loc
        if sweep_index and loc and loc[0] in sweep_index:
            shown = (loc[0], sweep_index[str(loc[0])]) + loc[1:]
        lines.append(f"{source}: {_path(prefix + shown)}: {_describe(err, model, loc)}")
    return "\n".join(dict.fromkeys(lines))


def _describe(err: Mapping[str, Any], model: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        return f"unknown key (allowed: {', '.join(allowed)})" if allowed else "unknown key"
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
