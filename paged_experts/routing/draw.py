"""The calibrated synthetic router's draws as a pure function of (seed, request, position, layer):
a counter-based integer hash instead of a random stream, so any token's experts are computed
without the tokens before it, on the host or the device, inside a CUDA graph or not, and a
request's routing never depends on which requests share its batch.

The generative model, per (request, layer), for each of the k expert slots j:
- slot j holds one expert per epoch; epochs advance at a layer's rate 1 - keep_l per position with
  a hashed phase per slot (epoch(p) = (p x rate + phase) >> 10, rate in 1/1024 units), so a slot
  keeps its expert from one token to the next with probability keep_l, as the old per-token coin did;
- at an epoch's start, a slot draws its expert: with probability recency_mix_l it takes the expert
  a hashed slot j' had held until its epoch at delta positions before that start (delta from a
  power law delta^-recency_alpha, 1 <= delta <= MAX_DELTA): an expert used recently and since let
  go, as the recency stack's reuse (experts still held would only clash), resolving that slot's
  own draw the same way, up to CHAIN_DEPTH hops; otherwise (or at the chain's end, or before
  position 0) from the layer's popularity: a working set of `working_set` x E
  experts holding `working_set_mass`, Zipf(`zipf_s`) inside, over a seeded permutation per layer;
- a token's k experts are made distinct: a slot whose expert an earlier slot already holds redraws
  from the popularity (DEDUP_ROUNDS times, keyed by its epoch), then steps to the next free id.
Layer strengths (keep and recency_mix scaled per layer, working-set knee) are routing.py's.

Every random choice is `hash2(key, field)` of the seed, request id, layer, slot, epoch and a tag;
integer tables give the inverse CDFs (thresholds in 2^-24 units), so the torch draw here and the
Triton kernel (routing/draw_triton.py, the graphed decode step) agree bit for bit.

Cost: the tables are 8 x L x (E + 2) + 8 x MAX_DELTA bytes (54 KB for 48 layers and 128 experts);
this torch draw of T tokens holds ~12 int64 temporaries of T x L x k (it draws DRAW_CHUNK_TOKENS
tokens at a time: ~24 MB at 48 layers, k = 8) and runs ~1,300 small ops per slice, which is why
CUDA runs the Triton kernel instead (one launch, no temporaries) inside and outside graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

M32 = 0xFFFFFFFF
U24 = 1 << 24  # probabilities and CDF thresholds in units of 2^-24
RATE_ONE = 1024  # epoch rates in units of 1/1024 per position
MAX_DELTA = 512  # longest reuse distance of the recency draw, in positions
CHAIN_DEPTH = 12  # hops of "the expert slot j' held then" before falling back to popularity
DEDUP_ROUNDS = 2
DRAW_CHUNK_TOKENS = 256
_GOLDEN = 0x9E3779B9
_TAG_POP, _TAG_DELTA, _TAG_SLOT, _TAG_DEDUP = 1, 2, 3, 16


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def hash2(key: torch.Tensor, value: torch.Tensor | int) -> torch.Tensor:
    """A key's hash of one more field (a bijection of `value` mod 2^32 for a fixed key)."""
    return mix32((key + value * _GOLDEN) & M32)


@dataclass(frozen=True)
class DrawTables:
    """The generator's integer tables, on one device."""

    seed_key: int
    top_k: int
    rate: torch.Tensor  # [L] int64 epoch advance per position, 1/1024 units, in [0, 1024]
    mix_threshold: torch.Tensor  # [L] int64 recency_mix_l x 2^24
    pop_cdf: torch.Tensor  # [L, E] int64 cumulative popularity x 2^24 (last = 2^24), by expert id
    delta_cdf: torch.Tensor  # [MAX_DELTA] int64 cumulative P(delta <= d) x 2^24 (last = 2^24)

    @property
    def num_layers(self) -> int:
        return int(self.rate.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.pop_cdf.shape[1])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.rate, self.mix_threshold, self.pop_cdf, self.delta_cdf))

    def to(self, device: torch.device | str) -> DrawTables:
        return DrawTables(
            self.seed_key, self.top_k, self.rate.to(device), self.mix_threshold.to(device),
            self.pop_cdf.to(device), self.delta_cdf.to(device),
        )  # fmt: skip


def cdf_thresholds(weights: np.ndarray) -> np.ndarray:
    """[..., n] non-negative weights -> int64 cumulative thresholds in 2^-24 units, last = 2^24:
    index = count(thresholds <= u) for u uniform in [0, 2^24) draws i with probability ~ w_i / sum."""
    cum = np.cumsum(weights, axis=-1) / weights.sum(axis=-1, keepdims=True)
    out = np.minimum(np.round(cum * U24), U24).astype(np.int64)
    out[..., -1] = U24
    return out


def build_tables(
    keep: np.ndarray, recency_mix: np.ndarray, popularity: np.ndarray, recency_alpha: float, top_k: int, seed: int
) -> DrawTables:
    """keep, recency_mix [L] per layer; popularity [L, E] weights by expert id."""
    rate = np.clip(np.round(RATE_ONE * (1.0 - keep)), 0, RATE_ONE).astype(np.int64)  # 0: a slot never changes
    deltas = np.arange(1, MAX_DELTA + 1, dtype=np.float64)
    return DrawTables(
        seed_key=int(mix32(torch.tensor((seed * _GOLDEN + 0x5EED) & M32)).item()) & 0x7FFFFFFF,  # an int32 for Triton
        top_k=top_k,
        rate=torch.from_numpy(rate),
        mix_threshold=torch.from_numpy(np.round(np.clip(recency_mix, 0.0, 1.0) * U24).astype(np.int64)),
        pop_cdf=torch.from_numpy(cdf_thresholds(popularity)),
        delta_cdf=torch.from_numpy(cdf_thresholds(deltas**-recency_alpha)),
    )


