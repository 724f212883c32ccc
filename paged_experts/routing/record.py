"""Recording a served model's routing without stopping the device: what `--record-routing PATH` runs.

`TraceWriter` (trace.py) wants each layer's routed ids and weights on the host. Reading a CUDA tensor to the
host waits for the device, once per layer: eager steps paid that (two waits a layer), and graphed decode
steps could not record at all (a server with `--record-routing` decoded eagerly, several times slower, so a
benchmark that recorded routing measured another engine). `RoutingRecorder` instead copies each layer's
tensors into one pinned host buffer (`HostStage`) in stream order, without waiting, and hands the writer
`Staged` rows that become numpy arrays on their first read: one device synchronization when the buffer is
full (64 MiB by default: ~7 prefills of 2,048 tokens at 48 layers, thousands of decode steps) and one when
the trace is written. Nothing else in a step waits for the recording.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paged_experts.routing.trace import TraceWriter

STAGE_BYTES = 64 << 20
_ALIGN = 8  # every staged tensor starts at an 8-byte offset (its dtype's view of the bytes needs it)


class Staged:
    """One staged tensor: its shape now, its values (numpy) once the stage settles (`np.asarray` settles it)."""

    __slots__ = ("_stage", "_value", "_view", "shape")

    def __init__(self, stage: HostStage, view: torch.Tensor) -> None:
        self.shape = tuple(view.shape)
        self._stage: HostStage | None = stage
        self._view: torch.Tensor | None = view
        self._value: np.ndarray | None = None

    def _settle(self) -> None:
        """Called by the stage once the copies it enqueued have landed: take the values out of the buffer."""
        assert self._view is not None
        self._value = self._view.numpy().copy()
        self._stage = self._view = None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self._value is None:
            assert self._stage is not None
            self._stage.settle()
        assert self._value is not None
        return self._value if dtype is None else self._value.astype(dtype)


class HostStage:
    """Tensors copied into one host buffer (pinned for CUDA tensors) without waiting for the device; `settle()`
    waits once and takes every pending copy out, then the buffer is reused. Host tensors take the same path
    (their copies are done at once), so the CPU runs what the GPU does."""

    def __init__(self, nbytes: int = STAGE_BYTES) -> None:
        self.nbytes = nbytes
        self._buf: torch.Tensor | None = None  # [nbytes] uint8, allocated on the first put
        self._pinned = False  # whether _buf is pinned (for CUDA tensors)
        self._used = 0
        self._pending: list[Staged] = []
        self._device: torch.device | None = None
        self.settles = 0  # device waits, for tests and logs

    def put(self, t: torch.Tensor) -> Staged | np.ndarray:
        """A copy of t (any shape; int64 / int32 / float32 / float16, not bfloat16, which numpy lacks)."""
        nbytes = t.numel() * t.element_size()
        if nbytes > self.nbytes:
            return t.detach().to("cpu").numpy().copy()  # larger than the stage: read now
        if self._used + nbytes > self.nbytes or (self._device is not None and t.device != self._device):
            self.settle()
        if self._buf is None or self._pinned != t.is_cuda:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=t.is_cuda)
            self._pinned = t.is_cuda
        self._device = t.device
        view = self._buf[self._used : self._used + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t, non_blocking=True)  # in the current stream's order: after the step that wrote t
        self._used += -(-nbytes // _ALIGN) * _ALIGN
        staged = Staged(self, view)
        self._pending.append(staged)
        return staged

    def settle(self) -> None:
        """Waits for every copy enqueued so far, moves their values out, and frees the buffer for reuse."""
        if self._pending:
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            for staged in self._pending:
                staged._settle()
            self.settles += 1
        self._pending = []
        self._used = 0


class RoutingRecorder:
    """The server's routing observer (called as one) and step hook, writing `path` on `close()` (trace.TraceWriter's
    format). A graphed step hands its whole routing at once (`observe_step`): two copies a step, not two a layer."""

    def __init__(self, path: str | Path, config: object, source: str, model: str, stage_bytes: int = STAGE_BYTES):
        self.writer = TraceWriter(path, config, source=source, model=model)
        self.stage = HostStage(stage_bytes)

    def begin_step(self, layout: list[tuple[str, int]]) -> None:
        self.writer.begin_step(layout)

    def observe(self, layer: int, ids: torch.Tensor, weights: torch.Tensor | None, ctx: object = None) -> None:
        """Routed ids [T, k] and weights [T, k] (or None) of one MoE layer, on any device; nothing waits."""
        k = self.writer.meta.top_k
        ids_rows = self.stage.put(ids.reshape(-1, k).to(torch.int64))
        w_rows = None if weights is None else self.stage.put(weights.reshape(-1, k).to(torch.float32))
        self.writer.observe_rows(layer, ids_rows, w_rows)

    __call__ = observe

    def observe_step(
        self, layer_ids: Sequence[int], ids: torch.Tensor, weights: torch.Tensor | None, ctx: object = None
    ) -> None:
        """A graphed step's routing: ids [layers, B, k], weights the same or None, each staged in one copy and
        kept as one entry of the writer (a handful of objects a step: the server's heap holds them until close)."""
        k = self.writer.meta.top_k
        n = len(layer_ids)
        ids_all = self.stage.put(ids.reshape(n, -1, k).to(torch.int64))
        w_all = None if weights is None else self.stage.put(weights.reshape(n, -1, k).to(torch.float32))
        self.writer.observe_step_rows(layer_ids, ids_all, w_all)

    def close(self) -> Path:
        """Waits for the staged copies and writes the trace. A device error while waiting (the server is
        stopping after a CUDA fault) raises here: the caller logs it and closes the rest."""
        self.stage.settle()
        return self.writer.close()


def observe_step(
    observers: Sequence[Any], layer_ids: Sequence[int], ids: torch.Tensor, weights: torch.Tensor | None, ctx: object
) -> None:
    """A graphed step's routing to the observers: ids [layers, B, k], weights the same or None; whole to an observer
    with `observe_step` (RoutingRecorder), else layer by layer."""
    for fn in observers:
        whole = getattr(fn, "observe_step", None)
        if whole is not None:
            whole(layer_ids, ids, weights, ctx)
            continue
        for i, layer in enumerate(layer_ids):
            fn(layer, ids[i], None if weights is None else weights[i], ctx)
