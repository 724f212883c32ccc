"""The static decode step's inputs (paged_experts/decode/graphs.py): their layout in one int64 buffer, the
pinned host copy each step fills in place, and the KV buckets of the torch attention.

Layout of a step of B sequences: tokens [B], positions [B], new KV rows [B], then a KV table of B
rows of W entries: with the triton backend (KV bucket 0) each sequence's block table, W the pool's
blocks, which `attn_triton` walks only up to the sequence's own position; with the torch attention
the KV rows of positions 0..L-1, W = L the step's bucket (its longest context rounded up to a power
of two, at least 64); then, when a synthetic router routes the step, each token's request id [B]
(the router draws every layer's experts inside the graph from request ids and positions).
A step's key is (B, L bucket or 0, planned).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from paged_experts.kv import KvPool, SeqChunk

MIN_BUCKET = 64
StepKey = tuple[int, int, bool]  # (batch size, KV bucket or 0 for the block table, synthetic routing drawn inside)


def bucket(length: int) -> int:
    b = MIN_BUCKET
    while b < length:
        b *= 2
    return b


def buckets_up_to(capacity_tokens: int) -> list[int]:
    """Every KV bucket a sequence of at most `capacity_tokens` tokens can fall in."""
    out = [MIN_BUCKET]
    while out[-1] < capacity_tokens:
        out.append(out[-1] * 2)
    return out


class Entry:
    """One (batch size, KV bucket, routing source) step: its buffers and, on CUDA, its graph."""

    def __init__(self, host: torch.Tensor, inputs: torch.Tensor) -> None:
        self.host = host  # [n] int64 step inputs on the host (pinned on CUDA), filled in place
        self.inputs = inputs  # [n] the same on the device
        self.copied: torch.cuda.Event | None = None  # the last host->device copy of `host`
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [B, V]
        self.greedy: torch.Tensor | None = None  # [B]
        self.ids: torch.Tensor | None = None  # [layers, B, k] the step's routed experts (for `trace`, observers)
        self.weights: torch.Tensor | None = None  # [layers, B, k] their routing weights (for observers)
        self.rings: dict[int, int] = {}  # DMA proxy rings the captured step launches, per device (dma_proxy)


def table_width(pool: KvPool, key: StepKey) -> int:
    return pool.num_blocks if key[1] == 0 else key[1]


def new_entry(pool: KvPool, key: StepKey, device: torch.device, capture: bool) -> Entry:
    """An entry's buffers: pinned host memory and a device copy on CUDA (capture), one tensor on CPU."""
    b, _, planned = key
    n = b * 3 + b * table_width(pool, key) + (b if planned else 0)
    host = torch.zeros(n, dtype=torch.long, pin_memory=capture)
    return Entry(host, host.to(device) if capture else host.clone())


def fill(entry: Entry, pool: KvPool, key: StepKey, chunks: Sequence[SeqChunk], requests: Sequence[int] | None) -> None:
    """Writes a step's inputs into the entry's host buffer and starts their copy to the device.
    requests: each token's request id [B] for the synthetic router's draw (key[2])."""
    b, length, _ = key
    bs = pool.block_size
    width = table_width(pool, key)
    if entry.copied is not None:
        entry.copied.synchronize()  # the previous copy out of this buffer has finished
    a = entry.host.numpy()
    for i, c in enumerate(chunks):
        blocks, pos = c.seq.blocks, c.start_pos
        a[i] = int(c.token_ids[0])
        a[b + i] = pos
        a[2 * b + i] = blocks[pos // bs] * bs + pos % bs
        row = a[3 * b + i * width : 3 * b + (i + 1) * width]
        if length == 0:  # block table, padded with block 0 (never read: the kernel stops at pos)
            row[: len(blocks)] = blocks
            row[len(blocks) :] = 0
        else:  # KV row of each position 0..L-1; padded positions reuse the last real row (finite)
            p = np.minimum(np.arange(length), pos)
            row[:] = np.asarray(blocks, dtype=np.int64)[p // bs] * bs + p % bs
    if requests is not None:
        a[3 * b + b * width :] = requests
    copy_in(entry)


def fill_dummy(entry: Entry, key: StepKey) -> None:
    """Inputs of a capture before serving: token 0 at the bucket's last position, KV rows of
    block 0 and the first blocks (free: the pool is empty), request 0 if planned."""
    b, length, _ = key
    a = entry.host.numpy()
    a[:] = 0
    a[b : 2 * b] = max(length - 1, 0)
    a[2 * b : 3 * b] = np.arange(b)
    copy_in(entry)


def copy_in(entry: Entry) -> None:
    """Host buffer -> device inputs: a stream-ordered non-blocking copy from pinned memory (its
    end recorded, so the next fill waits for it) on CUDA; a plain copy on the CPU."""
    if not entry.host.is_pinned():
        entry.inputs.copy_(entry.host)
        return
    entry.inputs.copy_(entry.host, non_blocking=True)
    entry.copied = torch.cuda.Event()
    entry.copied.record()
