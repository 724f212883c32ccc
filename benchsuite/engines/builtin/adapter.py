"""Adapter for the built-in engine, `python -m paged_experts.server` (see engines/base.py).

Owns the builtin `options:` schema of matrix.yaml, the exact server command line, the
`paged_experts:*` Prometheus counters it exposes and the routing label its cells carry.
The model `tiny` means the generated tiny checkpoint (paged_experts.synth.ensure_tiny()),
made on first use in the cache directory.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from benchsuite.engines import RUN_DIR_PLACEHOLDER
from benchsuite.engines.base import EngineConfigError, LaunchPlan, ServerSpec
from benchsuite.metrics import parse_prometheus

_MODE_OPTION = {"paged": "resident_experts", "offload": "offload_layers", "cpu-experts": "n_cpu_moe"}


class BuiltinOptions(BaseModel):
    """`engines.<name>.options` for `kind: builtin` (one scalar per field after sweep expansion)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "tiny"  # checkpoint directory, or `tiny` for the generated test model
    mode: Literal["resident", "paged", "offload", "cpu-experts"] = "paged"
    resident_experts: int | None = Field(None, ge=1)  # K, mode paged
    offload_layers: int | None = Field(None, ge=0)  # mode offload
    n_cpu_moe: int | None = Field(None, ge=0)  # mode cpu-experts
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # server default when unset
    routing: str = "model"  # "model", or a synthetic routing spec (paged_experts.routing.parse_spec)
    routing_seed: int = 0  # seed of the synthetic routing source
    record_routing: bool = False  # write the routing trace to <run>/routing/<server-id>.trace
    startup_timeout_s: float = Field(600.0, gt=0)

    @field_validator("routing")
    @classmethod
    def _routing_spec(cls, value: str) -> str:
        if value != "model":
            from paged_experts.routing import parse_spec  # imports torch: only for synthetic routing

            parse_spec(value)  # ValueError names the accepted forms
        return value

    @model_validator(mode="after")
    def _mode_options(self) -> BuiltinOptions:
        needed = _MODE_OPTION.get(self.mode)
        if needed is not None and getattr(self, needed) is None:
            raise ValueError(f"mode {self.mode} needs {needed}")
        for mode, option in _MODE_OPTION.items():
            if mode != self.mode and getattr(self, option) is not None:
                raise ValueError(f"{option} applies only to mode {mode}, not {self.mode}")
        return self


class BuiltinAdapter:
    kind = "builtin"
    options_model = BuiltinOptions
    flush_cache_path: str | None = "/flush_cache"  # POST between cells

    def _options(self, spec: ServerSpec) -> BuiltinOptions:
        return BuiltinOptions.model_validate(dict(spec.options))

    def model_dir(self, spec: ServerSpec) -> Path:
        """The checkpoint directory (generates the tiny model on first use)."""
        model = self._options(spec).model
        if model == "tiny":
            from paged_experts.synth import ensure_tiny

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

    def launch_plan(self, spec: ServerSpec, port: int) -> LaunchPlan:
        opts = self._options(spec)
        argv = [
            sys.executable, "-m", "paged_experts.server.app",
            "--model-path", str(self.model_dir(spec)),
            "--host", "127.0.0.1", "--port", str(port),
            "--mode", opts.mode,
            "--device", opts.device,
            "--max-running-requests", str(spec.max_concurrency),
            "--max-total-tokens", str(spec.fairness["kv_capacity_tokens"]),
        ]  # fmt: skip
        if opts.resident_experts is not None:
            argv += ["--paged-experts-num-resident", str(opts.resident_experts)]
        if opts.offload_layers is not None:
            argv += ["--offload-layers", str(opts.offload_layers)]
        if opts.n_cpu_moe is not None:
            argv += ["--n-cpu-moe", str(opts.n_cpu_moe)]
        if opts.dtype is not None:
            argv += ["--dtype", opts.dtype]
        if opts.routing != "model":
            argv += ["--routing-source", opts.routing, "--routing-seed", str(opts.routing_seed)]
        if opts.record_routing:
            argv += ["--record-routing", f"{RUN_DIR_PLACEHOLDER}/routing/{spec.server_id}.trace"]
        argv += ["--served-model-name", opts.model]  # what the runner's requests name (404 for another name)
        # The tiny model on 2 CPU cores starts in seconds; a real checkpoint may take minutes.
        return LaunchPlan(argv=argv, env={"PYTHONUNBUFFERED": "1"}, startup_timeout_s=opts.startup_timeout_s)

    def mode(self, spec: ServerSpec) -> str:
        return self._options(spec).mode

    def routing_label(self, spec: ServerSpec) -> str:
        routing = self._options(spec).routing
        return "model" if routing == "model" else f"synthetic:{routing.strip().lower()}"  # as the server labels it

    def request_extras(self, spec: ServerSpec) -> dict[str, Any]:
        return {}

    def version(self, spec: ServerSpec) -> dict[str, Any]:
        return {
            "engine": "paged_experts",
            "version": _dist_version("benchsuite"),
            "torch": _dist_version("torch"),
            "python": sys.version.split()[0],
        }

    async def scrape(self, session: Any, base_url: str) -> dict[str, float] | None:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
        return {k: v for k, v in parse_prometheus(text).items() if k.startswith("paged_experts:")}

    def parse_log(self, log_text: str) -> dict[str, Any]:
        # The builtin server reports everything through /metrics; its log carries no extra facts.
        return {}


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
