"""The MoE block of one layer: one class per placement behind one forward contract.

Routing is always E-wide on the compute device (`layer.MoeLayer.forward`); the placement decides
where expert weights come from and where the matmuls run:
- `resident` (`placements.ResidentLayer`): all E experts on the device (the unpaged reference);
- `paged` (`paged.PagedLayer`): K device slots, given its planning strategies (`planning.HostWaves`:
  host LRU waves with batched page-in; `planning.DeviceLru`: one-wave steps planned on the device,
  overlap, prefetch; `staging.StagingRows`: rows all paged layers share for a prefill's first page-ins);
- `offload` (`placements.OffloadLayer`): all E experts copied into a shared device buffer every
  forward, whatever the router chose (SGLang `--cpu-offload-gb`);
- `cpu` (`placements.CpuLayer`): experts computed on the CPU from the host store (llama.cpp `--n-cpu-moe`).
Every layer is given its expert kernel (`waves.EXPERT_KERNELS`: fused grouped matmuls or the loop).
`make_layer` builds a layer of either kind for a runtime (loader and in-memory synthetic models).
"""

from __future__ import annotations

import torch

from paged_experts.config import MoeModelConfig
from paged_experts.moe.layer import (
    BeforeCompute,
    ExpertsFn,
    MoeLayer,
    MoeShared,
    RouterOverride,
    RoutingObserver,
    StepContext,
    page_in_stream,
)
from paged_experts.moe.paged import PagedLayer
from paged_experts.moe.placements import CpuLayer, OffloadLayer, ResidentLayer
from paged_experts.moe.planning import DeviceLru, HostWaves, PendingPrefetch
from paged_experts.moe.waves import EXPERT_KERNELS
from paged_experts.residency.device import DeviceResidency
from paged_experts.residency.planner import LayerResidency
from paged_experts.residency.policies import make_policy
from paged_experts.residency.store import ExpertTensors, to_device_rows
from paged_experts.runtime import RuntimeConfig

__all__ = [
    "EXPERT_KERNELS",
    "BeforeCompute",
    "CpuLayer",
    "DeviceLru",
    "ExpertsFn",
    "HostWaves",
    "MoeLayer",
    "MoeShared",
    "OffloadLayer",
    "PagedLayer",
    "PendingPrefetch",
    "ResidentLayer",
    "RouterOverride",
    "RoutingObserver",
    "StepContext",
    "make_layer",
    "page_in_stream",
]


def make_layer(
    layer_idx: int,
    placement: str,
    router_weight: torch.Tensor,
    host: ExpertTensors,
    shared: MoeShared,
    cfg: MoeModelConfig,
    runtime: RuntimeConfig,
) -> MoeLayer:
    """One layer in `placement` over its host rows: slots start with experts 0..K-1 (paged); a
    resident layer keeps one copy, on the device."""
    device = runtime.torch_device
    if placement == "resident":
        # resident rows stay split (RuntimeConfig.expert_rows): an in-memory store may be packed for every layer
        rows = to_device_rows(host, cfg.num_experts, device, split=True)
        return ResidentLayer(layer_idx, router_weight, rows, shared)
    if placement == "offload":
        return OffloadLayer(layer_idx, router_weight, host, shared)
    if placement == "cpu":
        return CpuLayer(layer_idx, router_weight, host, shared)
    if placement != "paged":
        raise ValueError(f"unknown placement {placement!r}")
    k = runtime.resident_experts
    assert k is not None
    policy = make_policy(runtime.eviction_policy, k)  # RuntimeConfig refused one the device plan cannot run
    lru = None
    if runtime.plans_on_device:
        lru = DeviceLru(
            DeviceResidency.for_policy(policy, cfg.num_experts, k, device),
            overlap=runtime.overlap_page_in,
            overlap_groups=runtime.overlap_groups,
            overlap_copies=runtime.overlap_copies,
            copy_programs=runtime.copy_programs,
            fused_page_in=runtime.fused_page_in,
        )
    waves = HostWaves(LayerResidency(cfg.num_experts, k, policy, prefill_keep=runtime.prefill_residency))
    rows = to_device_rows(host, k, device, arena=shared.slots)
    return PagedLayer(layer_idx, router_weight, host, rows, shared, waves, lru)
