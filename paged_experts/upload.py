"""`to_device`: a host tensor sent to the device without blocking the host.

A copy from pageable host memory blocks the calling thread: the driver stages it through its own pinned buffer and
may first wait for the stream to reach the copy (CUDA's "API synchronization behavior"), and with CUDA's default
scheduling a waiting thread spins on its CPU, so the wait reads as CPU time in the engine thread's clocks. A paged
prefill's host issues a whole chunk ahead of the device; every such wait on its path stalls the issue (and the
link, which waits for the host at each layer: docs/prefill.md). Pinned first, the copy is queued and the host goes
on; torch's caching host allocator keeps the pinned block until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (on the host) on `device`: a pinned copy queued without blocking on CUDA (the caller may reuse `t` at once;
    a `t` pinned already is sent as it is, so it must not change until the copy has run), `t.to(device)` elsewhere
    (on the CPU, `t` itself)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
