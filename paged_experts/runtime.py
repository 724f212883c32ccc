"""`RuntimeConfig`: how a model is placed and run (mode, K, offloaded / CPU layers, device, dtype,
paging options, kernel backend).

Owns validation of those choices against a model's shape, with errors that say what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from paged_experts.config import TORCH_DTYPES, MoeModelConfig
from paged_experts.kernels import moe_triton
from paged_experts.kernels.fused import check_expert_backend
from paged_experts.residency.dma_proxy import MAX_PAIRS as DMA_MAX_PAIRS
from paged_experts.residency.page_in import EXPERT_ROWS, PAGE_IN_CHOICES, ExpertRows, PageIn, resolve_expert_rows
from paged_experts.residency.planner import DEFAULT_PREFILL_KEEP, MAX_STAGING_ROWS, PREFILL_KEEP
from paged_experts.residency.policies import (
    DEFAULT_EVICTION_POLICY,
    DEVICE_POLICIES,
    eviction_policy_error,
    policy_base,
)

Mode = Literal["resident", "paged", "offload", "cpu-experts"]
MODES: tuple[str, ...] = ("resident", "paged", "offload", "cpu-experts")
DEVICES: tuple[str, ...] = ("cpu", "cuda")


@dataclass(frozen=True)
class RuntimeConfig:
    """`resident_experts` is K (paged mode only); `offload_layers` None means every MoE layer is
    offloaded; `cpu_expert_layers` counts the FIRST N layers (llama.cpp `--n-cpu-moe N`)."""

    mode: Mode = "resident"
    resident_experts: int | None = None
    offload_layers: int | None = None
    cpu_expert_layers: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    # How host-planned page-ins (prefill waves, steps above one wave, offload) copy host rows to the device
    # (residency/store.py): 'auto' = 'direct' (a DMA per tensor and run) on CUDA, 'index' on the CPU;
    # 'kernel' = one Triton copy launch per group of rows (CUDA; measured by configs/h200/kernelcopy.yaml);
    # 'batch' = every tensor's runs of rows in one cuMemcpyBatchAsync call (CUDA driver 12.8+; memmoves on the CPU;
    # to be measured by configs/h200/batchcopy.yaml).
    page_in: PageIn = "auto"
    # How the host store of paged and offloaded layers and their device rows lay an expert out
    # (residency/store.py ExpertTensors): 'split', a tensor each (an FP8 expert's page-in: three weight DMAs and
    # its scale rows); 'packed', one byte row an expert (one DMA a run of experts with page_in direct or batch; the
    # kernels read each tensor at its stride: the same bits). Resident layers' device rows stay split (an in-memory
    # synthetic model packs every layer's host store; a checkpoint's loader only the paged and offloaded layers').
    # 'auto' (`rows_layout`) = packed for mode paged on CUDA, where it was measured to win (2,048-token TTFT -11 to
    # -13% on both routings, decode no lower: configs/h200/packed.yaml, benchmarks/results/h200/2026-12-06-h100-packed
    # and 2026-12-06-h100-packed-cd), split elsewhere: on the CPU the two layouts tie since c531e61 (before it packed
    # rows slowed offload's copies: benchmarks/results/cpu/README.md), so packing wins nothing there, and offload on
    # CUDA is not measured packed.
    expert_rows: ExpertRows = "auto"
    # Paged one-wave steps planned and paged in on the device (no host sync, CUDA-graph capturable):
    # 'auto' = on for CUDA, off on the CPU (where the host planner is the cheaper path).
    device_planning: Literal["auto", "on", "off"] = "auto"
    # Device-planned paged steps: compute the hits while the misses copy (on a second CUDA stream),
    # then each group of misses as soon as its copy landed (moe/overlap.py). Off by default until
    # measured (configs/h200/overlap.yaml; benchmarks/decode_h200.py '+overlap' modes).
    overlap_page_in: bool = False
    # With overlap_page_in: the groups a step's misses are dealt into (miss i in group i mod G), each
    # copied, then computed, on its own. 1: the hits, then all the misses.
    overlap_groups: int = 1
    # With overlap_page_in: what runs the misses' copies. 'kernel': the Triton copy kernel on the page-in stream
    # (SM reads of pinned rows: on an H100 ~34 GB/s split, ~50 packed, copy_overlap.py); 'dma': the copy engine, at
    # the link's rate, issued by a host thread the step rings from inside the graph (residency/dma_proxy.py;
    # CUDA, a C compiler to build the thread once): measured on an H100, it lost (h100-dmaproxy, 2026-12-06).
    # 'switch': the copy engines too, started from inside the captured step with no host: SWITCH conditional
    # nodes with memcpy bodies (moe/overlap.py SwitchCopies, residency/switch_lanes.py; docs/decode-copies.md),
    # eager steps by the copy kernel. Measured on an H100: 0.89-0.97x the copy kernel's rate, hiding almost none
    # of the compute (h100-switch, 2026-12-06), so off.
    overlap_copies: Literal["kernel", "dma", "switch"] = "kernel"
    # Device-planned page-ins: the copy kernel's grid cap (kernels/copy_kernel.py). None: one program per
    # 16 KiB chunk, which fills every SM; N: N programs loop over the chunks, leaving the other SMs to the
    # kernels an overlapped pass runs beside the copy. Unset until measured on the H200.
    copy_programs: int | None = None
    # Device-planned paged steps of ONE token on the triton backend: the expert kernels page the misses in
    # themselves (a missed pair's programs read its row from the pinned host store and write it through
    # to its slot) while the hits' programs compute, in one launch per projection: no copy kernel before
    # the compute (moe/paged.py `_fused_page_in`). Larger steps copy, then compute. Off: slower on the H200
    # at c=1 on both routings (h200-fused, configs/h200/README.md: its small host reads per program run the
    # two kernels at the pace of the link's round trips, slower than the copy kernel they replace).
    fused_page_in: bool = False
    # Graphed decode steps of paged layers: while layer i computes, layer i+1's router is applied to
    # layer i's hidden state and the predicted experts are paged in on a second stream; layer i+1
    # then pages in only what the prediction missed (see graphs.GraphedDecoder). Off by default until
    # measured (benchmarks/decode_h200.py '+prefetch' modes).
    prefetch_next_layer: bool = False
    # What a paged step larger than K (a prefill chunk) leaves in the slots: residency.planner.PREFILL_KEEP
    # ('recent' keeps the experts of the chunk's last tokens, the next decode tokens' best guess).
    prefill_residency: str = DEFAULT_PREFILL_KEEP
    # Paged: R device rows, shared by all layers, that take a prefill layer-step's first page-ins while the
    # layer before it computes (moe/staging.py; residency.planner says which experts). 0: none. Costs R
    # experts' bytes of device memory; off by default until configs/h200/staging.yaml measures it.
    prefill_staging_rows: int = 0
    # Which resident expert a paged miss evicts: residency.policies.EVICTION_POLICIES. 'lfu-decay' runs on the
    # host planner only; the device plan (inside the captured graph) runs 'lru', 'lfu-aging' and 'duel'.
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    # Which kernels route and compute one-wave steps (kernels.fused.EXPERT_BACKENDS): 'grouped' (torch's
    # grouped GEMM) or 'triton' (moe_triton's decode kernels and, in captured steps, attn_triton's
    # attention; CUDA steps of up to moe_triton.MAX_PAIRS pairs, larger ones keep grouped).
    kernel_backend: str = "grouped"
    # Block-FP8 checkpoints: their attention projections dequantized to `dtype` at load, instead of kept FP8
    # on the device (MoeModelConfig.fp8_attention): 2x their bytes (0.9 GB more at Qwen3-30B-A3B's shape).
    # The runtime did this with every checkpoint before 2026-12-03; the option keeps that layout measurable beside
    # the new one, and loads a checkpoint declared FP8 whose attention is stored dense. (The in-memory build of the
    # FP8 presets, synth_memory, kept the unquantized generated values before 2026-12-03; now it holds the FP8
    # values a checkpoint of the preset stores, so this option gives the same bytes but those values.)
    dequantize_attention: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {self.dtype!r}")
        if self.expert_rows not in EXPERT_ROWS:
            raise ValueError(f"expert_rows must be one of {EXPERT_ROWS}, got {self.expert_rows!r}")
        if self.page_in not in PAGE_IN_CHOICES:
            raise ValueError(f"page_in must be one of {PAGE_IN_CHOICES}, got {self.page_in!r}")
        if self.page_in in ("kernel", "staged") and self.device != "cuda":
            raise ValueError(f"page_in={self.page_in!r} needs a CUDA device (device='cuda'): it copies through the GPU")
        if self.page_in == "kernel" and not moe_triton.available():
            raise ValueError("page_in='kernel' needs Triton (a CUDA build of torch): its copy is a Triton kernel")
        if self.device_planning not in ("auto", "on", "off"):
            raise ValueError(f"device_planning must be 'auto', 'on' or 'off', got {self.device_planning!r}")
        if not 0 <= self.prefill_staging_rows <= MAX_STAGING_ROWS:
            raise ValueError(
                f"prefill_staging_rows must be in [0, {MAX_STAGING_ROWS}], got {self.prefill_staging_rows}"
            )
        if self.prefill_staging_rows and self.mode != "paged":
            raise ValueError(f"prefill_staging_rows applies to mode='paged', not {self.mode!r}")
        if self.prefill_residency not in PREFILL_KEEP:
            raise ValueError(f"prefill_residency must be one of {PREFILL_KEEP}, got {self.prefill_residency!r}")
        check_expert_backend(self.kernel_backend)
        problem = eviction_policy_error(self.eviction_policy)
        if problem is not None:
            raise ValueError(f"eviction_policy {self.eviction_policy!r} {problem}")
        if self.eviction_policy != DEFAULT_EVICTION_POLICY and self.mode != "paged":
            raise ValueError(f"eviction_policy applies to mode='paged', not {self.mode!r}")
        if policy_base(self.eviction_policy) not in DEVICE_POLICIES and self.plans_on_device:
            raise ValueError(
                f"eviction_policy={self.eviction_policy!r} runs on the host planner only: device planning "
                f"(CUDA) plans on the device with one of {', '.join(DEVICE_POLICIES)}"
            )
        if self.overlap_page_in and not self.plans_on_device:
            raise ValueError(
                "overlap_page_in needs mode='paged' with device planning (device_planning 'on', or 'auto' on CUDA)"
            )
        if not 1 <= self.overlap_groups <= 64:
            raise ValueError(f"overlap_groups must be in [1, 64], got {self.overlap_groups}")
        if self.overlap_groups != 1 and not self.overlap_page_in:
            raise ValueError("overlap_groups applies with overlap_page_in only")
        if self.overlap_copies not in ("kernel", "dma", "switch"):
            raise ValueError(f"overlap_copies must be 'kernel', 'dma' or 'switch', got {self.overlap_copies!r}")
        if self.overlap_copies != "kernel" and not self.overlap_page_in:
            raise ValueError(f"overlap_copies={self.overlap_copies!r} applies with overlap_page_in only")
        if self.overlap_copies == "switch" and self.device != "cuda":
            raise ValueError("overlap_copies='switch' needs device='cuda' (CUDA graph conditional nodes)")
        if self.overlap_copies == "dma" and (self.resident_experts or 0) > DMA_MAX_PAIRS:
            raise ValueError(f"overlap_copies='dma' holds plans of at most {DMA_MAX_PAIRS} slots a layer")
        if self.overlap_copies == "dma" and self.device != "cuda":
            raise ValueError("overlap_copies='dma' needs device='cuda' (the copy engine)")
        if self.overlap_copies == "dma" and self.copy_programs is not None:
            raise ValueError("copy_programs caps the copy kernel, which overlap_copies='dma' does not run")
        if self.copy_programs is not None and not 1 <= self.copy_programs <= 65535:
            raise ValueError(f"copy_programs must be in [1, 65535], got {self.copy_programs}")
        if self.copy_programs is not None and not self.plans_on_device:
            raise ValueError(
                "copy_programs needs mode='paged' with device planning (device_planning 'on', or 'auto' on CUDA)"
            )
        if self.fused_page_in and not self.plans_on_device:
            raise ValueError(
                "fused_page_in needs mode='paged' with device planning (device_planning 'on', or 'auto' on CUDA)"
            )
        if self.fused_page_in and self.device != "cuda":
            raise ValueError("fused_page_in needs device='cuda' (its kernels read pinned host memory from the GPU)")
        if self.fused_page_in and self.kernel_backend != "triton":
            raise ValueError("fused_page_in needs kernel_backend='triton' (the expert kernels that read the host rows)")
        if self.fused_page_in and self.overlap_page_in:
            raise ValueError("fused_page_in and overlap_page_in are two ways to page a step's misses in: choose one")
        if self.prefetch_next_layer and not self.plans_on_device:
            raise ValueError(
                "prefetch_next_layer needs mode='paged' with device planning (device_planning 'on', or 'auto' on CUDA)"
            )
        if self.prefetch_next_layer and self.overlap_page_in:
            raise ValueError("prefetch_next_layer and overlap_page_in both use the page-in stream: choose one")
        if self.prefetch_next_layer and policy_base(self.eviction_policy) != "lru":
            raise ValueError(
                f"prefetch_next_layer plans each prediction as a step of its own, which {self.eviction_policy!r} "
                "would count as uses (and age twice a token): use eviction_policy 'lru' with it"
            )
        if self.mode == "paged" and self.resident_experts is None:
            raise ValueError("mode='paged' needs resident_experts (K, the slots per layer)")
        if self.mode != "paged" and self.resident_experts is not None:
            raise ValueError(f"resident_experts is only meaningful with mode='paged', not {self.mode!r}")
        if self.mode != "offload" and self.offload_layers is not None:
            raise ValueError(f"offload_layers is only meaningful with mode='offload', not {self.mode!r}")
        if self.mode == "cpu-experts" and self.cpu_expert_layers is None:
            raise ValueError("mode='cpu-experts' needs cpu_expert_layers (the first N layers run on the CPU)")
        if self.mode != "cpu-experts" and self.cpu_expert_layers is not None:
            raise ValueError(f"cpu_expert_layers is only meaningful with mode='cpu-experts', not {self.mode!r}")
        for name in ("offload_layers", "cpu_expert_layers"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch.cuda.is_available() is False")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def plans_on_device(self) -> bool:
        """Whether paged layers keep their residency on the device (see `device_planning`)."""
        if self.mode != "paged" or self.device_planning == "off":
            return False
        return self.device_planning == "on" or self.device == "cuda"

    def validate_for(self, model: MoeModelConfig) -> None:
        """Checks the choices that depend on the model's shape; raises ValueError."""
        if self.mode == "paged":
            k = self.resident_experts
            assert k is not None
            if not model.top_k <= k <= model.num_experts:
                raise ValueError(
                    f"resident_experts (K) must be in [top_k={model.top_k}, num_experts={model.num_experts}], got {k}"
                )
            if self.prefill_staging_rows > model.num_experts - k:
                raise ValueError(
                    f"prefill_staging_rows={self.prefill_staging_rows} exceeds the {model.num_experts - k} experts "
                    f"a layer keeps outside its K={k} slots (num_experts - K)"
                )
        if self.offload_layers is not None and self.offload_layers > model.num_moe_layers:
            raise ValueError(
                f"offload_layers={self.offload_layers} exceeds the model's {model.num_moe_layers} MoE layers"
            )
        if self.cpu_expert_layers is not None and self.cpu_expert_layers > model.num_moe_layers:
            raise ValueError(
                f"cpu_expert_layers={self.cpu_expert_layers} exceeds the model's {model.num_moe_layers} MoE layers"
            )

    @property
    def rows_layout(self) -> Literal["split", "packed"]:
        """The expert layout in force for paged and offloaded layers: `expert_rows`, 'auto' resolved (packed for
        mode paged on CUDA, split elsewhere)."""
        return resolve_expert_rows(self.expert_rows, self.mode, self.device)

    def packs_rows(self, placement: str) -> bool:
        """True where a layer of this placement ('layer_mode') keeps its experts in packed rows (`rows_layout`):
        the layers whose host rows are copied to the device, paged and offloaded."""
        return self.rows_layout == "packed" and placement in ("paged", "offload")

    def layer_mode(self, layer_idx: int, num_moe_layers: int) -> str:
        """The placement of one layer's experts: 'resident', 'paged', 'offload' or 'cpu'."""
        if self.mode == "paged":
            return "paged"
        if self.mode == "offload":
            n = num_moe_layers if self.offload_layers is None else self.offload_layers
            return "offload" if layer_idx < n else "resident"
        if self.mode == "cpu-experts":
            assert self.cpu_expert_layers is not None
            return "cpu" if layer_idx < self.cpu_expert_layers else "resident"
        return "resident"
