"""Will llama-server with `--n-cpu-moe N` fit the GPU? Memory projections without a launch.

Two sources, one `Projection` type:
- ours (`project`), from the GGUF's tensor sizes: with `-ngl` covering every layer, the routed
  expert tensors `blk.<i>.ffn_{gate,up,down,gate_up}_exps` of the first N layers and the token
  embedding stay on the host, every other tensor goes to the GPU; plus the KV cache of the GPU
  layers and an estimate of the GPU compute buffer. Used on CPU-only builds (where llama.cpp has
  no GPU to project for). Checked against llama.cpp on an H200 (8-layer qwen3-30b-a3b-shape,
  bf16, -c 10240, flash attention): model and KV bytes equal llama-fit-params' to the MiB for
  every N; the compute buffer is underestimated by ~32 MiB (62 vs 94 MiB at N = 0, 446 vs 454
  MiB for N >= 1), well inside llama.cpp's 1024 MiB margin.
- llama.cpp's (`parse_fit_print`), from `llama-fit-params ... --fit-print on`, which prints one
  line per device plus `Host`: `<device> <model MiB> <context MiB> <compute MiB>`.

A value fits when `gpu_total_bytes + margin_bytes <= budget_bytes`; llama.cpp's own fitting keeps
a 1024 MiB margin per device (DEFAULT_MARGIN_MIB).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_experts.shape import ModelShape

MIB = 2**20
GIB = 2**30
DEFAULT_MARGIN_MIB = 1024
DEFAULT_BATCH_TOKENS = 2048  # llama.cpp's defaults for -b and -ub (common/common.h)
DEFAULT_UBATCH_TOKENS = 512
KV_CELL_PAD_TOKENS = 256  # llama.cpp sizes the KV cache in multiples of 256 cells
KV_ELEMENT_BYTES = 2  # default K/V cache type f16
F32_BYTES = 4
_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_(ch)?exps\.")
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")
_FIT_LINE = re.compile(r"^\s*(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$")


@dataclass(frozen=True)
class GgufFacts:
    """What a projection needs from a GGUF: shapes from its metadata, bytes per tensor (llama.cpp's
    names; `shape()` gives the suite's ModelShape)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    tensor_bytes: tuple[tuple[str, int], ...]  # (gguf name, bytes)

    def shape(self, name: str = "") -> ModelShape:
        """The model's shape (paged_experts.shape) as the GGUF gives it; MoE layers are those that
        hold routed expert tensors."""
        moe_layers = {int(m.group(1)) for t, _ in self.tensor_bytes if (m := _EXPERT_TENSOR.match(t))}
        return ModelShape(
            num_layers=self.n_layer, num_moe_layers=len(moe_layers), num_experts=self.n_expert,
            top_k=self.n_expert_used, hidden_size=self.n_embd, moe_intermediate_size=self.n_ff_exp,
            num_kv_heads=self.n_head_kv, head_dim=self.head_dim_k, num_attention_heads=self.n_head,
            vocab_size=self.n_vocab, name=name,
        )  # fmt: skip


@dataclass(frozen=True)
class Projection:
    """Projected device memory for one configuration. Bytes; the GPU side is what must fit."""

    n_cpu_moe: int
    gpu_model_bytes: int
    gpu_context_bytes: int  # KV cache (+ llama.cpp's output buffer when it reports it)
    gpu_compute_bytes: int
    host_model_bytes: int
    source: str  # "benchsuite" or "llama-fit-params"

    @property
    def gpu_total_bytes(self) -> int:
        return self.gpu_model_bytes + self.gpu_context_bytes + self.gpu_compute_bytes

    def fits(self, budget_bytes: int, margin_bytes: int) -> bool:
        return self.gpu_total_bytes + margin_bytes <= budget_bytes


@dataclass(frozen=True)
class DeviceMemory:
    device: str  # e.g. CUDA0, or Host
    model_mib: int
    context_mib: int
    compute_mib: int


def read_model_facts(path: str | Path) -> GgufFacts:
    import gguf

    reader = gguf.GGUFReader(Path(path))
    arch = _field(reader, "general.architecture")

    def key(name: str, default: int | None = None) -> int:
        value = _field(reader, f"{arch}.{name}")
        if value is None:
            if default is None:
                raise ValueError(f"{path}: GGUF lacks {arch}.{name}")
            return default
        return int(value)

    n_embd, n_head = key("embedding_length"), key("attention.head_count")
    head_dim = n_embd // n_head
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return GgufFacts(
        n_layer=key("block_count"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=key("attention.head_count_kv", n_head),
        head_dim_k=key("attention.key_length", head_dim),
        head_dim_v=key("attention.value_length", head_dim),
        n_vocab=len(tokens.data) if tokens is not None else key("vocab_size"),
        n_expert=key("expert_count", 0),
        n_expert_used=key("expert_used_count", 0),
        n_ff_exp=key("expert_feed_forward_length", 0),
        tensor_bytes=tuple((t.name, int(t.n_bytes)) for t in reader.tensors),
    )


def _field(reader: Any, name: str) -> Any:  # a GGUF field's contents: an int, a string, a list
    f = reader.fields.get(name)
    if f is None:
        return None
    value = f.contents()
    return value


def kv_cells(n_ctx_tokens: int) -> int:
    return -(-n_ctx_tokens // KV_CELL_PAD_TOKENS) * KV_CELL_PAD_TOKENS


def kv_bytes_per_layer(facts: GgufFacts, n_ctx_tokens: int) -> int:
    """cells x kv_heads x (k_dim + v_dim) x 2 bytes (f16 K and V)."""
    per_cell = facts.n_head_kv * (facts.head_dim_k + facts.head_dim_v) * KV_ELEMENT_BYTES
    return kv_cells(n_ctx_tokens) * per_cell


def compute_buffer_bytes(
    facts: GgufFacts,
    n_ctx_tokens: int,
    flash_attn: bool,
    n_ubatch: int = DEFAULT_UBATCH_TOKENS,
    n_kv_streams: int = 1,
) -> int:
    """Estimate of the compute buffer: the graph of one micro-batch of T = min(ubatch, ctx) tokens.

    Each attention spans n_kv = cells / n_kv_streams (1 stream with --kv-unified, as the server
    runs; -np streams without it, as llama-fit-params projects). Terms, bytes:
    f32 activations 4 x T x (4 H + 3 top_k I); the KQ mask T x n_kv (f16 with flash attention,
    f32 without); without flash attention also the f32 scores heads x T x n_kv.
    Calibrated on the CPU build against llama-fit-params (tests/test_llamacpp_integration.py).
    """
    t = min(n_ubatch, n_ctx_tokens)
    n_kv = kv_cells(n_ctx_tokens) // max(1, n_kv_streams)
    act = F32_BYTES * t * (4 * facts.n_embd + 3 * facts.n_expert_used * facts.n_ff_exp)
    if flash_attn:
        return act + 2 * t * n_kv
    return act + F32_BYTES * t * n_kv * (1 + facts.n_head)


def project(
    facts: GgufFacts,
    n_cpu_moe: int,
    n_ctx_tokens: int,
    *,
    flash_attn: bool = False,
    n_gpu_layers: int = 999,
    n_ubatch: int = DEFAULT_UBATCH_TOKENS,
    n_kv_streams: int = 1,
) -> Projection:
    """Our projection of `-ngl n_gpu_layers --n-cpu-moe n_cpu_moe -c n_ctx_tokens`."""
    first_gpu_layer = max(0, facts.n_layer - n_gpu_layers)
    output_on_gpu = n_gpu_layers > facts.n_layer
    gpu = host = largest_host_expert = 0
    for name, nbytes in facts.tensor_bytes:
        layer_match = _LAYER_TENSOR.match(name)
        if layer_match is None:
            on_gpu = output_on_gpu and not name.startswith("token_embd.")
        else:
            layer = int(layer_match.group(1))
            host_expert = bool(_EXPERT_TENSOR.match(name)) and layer < n_cpu_moe
            on_gpu = layer >= first_gpu_layer and not host_expert
            if host_expert and layer >= first_gpu_layer:
                largest_host_expert = max(largest_host_expert, nbytes)
        if on_gpu:
            gpu += nbytes
        else:
            host += nbytes
    gpu_layers = facts.n_layer - first_gpu_layer
    any_gpu = gpu_layers > 0
    return Projection(
        n_cpu_moe=n_cpu_moe,
        gpu_model_bytes=gpu,
        gpu_context_bytes=gpu_layers * kv_bytes_per_layer(facts, n_ctx_tokens),
        # With experts on the host, a large micro-batch copies a whole stacked expert tensor to the
        # GPU for the matmul: llama.cpp's compute buffer grows by about one such tensor (H200:
        # 94 -> 454 MiB for 384 MiB tensors once N >= 1).
        gpu_compute_bytes=(
            compute_buffer_bytes(facts, n_ctx_tokens, flash_attn, n_ubatch, n_kv_streams) + largest_host_expert
            if any_gpu
            else 0
        ),
        host_model_bytes=host,
        source="benchsuite",
    )


def parse_fit_print(text: str) -> list[DeviceMemory]:
    """Lines `<device> <model> <context> <compute>` (MiB) from `llama-fit-params --fit-print on`."""
    rows = []
    for line in text.splitlines():
        m = _FIT_LINE.match(line)
        if m:
            rows.append(DeviceMemory(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))))
    return rows


def projection_from_fit_print(text: str, n_cpu_moe: int, device: str | None = None) -> Projection:
    """llama.cpp's projection for one GPU (the first non-Host device unless named)."""
    rows = parse_fit_print(text)
    host = next((r for r in rows if r.device == "Host"), None)
    gpus = [r for r in rows if r.device != "Host" and (device is None or r.device == device)]
    if not gpus:
        raise ValueError("llama-fit-params printed no GPU device line (is this a CPU-only build?)")
    g = gpus[0]
    return Projection(
        n_cpu_moe=n_cpu_moe,
        gpu_model_bytes=g.model_mib * MIB,
        gpu_context_bytes=g.context_mib * MIB,
        gpu_compute_bytes=g.compute_mib * MIB,
        host_model_bytes=(host.model_mib * MIB) if host else 0,
        source="llama-fit-params",
    )


def fit_params_argv(
    binary: Path,
    model: Path,
    n_cpu_moe: int,
    n_ctx_tokens: int,
    n_parallel: int,
    flash_attn: bool,
    n_gpu_layers: int,
    *,
    batch_size: int = DEFAULT_BATCH_TOKENS,
    ubatch_size: int = DEFAULT_UBATCH_TOKENS,
) -> list[str]:
    """The llama-fit-params command that prints llama.cpp's projection for one N, with every flag
    of the server's command line that sizes a GPU buffer (-fa and -ub the compute buffer).

    llama-fit-params takes no --kv-unified (a server flag): its context is the same -c cells,
    its compute buffer is projected for -np separate KV streams (see compute_buffer_bytes).
    """
    return [
        str(binary), "-m", str(model), "-ngl", str(n_gpu_layers), "--n-cpu-moe", str(n_cpu_moe),
        "-c", str(n_ctx_tokens), "-np", str(n_parallel),
        "-fa", "on" if flash_attn else "off", "-b", str(batch_size), "-ub", str(ubatch_size),
        "--fit-print", "on",
    ]  # fmt: skip
