"""The matrix.yaml schema: pydantic models at the boundary, and the bounds on every size and count.

`Matrix` and its parts (`EngineEntry`, `Workload`, `Fairness`, `ReferenceChoice`) validate the
structure of an expanded YAML mapping; an engine's `options:` stay a plain mapping here (the engine's
own `options_model` validates each sweep point, benchsuite.config.sweeps). The MAX_* bounds refuse
numbers no machine could run. Loading, the cross-field checks and the run id hash are
benchsuite.config.matrix.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer, model_validator

from benchsuite.config.engine_env import NAME as ENV_NAME
from benchsuite.tools import reference

ENGINE_KINDS = ("builtin", "llamacpp", "sglang")
MAX_CELLS = 100_000  # a matrix past this is a typo (or a week of GPU time); refuse it before planning
MAX_RUN_REQUESTS = 10_000_000  # warmup + measured over all cells: ~28 h at 100 requests/s
MAX_NUMBER = 2**63 - 1  # any number anywhere: what a 64-bit engine flag can hold; 1e30 is a typo
MAX_TOKENS = 2**24  # 16.8 M tokens: above any model's context or any GPU's KV (98 KB/token -> 1.6 TB)
MAX_CONCURRENCY = 65_536  # open streams from one load generator
MAX_REQUESTS_PER_CELL = 1_000_000


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
    # A minimum: a cell at concurrency c sends max(warmup_requests, c), all c streams at once, so the warm-up
    # runs the batch sizes the measurement will (h200-ttft's resident c=4 stalled 3.4 s on the first
    # four-prompt step after a one-request warm-up); 0 is no warm-up at all (`warmups_at`).
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

    def warmups_at(self, concurrency: int) -> int:
        """The warm-up requests of a cell at `concurrency`: warmup_requests raised to the concurrency (every
        stream warms at once, so the measured batch sizes ran before), or none when warmup_requests is 0."""
        return max(self.warmup_requests, concurrency) if self.warmup_requests else 0


class Fairness(_Strict):
    """Settings every engine gets alike (DESIGN.md section 2)."""

    kv_capacity_tokens: int = Field(10240, ge=1, le=MAX_TOKENS)
    prefix_caching: bool = False


class ReferenceChoice(_Strict):
    """`reference: pr42557` or `reference: {name: pr42557, machine: ..., quant: ...}`: the published
    figures the report compares against, narrowed to one published setup (benchsuite.tools.reference data)."""

    name: Literal["pr42557"]  # benchsuite.tools.reference.REFERENCE_NAMES
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
    # VARIABLE -> what it must hold and how to get it (a checkpoint's hub id and size, a dataset's
    # URL): a dry run prints it beside a variable that is unset. Not part of the run id.
    inputs: dict[str, str] = Field(default_factory=dict)

    _text_env = field_validator("env", mode="before")(_env_vars)
    # measure the host->device link once per run before the first server (benchsuite linkbw; needs
    # CUDA): the report's link-bound section divides by it. Not part of the run id (no cell changes).
    linkbw: bool = False

    @field_validator("reference", mode="before")
    @classmethod
    def _reference_by_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value
