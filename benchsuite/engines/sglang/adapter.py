"""Adapter for SGLang (`python -m sglang.launch_server`, reference version 0.5.23), see base.py.

Owns the `kind: sglang` options schema of matrix.yaml, the exact server command line in its three
modes (paged: `--enable-paged-experts --paged-experts-num-resident K`; offload: `--cpu-offload-gb G`;
unpaged), the request field for routing capture, the version probe, and the Prometheus scrape.
The options schema lives in benchsuite.engines.sglang.options, constraint checks in .constraints,
log parsing in .logs, routing decoding in .routing.

Every flag emitted here exists in sglang 0.5.23 (`srt/arg_groups/fields/*.py`, CLI name = field name
with dashes, `arg_utils.py:288-290`); docs/sglang.md lists each flag with its file and line.
SGLang needs a CUDA GPU; nothing in this project has run it, and no result here claims it did.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from benchsuite.engines.base import (
    CellView,
    EngineAdapter,
    EngineConfigError,
    EngineTraits,
    EnvCheck,
    LaunchPlan,
    ServerSpec,
    cuda_device_check,
    options_of,
)
from benchsuite.engines.sglang import constraints as sglang_constraints
from benchsuite.engines.sglang import logs as sglang_logs
from benchsuite.engines.sglang.options import SGLangOptions
from benchsuite.records import LoadRequest
from benchsuite.tools.scrape import scrape_prometheus
from paged_experts.shape import ModelShape

__all__ = ["SGLangAdapter", "SGLangOptions", "scrape_prometheus"]

METRIC_PREFIX = "sglang:"  # observability/metrics_collector.py names every series sglang:*
VERSION_PROBE_TIMEOUT_S = 120.0


class SGLangAdapter(EngineAdapter):
    kind = "sglang"
    options_model = SGLangOptions
    # every expert on the GPU: mode unpaged; its published figures are the ones a report compares first
    traits = EngineTraits(reference_mode="unpaged", published_rank=0)
    # http_server.py:1025 (GET or POST); a no-op with the radix cache off, kept for prefix_caching: true.
    flush_cache_path = "/flush_cache"

    def _options(self, spec: ServerSpec) -> SGLangOptions:
        return options_of(spec, SGLangOptions)

    def tokenizer_dir(self, spec: ServerSpec) -> Path:
        """The checkpoint's tokenizer, for exact-length prompts (the runner asks for it)."""
        path = Path(self._options(spec).model_path).expanduser()
        if not (path / "config.json").is_file():
            raise EngineConfigError(
                f"sglang {spec.name}: exact-length prompts need model_path to be a local checkpoint directory, "
                f"not {path}"
            )
        return path

    def model_shape(self, spec: ServerSpec) -> ModelShape | None:
        """A local checkpoint's config.json (paged_experts.shape); None for a hub id SGLang downloads."""
        path = Path(self._options(spec).model_path).expanduser()
        try:
            return ModelShape.from_dir(path) if (path / "config.json").is_file() else None
        except (OSError, ValueError, TypeError):  # not a MoE config or unreadable: the shape is unknown
            return None

    def validate(self, spec: ServerSpec) -> None:
        opts = self._options(spec)
        problems: list[str] = []  # extra_args were checked when the options were validated (matrix load)
        if opts.mode == "paged":
            facts = sglang_constraints.read_model_facts(opts.model_path)
            problems += sglang_constraints.paged_problems(opts, facts)
        if problems:
            raise EngineConfigError(f"sglang {spec.name}: " + "; ".join(problems))

    def environment(self, spec: ServerSpec) -> list[EnvCheck]:
        """SGLang importable (in this interpreter, or the `python` option names an interpreter that
        exists: asking it would start a process) and a CUDA device (SGLang needs one) as this
        interpreter's torch sees it; with another interpreter, its torch decides at launch."""
        opts = self._options(spec)
        fix = 'pip install ".[sglang]" (SGLang 0.5.23), or set the `python` option to an interpreter that has it'
        if opts.python is not None:
            # a path, or a bare name found on PATH as the launch will find it (`python3.11`)
            ok = shutil.which(str(Path(opts.python).expanduser())) is not None
            found = f"interpreter {opts.python}" + ("" if ok else " does not exist (nor on PATH)")
        else:
            spec_found = importlib.util.find_spec("sglang")
            ok = spec_found is not None
            where = f"in {Path(spec_found.origin or '').parent}" if spec_found else None
            found = where or f"not importable by {sys.executable}"
        checks = [EnvCheck("SGLang", found, missing=not ok, fix=None if ok else fix)]
        if opts.python is not None:
            return checks
        return [*checks, cuda_device_check("run SGLang on a machine with a CUDA GPU (it has no CPU path)")]

    def launch_plan(self, spec: ServerSpec, port: int) -> LaunchPlan:
        opts = self._options(spec)
        argv = [
            opts.python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", opts.model_path,
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        if not spec.fairness.prefix_caching:
            argv.append("--disable-radix-cache")
        argv += ["--max-total-tokens", str(spec.fairness.kv_capacity_tokens), "--enable-metrics"]
        if opts.mode == "paged":
            argv += ["--enable-paged-experts", "--paged-experts-num-resident", str(opts.resident_experts)]
        if opts.mode == "offload":
            argv += ["--cpu-offload-gb", str(opts.cpu_offload_gb)]
        argv += _valued("--mem-fraction-static", opts.mem_fraction_static)
        argv += _valued("--quantization", opts.quantization)
        argv += _valued("--kv-cache-dtype", opts.kv_cache_dtype)
        for flag, size in (
            ("--tp-size", opts.tp_size),
            ("--ep-size", opts.ep_size),
            ("--pp-size", opts.pp_size),
            ("--dp-size", opts.dp_size),
        ):
            if size != 1:
                argv += [flag, str(size)]
        argv += _valued("--speculative-algorithm", opts.speculative_algorithm)
        argv += _valued("--speculative-draft-model-path", opts.speculative_draft_model_path)
        argv += _graph_args(opts)
        argv += _valued("--load-format", opts.load_format)
        argv += _valued("--moe-runner-backend", opts.moe_runner_backend)
        if opts.disable_shared_experts_fusion:
            argv.append("--disable-shared-experts-fusion")
        if opts.deterministic:
            argv.append("--enable-deterministic-inference")
        if opts.return_routed_experts:
            argv.append("--enable-return-routed-experts")
        argv += ["--max-running-requests", str(spec.max_concurrency)]
        argv += list(opts.extra_args)
        return LaunchPlan(
            argv=argv,
            env={"PYTHONUNBUFFERED": "1"},
            # /health answers 200 without generating unless an env var says so; /health_generate
            # runs one real token (entrypoints/http_server.py:721-796).
            health_path="/health_generate",
            startup_timeout_s=opts.startup_timeout_s,
        )

    def request_extras(self, spec: ServerSpec) -> dict[str, Any]:
        # CompletionRequest.return_routed_experts (entrypoints/openai/protocol.py:390); the ids come
        # back base64 in `sglext.routed_experts` (protocol.py:470-477, 536, 575): on the response, or
        # when streaming on a chunk with empty `choices` (serving_completions.py:428-476).
        return {"return_routed_experts": True} if self._options(spec).return_routed_experts else {}

    def version(self, spec: ServerSpec) -> dict[str, Any]:
        python = self._options(spec).python or sys.executable
        facts: dict[str, Any] = {
            "engine": "sglang",
            "python": python,
            "reference_version": sglang_constraints.SGLANG_REFERENCE_VERSION,
        }
        try:
            done = subprocess.run(
                [python, "-c", "import sglang; print(sglang.__version__)"],
                capture_output=True, text=True, timeout=VERSION_PROBE_TIMEOUT_S, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {**facts, "version": "not installed", "error": f"{type(exc).__name__}: {exc}"}
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return {**facts, "version": "not installed", "error": last}
        version = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "unknown"
        return {**facts, "version": version, "matches_reference": version == facts["reference_version"]}

    async def scrape(self, session: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
        return await scrape_prometheus(session, base_url, METRIC_PREFIX)

    def parse_log(self, log_text: str) -> dict[str, Any]:
        return sglang_logs.parse_log(log_text).as_dict()

    def batch_cap_flag(self, parsed_log: dict[str, Any], concurrency: int) -> str | None:
        return sglang_logs.batch_cap_flag(parsed_log, concurrency)

    def recorded_expert_format(self, options: Mapping[str, Any]) -> str | None:
        return str(options.get("quantization") or "checkpoint dtype")

    def recorded_label_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return {"cpu_offload_gb": options["cpu_offload_gb"]} if options.get("cpu_offload_gb") is not None else {}

    def cell_flags(self, spec: ServerSpec, log_text: str, cell: CellView) -> list[str]:
        """Runner hook: warnings for one cell from the server log (concurrency above the captured
        CUDA-graph batch cap; a KV pool that is not the matrix's fixed token capacity)."""
        parsed = sglang_logs.parse_log(log_text).as_dict()
        flags = [
            sglang_logs.batch_cap_flag(parsed, cell.concurrency),
            sglang_logs.kv_capacity_flag(parsed, spec.fairness.kv_capacity_tokens),
        ]
        return [f for f in flags if f]

    async def after_cells(
        self, session: aiohttp.ClientSession, spec: ServerSpec, base_url: str, run_dir: Path,
        requests: Callable[[], Sequence[LoadRequest]],
    ) -> dict[str, Any]:  # fmt: skip
        """Runner hook, on the live server after its cells: with return_routed_experts, send the
        cells' prompts once more (greedy, not streamed) and write their routing to
        <run_dir>/routing/<server-id>.trace; the manifest's server entry gets the path."""
        opts = self._options(spec)
        if not opts.return_routed_experts:
            return {}
        sent = requests()
        if not sent:
            return {}
        # imports torch (through paged_experts.routing.trace): only when capturing
        from benchsuite.engines.sglang import routing as sglang_routing

        prompts = [r.prompt if isinstance(r.prompt, str) else list(r.prompt) for r in sent]
        responses = await sglang_routing.capture_routing(
            session, base_url, spec.model_name, prompts, max(r.max_tokens for r in sent)
        )
        path = run_dir / "routing" / f"{spec.server_id}.trace"
        sglang_routing.write_routing_trace(path, responses, opts.model_path)
        return {"routing_trace": str(path.relative_to(run_dir)), "routing_requests": len(responses)}


def _valued(flag: str, value: object) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _graph_args(opts: SGLangOptions) -> list[str]:
    """CUDA-graph flags of 0.5.23: `--disable-cuda-graph` is deprecated there (server_args.py:408-414),
    so disabling writes both per-phase backends (fields/exec_.py:613-628)."""
    if opts.disable_cuda_graph:
        return ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    args = _valued("--cuda-graph-backend-decode", opts.cuda_graph_backend_decode)
    args += _valued("--cuda-graph-backend-prefill", opts.cuda_graph_backend_prefill)
    return args + _valued("--cuda-graph-max-bs-decode", opts.cuda_graph_max_bs)