def _count_le(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """count(cdf <= u) along cdf's last dim; cdf [n] or [L, n] with u [T, L, k]."""
    if cdf.dim() == 1:
        return torch.searchsorted(cdf, u.contiguous(), right=True)
    t, layers, k = u.shape
    flat = u.permute(1, 0, 2).reshape(layers, t * k).contiguous()  # [L, T*k]
    return torch.searchsorted(cdf, flat, right=True).view(layers, t, k).permute(1, 0, 2)


def _epoch(slot_key: torch.Tensor, pos: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    return (pos * rate + (slot_key & (RATE_ONE - 1))) >> 10


def _epoch_start(slot_key: torch.Tensor, epoch: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """The first position of `epoch` (0 for the epoch holding position 0)."""
    num = epoch * RATE_ONE - (slot_key & (RATE_ONE - 1))
    return torch.where(num <= 0, torch.zeros_like(num), (num.clamp(min=0) + rate - 1) // rate.clamp(min=1))


def draw(tables: DrawTables, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """requests [T], positions [T] int64 (on the tables' device) -> expert ids [T, L, k] int64."""
    chunks = [
        _draw(tables, requests[i : i + DRAW_CHUNK_TOKENS], positions[i : i + DRAW_CHUNK_TOKENS])
        for i in range(0, max(1, requests.shape[0]), DRAW_CHUNK_TOKENS)
    ]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def _draw(tables: DrawTables, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    dev = requests.device
    k, num_layers = tables.top_k, tables.num_layers
    layers = torch.arange(num_layers, device=dev)
    slots = torch.arange(k, device=dev)
    req_key = hash2(hash2(torch.full_like(requests, tables.seed_key), requests)[:, None], layers)  # [T, L]
    req_key = req_key[:, :, None]  # [T, L, 1]
    rate = tables.rate[None, :, None]  # [1, L, 1]
    threshold = tables.mix_threshold[None, :, None]
    slot_key = hash2(req_key, slots)  # [T, L, k]
    epoch = _epoch(slot_key, positions[:, None, None], rate)  # [T, L, k]
    own_key, own_epoch = slot_key, epoch
    start = _epoch_start(slot_key, epoch, rate)
    out = torch.full_like(slot_key, -1)
    for _ in range(CHAIN_DEPTH):
        h = hash2(slot_key, epoch)  # this (slot, epoch)'s own draw
        delta = 1 + _count_le(tables.delta_cdf, hash2(h, _TAG_DELTA) & (U24 - 1))
        other_key = hash2(req_key, hash2(h, _TAG_SLOT) % k)  # the slot reused, delta before this start
        # ... its expert before the epoch it was in then: one it had let go (still-held ones would clash)
        other_epoch = _epoch(other_key, start - delta, rate) - 1
        reuse = ((h & (U24 - 1)) < threshold) & (start - delta >= 0) & (other_epoch >= 0)
        fresh = _count_le(tables.pop_cdf, hash2(h, _TAG_POP) & (U24 - 1))
        out = torch.where((out < 0) & ~reuse, fresh, out)
        slot_key = torch.where(reuse, other_key, slot_key)
        epoch = torch.where(reuse, other_epoch, epoch)
        start = torch.where(reuse, _epoch_start(other_key, other_epoch, rate), start)
    last = _count_le(tables.pop_cdf, hash2(hash2(slot_key, epoch), _TAG_POP) & (U24 - 1))
    out = torch.where(out < 0, last, out)
    return _distinct(tables, out, hash2(own_key, own_epoch))


def _duplicates(ids: torch.Tensor) -> torch.Tensor:
    """[T, L, k] -> [T, L, k] bool: an earlier slot of the same token holds the same expert."""
    k = ids.shape[-1]
    same = ids[..., :, None] == ids[..., None, :]  # [T, L, k, k] (j, i)
    earlier = torch.ones(k, k, dtype=torch.bool, device=ids.device).tril(-1)  # i < j
    return (same & earlier).any(dim=-1)


def _distinct(tables: DrawTables, ids: torch.Tensor, epoch_key: torch.Tensor) -> torch.Tensor:
    for r in range(DEDUP_ROUNDS):
        redraw = _count_le(tables.pop_cdf, hash2(epoch_key, _TAG_DEDUP + r) & (U24 - 1))
        ids = torch.where(_duplicates(ids), redraw, ids)
    e = tables.num_experts
    for j in range(1, ids.shape[-1]):  # then the next free id, slot by slot (j earlier ones: j steps at most)
        col = ids[..., j]
        for _ in range(j):
            clash = (ids[..., :j] == col[..., None]).any(dim=-1)
            col = torch.where(clash, (col + 1) % e, col)
        ids = torch.cat([ids[..., :j], col[..., None], ids[..., j + 1 :]], dim=-1)
    return ids
