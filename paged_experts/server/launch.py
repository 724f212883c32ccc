"""Server start-up: the `python -m paged_experts.server` command line (declared in `options`: SGLang
names where they mean the same, llama.cpp's `--n-cpu-moe`), and `load_serving`, which builds the
model, KV pool, tokenizer, routing source, trace writer and engine from one `ServeOptions`.

Routing sources (`paged_experts.routing.sources`) and the trace writer (`paged_experts.routing.trace`) are
imported only when asked for, so the server runs without them.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from paged_experts.config import MoeModelConfig
from paged_experts.residency.planner import DEFAULT_PREFILL_KEEP
from paged_experts.residency.policies import DEFAULT_EVICTION_POLICY
from paged_experts.runtime import RuntimeConfig
from paged_experts.server import options
from paged_experts.server.engine import Engine, EngineConfig
from paged_experts.server.metrics import ServerMetrics
from paged_experts.server.options import ServeOptions
from paged_experts.server.text import TextCodec

KV_BLOCK_TOKENS = 16


def runtime_config(serve: ServeOptions, model: MoeModelConfig) -> RuntimeConfig:
    """The runtime's configuration for `model` (checks the choices that depend on its shape)."""
    dtype = serve.dtype or ("float32" if serve.device == "cpu" else model.torch_dtype)
    runtime = RuntimeConfig(
        mode=serve.mode,  # type: ignore[arg-type]  # a str the parser checked against MODES, not the Literal
        resident_experts=serve.resident_experts,
        offload_layers=serve.offload_layers,
        cpu_expert_layers=serve.n_cpu_moe,
        device=serve.device,
        dtype=dtype,
        prefetch_next_layer=serve.prefetch_next_layer,
        overlap_page_in=serve.overlap_page_in,
        overlap_groups=serve.overlap_groups,
        overlap_copies=serve.overlap_copies,  # type: ignore[arg-type]  # a str the parser checked against its choices
        copy_programs=serve.copy_programs,
        fused_page_in=serve.fused_page_in,
        page_in=serve.page_in,  # type: ignore[arg-type]  # a str the parser checked against PAGE_IN_CHOICES
        prefill_staging_rows=serve.prefill_staging_rows,
        expert_rows=serve.expert_rows,  # type: ignore[arg-type]  # a str the parser checked against its choices
        prefill_residency=serve.prefill_residency or DEFAULT_PREFILL_KEEP,
        eviction_policy=serve.eviction_policy or DEFAULT_EVICTION_POLICY,
        kernel_backend=serve.kernel_backend,
        dequantize_attention=serve.dequantize_attention,
    )
    runtime.validate_for(model)
    return runtime


def parse_args(argv: Sequence[str]) -> ServeOptions:
    """The server's command line (options.ServeOptions declares it), checked; exits 2 naming the flag."""
    return options.parse_args(argv, description=__doc__.split("\n\n")[0])


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(description=__doc__.split("\n\n")[0])


@dataclass
class Serving:
    """Everything a loaded server holds; built once by `load_serving`."""

    config: ServeOptions
    model: Any  # paged_experts.model.MoeCausalLM
    runtime: RuntimeConfig
    codec: TextCodec
    engine: Engine
    closers: list[Callable[[], object]] = field(default_factory=list)
    startup_s: dict[str, float] = field(default_factory=dict)  # load, capture, eager warm-up, ready (seconds)

    def info(self) -> dict[str, Any]:
        """`GET /server_info`: resolved configs, versions and the routing label."""
        return {
            "served_model_name": self.config.model_name,
            "model_path": str(Path(self.config.model_path).resolve()),
            "server": asdict(self.config),
            "runtime": asdict(self.runtime),
            "model": asdict(self.model.config),
            "layer_placements": list(self.model.layer_placements()),
            "experts": self._expert_facts(),
            "kv": {"capacity_tokens": self.engine.kv_capacity_tokens, "block_size": self.engine.pool.block_size},
            "engine": asdict(self.engine.config),
            "routing": self.config.routing_label,
            "routing_synthetic": self.config.routing_source is not None,
            "startup_s": self.startup_s,
            "cpu_threads": torch.get_num_threads(),
            "captured_graphs": self.model.captured_graphs,
            "step_timing": self.engine.step_timing(),
            "versions": versions(),
        }

    def _expert_facts(self) -> dict[str, Any]:
        """How experts are stored and computed: dtype, bytes per expert (block scales included), kernels."""
        from paged_experts.kernels.fused import kernel_choice

        host = self.model.moe_layers[0].host
        return {
            "dtype": str(host.gate.dtype).removeprefix("torch."),
            "bytes_per_expert": host.row_bytes,
            "expert_rows": "split" if host.packed is None else "packed",
            "row_pitch_bytes": host.row_pitch,  # a packed row's bytes, alignment padding included (0: split)
            "kernels": kernel_choice(host.is_fp8, self.runtime.device, self.runtime.dtype, self.runtime.kernel_backend),
        }


