"""Adapter for llama.cpp's `llama-server` (kind `llamacpp`; contract in engines/base.py).

Owns the llamacpp `options:` schema of matrix.yaml, the binary lookup (matrix `binary`, then
PATH, then the benchsuite build cache), which flags the binary supports (from its `--help`), the
model resolution (a GGUF file; an HF checkpoint directory or `tiny`, exported to GGUF on first
use), the exact command line, the `llamacpp:*` Prometheus counters and the log facts.

KV capacity: `-c` is the TOTAL number of KV cells and `-np` the number of slots (the highest
concurrency of the server's cells). llama.cpp's default with an explicit `-np` splits `-c` evenly,
so each request could use only c/np tokens. We pass `--kv-unified`: all slots share one pool of
`-c` = fairness `kv_capacity_tokens` cells and one request may use all of it, the same meaning as
the builtin engine's token pool and SGLang's `--max-total-tokens`.
Prefix caching: `--no-cache-prompt` where the binary has it, `--cache-ram 0` (no host prompt
cache), and `cache_prompt: false` on every request.
HTTP: this llama-server answers `Keep-Alive: timeout=5, max=100` yet closes the socket after every
streamed (chunked) response, so a client that reuses pooled connections fails every second request
("Can not write request body"); the load generator's connector must use `force_close=True`.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import aiohttp
from pydantic import Field, field_validator, model_validator

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
    extra_args_check,
    options_of,
    searchable_count,
)
from benchsuite.engines.llamacpp import owned, tuning
from benchsuite.engines.search_settings import NCpuMoeSettings, SearchSettingsAny
from benchsuite.errors import UserError
from benchsuite.tools.scrape import scrape_prometheus
from paged_experts.shape import ModelShape

BINARY_NAME = "llama-server"
FIT_PARAMS_NAME = "llama-fit-params"
GB = 10**9  # vram_budget_gb is decimal gigabytes
# What a dry run without a binary assumes the build lists (the pinned build does).
_ASSUMED_FLAGS = frozenset(
    {"--no-cache-prompt", "--cache-ram", "--kv-unified", "--log-verbosity", "--cors-origins", "--load-mode"}
)
_GPU_DEVICE_LINE = re.compile(r"^\s*(CUDA|ROCm|HIP|Vulkan|Metal|SYCL)\d*\s*:", re.MULTILINE)


class LlamaCppOptions(EngineOptions):
    """`engines.<name>.options` for `kind: llamacpp` (one scalar per field after sweep expansion)."""

    model: str = "tiny"  # GGUF file, HF Qwen3-MoE directory (exported on first use), or `tiny`
    gguf_type: Literal["f32", "f16", "bf16", "q8_0"] = "f32"  # export type for an HF directory
    binary: str | None = None  # llama-server path; default PATH, then the benchsuite build cache
    n_gpu_layers: int = Field(999, ge=0)  # -ngl
    # -ncmoe: experts of the first N layers on the CPU; `search` or {search: {...}} searches N.
    n_cpu_moe: int | Literal["search"] | dict[str, Any] | None = None
    # Tuning beyond N, defaults as llama.cpp's MoE-offload users run it (tuning.py says why).
    flash_attn: Literal["on", "off", "auto"] = "on"  # -fa
    batch_size: int = Field(tuning.DEFAULT_BATCH_TOKENS, ge=1)  # -b: logical batch (prompt tokens per decode call)
    ubatch_size: int = Field(tuning.DEFAULT_UBATCH_TOKENS, ge=1)  # -ub: physical micro-batch (GPU compute buffer)
    mmap: bool = False  # false: --load-mode none (host experts read into pinned buffers on GPU builds)
    moe_cache_mib: int | None = Field(None, ge=1)  # llama.cpp's expert cache, where the build has it
    vram_budget_gb: float | None = Field(None, gt=0)  # emulate a smaller GPU in the n_cpu_moe search
    threads: int | None = Field(None, ge=1)  # -t; default the physical cores this process may use
    extra_args: list[str] = Field(default_factory=list)  # never a flag the adapter owns (owned.py)
    startup_timeout_s: float = Field(600.0, gt=0, le=7 * 86400)

    _not_owned = field_validator("extra_args")(extra_args_check(owned.extra_args_problems))

    @field_validator("flash_attn", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: Any) -> Any:
        # YAML reads unquoted on/off as booleans.
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _ubatch_within_batch(self) -> LlamaCppOptions:
        # llama.cpp silently clamps -ub to -b; the projection must not count a micro-batch that never runs.
        if self.ubatch_size > self.batch_size:
            raise ValueError(f"ubatch_size {self.ubatch_size} exceeds batch_size {self.batch_size}")
        return self

    _n_cpu_moe = field_validator("n_cpu_moe")(searchable_count("n_cpu_moe", 0))

    def placement(self) -> Placement:
        n = self.n_cpu_moe if isinstance(self.n_cpu_moe, int) else None  # a search request has no N yet
        mode = "moe-cache" if self.moe_cache_mib is not None else ("n-cpu-moe" if n else "gpu")
        return Placement(mode, n_cpu_moe=n)

    def request_model(self) -> str:
        return self.model

    def model_source(self) -> str:
        return self.model

    checkpoint_kinds = "a checkpoint directory or GGUF file"

    def sized_values(self) -> SizedValues:
        return SizedValues(layer_counts={"n_cpu_moe": self.n_cpu_moe} if isinstance(self.n_cpu_moe, int) else {})


@functools.lru_cache(maxsize=16)
def _help_text(binary: str, mtime_ns: int) -> str:
    proc = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60, check=False)
    return proc.stdout + proc.stderr


@functools.lru_cache(maxsize=16)
def _devices_text(binary: str, mtime_ns: int) -> str:
    proc = subprocess.run(
        [binary, "--list-devices"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc.stdout + proc.stderr


def find_binary(name: str = BINARY_NAME, configured: str | None = None) -> Path | None:
    """Matrix option, then PATH, then the build cache; None when none exists."""
    from benchsuite.engines.llamacpp.build import cached_binary

    if configured:
        path = Path(configured).expanduser()
        return path if path.is_file() else None
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    return cached_binary(name)


def binary_flags(binary: Path) -> set[str]:
    """Every long option the binary's --help lists (e.g. --n-cpu-moe, --moe-cache-mib)."""
    text = _help_text(str(binary), binary.stat().st_mtime_ns)
    return set(re.findall(r"(--[a-z][a-z0-9\-]*)", text))


