"""The GPU's side of the DMA proxy (residency/dma_proxy.py): two one-program Triton kernels a captured decode
step launches in stream order, with no host sync.

- `ring`: takes the next ticket (an atomic on a device counter), writes a record (table, entries, tensor mask,
  the planned experts and their slots) into the ring in pinned host memory, notes the ticket under its call
  site's entry (device), and publishes the ticket last: a release at system scope after a barrier, so the host
  thread that reads the ticket reads the whole record. A record with nothing to copy (every entry padding: a
  layer whose routed experts all hit) then writes its own ticket into `done`, so its wait returns at once: no
  round trip through the host for it (the thread still serves the record, without copies or an echo). Why: on
  the model's routing most layers of a decode token miss nothing (h100-dmaproxy: 0.034 of the routed experts
  missed), and each round trip cost ~20-35 us. The GPU then no longer waits for the thread on those tickets, so
  its lead over the thread must stay below the ring's slots: the owner's drain after each replay bounds it to
  one replay's rings (residency/dma_proxy.py).
- `wait`: spins (volatile loads) until the proxy's copy of that ticket into `done` has landed, which the copy
  engine writes after every row of the record (one stream, in order). A wait gives up when it passes `limit`
  polls (~0.5 us each: an approximate time), when the thread's state says it is not running, or at once when an
  earlier wait gave up (a device word, read on every wait without crossing the link): it writes its ticket into
  that word and the pinned error word (if none is there) and the host's `DmaProxy.check` raises after the step's
  readback (the step's output is not to be trusted). A dead proxy never hangs the GPU. A give-up is final for the
  process: the proxy's records and the slots may disagree from then on, so every later step fails too (restart).

Record layout (int64 words): [0] ticket, [1] table, [2] entries, [3] tensor mask, [4, 4 + P) experts,
[4 + P, 4 + 2P) slots, P = max_pairs (dma_proxy.c reads the same).
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; the CPU wheel has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

if triton is not None:
    # The integer arguments vary per call site and step (an entry, a table, a mask, a count): unspecialized, so
    # a value of 1 never turns one into a constant and no value compiles a variant of its own during capture.

    @triton.jit(do_not_specialize=["entry", "table", "mask", "n", "rows"])
    def _ring(
        counter, ring, tick, done, experts, slots, entry, table, mask, n, rows, R: tl.constexpr, W: tl.constexpr,
        P: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip  # pragma: no cover
        t = tl.atomic_add(counter, 1) + 1  # tickets start at 1; `done` starts at 0
        rec = ring + (t % R) * W
        offs = tl.arange(0, BLOCK)
        live = offs < n
        ex = tl.load(experts + offs, mask=live, other=rows)  # [BLOCK]: padding names an expert >= rows
        tl.store(rec + 4 + offs, ex, mask=live)
        tl.store(rec + 4 + P + offs, tl.load(slots + offs, mask=live), mask=live)
        tl.store(rec + 1, table)  # stored as the ring's int64
        tl.store(rec + 2, n)
        tl.store(rec + 3, mask)
        tl.store(tick + entry, t)
        planned = tl.sum((ex < rows).to(tl.int32), axis=0)  # entries that name an expert to copy
        tl.debug_barrier()  # every thread's stores before the one release below
        tl.atomic_xchg(rec, t, sem="release", scope="sys")
        if planned == 0:  # nothing to copy: the ticket is done here, and the thread writes no echo for it
            tl.store(done + t % R, t)

    @triton.jit(do_not_specialize=["entry", "limit"])
    def _wait(done, tick, entry, err, gave_up, state, limit, R: tl.constexpr):  # pragma: no cover
        t = tl.load(tick + entry, volatile=True)
        seen = tl.load(done + t % R, volatile=True)  # a slot's done words only rise: >= t is t landed
        polls = 0
        alive = tl.load(gave_up, volatile=True) == 0  # device memory: once one wait gave up, every later one does
        while (seen < t) & (polls < limit) & alive:
            seen = tl.load(done + t % R, volatile=True)
            polls += 1
            if polls % 256 == 0:  # the thread's state (pinned, over the link): not running, nothing will land
                alive = tl.load(state, volatile=True) == 1
        if seen < t:
            if tl.load(gave_up, volatile=True) == 0:
                tl.store(gave_up, t)
                tl.store(err, t)  # pinned: the first ticket that did not land, for the host


def available() -> bool:
    """True where the kernels can launch (Triton imported)."""
    return triton is not None


def ring(
    counter: torch.Tensor, ring_words: torch.Tensor, tick: torch.Tensor, done: torch.Tensor, experts: torch.Tensor,
    slot_ids: torch.Tensor, entry: int, table: int, mask: int, rows: int, ring_slots: int, record_words: int,
    max_pairs: int,
) -> None:  # fmt: skip
    """Launches `_ring` for planned rows experts [n] -> slot_ids [n] (int64, n <= max_pairs, padded entries
    name an expert >= the table's `rows`). A record with no entry below `rows` completes its own ticket in `done`
    (no round trip: the thread serves it without copies and writes no echo)."""
    n = experts.shape[0]
    if n > max_pairs or slot_ids.shape[0] != n:
        raise ValueError(
            f"a ring record holds at most {max_pairs} entries, got {n} experts and {slot_ids.shape[0]} slots"
        )
    block = max(16, triton.next_power_of_2(max(n, 1)))
    _ring[(1,)](
        counter, ring_words, tick, done, experts, slot_ids, entry, table, mask, n, rows,
        R=ring_slots, W=record_words, P=max_pairs, BLOCK=block, num_warps=1,
    )  # fmt: skip


def wait(
    done: torch.Tensor, tick: torch.Tensor, entry: int, err: torch.Tensor, gave_up: torch.Tensor,
    state: torch.Tensor, limit: int, ring_slots: int,
) -> None:  # fmt: skip
    """Launches `_wait` for the ticket call site `entry` last rang (`err`, `state`: pinned words; `gave_up`: the
    device's copy of `err`)."""
    _wait[(1,)](done, tick, entry, err, gave_up, state, limit, R=ring_slots, num_warps=1)
