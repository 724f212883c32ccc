"""The forward contract every placement keeps, and what all of them share: routing and the seam.

`MoeLayer.forward(x, ctx, router_override, observers)` routes E-wide on the compute device (the
model's router, or an override checked here), tells the observers, then hands the routed pairs to
the placement's `experts(...)`. Placements (`placements.py`, `paged.py`) only decide where the
expert weights come from and where the matmuls run; the expert kernel (`waves.py`: fused grouped
or the per-expert loop) is a part each layer is given, not a branch.

Graphed decode (`graphs.py`) uses a second, device-only contract: `graphable`, `fits_one_wave(B)`,
`decode_pass(...)` (no host synchronization), and for paged layers `can_prefetch` / `prefetch(...)`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from paged_experts.kernels.fused import experts_over_rows, route_logits
from paged_experts.moe.staging import StagingRows
from paged_experts.moe.streaming import StepStreams
from paged_experts.moe.waves import EXPERT_KERNELS, FUSED, WaveKernel
from paged_experts.residency.counters import PagingCounters, TalliedCounters
from paged_experts.residency.device import DeviceResidency
from paged_experts.residency.planner import Wave
from paged_experts.residency.store import ExpertTensors, PageInEngine, SlotArena
from paged_experts.routing.sources import PlannedIds
from paged_experts.upload import to_device

RouterOverride = Callable[[int, torch.Tensor, Any], tuple[torch.Tensor | PlannedIds, torch.Tensor]]
# (layer, ids [T, k], weights [T, k] or None, StepContext). On a graphed decode step the tensors are views of the
# graph's static outputs, rewritten by the next replay: an observer copies what it keeps (routing.record stages them).
RoutingObserver = Callable[[int, torch.Tensor, torch.Tensor, Any], None]
ExpertsFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # fused.experts_over_rows or its compiled twin
BeforeCompute = Callable[[], None]  # graphs: start the next layer's prefetch once this layer's page-ins are queued


@dataclass(frozen=True)
class StepContext:
    """Per-token facts of one engine step, handed to router overrides and observers."""

    seq_ids: tuple[int, ...]  # [T] sequence id of each token
    positions: tuple[int, ...]  # [T] position of each token in its sequence


@dataclass(frozen=True)
class MoeShared:
    """What the layers of one model share: page-in engine, offload buffer, counters, sizes."""

    device: torch.device
    dtype: torch.dtype
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    kernel_backend: str  # RuntimeConfig.kernel_backend: which kernels route and compute one-wave steps
    expert_bytes: int
    counters: PagingCounters
    page_in: PageInEngine
    offload_buffer: ExpertTensors | None  # [E, ...] on the device, reused by every offloaded layer
    steps: StepStreams = field(default_factory=StepStreams)  # the current step's start (paged layers' page-ins)
    staging: StagingRows | None = None  # RuntimeConfig.prefill_staging_rows: rows for a prefill layer's first page-ins
    slots: SlotArena | None = None  # every paged layer's packed slot rows in one allocation (packed rows only)


class MoeLayer(ABC):
    """One layer's router and experts; subclasses are the placements."""

    placement: ClassVar[str]
    stats_include_page_ins: ClassVar[bool] = False  # paged: the misses of `record_device` stats crossed the link

    def __init__(self, layer_idx: int, router_weight: torch.Tensor, host: ExpertTensors, shared: MoeShared) -> None:
        self.layer_idx = layer_idx
        self.router_weight = router_weight  # [E, H] on the device
        self.host = host  # [E, ...] host store rows (pinned when paged/offloaded on CUDA); device rows if resident
        self.shared = shared
        self.kernel: WaveKernel = FUSED

    # ---- the forward contract ------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        ctx: StepContext,
        router_override: RouterOverride | None,
        observers: Sequence[RoutingObserver],
    ) -> torch.Tensor:
        """x: [T, H] on the device -> [T, H]."""
        sh = self.shared
        sh.steps.enter(ctx, self.layer_idx, ctx.seq_ids, sh.device, sh.counters)  # the first layer of a step opens it
        ids_cpu = None
        if router_override is not None:
            t0 = time.perf_counter()
            ids, weights = router_override(self.layer_idx, F.linear(x, self.router_weight), ctx)
            ids, weights, ids_cpu = self._check_override(ids, weights, x.shape[0])
            if sh.steps.prefill:  # host time a synthetic router spends drawing (not paging's)
                sh.counters.prefill_router(time.perf_counter() - t0)
        else:
            ids, weights = self.route_on_device(x)  # [T, k], [T, k]
        for fn in observers:
            fn(self.layer_idx, ids, weights, ctx)
        return self.experts(x, ids, weights, ids_cpu, ctx)

    @abstractmethod
    def experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ids_cpu: torch.Tensor | None, ctx: StepContext
    ) -> torch.Tensor:
        """The routed pairs' expert pass: x [T, H], ids/weights [T, k] (ids_cpu: a host copy when
        the override was checked) -> [T, H] on the device; counts the layer-step."""

    def set_kernel(self, name: str) -> None:
        """'fused' (grouped matmuls, the default) or 'loop' (the per-expert reference)."""
        if name not in EXPERT_KERNELS:
            raise ValueError(f"expert_kernel must be one of {tuple(EXPERT_KERNELS)}, got {name!r}")
        self.kernel = EXPERT_KERNELS[name]

    def route_on_device(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own router (no override): [T, H] -> ids [T, k], weights [T, k]."""
        sh = self.shared
        return route_logits(F.linear(x, self.router_weight), sh.top_k, sh.norm_topk_prob, backend=sh.kernel_backend)

    # ---- the graphed decode contract (graphs.py) -----------------------------------------------

    @property
    def graphable(self) -> bool:
        """Whether `decode_pass` runs without a host synchronization (CUDA-graph capturable)."""
        return False

    def fits_one_wave(self, num_tokens: int) -> bool:
        """Whether a graphed decode step of `num_tokens` tokens can run through `decode_pass`."""
        return False

    def decode_pass(
        self,
        h: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts_fn: ExpertsFn,
        before_compute: BeforeCompute,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One-wave step with no host sync: h [B, H] -> (out [B, H], stats [3] or [5] on the device;
        None where the caller tallies the union itself: resident layers). `before_compute` runs
        once the layer's page-ins are queued, before its expert pass."""
        raise ValueError(f"a {self.placement} layer has no graph-safe decode pass")

    @property
    def can_prefetch(self) -> bool:
        return False

    def prefetch(self, predicted: torch.Tensor, copy_stream: torch.cuda.Stream | None) -> None:
        raise ValueError(f"a {self.placement} layer has no device-planned residency to prefetch into")

    @property
    def device_residency(self) -> DeviceResidency | None:
        """The LRU state planned on the device (paged layers with device planning), else None."""
        return None

    def after_replay(self) -> None:
        """A graph replay ran this layer's `decode_pass` without Python: resync any host mirror."""
        return None  # a hook: only layers with a host mirror of device state (paged) override it

    def drop_prefetch(self) -> None:
        """Forgets a prefetch not taken (a graphed step starts with none, even after an error)."""
        return None  # a hook: only layers that prefetch (paged) override it

    # ---- shared helpers ------------------------------------------------------------------------

    def table_pass(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, table: ExpertTensors
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every routed pair over an [E, ...] table on the device (expert id = row), no host sync:
        [T, H] -> (out [T, H], union as a device scalar)."""
        flat = ids.reshape(-1).to(device=self.shared.device, dtype=torch.long)  # [T*k]
        out, counts = experts_over_rows(
            x, flat, weights, table.gate, table.up, table.down, self.shared.top_k, True, *table.scales,
            backend=self.shared.kernel_backend,
        )  # fmt: skip
        assert counts is not None
        return out, (counts > 0).sum()

    def host_pass(
        self, x: torch.Tensor, ids_cpu: torch.Tensor, weights: torch.Tensor, table: ExpertTensors, device: torch.device
    ) -> tuple[torch.Tensor, int]:
        """Every routed expert over an [E, ...] table as one host-planned wave of the layer's kernel,
        computed on `device`: -> (out [T, H] on the model's device, union)."""
        distinct = tuple(sorted(set(ids_cpu.reshape(-1).tolist())))
        run = self.kernel.begin(x, ids_cpu, self.shared.num_experts, device)
        run.plan_waves((Wave(experts=distinct, slots=distinct, page_ins=(), hits=len(distinct)),), table.num_rows)
        run.wave(table, distinct, distinct)
        return run.finish(weights).to(self.shared.device), len(distinct)

    def record_device(self, stats: torch.Tensor, num_pairs: int) -> None:
        """stats: [3] (union, hits, misses) on the device, tallied without a host read where possible."""
        sh = self.shared
        if isinstance(sh.counters, TalliedCounters):
            sh.counters.record_step_device(self.layer_idx, self.placement, stats, num_pairs)
            return
        union, hits, misses = (int(v) for v in stats.tolist())
        self.record_host(union=union, routed_pairs=num_pairs, hits=hits, misses=misses, waves=1 if union else 0)
        if self.stats_include_page_ins:  # the tallied counters do the same when they flush
            sh.counters.record_copy(self.layer_idx, bytes_h2d=misses * sh.expert_bytes)

    def record_host(self, *, union: int, routed_pairs: int, hits: int, misses: int, waves: int, cpu: int = 0) -> None:
        self.shared.counters.record_step(
            self.layer_idx,
            union=union,
            routed_pairs=routed_pairs,
            hits=hits,
            misses=misses,
            cpu_activations=cpu,
            waves=waves,
        )

    def _check_override(
        self, ids: torch.Tensor | PlannedIds, weights: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Checks an override's choice on a host copy, returned for the planner to reuse: ids the
        override made on the host are checked and sent to the device with no host synchronization;
        ids on the device are read once (one sync); `PlannedIds` (the synthetic router's, checked once
        a step) are taken as they are."""
        sh = self.shared
        expected = (num_tokens, sh.top_k)
        if isinstance(ids, PlannedIds):  # drawn and checked once for the whole step, on both sides already
            if tuple(ids.host.shape) != expected or tuple(ids.device.shape) != expected:
                raise ValueError(f"router_override planned ids {tuple(ids.host.shape)}; expected {expected}")
            if ids.num_experts != sh.num_experts:  # checked against another E: out of range here, maybe
                raise ValueError(
                    f"router_override planned ids for {ids.num_experts} experts; this layer has {sh.num_experts}"
                )
            if ids.host.device.type != "cpu" or ids.host.dtype != torch.long or ids.device.dtype != torch.long:
                raise ValueError("router_override planned ids must be int64, their host copy on the host")
            if tuple(weights.shape) != expected:
                raise ValueError(f"router_override returned weights {tuple(weights.shape)}; expected {expected}")
            return ids.device.to(device=sh.device, dtype=torch.long), weights.to(torch.float32), ids.host
        if tuple(ids.shape) != expected or tuple(weights.shape) != expected:
            raise ValueError(
                f"router_override returned ids {tuple(ids.shape)} and weights {tuple(weights.shape)}; "
                f"expected {expected}"
            )
        ids_cpu = ids.to("cpu", torch.long)  # [T, k]
        if ids_cpu.numel() and (int(ids_cpu.min()) < 0 or int(ids_cpu.max()) >= sh.num_experts):
            raise ValueError(f"router_override returned expert ids outside [0, {sh.num_experts})")
        ordered = ids_cpu.sort(dim=1).values  # [T, k]
        twice = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)  # [T]
        if bool(twice.any()):
            row = ids_cpu[int(twice.nonzero()[0, 0])].tolist()
            raise ValueError(f"router_override routed a token to the same expert twice: {row}")
        if ids.device.type == "cpu" and sh.device.type == "cuda":
            ids = to_device(ids_cpu, sh.device)  # pinned: queued, the host goes on
        return ids.to(device=sh.device, dtype=torch.long), weights.to(torch.float32), ids_cpu


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def page_in_stream(device: torch.device) -> torch.cuda.Stream | None:
    """One page-in stream per CUDA device (created outside any graph capture: first use is eager)."""
    if device.type != "cuda":
        return None
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]