def versions() -> dict[str, str | None]:
    def dist(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"benchsuite": dist("benchsuite"), "torch": torch.__version__, "python": sys.version.split()[0]}


def kv_block_tokens(capacity_tokens: int) -> int:
    """The pool's block size: 16 tokens, or a divisor of the capacity so it is honoured exactly."""
    return math.gcd(KV_BLOCK_TOKENS, capacity_tokens)


def load_serving(config: ServeOptions, metrics: ServerMetrics) -> Serving:
    """Loads the checkpoint and builds the engine (slow: call it off the event loop)."""
    from paged_experts.kv import KvPool
    from paged_experts.model import MoeCausalLM, SeqChunk

    t0 = time.perf_counter()
    model_config = MoeModelConfig.from_dir(config.model_path)
    runtime = runtime_config(config, model_config)
    model = MoeCausalLM.from_pretrained(config.model_path, runtime, expert_kernel=config.expert_kernel)
    if config.cuda_graph_max_bs:
        if runtime.device != "cuda" or not model.graphable():
            raise ValueError(
                "--cuda-graph-max-bs needs --device cuda and --mode resident or paged (paged: planned on the device)"
            )
        model.enable_cuda_graphs(range(1, config.cuda_graph_max_bs + 1), compile_layers=config.enable_torch_compile)
    pool = KvPool.for_model(model, config.max_total_tokens, block_size=kv_block_tokens(config.max_total_tokens))
    load_s = time.perf_counter() - t0
    extra_eos = [model_config.eos_token_id] if model_config.eos_token_id is not None else []
    codec = TextCodec.from_dir(config.model_path, extra_eos_ids=extra_eos)
    closers: list[Callable[[], object]] = []
    step_hooks: list[Callable[[list[tuple[str, int]]], None]] = []
    free_hooks: list[Callable[[Any], None]] = []
    if config.routing_source is not None:
        from paged_experts.routing.sources import make_router

        router = make_router(config.routing_source, model_config, config.routing_seed)
        model.router_override = router
        # the router keeps per-sequence routing state; drop it when the sequence's KV is freed
        free_hooks.append(lambda seq: router.forget(seq.seq_id))
    if config.record_routing is not None:
        from paged_experts.routing.record import RoutingRecorder

        Path(config.record_routing).parent.mkdir(parents=True, exist_ok=True)
        # staged to pinned host memory without waiting for the device; graphed decode steps record too
        recorder = RoutingRecorder(config.record_routing, model_config, config.routing_label, config.model_name)
        model.routing_observers.append(recorder)
        step_hooks.append(recorder.begin_step)
        closers.append(recorder.close)
    # Ready means ready: every decode graph and compiled kernel a served step could need exists
    # before /health answers 200 (the synthetic router is set: its graphs take its ids as input).
    startup = {
        "load_s": load_s,
        **(model.prepare_decode(pool, config.max_running_requests) if runtime.device == "cuda" else {}),
    }
    startup["ready_s"] = time.perf_counter() - t0
    engine_config = EngineConfig(
        max_running_requests=config.max_running_requests,
        chunked_prefill_tokens=config.chunked_prefill_size,
        max_context_tokens=model_config.max_position_embeddings,
        eos_token_ids=codec.eos_token_ids,
        overlap_schedule=config.overlap_schedule,
    )
    engine = Engine(
        model,
        pool,
        lambda seq, ids, pos, all_logits: SeqChunk(seq, ids, pos, all_logits),
        engine_config,
        on_finish=metrics.on_finish,
        step_hooks=step_hooks,
        free_hooks=free_hooks,
    )
    return Serving(config, model, runtime, codec, engine, closers, startup)