def has_gpu_device(binary: Path) -> bool:
    return bool(_GPU_DEVICE_LINE.search(_devices_text(str(binary), binary.stat().st_mtime_ns)))


class LlamaCppAdapter(EngineAdapter):
    kind = "llamacpp"
    options_model = LlamaCppOptions
    # its best --n-cpu-moe that fits the budget is the published baseline ("llama.cpp, best")
    traits = EngineTraits(is_cpu_expert_baseline=True, published_rank=2)
    owned_env = owned.OWNED_ENV  # LLAMA_ARG_* variables of the flags above; refused in a matrix's env:

    def _options(self, spec: ServerSpec) -> LlamaCppOptions:
        return options_of(spec, LlamaCppOptions)

    def binary(self, spec: ServerSpec) -> Path:
        opts = self._options(spec)
        found = find_binary(BINARY_NAME, opts.binary)
        if found is None:
            where = (
                f"binary {opts.binary!r} does not exist" if opts.binary else "no llama-server on PATH or in the cache"
            )
            raise EngineConfigError(f"llamacpp engine {spec.name}: {where}; run `benchsuite install llama-server`")
        return found

    def environment(self, spec: ServerSpec) -> list[EnvCheck]:
        """llama-server found (the matrix's `binary`, PATH, the build cache) and how it was built: a
        CPU-only build runs every layer on the CPU whatever -ngl says (listed, not refused: the
        tiny matrices run on CPU builds on purpose)."""
        from benchsuite.engines.llamacpp.build import install_dir, read_stamp

        opts = self._options(spec)
        found = find_binary(BINARY_NAME, opts.binary)
        if found is None:
            where = (
                f"{opts.binary} does not exist (engines.{spec.name}.options.binary)"
                if opts.binary
                else f"not on PATH nor in {install_dir(False).parent}"
            )
            fix = "run `benchsuite install llama-server` (add --cuda for a GPU build)"
            if opts.binary:
                fix = f"point engines.{spec.name}.options.binary at a llama-server, or remove it to use the build cache"
            return [EnvCheck(BINARY_NAME, where, missing=True, fix=fix)]
        stamp = read_stamp(found.parent)
        if stamp is not None:
            build = "CUDA build" if stamp.get("cuda") else "CPU-only build: no layer runs on a GPU"
        else:
            build = "GPU device listed" if has_gpu_device(found) else "no GPU device listed: every layer on the CPU"
        return [EnvCheck(BINARY_NAME, f"{found} ({build})")]

    def model_path(self, spec: ServerSpec, *, export: bool = True) -> Path:
        """The GGUF file. An HF directory or `tiny` is exported into the cache on first use; with
        export=False only its cache path is computed (a dry run writes nothing)."""
        opts = self._options(spec)
        from benchsuite.engines.llamacpp.gguf_export import cached_export, export_target

        convert = cached_export if export else export_target
        if opts.model == "tiny":
            from paged_experts.weights.synth import ensure_tiny

            return convert(ensure_tiny(), opts.gguf_type)
        path = Path(opts.model).expanduser()
        if path.is_dir():
            return convert(path, opts.gguf_type)
        return path

    def prepare(self, spec: ServerSpec) -> None:
        """Before a launch (not a dry run): export the GGUF the command line names, if needed."""
        self.model_path(spec, export=True)

    def gguf_file(self, spec: ServerSpec) -> Path | None:
        """The GGUF file the model option names (None for a checkpoint directory or `tiny`): dataset `random`
        reads its vocabulary."""
        path = Path(self._options(spec).model).expanduser()
        return path if path.is_file() else None

    def tokenizer_dir(self, spec: ServerSpec) -> Path:
        """The HF tokenizer for exact-length prompts (the checkpoint the GGUF came from)."""
        opts = self._options(spec)
        if opts.model == "tiny":
            from paged_experts.weights.synth import ensure_tiny

            return Path(ensure_tiny())
        path = Path(opts.model).expanduser()
        if path.is_dir():
            return path
        from benchsuite.engines.llamacpp.gguf_synth import read_facts

        facts = read_facts(path)  # a GGUF from `benchsuite gguf synth`: its preset's tokenizer beside it
        if facts is not None and Path(facts["hf_dir"]).is_dir():
            return Path(facts["hf_dir"])
        raise EngineConfigError(
            f"llamacpp engine {spec.name}: exact-length prompts need an HF model directory, not a GGUF"
        )

    def validate(self, spec: ServerSpec) -> None:
        opts = self._options(spec)
        binary = self.binary(spec)
        flags = binary_flags(binary)
        if opts.moe_cache_mib is not None and "--moe-cache-mib" not in flags:
            raise EngineConfigError(f"this llama-server build has no --moe-cache-mib ({binary})")
        if isinstance(opts.n_cpu_moe, int) and opts.n_cpu_moe > 0 and "--n-cpu-moe" not in flags:
            raise EngineConfigError(f"this llama-server build has no --n-cpu-moe ({binary})")
        path = Path(opts.model).expanduser()
        if opts.model != "tiny" and not path.exists():
            raise EngineConfigError(f"llamacpp engine {spec.name}: model {opts.model!r} does not exist")
        if path.is_file() and path.suffix != ".gguf":
            raise EngineConfigError(f"llamacpp engine {spec.name}: model {opts.model!r} is not a .gguf file")

    def launch_plan(self, spec: ServerSpec, port: int) -> LaunchPlan:
        opts = self._options(spec)
        if not isinstance(opts.n_cpu_moe, int | None):
            raise EngineConfigError(f"llamacpp engine {spec.name}: n_cpu_moe is still a search request")
        found = find_binary(BINARY_NAME, opts.binary)
        binary = str(found) if found else (opts.binary or BINARY_NAME)
        flags = binary_flags(found) if found else _ASSUMED_FLAGS
        argv = [
            binary, "-m", str(self.model_path(spec, export=False)),
            "--host", "127.0.0.1", "--port", str(port),
            "-ngl", str(opts.n_gpu_layers),
            "-c", str(spec.fairness.kv_capacity_tokens),
            "-np", str(spec.max_concurrency),
            "-fa", opts.flash_attn,
            "-b", str(opts.batch_size), "-ub", str(opts.ubatch_size),
            "-t", str(opts.threads if opts.threads is not None else tuning.physical_cores()),
            "--metrics",
        ]  # fmt: skip
        argv += tuning.load_args(opts.mmap, flags)
        if "--kv-unified" in flags:
            argv.append("--kv-unified")
        if "--cors-origins" in flags:  # no web page can read this server (owned.py says why)
            argv += owned.CORS_ARGS
        if "--log-verbosity" in flags:
            # trace: the memory lines (model/KV/compute buffers, the exit breakdown); nothing per token
            argv += ["-lv", str(tuning.LOG_VERBOSITY)]
        if not spec.fairness.prefix_caching:
            if "--no-cache-prompt" in flags:
                argv.append("--no-cache-prompt")
            if "--cache-ram" in flags:
                argv += ["--cache-ram", "0"]
        if opts.n_cpu_moe:
            argv += ["--n-cpu-moe", str(opts.n_cpu_moe)]
        if opts.moe_cache_mib is not None:
            argv += ["--moe-cache-mib", str(opts.moe_cache_mib)]
        argv += list(opts.extra_args)
        return LaunchPlan(
            argv=argv,
            env={},
            health_path="/health",
            startup_timeout_s=opts.startup_timeout_s,
        )

    def recorded_expert_format(self, options: Mapping[str, Any]) -> str | None:
        model = str(options.get("model", "tiny"))
        return f"GGUF {Path(model).name}" if model.lower().endswith(".gguf") else str(options.get("gguf_type") or "f32")

    def request_extras(self, spec: ServerSpec) -> dict[str, Any]:
        # timings_per_token: every streamed chunk carries `timings` (predicted_n: the tokens generated so
        # far), including the chunks of tokens whose text is empty (server-context.cpp send_partial_response),
        # so benchsuite.measure.metrics times token 1 and token n, not the first and last visible text.
        extras: dict[str, Any] = {"timings_per_token": True}
        return extras if spec.fairness.prefix_caching else {**extras, "cache_prompt": False}

    def version(self, spec: ServerSpec) -> dict[str, Any]:
        from benchsuite.engines.llamacpp.build import binary_version, read_stamp
        from benchsuite.engines.llamacpp.gguf_synth import read_facts

        found = find_binary(BINARY_NAME, self._options(spec).binary)
        if found is None:
            return {"engine": "llama.cpp", "binary": None}
        return self._expert_facts(spec) | {
            "engine": "llama.cpp",
            "binary": str(found),
            "version": binary_version(found),
            "build": read_stamp(found.parent),  # None for a binary benchsuite did not build
            "moe_cache_mib_supported": "--moe-cache-mib" in binary_flags(found),
            "cross_origin": " ".join(owned.CORS_ARGS)
            if "--cors-origins" in binary_flags(found)
            else "not blockable: this build has no --cors-origins",
            # a GGUF from `benchsuite gguf synth`: how it was made (seed, shape, bytes per expert)
            "model_facts": read_facts(self.model_path(spec, export=False)),
            "weights": self._weights(spec),
        }

    def model_shape(self, spec: ServerSpec) -> ModelShape | None:
        """The GGUF's metadata (llamacpp.fit), read after `prepare` exported it where needed."""
        from benchsuite.engines.llamacpp import fit

        path = self.model_path(spec, export=False)
        try:
            return fit.read_model_facts(path).shape(path.stem)
        except (OSError, ValueError, KeyError):  # unreadable: the shape is unknown, not invented
            return None

    def _weights(self, spec: ServerSpec) -> dict[str, Any]:
        """{source, format}: the identity of the weights the GGUF was made from (a checkpoint this
        adapter exports: that checkpoint's; a GGUF file: its facts file's record, else unknown) and
        how the GGUF stores them."""
        from benchsuite.engines.llamacpp.gguf_export import tensor_formats
        from benchsuite.engines.llamacpp.gguf_synth import read_facts

        model = self._options(spec).model
        path = self.model_path(spec, export=False)
        source: dict[str, Any] | None
        if model == "tiny" or Path(model).expanduser().is_dir():
            from paged_experts.weights.synth import ensure_tiny
            from paged_experts.weights.weights_id import source_weights

            source = source_weights(ensure_tiny() if model == "tiny" else Path(model).expanduser())
        else:
            source = (read_facts(path) or {}).get("source_weights")
        if not source:
            source = {"id": None, "kind": "unknown", "covers": f"{path.name}: no facts file names its source weights"}
        try:
            fmt = tensor_formats(path) if path.is_file() else "not exported yet"
        except (OSError, ValueError, IndexError, KeyError):
            fmt = "unreadable GGUF"
        return {"source": source, "format": fmt}

    def _expert_facts(self, spec: ServerSpec) -> dict[str, Any]:
        """Bytes per expert of the served GGUF (the report sets them beside the built-in engine's)."""
        from benchsuite.engines.llamacpp.gguf_export import expert_facts

        path = self.model_path(spec, export=False)
        try:
            return expert_facts(path) if path.is_file() else {}
        except (OSError, ValueError, IndexError, KeyError):  # not a readable GGUF: the fact is absent, not invented
            return {}

    async def scrape(self, session: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
        return await scrape_prometheus(session, base_url, "llamacpp:")

    def parse_log(self, log_text: str) -> dict[str, Any]:
        from benchsuite.engines.llamacpp.logs import parse_server_log

        return parse_server_log(log_text)

    # ---- the n_cpu_moe search (benchsuite.run.search) ------------------------------------------------

    def needs_gpu(self, spec: ServerSpec) -> bool:
        """Layers offloaded (-ngl > 0) by a GPU build; where this machine has no build (a driver of a
        Ray cluster) the build the nodes run is unknown, and offloaded layers ask for a GPU."""
        if self._options(spec).n_gpu_layers == 0:
            return False
        try:
            return has_gpu_device(self.binary(spec))
        except EngineConfigError:
            return True

    def vram_budget_bytes(self, spec: ServerSpec) -> int:
        """`vram_budget_gb`, else the physical VRAM of GPU 0 on a GPU build."""
        opts = self._options(spec)
        if opts.vram_budget_gb is not None:
            return int(opts.vram_budget_gb * GB)
        if has_gpu_device(self.binary(spec)):
            out = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=memory.total",
                    "--format=csv,noheader,nounits",
                ],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            ).stdout.split()
            if out:
                return int(float(out[0]) * 2**20)
        raise UserError(
            f"engine {spec.name}: the n_cpu_moe search needs vram_budget_gb on a machine without a GPU build"
        )

    def projections(self, spec: ServerSpec, settings: SearchSettingsAny) -> dict[int, Any]:
        """n -> benchsuite.engines.llamacpp.fit.Projection for every candidate N of the search, with
        the flags the server runs with that size its GPU buffers (-fa, -b/-ub, -ngl, -c)."""
        from benchsuite.engines.llamacpp import fit as fit

        if not isinstance(settings, NCpuMoeSettings):
            raise UserError(f"engine {spec.name}: llama.cpp searches n_cpu_moe only")
        opts = self._options(spec)
        model = self.model_path(spec)
        facts = fit.read_model_facts(model)
        top = facts.n_layer if settings.max_n is None else min(settings.max_n, facts.n_layer)
        candidates = range(settings.min_n, top + 1)
        n_ctx = spec.fairness.kv_capacity_tokens
        use_llama = settings.projection == "llama-fit-params" or (
            settings.projection == "auto" and has_gpu_device(self.binary(spec))
        )
        if not use_llama:
            return {
                n: fit.project(
                    facts,
                    n,
                    n_ctx,
                    flash_attn=opts.flash_attn == "on",
                    n_gpu_layers=opts.n_gpu_layers,
                    n_ubatch=min(opts.ubatch_size, opts.batch_size),
                )
                for n in candidates
            }
        fit_binary = self.binary(spec).parent / FIT_PARAMS_NAME
        if not fit_binary.is_file():
            raise EngineConfigError(f"{fit_binary} is missing; llama.cpp's projection needs llama-fit-params")
        out: dict[int, Any] = {}
        for n in candidates:
            argv = fit.fit_params_argv(
                fit_binary,
                model,
                n,
                n_ctx,
                spec.max_concurrency,
                opts.flash_attn == "on",
                opts.n_gpu_layers,
                batch_size=opts.batch_size,
                ubatch_size=opts.ubatch_size,
            )
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
            if proc.returncode != 0:
                raise EngineConfigError(f"llama-fit-params failed for n_cpu_moe={n}: {proc.stderr.strip()[-400:]}")
            out[n] = fit.projection_from_fit_print(proc.stdout, n)
        return out
