"""The calibrated synthetic router's draw (paged_experts.routing.draw) as one Triton kernel, for the
graphed decode step: one program per (token, layer), the k slots as a vector, every step of
`routing_draw.draw` in the same integer arithmetic, so its ids equal the torch draw's bit for bit
(tests/test_routing_draw.py in the interpreter, tests/cuda/test_routing_draw_cuda.py compiled).

Why a kernel: the torch draw is ~450 small kernels (12 chain hops, the dedup rounds, the probe);
inside a graph at batch 1 that is ~1 ms a token, more than the host draw it replaces. One launch of
B x L programs is a few microseconds.
"""

from __future__ import annotations

import torch

from paged_experts.routing import draw as rd

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU torch wheel ships no Triton
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    # routing_draw's 32-bit hash on int64 values. Constants above 2^31 are written as their
    # negative twins (same value mod 2^32) and x & 0xFFFFFFFF as x - ((x >> 32) << 32), so every
    # literal is an int32 that promotes to int64: no unsigned constant enters the arithmetic.
    @triton.jit
    def _low32(x):  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        return x - ((x >> 32) << 32)

    @triton.jit
    def _mix32(x):  # pragma: no cover
        x = x ^ (x >> 16)
        x = _low32(x * 0x7FEB352D)
        x = x ^ (x >> 15)
        x = _low32(x * -2073254261)  # 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _hash2(key, value):  # pragma: no cover
        return _mix32(_low32(key + value * -1640531527))  # 0x9E3779B9

    @triton.jit
    def _count_le(cdf_row, u, N: tl.constexpr, STEPS: tl.constexpr):  # pragma: no cover
        """count(cdf_row[:N] <= u) for u [KP] -> [KP] int64, the cdf nondecreasing (as torch.searchsorted
        right=True takes it in routing_draw): a binary search per lane, STEPS >= log2(N + 1) halvings. It
        replaced a compare of every lane with all N entries (an [8, 512] block per chain hop), which made a
        2,048-token prompt's draw take 22.5 ms on the H200, in the prompt's TTFT; this one takes 1.1 ms."""
        lo = tl.zeros_like(u)  # [KP] the answer lies in [lo, hi]
        hi = lo + N
        for _ in tl.static_range(STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            v = tl.load(cdf_row + mid, mask=active, other=0)
            right = active & (v <= u)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(active & ~right, mid, hi)
        return lo

    @triton.jit
    def _epoch(slot_key, pos, rate):  # pragma: no cover
        return (pos * rate + (slot_key & 1023)) >> 10

    @triton.jit
    def _epoch_start(slot_key, epoch, rate):  # pragma: no cover
        num = epoch * 1024 - (slot_key & 1023)
        return tl.where(num <= 0, 0, (tl.maximum(num, 0) + rate - 1) // tl.maximum(rate, 1))

    @triton.jit
    def _draw(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        requests,
        positions,
        rates,
        thresholds,
        pop_cdf,
        delta_cdf,
        out,
        seed_key,
        num_layers,
        K: tl.constexpr,
        KP: tl.constexpr,
        E: tl.constexpr,
        DM: tl.constexpr,
        DSTEPS: tl.constexpr,
        ESTEPS: tl.constexpr,
        DEPTH: tl.constexpr,
        ROUNDS: tl.constexpr,
    ):
        """requests [T], positions [T] int64 -> out [T, L, K] int64 (routing_draw._draw's steps)."""
        t = tl.program_id(0).to(tl.int64)
        layer = tl.program_id(1).to(tl.int64)
        req = tl.load(requests + t)
        pos = tl.load(positions + t)
        rate = tl.load(rates + layer)
        threshold = tl.load(thresholds + layer)
        pop_row = pop_cdf + layer * E
        req_key = _hash2(_hash2(req * 0 + seed_key, req), layer)  # int64 even if seed_key is specialised
        j = tl.arange(0, KP).to(tl.int64)  # [KP] slots
        slot_key = _hash2(req_key, j)
        epoch = _epoch(slot_key, pos, rate)
        own_key = _hash2(slot_key, epoch)
        start = _epoch_start(slot_key, epoch, rate)
        ids = tl.full((KP,), -1, dtype=tl.int64)
        for _ in range(DEPTH):
            h = _hash2(slot_key, epoch)
            delta = 1 + _count_le(delta_cdf, _hash2(h, 2) & 0xFFFFFF, DM, DSTEPS)
            other_key = _hash2(req_key, _hash2(h, 3) % K)
            other_epoch = _epoch(other_key, start - delta, rate) - 1
            reuse = ((h & 0xFFFFFF) < threshold) & (start - delta >= 0) & (other_epoch >= 0)
            fresh = _count_le(pop_row, _hash2(h, 1) & 0xFFFFFF, E, ESTEPS)
            ids = tl.where((ids < 0) & ~reuse, fresh, ids)
            slot_key = tl.where(reuse, other_key, slot_key)
            epoch = tl.where(reuse, other_epoch, epoch)
            start = tl.where(reuse, _epoch_start(other_key, other_epoch, rate), start)
        last = _count_le(pop_row, _hash2(_hash2(slot_key, epoch), 1) & 0xFFFFFF, E, ESTEPS)
        ids = tl.where(ids < 0, last, ids)
        earlier = j[None, :] < j[:, None]  # [KP (slot), KP (earlier slot)]
        for r in tl.static_range(ROUNDS):
            dup = tl.max(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), axis=1) > 0
            redraw = _count_le(pop_row, _hash2(own_key, 16 + r) & 0xFFFFFF, E, ESTEPS)
            ids = tl.where(dup, redraw, ids)
        for jj in tl.static_range(1, K):  # the next free id, slot by slot
            col = tl.sum(tl.where(j == jj, ids, 0), axis=0)
            for _ in tl.static_range(jj):
                clash = tl.sum(((j < jj) & (ids == col)).to(tl.int32), axis=0) > 0
                col = tl.where(clash, (col + 1) % E, col)
            ids = tl.where(j == jj, col, ids)
        tl.store(out + (t * num_layers + layer) * K + j, ids, mask=j < K)


def draw(tables: rd.DrawTables, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`routing_draw.draw` in one launch: requests [T], positions [T] int64 on the tables' device
    -> [T, L, k] int64."""
    if not available():
        raise RuntimeError("the Triton routing draw needs Triton (a CUDA build of torch)")
    t, layers, k, e = requests.shape[0], tables.num_layers, tables.top_k, tables.num_experts
    out = torch.empty(t, layers, k, dtype=torch.long, device=requests.device)
    if t == 0:
        return out
    _draw[(t, layers)](
        requests.contiguous(), positions.contiguous(), tables.rate, tables.mix_threshold, tables.pop_cdf,
        tables.delta_cdf, out, tables.seed_key, layers,
        K=k, KP=max(2, triton.next_power_of_2(k)), E=e, DM=rd.MAX_DELTA,
        DSTEPS=rd.MAX_DELTA.bit_length(), ESTEPS=e.bit_length(), DEPTH=rd.CHAIN_DEPTH, ROUNDS=rd.DEDUP_ROUNDS,
        num_warps=1,  # a program is 8 lanes of work: one warp, so more programs share an SM
    )  # fmt: skip
    return out
