"""Server configuration and start-up: the `python -m paged_experts.server` flags (SGLang names where
they mean the same, llama.cpp's `--n-cpu-moe`), and `load_serving`, which builds the model, KV
pool, tokenizer, routing source, trace writer and engine from one resolved `ServeConfig`.

Routing sources (`paged_experts.routing`) and the trace writer (`paged_experts.trace`) are
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
from paged_experts.kernels.fused import EXPERT_BACKENDS, set_expert_backend
from paged_experts.residency import DEFAULT_EVICTION_POLICY, DEFAULT_PREFILL_KEEP, EVICTION_POLICIES, PREFILL_KEEP
from paged_experts.runtime import MODES, RuntimeConfig
from paged_experts.server.connections import BODY_TIMEOUT_S, HEADER_TIMEOUT_S
from paged_experts.server.engine import Engine, EngineConfig
from paged_experts.server.metrics import ServerMetrics
from paged_experts.server.text import TextCodec

KV_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class ServeConfig:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    mode: str = "resident"
    resident_experts: int | None = None
    offload_layers: int | None = None  # None: every MoE layer
    n_cpu_moe: int | None = None
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's dtype on CUDA
    max_running_requests: int = 16
    max_total_tokens: int = 16384
    chunked_prefill_size: int = 2048
    served_model_name: str | None = None
    routing_source: str | None = None
    routing_seed: int = 0
    record_routing: str | None = None
    cuda_graph_max_bs: int = 0  # 0: no CUDA graphs; N: capture decode batches 1..N (CUDA; paged: B x top_k <= K)
    enable_torch_compile: bool = False  # torch.compile the per-layer blocks of the captured decode step
    kernel_backend: str = "grouped"  # or "triton": fused.set_expert_backend (routing, experts, decode attention)
    prefetch_next_layer: bool = False  # captured paged decode steps page in the next layer's predicted experts ahead
    prefill_residency: str | None = None  # paged: what a prefill chunk leaves in the slots (None: residency default)
    eviction_policy: str | None = None  # paged: which resident expert a miss evicts (None: residency default, LRU)
    expert_kernel: str = "fused"
    overlap_schedule: bool = True  # launch a greedy decode step before reading the previous one's tokens
    cpu_threads: int | None = None  # torch's intra-op threads; None: default_cpu_threads()
    max_connections: int | None = None  # None: from the open-file limit (connections.default_max_connections)
    header_timeout: float = HEADER_TIMEOUT_S  # seconds to receive a request's header
    body_timeout: float = BODY_TIMEOUT_S  # seconds to receive a request's body once its header is in
    log_level: str = "info"

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name

    @property
    def routing_label(self) -> str:
        return "model" if self.routing_source is None else f"synthetic:{self.routing_source}"

    def runtime_config(self, model: MoeModelConfig) -> RuntimeConfig:
        dtype = self.dtype or ("float32" if self.device == "cpu" else model.torch_dtype)
        runtime = RuntimeConfig(
            mode=self.mode,  # type: ignore[arg-type]
            resident_experts=self.resident_experts,
            offload_layers=self.offload_layers,
            cpu_expert_layers=self.n_cpu_moe,
            device=self.device,
            dtype=dtype,
            prefetch_next_layer=self.prefetch_next_layer,
            prefill_residency=self.prefill_residency or DEFAULT_PREFILL_KEEP,
            eviction_policy=self.eviction_policy or DEFAULT_EVICTION_POLICY,
        )
        runtime.validate_for(model)
        return runtime


# Longer than ~80 lines on purpose: one flat declaration per flag, in the order `--help` prints them, each
# with its help text. Split into helpers, the list would read the same but a reader would hop between
# functions to see the order and the defaults; the checks that relate flags live in parse_args.
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m paged_experts.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", "--model", dest="model_path", required=True, help="HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--mode", choices=MODES, help="default: implied by the K / layer flag given, else resident")
    p.add_argument("--paged-experts-num-resident", "--resident-experts", dest="resident_experts", type=int,
                   help="K expert slots per layer (mode paged)")  # fmt: skip
    p.add_argument(
        "--offload-layers", type=int, help="offloaded MoE layers, counted from the first (mode offload; default all)"
    )
    p.add_argument(
        "--n-cpu-moe", type=int, help="MoE layers whose experts run on the CPU, the first N (mode cpu-experts)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="default: float32 on CPU, checkpoint dtype on CUDA"
    )
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV capacity in tokens")
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="prompt tokens per engine step")
    p.add_argument("--served-model-name")
    p.add_argument("--routing-source", help="replace the router with a synthetic routing source (labelled synthetic)")
    p.add_argument("--routing-seed", type=int, default=0)
    p.add_argument("--record-routing", metavar="PATH", help="write a routing trace to PATH")
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=0,
        help="capture decode steps of batch 1..N as CUDA graphs (CUDA; resident, or paged for N x top_k <= K; 0 = off)",
    )
    p.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="torch.compile the per-layer blocks of the captured decode step (needs --cuda-graph-max-bs)",
    )
    p.add_argument(
        "--disable-torch-compile",
        dest="enable_torch_compile",
        action="store_false",
        help="the default: no torch.compile (written out by benchsuite so the command names what is in force)",
    )
    p.add_argument(
        "--kernel-backend",
        choices=EXPERT_BACKENDS,
        default="grouped",
        help="grouped: torch's grouped GEMM for the fused expert pass; triton: routing, the expert pass "
        "and (in captured steps) attention of decode steps as Triton kernels (CUDA; steps of up to "
        "32 routed pairs, larger ones keep grouped)",
    )
    p.add_argument(
        "--prefetch-next-layer",
        action="store_true",
        help="in captured paged decode steps, apply each layer's router to the previous layer's residual "
        "stream and page the predicted experts in on a second stream while that layer computes "
        "(mode paged, --device cuda, needs --cuda-graph-max-bs; counted as experts_prefetched_total)",
    )
    p.add_argument(
        "--prefill-residency",
        choices=PREFILL_KEEP,
        help=f"mode paged: what a prefill chunk (a step routing to more than K experts) leaves in the "
        f"slots: recent = the experts of the chunk's last tokens, frequent = its most-routed ones, "
        f"lru = the last waves' misses (default {DEFAULT_PREFILL_KEEP}; see docs/prefill.md)",
    )
    p.add_argument(
        "--eviction-policy",
        choices=EVICTION_POLICIES,
        help=f"mode paged: which resident expert a miss evicts: lru = the least recently used, lfu-decay = "
        f"the least used with counts halving every 2 steps (host planner only: refused with --device cuda; "
        f"default {DEFAULT_EVICTION_POLICY}; see docs/eviction-policy.md)",
    )
    p.add_argument(
        "--expert-kernel",
        choices=("fused", "loop"),
        default="fused",
        help="grouped matmuls over the slot table (fused) or the per-expert reference loop",
    )
    p.add_argument(
        "--disable-overlap-schedule",
        dest="overlap_schedule",
        action="store_false",
        help="read every step's tokens before launching the next (default: a greedy decode step of a "
        "captured batch is launched first, its input tokens taken from the device; SGLang's flag)",
    )
    p.add_argument(
        "--enable-overlap-schedule",
        dest="overlap_schedule",
        action="store_true",
        help="the default (written out by benchsuite so the command names what is in force)",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        help="torch's intra-op threads for CPU work (the CPU device, cpu-experts layers); default: the "
        "cores minus one, which the event loop and the engine thread need",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        help="open connections at most; at the cap a new one replaces the oldest that holds no request "
        "(default: the open-file limit minus 384 descriptors the process and accept bursts need)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_S,
        help=f"seconds from connect (or a request's first byte) to the end of its header "
        f"(default {HEADER_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        help=f"seconds from the end of a header to the end of its body (default {BODY_TIMEOUT_S:g})",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def parse_args(argv: Sequence[str]) -> ServeConfig:
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    for name in ("max_running_requests", "max_total_tokens", "chunked_prefill_size"):
        if getattr(ns, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if ns.cpu_threads is not None and ns.cpu_threads < 1:
        parser.error("--cpu-threads must be >= 1")
    if ns.max_connections is not None and ns.max_connections < 1:
        parser.error("--max-connections must be >= 1")
    for name in ("header_timeout", "body_timeout"):
        if not 0 < getattr(ns, name) < math.inf:
            parser.error(f"--{name.replace('_', '-')} must be a positive number of seconds")
    if ns.cuda_graph_max_bs < 0:
        parser.error("--cuda-graph-max-bs must be >= 0")
    if ns.enable_torch_compile and not ns.cuda_graph_max_bs:
        parser.error("--enable-torch-compile compiles the captured decode step: it needs --cuda-graph-max-bs N")
    if ns.prefetch_next_layer and not ns.cuda_graph_max_bs:
        parser.error("--prefetch-next-layer runs inside the captured decode step: it needs --cuda-graph-max-bs N")
    if ns.kernel_backend == "triton" and ns.device != "cuda":
        parser.error("--kernel-backend triton runs Triton GPU kernels: it needs --device cuda")
    if not 0 <= ns.port < 65536:
        parser.error("--port must be in [0, 65535]")
    if ns.mode is None:
        implied = [m for m, v in (("paged", ns.resident_experts), ("offload", ns.offload_layers),
                                  ("cpu-experts", ns.n_cpu_moe)) if v is not None]  # fmt: skip
        ns.mode = implied[0] if len(implied) == 1 else "resident"
    if ns.prefill_residency is not None and ns.mode != "paged":
        parser.error(f"--prefill-residency applies to mode paged, not {ns.mode}")
    if ns.eviction_policy is not None and ns.mode != "paged":
        parser.error(f"--eviction-policy applies to mode paged, not {ns.mode}")
    config = ServeConfig(**vars(ns))
    try:
        # mode / K / layer flags are checked now; checks against the model's shape come at load
        RuntimeConfig(
            mode=config.mode,  # type: ignore[arg-type]
            resident_experts=config.resident_experts,
            offload_layers=config.offload_layers,
            cpu_expert_layers=config.n_cpu_moe,
            device=config.device,
            dtype=config.dtype or "float32",
            prefetch_next_layer=config.prefetch_next_layer,
            prefill_residency=config.prefill_residency or DEFAULT_PREFILL_KEEP,
            eviction_policy=config.eviction_policy or DEFAULT_EVICTION_POLICY,
        )
    except ValueError as exc:
        parser.error(_flag_names(str(exc)))
    if config.routing_source is not None:
        from paged_experts.routing import parse_spec

        try:
            parse_spec(config.routing_source)
        except ValueError as exc:
            parser.error(f"--routing-source: {exc}")
    return config


def _flag_names(message: str) -> str:
    """RuntimeConfig speaks in field names; the user typed flags."""
    for field_name, flag in (
        ("resident_experts", "--paged-experts-num-resident"),
        ("offload_layers", "--offload-layers"),
        ("cpu_expert_layers", "--n-cpu-moe"),
        ("mode=", "--mode "),
        ("prefetch_next_layer", "--prefetch-next-layer"),
        ("eviction_policy=", "--eviction-policy "),
    ):
        message = message.replace(field_name, flag)
    return message


@dataclass
class Serving:
    """Everything a loaded server holds; built once by `load_serving`."""

    config: ServeConfig
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
            "kernels": kernel_choice(host.is_fp8, self.runtime.device, self.runtime.dtype),
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


def load_serving(config: ServeConfig, metrics: ServerMetrics) -> Serving:
    """Loads the checkpoint and builds the engine (slow: call it off the event loop)."""
    from paged_experts.kv import KvPool
    from paged_experts.model import MoeCausalLM, SeqChunk

    t0 = time.perf_counter()
    model_config = MoeModelConfig.from_dir(config.model_path)
    runtime = config.runtime_config(model_config)
    set_expert_backend(config.kernel_backend)  # process-wide, before any step (and before graph capture)
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
        from paged_experts.routing import make_router

        router = make_router(config.routing_source, model_config, config.routing_seed)
        model.router_override = router
        # the router keeps per-sequence routing state; drop it when the sequence's KV is freed
        free_hooks.append(lambda seq: router.forget(seq.seq_id))
    if config.record_routing is not None:
        from paged_experts.trace import TraceWriter

        Path(config.record_routing).parent.mkdir(parents=True, exist_ok=True)
        writer = TraceWriter(config.record_routing, model_config, source=config.routing_label, model=config.model_name)
        model.routing_observers.append(lambda layer, ids, weights, ctx: writer.observe(layer, ids, weights))
        step_hooks.append(writer.begin_step)
        closers.append(writer.close)
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
