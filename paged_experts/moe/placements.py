"""The unpaged placements: `resident` (all E experts on the device: the reference), `offload` (all
E streamed into a shared device buffer every forward, whatever was routed: SGLang
`--cpu-offload-gb`) and `cpu` (experts computed on the CPU from the host store: llama.cpp
`--n-cpu-moe`). The paged placement is `paged.py`."""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch

from paged_experts.moe.layer import (
    BeforeCompute,
    ExpertsFn,
    MoeLayer,
    MoeShared,
    StepContext,
)
from paged_experts.residency.store import ExpertTensors


class _TableLayer(MoeLayer):
    """Experts computed on the device from an `[E, ...]` table (expert id = row)."""

    from_link: ClassVar[bool]  # the table crossed the link this step: its experts count as misses, not hits

    @abstractmethod
    def table(self) -> ExpertTensors:
        """The `[E, ...]` table this step's experts are read from."""

    def experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ids_cpu: torch.Tensor | None, ctx: StepContext
    ) -> torch.Tensor:
        table = self.table()
        num_pairs = ids.numel()
        if self.kernel.device_pass:
            out, union = self.table_pass(x, ids, weights, table)
            zero = torch.zeros_like(union)
            hits, misses = (zero, union) if self.from_link else (union, zero)
            self.record_device(torch.stack([union, hits, misses]), num_pairs)
            return out
        out, n = self.host_pass(x, ids.to("cpu", torch.long), weights, table, self.shared.device)
        host_hits, host_misses = (0, n) if self.from_link else (n, 0)
        self.record_host(union=n, routed_pairs=num_pairs, hits=host_hits, misses=host_misses, waves=1 if n else 0)
        return out


class ResidentLayer(_TableLayer):
    placement = "resident"
    from_link = False

    def __init__(
        self, layer_idx: int, router_weight: torch.Tensor, device_experts: ExpertTensors, shared: MoeShared
    ) -> None:
        # A resident layer never reads host rows: one copy, on the device, serves as both.
        super().__init__(layer_idx, router_weight, device_experts, shared)
        self.device_experts = device_experts  # [E, ...] on the device

    def table(self) -> ExpertTensors:
        return self.device_experts

    @property
    def graphable(self) -> bool:
        return True

    def fits_one_wave(self, num_tokens: int) -> bool:
        return True

    def decode_pass(
        self,
        h: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts_fn: ExpertsFn,
        before_compute: BeforeCompute,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No stats: the graphed step counts every resident layer's union at once."""
        before_compute()
        w = self.device_experts
        flat = ids.reshape(-1).to(device=self.shared.device, dtype=torch.long)  # [B*k]
        sh = self.shared
        return experts_fn(
            h, flat, weights, w.gate, w.up, w.down, sh.top_k, False, *w.scales, backend=sh.kernel_backend
        )[0], None  # fmt: skip


class OffloadLayer(_TableLayer):
    placement = "offload"
    from_link = True

    def table(self) -> ExpertTensors:
        sh = self.shared
        assert sh.offload_buffer is not None
        # Offload streams the whole layer whatever was routed, as a weight-offload engine does.
        pairs = [(e, e) for e in range(sh.num_experts)]
        sh.page_in.copy_rows(self.host, sh.offload_buffer, pairs, sh.counters, self.layer_idx, sh.expert_bytes)
        return sh.offload_buffer


class CpuLayer(MoeLayer):
    placement = "cpu"

    def experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ids_cpu: torch.Tensor | None, ctx: StepContext
    ) -> torch.Tensor:
        ids_cpu = ids.to("cpu", torch.long) if ids_cpu is None else ids_cpu  # [T, k]
        out, union = self.host_pass(x, ids_cpu, weights, self.host, torch.device("cpu"))
        self.record_host(
            union=union, routed_pairs=ids_cpu.numel(), hits=0, misses=0, cpu=union, waves=1 if union else 0
        )
        return out
