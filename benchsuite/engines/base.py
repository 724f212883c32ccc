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
log. Processes, sockets and files are the runner's business (benchsuite.run.process, loadgen).
Adapters live in a plain dict registry (benchsuite.engines.ADAPTERS), keyed by `kind`.

`EngineAdapter` is an abstract base class: six abstract members every engine has, and every optional
hook declared with a typed default that means "not supported" (no-op, None, empty). Callers call
the hooks directly; an adapter overrides the ones its engine has:
- `prepare(spec)`: before a launch (never in a dry run), build what the command line names
  (llama.cpp: export the GGUF of an HF checkpoint);
- `flush_cache_path`: POSTed before each cell (prefix cache flush); None: no flush;
- `tokenizer_dir(spec)`: the model's tokenizer, for exact-length prompts; None: it cannot name one;
- `gguf_file(spec)`: the GGUF file the server loads, where it serves one (its vocabulary size);
- `cell_flags(spec, log_text, cell)`: one-line engine warnings for a finished cell (stored in the
  cell's `extras["flags"]`, shown by the report);
- `owned_env`: environment variables that would set what the adapter owns (llama.cpp's
  `LLAMA_ARG_CTX_SIZE` ...) -> what sets it instead; the matrix loader refuses them in `env:`;
- `model_shape(spec)`: the served model's shape (`paged_experts.shape.ModelShape`), recorded in
  the manifest at launch (`ServerRecord.model`) so the report never reads a checkpoint;
- `resolved_options(spec)`: the options in force with defaults resolved (the manifest's server entry
  `resolved_options` and every cell's `options`); default: the options as validated;
- `async startup_facts(session, base_url)`: the engine's own start-up breakdown, read once it is
  ready (the manifest's server entry `startup_facts`, beside the runner's `startup_s`);
- `async after_cells(session, spec, base_url, run_dir, requests)`: on the live server after its
  cells, before it stops (`requests()` builds the distinct LoadRequests its cells sent); the dict is
  merged into the manifest's server entry as its `facts` (e.g. SGLang's routing capture);
- `environment(spec)`: what this machine has and lacks for the spec (a binary, a package, a CUDA
  device), as `EnvCheck`s; checked at plan time, before a run writes anything, and listed by a dry run;
- `vram_budget_bytes(spec)` and `projections(spec, settings)`: a search of an option against a
  memory budget (benchsuite.run.search; the searchable options are `SEARCH_KNOBS`); None: no search;
- `needs_gpu(spec)`: whether a server of the spec runs on a GPU (`benchsuite run --ray` asks a GPU of
  the node for it, else CPUs); default: it does;
- `recorded_model`, `recorded_expert_format`, `recorded_label_options`, `recorded_on_cpu`: what the
  report reads from a stored server's recorded options (runs from any version of this suite).
Facts about a kind the report needs (its all-on-GPU mode, whether it is the CPU-experts baseline,
...) are the typed `EngineTraits` each adapter class declares, so no stage outside the wings names
a kind (tests/test_engine_contract.py).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, TypeVar

import aiohttp
from pydantic import BaseModel, ConfigDict

from benchsuite.engines.search_settings import NCpuMoeSettings, ResidentExpertsSettings, SearchSettingsAny, parse_with
from benchsuite.errors import UserError
from benchsuite.records import LoadRequest
from paged_experts.shape import ModelShape


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


def searchable_count(option: str, minimum: int) -> Callable[[Any], Any]:
    """A pydantic validator for an option that is an integer >= `minimum`, `search`, or {search: {...}}
    (the request parsed by its knob, SEARCH_KNOBS[option]), so a bad value names its YAML path."""

    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be an integer, 'search' or {search: {...}}")  # noqa: TRY004 (pydantic reports ValueError)
        if isinstance(value, int) and value < minimum:
            raise ValueError(f"must be >= {minimum} (got {value})")
        if isinstance(value, dict):
            try:
                SEARCH_KNOBS[option].parse(value)
            except UserError as exc:
                raise ValueError(str(exc)) from None
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


@dataclass(frozen=True)
class EnvCheck:
    """One thing a server needs from this machine, as found: `missing` stops a run before anything
    is written (`fix` is the command or setting that cures it); a present one is a checklist line."""

    subject: str  # what is needed: "llama-server", "a CUDA device", "SGLang"
    found: str  # what was found, in words: a path and build, or why it is missing
    missing: bool = False
    fix: str | None = None  # e.g. "run `benchsuite install llama-server`"


def cuda_device_check(fix: str) -> EnvCheck:
    """The CUDA device a spec needs, as this process's torch sees it (benchsuite.tools.cuda_device)."""
    from benchsuite.tools.cuda_device import cuda_description, cuda_unavailable

    why = cuda_unavailable()
    if why is not None:
        return EnvCheck("a CUDA device", why, missing=True, fix=fix)
    return EnvCheck("a CUDA device", cuda_description())


@dataclass(frozen=True)
class SizedValues:
    """Option values the model's shape bounds, keyed by the option that sets them (a problem's YAML
    path): `experts_per_layer` (K: top_k <= K <= E) and `layer_counts` (no more than the layers)."""

    experts_per_layer: Mapping[str, int] = field(default_factory=dict)
    layer_counts: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SearchKnob:
    """An engine option a search may choose against a memory budget (benchsuite.run.search), as the
    plan, the CLI summary and the report name it."""

    option: str  # the option's name in `engines.<name>.options`
    settings_model: type[NCpuMoeSettings] | type[ResidentExpertsSettings]  # its `{search: {...}}` settings
    letter: str  # how summaries name a value (N=3, K=16) and the dry run's placeholder ({N}, {K})
    # Decided by the measured peak device memory: its one cell per launch takes the longest prompt
    # (prefill activations are the part of the peak that grows with the prompt); else the first class.
    by_peak_memory: bool
    figure_id: str  # the report's figure of its curve
    title: str
    axis: str

    def parse(self, value: Any) -> SearchSettingsAny:
        """`search` or `{search: {...}}` -> this option's settings; anything else is a user error."""
        return parse_with(self.settings_model, value, self.option)


SEARCH_KNOBS: Mapping[str, SearchKnob] = MappingProxyType({
    "n_cpu_moe": SearchKnob("n_cpu_moe", NCpuMoeSettings, "N", False, "fig-search", "llama.cpp --n-cpu-moe search",
                            "N (layers whose experts stay on the CPU)"),
    "resident_experts": SearchKnob("resident_experts", ResidentExpertsSettings, "K", True, "fig-search-k",
                                   "paged K search", "K (expert slots per layer on the GPU)"),
})  # fmt: skip
SHORT_NAMES: Mapping[str, str] = MappingProxyType(
    {**{knob.option: knob.letter for knob in SEARCH_KNOBS.values()}, "offload_layers": "offload"}
)  # how summaries name the option values that place experts (K, N, the layers offloaded)
FIRST_SEARCH_OPTION = "n_cpu_moe"  # what a search record stored before it named its option searched


def search_knob(option: str | None) -> SearchKnob:
    """The knob of a searched option; an option without its own (or a record without one) searches
    like the first: the fastest value whose projection fits."""
    return SEARCH_KNOBS.get(option or FIRST_SEARCH_OPTION, SEARCH_KNOBS[FIRST_SEARCH_OPTION])


class EngineOptions(BaseModel):
    """Base of every adapter's `options_model`: one scalar per field after sweep expansion, frozen,
    unknown keys refused (a typo names its YAML path)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The option that names the model (a missing model's YAML path), what it may name, and whether a
    # value that is not a path may be a hub id the engine downloads itself.
    checkpoint_option: ClassVar[str] = "model"
    checkpoint_kinds: ClassVar[str] = "a checkpoint directory"
    checkpoint_may_be_hub_id: ClassVar[bool] = False

    def placement(self) -> Placement:
        """Mode, K, N and routing of a server started with these options."""
        raise NotImplementedError(f"{type(self).__name__} does not say where its experts live")

    def request_model(self) -> str | None:
        """The `model` field completion requests carry; None: the engine entry's name."""
        return None

    def model_source(self) -> str | None:
        """The checkpoint or file the server loads, as the options name it (its input fingerprint)."""
        return None

    def sized_values(self) -> SizedValues:
        """The values of these options that the model's shape bounds (benchsuite.config.model_checks)."""
        return SizedValues()

    def replaced(self, **values: Any) -> EngineOptions:
        """A copy with `values` set, validated again (e.g. the search's chosen n_cpu_moe)."""
        return self.model_validate({**self.model_dump(), **values})


@dataclass(frozen=True)
class Fairness:
    """The matrix's `fairness:` block as every engine gets it alike (DESIGN.md section 2); validated
    at the boundary by matrix_schema.Fairness, this frozen copy is what specs and adapters carry."""

    kv_capacity_tokens: int  # the KV cache every engine holds, in tokens
    prefix_caching: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (the server id's hash and the manifest's `fairness`)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ServerSpec:
    """One server configuration: a matrix engine entry with every sweep value resolved.

    `options` is the engine's validated options object (its adapter's `options_model`).
    `fairness` holds the matrix's shared settings (kv capacity in tokens, prefix caching).
    `max_concurrency` is the highest concurrency any cell run on this server uses.
    """

    name: str  # engine entry name in the matrix
    kind: str
    options: EngineOptions
    fairness: Fairness
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
    # SIGTERM -> SIGKILL: what the engine may need to stop cleanly (a built-in server that records its routing
    # writes the trace then: tens of MB, seconds; killed at 5 s, it left none)
    stop_grace_s: float = 5.0


class Projection(Protocol):
    """One candidate value's projected device memory, as an adapter gives it (llama.cpp
    `engines/llamacpp/fit.Projection`, builtin `engines/builtin/memory.KProjection`; dataclasses)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass: the search stores it as a dict
    source: str  # where the figure comes from, shown beside ruled-out values

    @property
    def gpu_total_bytes(self) -> int: ...

    def fits(self, budget_bytes: int, margin_bytes: int) -> bool: ...


class CellView(Protocol):
    """What `cell_flags` reads of a cell (benchsuite.config.plan.CellSpec)."""

    @property
    def concurrency(self) -> int: ...


@dataclass(frozen=True)
class TraceReplay:
    """What replaying a paged server's recorded routing trace needs (the realized vs optimal hit rate):
    its K, what a prefill chunk leaves resident, and whether it was asked to record the trace."""

    resident_experts: int
    prefill_keep: str
    recorded: bool
    trace_file: str  # where the server writes its trace, relative to the run directory
    staging_rows: int = 0  # the server's prefill staging rows (its replay stages as it did)


@dataclass(frozen=True)
class EngineTraits:
    """Facts about a kind of engine that the report needs, declared by its adapter class.

    `reference_mode`: the placement mode that keeps every expert on the GPU (the roofline's unpaged
    reference), None where it has none; `is_cpu_expert_baseline`: its best configuration that fits
    the budget is the published baseline ("llama.cpp, best"); `chunks_prefill`: its cells record
    prefill chunks (the prefill section); `published_rank`: which engine's cells a comparison with
    published figures takes first (lower first).
    """

    reference_mode: str | None = None
    is_cpu_expert_baseline: bool = False
    chunks_prefill: bool = False
    published_rank: int = 99


class EngineAdapter(ABC):
    """One kind of engine: the abstract members every engine has, and the optional hooks (module
    docstring) with defaults that mean "not supported"."""

    kind: ClassVar[str]
    options_model: ClassVar[type[EngineOptions]]  # validates this engine's `options:` block of matrix.yaml
    traits: ClassVar[EngineTraits] = EngineTraits()
    owned_env: ClassVar[Mapping[str, str]] = MappingProxyType({})  # env var -> what sets it instead
    flush_cache_path: ClassVar[str | None] = None  # POSTed before each cell

    @abstractmethod
    def validate(self, spec: ServerSpec) -> None:
        """Raise EngineConfigError before any launch when the spec cannot work."""

    @abstractmethod
    def launch_plan(self, spec: ServerSpec, port: int) -> LaunchPlan:
        """The exact command line (and env) that starts this server on 127.0.0.1:port."""

    @abstractmethod
    def request_extras(self, spec: ServerSpec) -> dict[str, Any]:
        """Fields added to every completion request (e.g. llama.cpp's cache_prompt: false)."""

    @abstractmethod
    def version(self, spec: ServerSpec) -> dict[str, Any]:
        """Engine version and build facts for the manifest (without starting the server)."""

    @abstractmethod
    async def scrape(self, session: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
        """Engine counters (Prometheus text parsed into name -> value), or None if it has none."""

    @abstractmethod
    def parse_log(self, log_text: str) -> dict[str, Any]:
        """Facts from the server log the report needs (memory lines, captured batch sizes, ...)."""

    # ---- optional hooks: the defaults mean "not supported" ------------------------------------

    def prepare(self, spec: ServerSpec) -> None:
        """Build what the command line names, before a launch (never in a dry run)."""
        return None

    def tokenizer_dir(self, spec: ServerSpec) -> Path | None:
        """The model's tokenizer directory, for exact-length prompts."""
        return None

    def gguf_file(self, spec: ServerSpec) -> Path | None:
        """The GGUF file the server loads, where it serves one."""
        return None

    def cell_flags(self, spec: ServerSpec, log_text: str, cell: CellView) -> list[str]:
        """One-line engine warnings for a finished cell; empty: checked, nothing to say."""
        return []

    def resolved_options(self, spec: ServerSpec) -> dict[str, Any]:
        """The options in force, defaults that depend on the device, mode or concurrency resolved."""
        return spec.options.model_dump(mode="json")

    async def startup_facts(self, session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
        """The engine's own start-up breakdown, read once it is ready."""
        return {}

    async def after_cells(
        self, session: aiohttp.ClientSession, spec: ServerSpec, base_url: str, run_dir: Path,
        requests: Callable[[], Sequence[LoadRequest]],
    ) -> dict[str, Any]:  # fmt: skip
        """Facts gathered on the live server after its cells (the manifest's server `facts`)."""
        return {}

    def model_shape(self, spec: ServerSpec) -> ModelShape | None:
        """The served model's shape as the engine will load it (paged_experts.shape), recorded typed
        in the manifest at launch (`ServerRecord.model`); None: the adapter cannot read it."""
        return None

    def recorded_expert_format(self, options: Mapping[str, Any]) -> str | None:
        """How a stored server stored expert weights, read from its recorded options (runs stored
        before `version()` recorded `expert_format`)."""
        return None

    def recorded_model(self, options: Mapping[str, Any]) -> str | None:
        """The model a stored server loaded, as its recorded options name it."""
        value = options.get(self.options_model.checkpoint_option)
        return value if isinstance(value, str) else None

    def recorded_label_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Fixed options of a stored server that tell its configuration apart in labels (the amount
        offloaded), beside the placement's K and N."""
        return {}

    def recorded_on_cpu(self, options: Mapping[str, Any], has_gpu: bool) -> bool:
        """Whether a stored server ran its experts on the CPU, read from its recorded options."""
        return not has_gpu

    def environment(self, spec: ServerSpec) -> list[EnvCheck]:
        """What the spec needs from this machine (binaries, packages, devices), as found; cheap: no
        server is started and no model is read. Empty: nothing beyond this package."""
        return []

    def vram_budget_bytes(self, spec: ServerSpec) -> int | None:
        """The GPU memory budget a search fits its values into."""
        return None

    def needs_gpu(self, spec: ServerSpec) -> bool:
        """Whether a server of this spec runs on a GPU (a scheduler gives it one: `run --ray`)."""
        return True

    def trace_replay(self, spec: ServerSpec) -> TraceReplay | None:
        """A paged server whose routing trace (`<run>/routing/<server-id>.trace`) can be replayed
        with Belady's policy after it stops; None: the engine pages no experts or records no trace."""
        return None

    def projections(self, spec: ServerSpec, settings: SearchSettingsAny) -> Mapping[int, Projection] | None:
        """Every candidate value of a search -> its projected device memory."""
        return None
