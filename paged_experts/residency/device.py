"""LRU (aging-LFU, or their duel) residency of one paged layer kept on the device: a one-wave step is planned, paged
in and computed with no host synchronization, so a whole decode step can be captured in a CUDA graph.

A step fits one wave when its routed pairs P = tokens x top_k are at most K: then its distinct
experts are at most K too. The plan is the same one `residency.planner.LayerResidency` makes with its policy:
- hits are the routed experts already in a slot; misses are paged in in increasing expert id;
- the i-th miss takes the i-th victim: slots whose expert is not routed this step, ordered by
  (last use, expert id), never-used (initial) experts first, as `LruPolicy.victim` orders them;
  with `aging_period_steps` P (`lfu-aging`, `AgingLfuPolicy`), by (use count, last use, expert id): every
  expert's count (kept for all E, resident or not) is halved when a planned step is a multiple of P, then
  the routed experts' counts grow by one after the plan; with `duel` (`DuelPolicy`), by the aging LFU's
  order while the selector `psel` is above zero, else by LRU's, then the two shadow caches (LRU's and the LFU's,
  [2, E+1] bool) play the step and `psel` moves by their misses, over per-expert last uses [E+1];
- every routed expert's slot is stamped with the step number after the wave.
Shapes are static (the plan is padded to P entries; padding names the dummy expert E and the
dummy slot K, which the maps carry as one spare entry each), so nothing depends on a host read.

On CUDA with Triton the plan is one kernel (`plan_triton`, the same plan bit for bit; a duel's shadows a second one,
in a captured step one launch for every layer at the step's end: `DuelShadows`); `plan_step` below is its reference
and the CPU's plan.

Steps with more pairs than K (prefill, large batches) fall back to the host planner; the two
share one state: `pull_to(residency)` (`pull_many` for all layers: one device read) writes the device state into the
`LayerResidency` before a host-planned step and `push_from(residency)` reads it back after. A layer's state is views of
one int64 device buffer (`StateLayout`; the duel's shadow flags a byte view of its last words), so a push is one
host-to-device copy from one pinned buffer, with no dtype conversion on the way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paged_experts.residency import plan_triton
from paged_experts.residency.planner import LayerResidency
from paged_experts.residency.policies import DUEL_LIMIT_MISSES, AgingLfuPolicy, DuelPolicy, EvictionPolicy, LruPolicy

RECENT = 1 << 40
"""Added to a recently used slot's count in an aging plan with a window: it ranks after every count."""


