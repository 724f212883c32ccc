"""Adapter for the built-in engine, `python -m paged_experts.server` (see engines/base.py).

Owns the builtin `options:` schema of matrix.yaml, the exact server command line, the
`paged_experts:*` Prometheus counters it exposes and the routing label its cells carry.
The model `tiny` means the generated tiny checkpoint (paged_experts.weights.synth.ensure_tiny()),
made on first use in the cache directory.

Performance options default to the fastest measured path for the device and mode, as SGLang keeps
its CUDA graphs on by default: on CUDA, resident and paged servers capture a decode graph for every
batch size up to the server's max concurrency that the mode can capture (paged: B x top_k <= K; the
server keeps larger batches eager), torch.compile their per-layer blocks and run the Triton decode
kernels; offload and cpu-experts stay eager (their layers copy or compute on the host each step).
Every option is resolved here and written as an explicit server flag, spelled by the server's own
declaration (`paged_experts.server.options.ServeOptions.argv`), so the command line in the manifest
names the options in force; a matrix turns each one off by setting it. The rules between options are
the server's (`options.problems`), worded here in this schema's names so errors name the YAML path.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import aiohttp
from pydantic import Field, ValidationInfo, field_validator, model_validator

from benchsuite.engines import RUN_DIR_PLACEHOLDER
from benchsuite.engines.base import (
    EngineAdapter,
    EngineConfigError,
    EngineOptions,
    EngineTraits,
    EnvCheck,
    LaunchPlan,
    Placement,
    ServerSpec,
    SizedValues,
    TraceReplay,
    cuda_device_check,
    options_of,
    searchable_count,
)
from benchsuite.engines.search_settings import ResidentExpertsSettings, SearchSettingsAny
from benchsuite.errors import UserError
from benchsuite.tools.scrape import scrape_prometheus
from paged_experts.residency.page_in import ExpertRows, PageIn, resolve_expert_rows
from paged_experts.residency.planner import DEFAULT_PREFILL_KEEP
from paged_experts.residency.policies import DEFAULT_EVICTION_POLICY
from paged_experts.server.options import GRAPHABLE_MODES, MODE_OPTION, Namer, ServeOptions, mode_problems, problems
from paged_experts.server.threads import default_cpu_threads
from paged_experts.shape import FP8, ModelShape

GB = 10**9  # vram_budget_gb is decimal gigabytes
# This schema's names for the server's options where they differ (options.ServeOptions has the rest).
_MATRIX_NAME = {"enable_torch_compile": "torch_compile", "routing_source": "routing"}
_SERVER_NAME = {matrix: server for server, matrix in _MATRIX_NAME.items()}
# the server options whose rules (options.problems) a matrix can break
_RULED: tuple[str, ...] = ("cuda_graph_max_bs", "enable_torch_compile", "kernel_backend", "prefetch_next_layer")
_RULED += ("overlap_page_in", "overlap_groups", "copy_programs", "fused_page_in", "prefill_residency")
_RULED += ("eviction_policy", "page_in", "prefill_staging_rows", "overlap_copies", "expert_rows")
_LEADING_FLAGS: tuple[str, ...] = ("model_path", "host", "port", "mode", "device", "max_running_requests")
_LEADING_FLAGS += ("max_total_tokens", "resident_experts", "offload_layers", "n_cpu_moe", "dtype")
# A recording server writes its trace when it stops (the H200 headline's 40 requests, 2,048-token prompts among
# them: tens of MB); it exits as soon as that is done, so a long grace costs only a hung server's wait.
TRACE_STOP_GRACE_S = 180.0
_TRAILING_FLAGS: tuple[str, ...] = ("record_routing", "prefill_residency", "eviction_policy", "cuda_graph_max_bs")
_TRAILING_FLAGS += ("enable_torch_compile", "kernel_backend", "expert_kernel", "prefetch_next_layer")
_TRAILING_FLAGS += ("overlap_schedule", "cpu_threads", "served_model_name")


def _matrix_value(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"  # as the YAML spells it
    return repr(value)


MATRIX_NAMES = Namer(
    option=lambda name: _MATRIX_NAME.get(name, name),
    setting=lambda name, value: f"{_MATRIX_NAME.get(name, name)}: {value}",
    value=_matrix_value,
)


class BuiltinOptions(EngineOptions):
    """`engines.<name>.options` for `kind: builtin` (one scalar per field after sweep expansion)."""

    model: str = "tiny"  # checkpoint directory, or `tiny` for the generated test model
    mode: Literal["resident", "paged", "offload", "cpu-experts"] = "paged"
    # K, mode paged; `search` or {search: {...}} searches the largest K that fits vram_budget_gb
    resident_experts: int | Literal["search"] | dict[str, Any] | None = None
    # the resident_experts search's budget (default: the GPU's); left out of the dumped options when unset,
    # so the server ids of matrices without it stay as they were (plan.make_server_spec hashes the dump)
    vram_budget_gb: float | None = Field(None, gt=0, exclude_if=lambda v: v is None)
    offload_layers: int | None = Field(None, ge=0)  # mode offload
    n_cpu_moe: int | None = Field(None, ge=0)  # mode cpu-experts
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # server default when unset
    routing: str = "model"  # "model", or a synthetic routing spec (paged_experts.routing.specs.parse_spec)
    routing_seed: int = 0  # seed of the synthetic routing source
    record_routing: bool = False  # write the routing trace to <run>/routing/<server-id>.trace
    startup_timeout_s: float = Field(600.0, gt=0)
    # Performance options; None = the fastest measured path for this device and mode (module docstring).
    cuda_graph_max_bs: int | None = Field(None, ge=0)  # decode graphs for batch 1..N; 0 = off
    torch_compile: bool | None = None  # torch.compile the captured step's per-layer blocks
    kernel_backend: Literal["grouped", "triton"] | None = None  # decode-step routing/expert/attention kernels
    prefetch_next_layer: bool = False  # paged: page in the next layer's predicted experts (off until measured)
    # Paged, CUDA: the hit experts compute while the misses copy, each group of misses as soon as it
    # landed (paged_experts/moe/overlap.py; off until configs/h200/overlap.yaml measures it).
    # Both left out of the dumped options when unset, so the server ids of matrices without them stay.
    overlap_page_in: bool | None = Field(None, exclude_if=lambda v: v is None)
    overlap_groups: int | None = Field(None, exclude_if=lambda v: v is None)
    # With overlap_page_in: what copies the misses (RuntimeConfig.overlap_copies: kernel, dma = the copy
    # engine rung from the graph, or switch = the copy engines started by the graph's SWITCH nodes); unset like
    # the two above
    overlap_copies: Literal["kernel", "dma", "switch"] | None = Field(None, exclude_if=lambda v: v is None)
    # Paged, CUDA: the page-in copy kernel's grid cap (RuntimeConfig.copy_programs); unset like the two above
    copy_programs: int | None = Field(None, exclude_if=lambda v: v is None)
    # Paged, CUDA, one-token steps: the expert kernels page the misses in (RuntimeConfig.fused_page_in);
    # unset like the three above
    fused_page_in: bool | None = Field(None, exclude_if=lambda v: v is None)
    # How host-planned page-ins copy (RuntimeConfig.page_in): direct (DMAs), kernel (one Triton launch per
    # group of rows), batch (one cuMemcpyBatchAsync per group), staged; unset like fused_page_in (the server's
    # auto: direct on CUDA)
    page_in: PageIn | None = Field(None, exclude_if=lambda v: v is None)
    # Paged: device rows for a prefill layer's first page-ins (RuntimeConfig.prefill_staging_rows); unset like
    # page_in (the server's 0: none)
    prefill_staging_rows: int | None = Field(None, ge=0, exclude_if=lambda v: v is None)
    # Paged, offload: an expert as one byte row of the host store and device rows (RuntimeConfig.expert_rows:
    # auto, split or packed); unset like page_in (the server's auto: packed for mode paged on CUDA, else split)
    expert_rows: ExpertRows | None = Field(None, exclude_if=lambda v: v is None)
    # Freeze the loaded server's heap for the garbage collector (ServeOptions.gc_freeze; None = the server's
    # default, on); left out of the dumped options when unset, so the server ids of matrices without it stay
    gc_freeze: bool | None = Field(None, exclude_if=lambda v: v is None)
    # Block-FP8 checkpoints: the attention projections dequantized at load (RuntimeConfig.dequantize_attention;
    # None = the server's default, kept FP8); left out of the dumped options when unset like gc_freeze
    dequantize_attention: bool | None = Field(None, exclude_if=lambda v: v is None)
    expert_kernel: Literal["fused", "loop"] = "fused"  # grouped matmuls, or the per-expert reference loop
    overlap_schedule: bool = True  # launch a greedy decode step before the previous one's tokens are read
    cpu_threads: int | None = Field(None, ge=1)  # torch's intra-op threads; None: this machine's cores minus one
    # Paged: what a prefill chunk leaves in the slots (paged_experts.residency.planner.PREFILL_KEEP);
    # None = its default.
    prefill_residency: str | None = None
    # Paged: which resident expert a miss evicts (paged_experts.residency.policies.EVICTION_POLICIES); None = LRU.
    # Left out of the dumped options when unset, so the server ids of matrices without it stay as they were.
    eviction_policy: str | None = Field(None, exclude_if=lambda v: v is None)

    @field_validator(*(_MATRIX_NAME.get(name, name) for name in _RULED))
    @classmethod
    def _server_rules(cls, value: Any, info: ValidationInfo) -> Any:
        """The server's own rules (options.problems), worded in this schema's names; each option is
        checked against the options declared before it, which are the ones its rules read."""
        name = _SERVER_NAME.get(str(info.field_name), str(info.field_name))
        known = {_SERVER_NAME.get(key, key): v for key, v in info.data.items()}
        for problem in problems({**known, name: value}, MATRIX_NAMES):
            if problem.option == name:
                raise ValueError(problem.message)
        return value

    _resident_experts = field_validator("resident_experts")(searchable_count("resident_experts", 1))

    def resolved_eviction_policy(self) -> str | None:
        """The eviction policy in force on a paged server (None for other modes)."""
        return (self.eviction_policy or DEFAULT_EVICTION_POLICY) if self.mode == "paged" else None

    def resolved_prefill_residency(self) -> str | None:
        """The policy in force on a paged server (None for other modes)."""
        return (self.prefill_residency or DEFAULT_PREFILL_KEEP) if self.mode == "paged" else None

    def resolved_page_in(self) -> str:
        """The page-in copy in force ('auto' resolved as the runtime resolves it)."""
        if self.page_in not in (None, "auto"):
            return self.page_in
        return "direct" if self.device == "cuda" else "index"

    def resolved_expert_rows(self) -> str:
        """The expert layout in force ('auto' resolved as RuntimeConfig.rows_layout resolves it: packed for mode
        paged on CUDA, split elsewhere; resident layers' device rows are split in every layout)."""
        return resolve_expert_rows(self.expert_rows, self.mode, self.device)

    def graphs_max_bs(self, max_concurrency: int) -> int:
        """The decode graphs' largest batch: the option, or by default every batch the server runs."""
        if self.cuda_graph_max_bs is not None:
            return self.cuda_graph_max_bs
        return max_concurrency if self.device == "cuda" and self.mode in GRAPHABLE_MODES else 0

    def compile_layers(self, max_concurrency: int) -> bool:
        if self.torch_compile is not None:
            return self.torch_compile
        return self.graphs_max_bs(max_concurrency) > 0

    def backend(self) -> str:
        if self.kernel_backend is not None:
            return self.kernel_backend
        return "triton" if self.device == "cuda" and self.mode in GRAPHABLE_MODES else "grouped"

    def performance(self, max_concurrency: int) -> dict[str, Any]:
        """The performance options in force on a server of this max concurrency (defaults resolved)."""
        return {
            "cuda_graph_max_bs": self.graphs_max_bs(max_concurrency),
            "torch_compile": self.compile_layers(max_concurrency),
            "kernel_backend": self.backend(),
            "prefetch_next_layer": self.prefetch_next_layer,
            "overlap_page_in": bool(self.overlap_page_in),
            "overlap_groups": self.overlap_groups or 1,
            "overlap_copies": self.overlap_copies or "kernel",
            "copy_programs": self.copy_programs,
            "fused_page_in": bool(self.fused_page_in),
            "page_in": self.resolved_page_in(),
            "prefill_staging_rows": self.prefill_staging_rows or 0,
            "expert_rows": self.resolved_expert_rows(),
            "expert_kernel": self.expert_kernel,
            "overlap_schedule": self.overlap_schedule,
            "cpu_threads": self.cpu_threads or default_cpu_threads(),
            "gc_freeze": self.gc_freeze is not False,
        }

    @field_validator("routing")
    @classmethod
    def _routing_spec(cls, value: str) -> str:
        if value != "model":
            from paged_experts.routing.specs import parse_spec

            parse_spec(value)  # ValueError names the accepted forms
        return value

    @model_validator(mode="after")
    def _mode_options(self) -> BuiltinOptions:
        # a matrix names every mode's count (offload_layers too: the server's default offloads all)
        for problem in mode_problems(self.model_dump(), MATRIX_NAMES, needs_option=tuple(MODE_OPTION)):
            raise ValueError(problem.message)
        return self

    def placement(self) -> Placement:
        # the routing label is the one the server puts on its own counters
        routing = "model" if self.routing == "model" else f"synthetic:{self.routing.strip().lower()}"
        k = self.resident_experts if isinstance(self.resident_experts, int) else None  # a search has no K yet
        return Placement(self.mode, k, self.n_cpu_moe, routing)

    def request_model(self) -> str:
        return self.model

    def model_source(self) -> str:
        return self.model

    def sized_values(self) -> SizedValues:
        k = {"resident_experts": self.resident_experts} if isinstance(self.resident_experts, int) else {}
        layers = {"n_cpu_moe": self.n_cpu_moe, "offload_layers": self.offload_layers}
        return SizedValues(k, {key: n for key, n in layers.items() if n is not None})


def _trace_file(spec: ServerSpec) -> str:
    """The routing trace a server with record_routing writes, relative to the run directory."""
    return f"routing/{spec.server_id}.trace"


class BuiltinAdapter(EngineAdapter):
    kind = "builtin"
    options_model = BuiltinOptions
    # every expert on the GPU: mode resident; its cells count prefill chunks (the report's prefill section)
    traits = EngineTraits(reference_mode="resident", chunks_prefill=True, published_rank=1)
    flush_cache_path = "/flush_cache"  # POST between cells

    def _options(self, spec: ServerSpec) -> BuiltinOptions:
        return options_of(spec, BuiltinOptions)

    def model_dir(self, spec: ServerSpec) -> Path:
        """The checkpoint directory (generates the tiny model on first use)."""
        model = self._options(spec).model
        if model == "tiny":
            from paged_experts.weights.synth import ensure_tiny

            return Path(ensure_tiny())
        return Path(model).expanduser()

    def tokenizer_dir(self, spec: ServerSpec) -> Path:
        return self.model_dir(spec)

    def validate(self, spec: ServerSpec) -> None:
        opts = self._options(spec)
        if opts.model != "tiny" and not (Path(opts.model).expanduser() / "config.json").is_file():
            raise EngineConfigError(f"builtin model {opts.model!r}: no config.json in that directory")
        if opts.device == "cuda" and opts.mode == "cpu-experts" and opts.n_cpu_moe == 0:
            raise EngineConfigError("mode cpu-experts with n_cpu_moe 0 is mode resident; use that")

    def environment(self, spec: ServerSpec) -> list[EnvCheck]:
        if self._options(spec).device != "cuda":
            return []
        return [cuda_device_check("set `device: cpu` in their options, or run on a machine with a CUDA GPU")]

    def launch_plan(self, spec: ServerSpec, port: int) -> LaunchPlan:
        opts = self._options(spec)
        if opts.resident_experts is not None and not isinstance(opts.resident_experts, int):
            raise EngineConfigError(f"builtin engine {spec.name}: resident_experts is still a search request")
        perf = opts.performance(spec.max_concurrency)
        serve = ServeOptions(
            model_path=str(self.model_dir(spec)),
            port=port,
            mode=opts.mode,
            device=opts.device,
            max_running_requests=spec.max_concurrency,
            max_total_tokens=spec.fairness.kv_capacity_tokens,
            resident_experts=opts.resident_experts,
            offload_layers=opts.offload_layers,
            n_cpu_moe=opts.n_cpu_moe,
            dtype=opts.dtype,
            routing_source=None if opts.routing == "model" else opts.routing,
            routing_seed=opts.routing_seed,
            record_routing=f"{RUN_DIR_PLACEHOLDER}/{_trace_file(spec)}" if opts.record_routing else None,
            prefill_residency=opts.resolved_prefill_residency(),
            eviction_policy=opts.resolved_eviction_policy(),
            cuda_graph_max_bs=perf["cuda_graph_max_bs"],
            enable_torch_compile=perf["torch_compile"],
            kernel_backend=perf["kernel_backend"],
            expert_kernel=perf["expert_kernel"],
            prefetch_next_layer=perf["prefetch_next_layer"],
            overlap_page_in=perf["overlap_page_in"],
            overlap_groups=perf["overlap_groups"],
            overlap_copies=perf["overlap_copies"],
            copy_programs=perf["copy_programs"],
            fused_page_in=perf["fused_page_in"],
            page_in=opts.page_in or "auto",
            prefill_staging_rows=opts.prefill_staging_rows or 0,
            expert_rows=opts.expert_rows or "auto",
            overlap_schedule=perf["overlap_schedule"],
            cpu_threads=perf["cpu_threads"],
            gc_freeze=perf["gc_freeze"],
            dequantize_attention=bool(opts.dequantize_attention),
            served_model_name=opts.model,  # what the runner's requests name (404 for another name)
        )
        seed = ("routing_seed",) if serve.routing_source is not None else ()  # the seed of a synthetic source
        overlap: tuple[str, ...] = ("overlap_page_in", "overlap_groups") if serve.overlap_page_in else ()  # when on
        overlap += ("overlap_copies",) if opts.overlap_copies is not None else ()  # written when set
        capped = ("copy_programs",) if serve.copy_programs is not None else ()  # written when set
        fused = ("fused_page_in",) if serve.fused_page_in else ()  # written when on
        copies: tuple[str, ...] = ("page_in",) if opts.page_in is not None else ()  # written when set
        copies += ("prefill_staging_rows",) if opts.prefill_staging_rows is not None else ()
        copies += ("expert_rows",) if opts.expert_rows is not None else ()  # written when set
        copies += ("dequantize_attention",) if opts.dequantize_attention else ()  # written when on
        # every flag explicit, in the order earlier manifests wrote them (the command line is recorded)
        order = (*_LEADING_FLAGS, "routing_source", *seed, *_TRAILING_FLAGS, *overlap, *capped, *fused, *copies)
        order += ("gc_freeze",)  # always written: the server's default changed (it froze nothing before)
        argv = [sys.executable, "-m", "paged_experts.server", *serve.argv(order)]
        # The tiny model on 2 CPU cores starts in seconds; a real checkpoint may take minutes.
        grace_s = TRACE_STOP_GRACE_S if opts.record_routing else LaunchPlan.stop_grace_s
        return LaunchPlan(
            argv=argv, env={"PYTHONUNBUFFERED": "1"}, startup_timeout_s=opts.startup_timeout_s, stop_grace_s=grace_s
        )

    def trace_replay(self, spec: ServerSpec) -> TraceReplay | None:
        opts = self._options(spec)
        k, keep = opts.placement().resident_experts, opts.resolved_prefill_residency()  # keep: None unless paged
        if opts.mode != "paged" or k is None or keep is None:
            return None
        return TraceReplay(k, keep, opts.record_routing, _trace_file(spec), opts.prefill_staging_rows or 0)

    def resolved_options(self, spec: ServerSpec) -> dict[str, Any]:
        """The options in force, defaults resolved (the performance ones depend on device and mode)."""
        opts = self._options(spec)
        resolved = {
            "prefill_residency": opts.resolved_prefill_residency(),
            "eviction_policy": opts.resolved_eviction_policy(),
            "dequantize_attention": bool(opts.dequantize_attention),  # unset: the server's default, kept FP8
        }
        return {**opts.model_dump(mode="json"), **resolved, **opts.performance(spec.max_concurrency)}

    async def startup_facts(self, session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
        """The server's own start-up breakdown (load, graph capture, eager warm-up) and its graphs."""
        async with session.get(f"{base_url}/server_info") as resp:
            if resp.status != 200:
                return {}
            info = await resp.json()
        return {"engine_startup_s": info.get("startup_s", {}), "captured_graphs": info.get("captured_graphs", [])}

    def request_extras(self, spec: ServerSpec) -> dict[str, Any]:
        return {}

    def recorded_expert_format(self, options: Mapping[str, Any]) -> str | None:
        generated = options.get("model", "tiny") == "tiny"
        return str(options.get("dtype") or ("float32" if generated else "checkpoint dtype"))

    def recorded_label_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return {"offload_layers": options["offload_layers"]} if options.get("offload_layers") is not None else {}

    def recorded_on_cpu(self, options: Mapping[str, Any], has_gpu: bool) -> bool:
        return str(options.get("device", "cpu")) == "cpu"

    def version(self, spec: ServerSpec) -> dict[str, Any]:
        return self._expert_facts(spec) | {
            "engine": "paged_experts",
            "version": _dist_version("benchsuite"),
            "torch": _dist_version("torch"),
            "python": sys.version.split()[0],
        }

    def model_shape(self, spec: ServerSpec) -> ModelShape:
        """The checkpoint's config.json, read as the runtime will (paged_experts.shape)."""
        return ModelShape.from_dir(self.model_dir(spec))

    def _expert_facts(self, spec: ServerSpec) -> dict[str, Any]:
        """How the served model stores one expert (FP8 with its block scales, or the compute dtype)."""
        from paged_experts.config import MoeModelConfig

        opts = self._options(spec)
        cfg = MoeModelConfig.from_dir(self.model_dir(spec))
        dtype = cfg.expert_dtype(opts.dtype or ("float32" if opts.device == "cpu" else cfg.torch_dtype))
        facts: dict[str, Any] = {"expert_format": dtype, "expert_bytes": cfg.expert_bytes(dtype)}
        marker = (
            self.model_dir(spec) / "synthetic_weights.json"
        )  # paged_experts.weights.synth_memory: seeded random weights
        if opts.model == "tiny" or marker.is_file():
            facts["random_weights"] = True  # untrained router: the report's caveat says how it routed
        compute = opts.dtype or ("float32" if opts.device == "cpu" else cfg.torch_dtype)
        blocks = " (128x128 blocks)" if cfg.fp8_weights else ""
        attention = f", attention {FP8}{blocks}" if cfg.fp8_attention(bool(opts.dequantize_attention)) else ""
        facts["weights"] = {
            "source": self._source_weights(spec),
            "format": f"{compute}, experts {dtype}{blocks}{attention}",
        }
        return facts

    def _source_weights(self, spec: ServerSpec) -> dict[str, Any]:
        """paged_experts.weights.weights_id: the identity of the weights this server loads (report: same model?)."""
        from paged_experts.weights.weights_id import source_weights

        try:
            return source_weights(self.model_dir(spec))
        except (OSError, ValueError, KeyError) as exc:  # unreadable: the identity is unknown, not invented
            return {"id": None, "kind": "unknown", "covers": f"not fingerprinted ({type(exc).__name__}: {exc})"}

    async def scrape(self, session: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
        return await scrape_prometheus(session, base_url, "paged_experts:")

    def parse_log(self, log_text: str) -> dict[str, Any]:
        # The builtin server reports everything through /metrics; its log carries no extra facts.
        return {}

    # ---- the resident_experts search (benchsuite.run.search; projection in engines/builtin/memory.py) ----

    def needs_gpu(self, spec: ServerSpec) -> bool:
        return self._options(spec).device == "cuda"

    def vram_budget_bytes(self, spec: ServerSpec) -> int:
        """`vram_budget_gb`, else the memory of the GPU (NVML) on a cuda server."""
        from benchsuite.tools.device_memory import gpu_total_bytes

        opts = self._options(spec)
        if opts.vram_budget_gb is not None:
            return int(opts.vram_budget_gb * GB)
        total = gpu_total_bytes() if opts.device == "cuda" else None
        if total is None:
            raise UserError(f"engine {spec.name}: the resident_experts search needs vram_budget_gb without a GPU")
        return total

    def projections(self, spec: ServerSpec, settings: SearchSettingsAny) -> dict[int, Any]:
        """K -> memory.KProjection for every K the search may choose (memory.k_range)."""
        from benchsuite.engines.builtin import memory
        from paged_experts.config import MoeModelConfig

        if not isinstance(settings, ResidentExpertsSettings):
            raise UserError(f"engine {spec.name}: the builtin engine searches resident_experts only")
        opts = self._options(spec)
        model_dir = self.model_dir(spec)
        cfg = MoeModelConfig.from_dir(model_dir)
        rows = opts.prefill_staging_rows or 0
        # a server refuses more staging rows than the E - K experts outside its slots: K up to E - rows
        max_k = cfg.num_experts - rows if settings.max_k is None else min(settings.max_k, cfg.num_experts - rows)
        try:
            ks = memory.k_range(cfg.num_experts, cfg.top_k, spec.max_concurrency, settings.min_k, max_k)
        except UserError as exc:
            if not rows:
                raise
            raise UserError(f"{exc} (prefill_staging_rows {rows} leave K at most E - rows = {max_k})") from None
        dtype = opts.dtype or ("float32" if opts.device == "cpu" else cfg.torch_dtype)
        return memory.projections(
            model_dir, dtype, spec.fairness.kv_capacity_tokens, ks, rows, bool(opts.dequantize_attention)
        )


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
