"""The contract between the pipeline and one kind of engine (builtin, llamacpp, sglang).

The pipeline stages (matrix, plan, runner, loadgen, metrics, store, report) know an engine only
through this module and the registry (benchsuite.engines.ADAPTERS); everything else an engine owns
lives in its wing, benchsuite/engines/<kind>/.

Options are typed once: an engine's `options:` block of matrix.yaml is validated by its adapter's
`options_model` (a subclass of `EngineOptions`) when the matrix loads, and that frozen object is
what the plan (`ServerSpec.options`), the adapter and the runner carry. Its `placement()` gives the
typed facts every cell records (mode, K, N, routing): the report reads those, never argv.

An adapter is pure: it turns a resolved server spec into an exact command line, says how to
check readiness, what to add to each request, and how to read the engine's own counters and
log. Processes, sockets and files are the runner's business (benchsuite.process, loadgen).
Adapters live in a plain dict registry (benchsuite.engines.ADAPTERS), keyed by `kind`.

Optional members the runner reads with getattr (an adapter without one simply lacks the feature):
- `prepare(spec) -> None`: before a launch (never in a dry run), build what the command line
  names (llama.cpp: export the GGUF of an HF checkpoint);
- `flush_cache_path: str | None`: POSTed before each cell (prefix cache flush);
- `tokenizer_dir(spec) -> Path`: the model's tokenizer, for exact-length prompts;
- `cell_flags(spec, log_text, cell) -> list[str]`: one-line engine warnings for a finished cell
  (stored in the cell's `extras["flags"]`, shown by the report);
- `owned_env: dict[str, str]`: environment variables that would set what the adapter owns (llama.cpp's
  `LLAMA_ARG_CTX_SIZE` ...) -> what sets it instead; the matrix loader refuses them in `env:`;
- `resolved_options(spec) -> dict`: the options in force with defaults resolved (the manifest's
  server entry `resolved_options` and every cell's `options`; without it, the options as validated);
- `async startup_facts(session, base_url) -> dict`: the engine's own start-up breakdown, read once
  it is ready (the manifest's server entry `startup_facts`, beside the runner's `startup_s`);
- `async after_cells(ctx, server, requests) -> dict`: on the live server after its cells, before it
  stops (`requests`: the distinct LoadRequests its cells sent); the dict is merged into the
  manifest's server entry as its `facts` (e.g. SGLang's routing capture: `routing_trace`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict


class EngineConfigError(ValueError):
    """A server spec the engine cannot run; the message is one line that names the cause."""


def extra_args_check(problems_of: Callable[[list[str]], list[str]]) -> Callable[[list[str]], list[str]]:
    """A pydantic validator for an adapter's `extra_args` that refuses, in one line, what
    `problems_of` names (flags the adapter owns), so the matrix load names them."""

    def check(value: list[str]) -> list[str]:
        problems = problems_of(value)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    return check


@dataclass(frozen=True)
class Placement:
    """Where one server keeps its experts, as every cell of it records it (CellResult fields of the
    same names) and the report groups and labels it."""

    # builtin: resident|paged|offload|cpu-experts; llamacpp: n-cpu-moe|moe-cache|gpu; sglang: paged|offload|unpaged
    mode: str
    resident_experts: int | None = None  # K: expert slots per layer on the GPU (paged modes)
    n_cpu_moe: int | None = None  # N: layers whose experts stay on the CPU (cpu-experts, llama.cpp)
    routing: str = "model"  # "model", or "synthetic:<spec>"; synthetic results say so everywhere


class EngineOptions(BaseModel):
    """Base of every adapter's `options_model`: one scalar per field after sweep expansion, frozen,
    unknown keys refused (a typo names its YAML path)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def placement(self) -> Placement:
        """Mode, K, N and routing of a server started with these options."""
        raise NotImplementedError(f"{type(self).__name__} does not say where its experts live")

    def request_model(self) -> str | None:
        """The `model` field completion requests carry; None: the engine entry's name."""
        return None

    def model_source(self) -> str | None:
        """The checkpoint or file the server loads, as the options name it (its input fingerprint)."""
        return None

    def replaced(self, **values: Any) -> EngineOptions:
        """A copy with `values` set, validated again (e.g. the search's chosen n_cpu_moe)."""
        return self.model_validate({**self.model_dump(), **values})


@dataclass(frozen=True)
class ServerSpec:
    """One server configuration: a matrix engine entry with every sweep value resolved.

    `options` is the engine's validated options object (its adapter's `options_model`).
    `fairness` holds the matrix's shared settings (kv_capacity_tokens, prefix_caching, ...).
    `max_concurrency` is the highest concurrency any cell run on this server uses.
    """

    name: str  # engine entry name in the matrix
    kind: str
    options: EngineOptions
    fairness: dict[str, Any]
    max_concurrency: int
    server_id: str  # stable hash of the above (plan.make_server_spec)
    env: dict[str, str] = field(default_factory=dict)  # the matrix's `env:` for this engine (matrix, then engine level)

    @property
    def model_name(self) -> str:
        """The `model` field of completion requests (the entry's name where the options name none)."""
        return self.options.request_model() or self.name


OptionsT = TypeVar("OptionsT", bound=EngineOptions)


def options_of(spec: ServerSpec, model: type[OptionsT]) -> OptionsT:
    """`spec.options` as the adapter's own options type (a spec built for another engine is a bug)."""
    if not isinstance(spec.options, model):
        raise TypeError(f"server {spec.name}: options are {type(spec.options).__name__}, not {model.__name__}")
    return spec.options


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the runner's environment
    health_path: str = "/health"
    startup_timeout_s: float = 600.0


class EngineAdapter(Protocol):
    kind: str
    options_model: type[EngineOptions]  # validates this engine's `options:` block of matrix.yaml

    def validate(self, spec: ServerSpec) -> None:
        """Raise EngineConfigError before any launch when the spec cannot work."""

    def launch_plan(self, spec: ServerSpec, port: int) -> LaunchPlan:
        """The exact command line (and env) that starts this server on 127.0.0.1:port."""

    def request_extras(self, spec: ServerSpec) -> dict[str, Any]:
        """Fields added to every completion request (e.g. llama.cpp's cache_prompt: false)."""

    def version(self, spec: ServerSpec) -> dict[str, Any]:
        """Engine version and build facts for the manifest (without starting the server)."""

    async def scrape(self, session: Any, base_url: str) -> dict[str, float] | None:
        """Engine counters (Prometheus text parsed into name -> value), or None if it has none."""

    def parse_log(self, log_text: str) -> dict[str, Any]:
        """Facts from the server log the report needs (memory lines, captured batch sizes, ...)."""