class StateLayout:
    """Where each part of one layer's state lies in its int64 buffer (words): slot_of [E+1], expert_in [K+1], last_use
    [K+1], step, uses [E+1], expert_last_use [E+1], psel, then the shadows' [2, E+1] bool flags as bytes, padded to
    whole words. Each part starts on a 16-byte boundary (an even word), as a tensor of its own would: Triton
    specializes a kernel on whether each pointer it takes is 16-byte aligned, and the shadows' kernel is first
    launched on scratch copies (`DuelShadows.warm`), outside a capture that must not compile. The parts LRU reads
    come first (`lru_words`): an LRU or aging-LFU push copies only them. Plain attributes, computed once: a
    host-planned step reads them a few times per layer."""

    __slots__ = ("num_experts", "num_slots", "slot_of", "expert_in", "last_use", "step", "uses", "lru_words",
                 "expert_last_use", "psel", "shadow_bytes", "shadows", "words")  # fmt: skip

    def __init__(self, num_experts: int, num_slots: int) -> None:
        e1, k1 = num_experts + 1, num_slots + 1
        self.num_experts, self.num_slots = num_experts, num_slots
        self.slot_of = _part(0, e1)
        self.expert_in = _part(self.slot_of.stop, k1)
        self.last_use = _part(self.expert_in.stop, k1)
        self.step = _part(self.last_use.stop, 1).start  # one word
        self.uses = _part(self.step + 1, e1)
        self.lru_words = self.uses.stop  # what an LRU or aging-LFU plan reads and writes (the duel's parts follow)
        self.expert_last_use = _part(self.lru_words, e1)
        self.psel = _part(self.expert_last_use.stop, 1).start  # one word
        self.shadow_bytes = 2 * e1
        # the words whose first `shadow_bytes` bytes are the [2, E+1] shadow flags
        self.shadows = _part(self.psel + 1, -(-self.shadow_bytes // 8))
        self.words = self.shadows.stop


def _part(after: int, words: int) -> slice:
    """`words` words from the first even word at or after `after` (16 bytes: the buffer itself is aligned further)."""
    start = after + after % 2
    return slice(start, start + words)


@dataclass(frozen=True)
class DevicePlan:
    """One wave planned on the device (P = routed pairs of the step)."""

    pair_slot: torch.Tensor  # [P] slot serving each routed pair (after the page-ins)
    pair_missed: torch.Tensor  # [P] bool: the pair's expert is paged in by this plan
    miss_experts: torch.Tensor  # [P] experts to page in, ascending, padded with E
    miss_slots: torch.Tensor  # [P] slot each of them goes to, padded with K
    stats: torch.Tensor  # [3] int64: union, hits, misses (device scalars, read lazily)


class DeviceResidency:
    """K slots of one layer: expert<->slot maps, per-slot last use, per-expert use counts (aging LFU) and the
    step counter on `device`. `aging_period_steps` None: LRU; P: `lfu-aging` with counts halved every P steps;
    `duel` (with P): `duel:<P>:<W>`, LRU against that aging LFU, with shadow caches, a selector and per-expert last
    uses."""

    def __init__(
        self,
        num_experts: int,
        num_slots: int,
        device: torch.device,
        aging_period_steps: int | None = None,
        aging_window_steps: int = 0,
        duel: bool = False,
    ) -> None:
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"num_slots must be in [1, {num_experts}], got {num_slots}")
        if aging_period_steps is not None and aging_period_steps < 1:
            raise ValueError(f"aging_period_steps must be >= 1, got {aging_period_steps}")
        if duel and aging_period_steps is None:
            raise ValueError("a duel plan needs the aging LFU's period")
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.device = device
        self.aging_period_steps = aging_period_steps
        self.aging_window_steps = aging_window_steps if aging_period_steps is not None else 0  # AgingLfuPolicy's
        self.duel = duel
        e, k = num_experts, num_slots
        # Every part of the state is a view of one buffer (StateLayout): a push from the host planner is one copy.
        # The views are written in place, never replaced (the plan kernels and the shadows' table hold their addresses).
        self.layout = lay = StateLayout(e, k)
        self._state = torch.zeros(lay.words, dtype=torch.long, device=device)  # [words]
        # One spare entry each (index E / K) absorbs the padded writes of a plan.
        self.slot_of = self._state[lay.slot_of]  # [E+1] slot or -1
        self.slot_of.fill_(-1)
        self.slot_of[:k] = torch.arange(k, device=device)
        self.expert_in = self._state[lay.expert_in]  # [K+1] expert or E
        self.expert_in.fill_(e)
        self.expert_in[:k] = torch.arange(k, device=device)
        self.last_use = self._state[lay.last_use].fill_(-1)  # [K+1] step stamp, -1 never
        self.step = self._state[lay.step]  # [] planned steps so far
        # [E+1] aging LFU's use counts as of the last planned step (E: the spare entry); all 0 and unused under LRU
        self.uses = self._state[lay.uses]
        # The duel's (DuelPolicy's) state, all unused otherwise: [E+1] every expert's last use (-1 never; its shadows
        # rank experts that hold no slot), [2, E+1] LRU's and the LFU's shadow caches, [] the selector
        self.expert_last_use = self._state[lay.expert_last_use].fill_(-1)
        self.shadows = self._state[lay.shadows].view(torch.bool)[: lay.shadow_bytes].view(2, e + 1)
        self.shadows[:, :k] = True
        self.psel = self._state[lay.psel]
        self._arange_e = torch.arange(e + 1, device=device)  # [E+1]
        self._compiled_fn = None
        # The plan as one fused kernel (plan_triton) where it runs: the same plan as `plan_step`, one
        # launch instead of ~45 inside the captured decode step (a duel's shadows: a second). A benchmark sets it
        # False to compare.
        self.fused = plan_triton.available(device, num_experts, num_slots)
        # Set by the static decode step (graphs.GraphedDecoder) around its body: only there does the
        # plan go through torch.compile, whose shapes are captured before serving. Eager one-wave
        # steps of other sizes keep the plain plan, so nothing compiles inside a served request.
        self.in_static_step = False
        # The duel's shadows (the fused plan's second launch): only the layer's next plan reads what they write, so a
        # captured step defers them (`shadows_pending`, the step's pairs) and the step launches every layer's at its
        # end in one kernel (`DuelShadows.flush`, graphs.GraphedDecoder): one launch a token instead of one a
        # layer-step on the step's path (h100-duel-b: 48 forks beside the layers cost ~1.3-1.9 us a layer-step more
        # than the plan itself). Whatever is still pending when the layer plans again, or its state is read or
        # written, runs first, in line (`flush`), so a step that does not batch them stays correct. Eager steps
        # launch them right after the plan. `defer_shadows` False keeps them in line in a graph too (unused today).
        self.defer_shadows = duel and device.type == "cuda"
        self._duel_ids = torch.full((k,), -1, dtype=torch.long, device=device)  # [K] the step's ids, for the shadows
        self.shadows_pending: int | None = None  # the pairs of the planned step whose shadows have not run

    @classmethod
    def for_policy(
        cls, policy: EvictionPolicy, num_experts: int, num_slots: int, device: torch.device
    ) -> DeviceResidency:
        """The device plan of a host policy (LRU, `lfu-aging` or `duel`; the layer's host planner holds the same policy
        object, and the two share one state through `pull_to`/`push_from`). Any other policy raises TypeError."""
        if type(policy) not in (LruPolicy, AgingLfuPolicy, DuelPolicy):
            raise TypeError(f"the device plan runs LRU, lfu-aging and duel, not {type(policy).__name__}")
        aging = policy.lfu if isinstance(policy, DuelPolicy) else policy if isinstance(policy, AgingLfuPolicy) else None
        return cls(
            num_experts,
            num_slots,
            device,
            aging_period_steps=aging.period_steps if aging else None,
            aging_window_steps=aging.window_steps if aging else 0,
            duel=isinstance(policy, DuelPolicy),
        )

    def compile(self) -> None:
        """Plan through torch.compile inside the static decode step (one compiled function serves
        every layer of one shape): the plan is ~25 small elementwise ops and reductions, no sort, on a
        step's critical path per paged layer."""
        self._compiled_fn = _compiled_plan_step()

    def plan(self, flat_ids: torch.Tensor) -> DevicePlan:
        """flat_ids: [P] routed expert of each pair (P <= K) on the device; updates the state."""
        p = flat_ids.shape[0]
        if p > self.num_slots:
            raise ValueError(f"a device-planned step routes at most K={self.num_slots} pairs, got {p}")
        self.flush()  # the previous step's shadows, where no batch ran them: this plan reads their selector
        args = (
            flat_ids.to(torch.long),
            self.slot_of,
            self.expert_in,
            self.last_use,
            self.step,
            self._arange_e,
            self.num_experts,
            self.num_slots,
            self.uses,
            self.aging_period_steps or 0,
            self.aging_window_steps,
            (self.expert_last_use, self.shadows, self.psel) if self.duel else None,
        )
        if self.fused:
            # a duel's layer on CUDA: only a captured step defers its shadows (to the step's one launch for all layers)
            defer = self.defer_shadows and torch.cuda.is_current_stream_capturing()
            results = plan_triton.plan_step_triton(*args, duel_ids=self._duel_ids, defer_shadows=defer)
            if defer:
                self.shadows_pending = p
        elif self.in_static_step and self._compiled_fn is not None:
            results = self._compiled_fn(*args)
        else:
            results = plan_step(*args)
        pair_slot, pair_missed, miss_experts, miss_slots, stats = results
        return DevicePlan(
            pair_slot=pair_slot, pair_missed=pair_missed, miss_experts=miss_experts, miss_slots=miss_slots, stats=stats
        )

    def flush(self) -> None:
        """Runs this layer's pending shadows (a captured step's, where no batch ran them) in line on the current stream,
        which must be the one the plan ran on; a no-op when none is pending."""
        if self.shadows_pending is not None:
            p, self.shadows_pending = self.shadows_pending, None
            plan_triton.duel_shadows_triton(
                self._duel_ids, p, self.uses, self.step, self.expert_last_use, self.shadows, self.psel,
                self.num_experts, self.aging_window_steps,
            )  # fmt: skip

    def shadow_addresses(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensors `plan_triton.shadow_table` takes the addresses of (written in place, never replaced)."""
        return (self._duel_ids, self.uses, self.step, self.expert_last_use, self.shadows, self.psel)

    def state(self) -> torch.Tensor:
        """A copy of the state, [words] (graph capture rewinds a warm-up step with it)."""
        self.flush()
        return self._state.clone()

    def load_state(self, state: torch.Tensor) -> None:
        self.flush()
        self._state.copy_(state)

    def pull_to(self, residency: LayerResidency) -> None:
        """Writes this state into a host `LayerResidency` (same policy) before a host-planned step."""
        pull_many([(self, residency)])

    def push_from(self, residency: LayerResidency) -> None:
        """Reads a host `LayerResidency` (same policy) back after a host-planned step: the state laid out in one pinned
        host buffer and copied in one H2D copy without blocking the host (the device plan of a later step is
        stream-ordered after it). The shadow flags go as bytes of that buffer: torch's H2D copy that converts int64 to
        bool converts on the host into a new pageable tensor, whose copy CUDA may stage synchronously with the stream
        (its API synchronization rules), and is not pinned for the copy to run later."""
        self.flush()  # the copy below overwrites what a pending step's shadows read and write
        policy = _policy(self, residency)
        lay, e, k = self.layout, self.num_experts, self.num_slots
        assert len(residency.expert_in) == k
        words = lay.words if self.duel else lay.lru_words
        host = torch.empty(words, dtype=torch.long, pin_memory=self.device.type == "cuda")  # freed after its copy
        a = host.numpy()  # [words], the same memory
        a.fill(0)  # the padding between parts too: a pushed state equals one the device planned, word for word
        slot_of = a[lay.slot_of]
        slot_of.fill(-1)
        n = len(residency.slot_of)
        experts = np.fromiter(residency.slot_of.keys(), np.int64, n)
        slot_of[experts] = np.fromiter(residency.slot_of.values(), np.int64, n)
        a[lay.expert_in] = [*residency.expert_in, e]
        slots_expert = a[lay.expert_in][:k]  # [K], each slot's expert (< E: the slots are always full)
        a[lay.step] = residency.step
        last = max(residency.step - 1, 0)  # the aging counts as of the last planned step, as the device keeps them
        if isinstance(policy, DuelPolicy):
            every_stamp = np.array(policy.lfu.all_last_uses(e), dtype=np.int64)  # [E]
            a[lay.last_use][:k] = every_stamp[slots_expert]
            a[lay.uses][:e] = policy.lfu.all_uses(e, last)
            a[lay.expert_last_use][:e] = every_stamp
            a[lay.expert_last_use][e] = -1
            a[lay.psel] = policy.psel
            flags = a[lay.shadows].view(np.uint8)[: lay.shadow_bytes].reshape(2, e + 1)  # [2, E+1], bool's bytes
            for i, shadow in enumerate(policy.shadows):
                flags[i, np.fromiter(shadow, np.int64, len(shadow))] = 1
        else:
            assert isinstance(policy, AgingLfuPolicy | LruPolicy)
            a[lay.last_use][:k] = np.array(policy.all_last_uses(e), dtype=np.int64)[slots_expert]
            if isinstance(policy, AgingLfuPolicy):  # the next plan halves the counts first at a multiple of the period
                a[lay.uses][:e] = policy.all_uses(e, last)
        a[lay.last_use][k] = -1
        self._state[:words].copy_(host, non_blocking=True)  # the caching host allocator keeps `host` until it ran


def pull_many(pairs: Sequence[tuple[DeviceResidency, LayerResidency]]) -> float:
    """Writes each device state into its host `LayerResidency` (LRU, aging LFU or their duel) with one device read
    for all. Returns the seconds of that read (on CUDA it waits for the device's queued work: the prefill counters'
    host_wait_s)."""
    if not pairs:
        return 0.0
    for dev, _ in pairs:
        dev.flush()  # a pending step's shadows write what the read below takes
    words = [d.layout.words if d.duel else d.layout.lru_words for d, _ in pairs]
    rows = torch.cat([d._state[:n] for (d, _), n in zip(pairs, words, strict=True)])
    started = time.perf_counter()
    values = rows.cpu().numpy()  # the one host read
    read_s = time.perf_counter() - started
    start = 0
    for (dev, residency), n in zip(pairs, words, strict=True):
        a, lay, k, e = values[start : start + n], dev.layout, dev.num_slots, dev.num_experts
        start += n
        expert_in, last_use = a[lay.expert_in][:k].tolist(), a[lay.last_use][:k].tolist()
        step, uses = int(a[lay.step]), a[lay.uses][:e].tolist()
        policy = _policy(dev, residency)
        residency.expert_in = expert_in
        residency.slot_of = {ex: s for s, ex in enumerate(expert_in)}
        residency.step = step
        if isinstance(policy, DuelPolicy):
            # every expert's last use, counts and shadows as the device kept them: the host plans from the same state
            stamps = a[lay.expert_last_use][:e].tolist()
            flags = a[lay.shadows].view(np.uint8)[: lay.shadow_bytes].reshape(2, e + 1)[:, :e]  # [2, E]
            policy.lfu.set_states(uses, stamps, max(step - 1, 0))
            policy.lru.set_last_uses(stamps)
            lru_shadow, lfu_shadow = (set(np.flatnonzero(row).tolist()) for row in flags)
            policy.set_state((lru_shadow, lfu_shadow), int(a[lay.psel]))
            continue
        if isinstance(policy, AgingLfuPolicy):
            # counts of every expert as of the last planned step; last uses of the residents only (the device
            # keeps a stamp per slot: an evicted expert's last use is the host's, from before, or unknown)
            stamps = policy.all_last_uses(e)  # [E], a new list
            for ex, stamp in zip(expert_in, last_use, strict=True):
                if 0 <= ex < e:  # a real expert (as the dict before it, nothing else is written)
                    stamps[ex] = stamp
            policy.set_states(uses, stamps, max(step - 1, 0))
            continue
        assert isinstance(policy, LruPolicy)
        policy.set_some_last_uses(expert_in, last_use)
    return read_s


def plan_step(
    flat_ids: torch.Tensor,
    slot_of: torch.Tensor,
    expert_in: torch.Tensor,
    last_use: torch.Tensor,
    step: torch.Tensor,
    arange_e: torch.Tensor,
    e: int,
    k: int,
    uses: torch.Tensor | None = None,
    aging_period: int = 0,
    aging_window: int = 0,
    duel: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One wave's plan over a layer's state (updated in place): flat_ids [P] int64 ->
    (pair_slot [P], pair_missed [P], miss_experts [P], miss_slots [P], stats [3]); see DevicePlan.
    aging_period 0: LRU; P > 0: aging LFU over `uses` [E+1] (halved first when the step is a multiple of P),
    with aging_window W > 0 the slots used in the last W steps ranked after every other. `duel` (with P):
    (expert_last_use [E+1], shadows [2, E+1] bool, psel []): the LFU's order while psel > 0, else LRU's, then
    the shadows play the step (`DuelPolicy.end_step`)."""
    p = flat_ids.shape[0]
    device = flat_ids.device
    # index_fill_ (a scalar kernel argument), not `t[idx] = value`: that copies the value from
    # the host, which a CUDA graph cannot capture
    used = torch.zeros(e + 1, dtype=torch.bool, device=device).index_fill_(0, flat_ids, True)  # [E+1]
    resident = slot_of >= 0  # [E+1]
    miss = used & ~resident  # [E+1]
    n_used = used.sum()
    n_miss = miss.sum()
    # No sort: in the graphed (uncompiled) FP8 step on the H200, torch.sort of these few entries ran as
    # radix sorts of 26 us (E+1 = 129) and 9 us (K = 40) per paged layer, 1.7 ms of a 48-layer token
    # (benchmarks/results/h200/2026-12-02-flags-overlap). Counting ranks takes a few small elementwise ops.
    # Misses ascending, padded with E: the i-th miss is the first expert whose running miss count is i + 1.
    misses_so_far = torch.cumsum(miss, 0)  # [E+1]
    wanted = torch.arange(1, p + 1, device=device, dtype=misses_so_far.dtype)  # [P]
    miss_experts = torch.searchsorted(misses_so_far, wanted).clamp_(max=e)  # [P]; past the last miss: E + 1 -> E
    valid = miss_experts < e  # [P]
    # Victims: unpinned slots by (last use, expert id); pinned slots (routed now) rank last.
    pinned = used[expert_in[:k]]  # [K]
    key = (last_use[:k] + 1) * (e + 1) + expert_in[:k]  # [K], distinct per slot
    key = torch.where(pinned, torch.iinfo(torch.long).max, key)
    # rank of slot i = slots ordered before it (ties, among pinned slots only, by slot index): a permutation
    earlier = arange_e[None, :k] < arange_e[:k, None]  # [K, K]: slot j before slot i
    before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & earlier)  # [K, K]
    lru_before = before
    if aging_period:
        assert uses is not None
        # the period's halving, before anything reads the counts (a device scalar: no host read)
        uses.copy_(torch.where(torch.remainder(step, aging_period) == 0, uses >> 1, uses))
        count = uses[expert_in[:k]]  # [K]
        if aging_window:
            stamp = last_use[:k]  # [K]; -1: never used, not recent
            recent = (stamp >= 0) & (stamp >= step - aging_window)
            count = count + recent.to(torch.long) * RECENT  # ranks after every count (counts stay below 2P)
        count = torch.where(pinned, torch.iinfo(torch.long).max, count)  # [K]
        before = (count[None, :] < count[:, None]) | ((count[None, :] == count[:, None]) & before)  # [K, K]
        if duel is not None:
            before = torch.where(duel[2] > 0, before, lru_before)  # the selector's choice, a device scalar
    rank = before.sum(1)  # [K]
    victims = (rank[None, :] == arange_e[:p, None]).to(torch.uint8).argmax(1)  # [P] slot of rank j (P <= K)
    miss_slots = torch.where(valid, victims, k)  # [P]
    evicted = torch.where(valid, expert_in[miss_slots], e)  # [P]
    slot_of.index_fill_(0, evicted, -1)
    slot_of.index_copy_(0, miss_experts, torch.where(valid, miss_slots, -1))
    slot_of[e:].fill_(-1)  # the spare entry took padded writes
    expert_in.index_copy_(0, miss_slots, torch.where(valid, miss_experts, e))
    pair_missed = miss[flat_ids]  # [P]
    pair_slot = slot_of[flat_ids]  # [P]
    last_use.index_copy_(0, pair_slot, step.expand(p).contiguous())
    if duel is not None:
        assert uses is not None and aging_period
        _duel_shadows(used[:e], uses[:e], step, aging_window, arange_e[:e], *duel)
        duel[0].index_copy_(0, flat_ids, step.expand(p).contiguous())
        duel[0][e:].fill_(-1)  # the spare entry took padded writes
    if aging_period:
        assert uses is not None
        uses.add_(used.to(torch.long))  # once per step and routed expert
        uses[e:].fill_(0)  # the spare entry took the padding's count
    step += 1
    return pair_slot, pair_missed, miss_experts, miss_slots, torch.stack([n_used, n_used - n_miss, n_miss])


def _duel_shadows(
    used: torch.Tensor,
    uses: torch.Tensor,
    step: torch.Tensor,
    window_steps: int,
    arange: torch.Tensor,
    expert_last_use: torch.Tensor,
    shadows: torch.Tensor,
    psel: torch.Tensor,
) -> None:
    """`DuelPolicy.end_step` on the device: used [E] bool, uses [E] (the step's counts, halved, before its own uses)
    -> each shadow's misses take its lowest-ranked unrouted experts' places, psel += LRU's misses - the LFU's."""
    e = used.shape[0]
    stamp = expert_last_use[:e]  # [E] before this step's uses
    key = (stamp + 1) * (e + 1) + arange  # [E] LRU's order: (last use, id), distinct
    count = uses
    if window_steps:
        count = count + ((stamp >= 0) & (stamp >= step - window_steps)).to(torch.long) * RECENT
    lru_before = key[None, :] < key[:, None]  # [E, E]: expert j before expert i
    lfu_before = (count[None, :] < count[:, None]) | ((count[None, :] == count[:, None]) & lru_before)  # [E, E]
    missed = []
    for i, before in enumerate((lru_before, lfu_before)):
        shadow = shadows[i, :e]  # [E] bool
        candidates = shadow & ~used
        miss = used & ~shadow
        n_miss = miss.sum()
        rank = (before & candidates[None, :]).sum(1)  # [E]: candidates ranked before expert i
        evicted = candidates & (rank < n_miss)
        shadows[i, :e] = (shadow & ~evicted) | miss
        missed.append(n_miss)
    psel.copy_((psel + missed[0] - missed[1]).clamp(-DUEL_LIMIT_MISSES, DUEL_LIMIT_MISSES))


class DuelShadows:
    """Every duel layer's shadows of a captured step in one launch at the step's end (`flush`): the layers' plans defer
    theirs (DeviceResidency.shadows_pending) and nothing in the step reads them. Built outside any capture (the
    address table is a device tensor); the layers must share E and the window, as one policy's do."""

    def __init__(self, layers: Sequence[DeviceResidency | None]) -> None:
        self.layers = [dr for dr in layers if dr is not None and dr.duel and dr.defer_shadows]
        self.table: torch.Tensor | None = None
        if self.layers:
            first = self.layers[0]
            if any((dr.num_experts, dr.aging_window_steps) != (first.num_experts, first.aging_window_steps)
                   for dr in self.layers):  # fmt: skip
                raise ValueError("DuelShadows: the layers' duels differ in E or window; one launch plays one shape")
            self.table = plan_triton.shadow_table([dr.shadow_addresses() for dr in self.layers], first.device)

    def flush(self) -> None:
        """One launch for every layer whose plan of this step deferred its shadows with the same pairs (all of them,
        in a decode step); any other pending layer runs its own in line."""
        pending = [dr.shadows_pending for dr in self.layers]
        if not self.layers or all(p is None for p in pending):
            return
        p = pending[0]
        if self.table is not None and p is not None and all(q == p for q in pending):
            dr0 = self.layers[0]
            plan_triton.duel_shadows_layers_triton(self.table, p, dr0.num_experts, dr0.aging_window_steps)
            for dr in self.layers:
                dr.shadows_pending = None
            return
        for dr in self.layers:
            dr.flush()

    def warm(self, p: int) -> None:
        """Compiles and loads the shadows' kernels (the batch's and a layer's own) for steps of `p` pairs, outside any
        capture: Triton loads a kernel's module at its first launch of a specialization, which the driver forbids
        while a stream captures (cuModuleLoadData), and a captured step's first launch of the batch would be its
        first anywhere (eager steps run each layer's shadows in line, so nothing else launches it). Runs them once
        on scratch copies of the first layer's state, so no layer's state moves."""
        if self.table is None:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("DuelShadows.warm: call it before the capture (a first launch loads a module)")
        dr0 = self.layers[0]
        ids, uses, step, elu, shadows, psel = (t.clone() for t in dr0.shadow_addresses())
        table = plan_triton.shadow_table([(ids, uses, step, elu, shadows, psel)], dr0.device)
        e, window = dr0.num_experts, dr0.aging_window_steps
        plan_triton.duel_shadows_layers_triton(table, p, e, window)
        plan_triton.duel_shadows_triton(ids, p, uses, step, elu, shadows, psel, e, window)

    def discard(self) -> None:
        """Forgets every pending flag without launching anything: after a capture that failed, whose deferred plans
        never ran (a later flush would replay the step before them, or bake it into the next capture)."""
        for dr in self.layers:
            dr.shadows_pending = None


_COMPILED: list = []


def _compiled_plan_step():  # noqa: ANN202 - torch.compile's wrapper type
    if not _COMPILED:
        _COMPILED.append(torch.compile(plan_step, dynamic=False))
    return _COMPILED[0]


def _policy(dev: DeviceResidency, residency: LayerResidency) -> EvictionPolicy:
    """The host policy that shares `dev`'s state: LRU, aging LFU of the same period and window, or their duel."""
    policy = residency.policy
    if dev.aging_period_steps is None:
        if not isinstance(policy, LruPolicy):
            raise TypeError(f"this device residency plans LRU, the host {type(policy).__name__}")
        return policy
    kind, name = (DuelPolicy, "duel") if dev.duel else (AgingLfuPolicy, "lfu-aging")
    if not isinstance(policy, kind) or (policy.period_steps, policy.window_steps) != (
        dev.aging_period_steps,
        dev.aging_window_steps,
    ):
        raise TypeError(
            f"this device residency plans {name} every {dev.aging_period_steps} steps (window "
            f"{dev.aging_window_steps}), the host {type(policy).__name__}"
        )
    return policy
