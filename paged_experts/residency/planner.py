"""The wave planner of one MoE layer's expert residency: which expert sits in which slot, and the waves
a step is served in (`LayerResidency.plan_step`); which resident leaves is the eviction policy's choice
(policies.py).

This module is Python and numpy (no tensors) so the runtime, the paging simulator and the tests all
share one implementation: the simulator replays traces through exactly this code.

Rules (DESIGN.md section 4):
- slots start holding experts 0..K-1;
- a step whose distinct routed experts fit K is one wave; a larger step (a prefill chunk, a large
  batch) is split into waves, resident ones first, so every routed expert is paged in at most once;
- an expert of the wave being served is never evicted, nor a routed one still waiting for its wave;
- every miss pages one expert into the slot of an evicted one.

Multi-wave steps are planned for a copy engine that never idles (moe/planning.py streams them):
waves hold at most W = (K - P) // 2 experts and the previous wave's experts are not evicted either,
so wave j+1's page-ins land in slots that waves <= j-1 have finished with and copy while wave j
computes. What such a step leaves in the K slots is the prefill residency policy (`PREFILL_KEEP`,
compared by `benchsuite simulate --include-prefill --prefill-keep ...`, docs/prefill.md):
- `recent` (default): the experts routed by the chunk's LAST tokens stay. Misses are served in order
  of their last use in the step (the latest last), served experts are evicted oldest-last-use first,
  and up to K/2 routed residents among the step's K most recent are kept in place (P of them,
  protected: never evicted, served in the middle waves, so that the first wave stays small and the
  first page-ins start early, and the last wave, the layer's tail after its last page-in, too). This
  is what token-by-token LRU would keep, and the next decode tokens route mostly to what the last
  prompt tokens used (consecutive tokens share experts: DESIGN.md section 8). On the calibrated
  synthetic routing (its host generator before the counter-based draw of routing_draw.py) it keeps
  0.79 of the first 16 decode tokens' experts resident after a 2,048-token prompt at K=32 where `lru`
  keeps 0.71 (0.90 against 0.80 at K=64), for the same page-in bytes.
- `frequent`: the same with the step's most-routed experts kept (ties: the later last use).
- `lru`: the planner before this policy existed: misses in expert-id order, served experts evicted
  lowest id first, nothing protected; the slots end up holding the highest-id misses, which have
  nothing to do with the decode that follows.
None of them moves a byte more than another: hits and misses of a step do not depend on the policy,
only what the slots hold afterwards (and so the misses of the steps that follow).

Staging rows (`RuntimeConfig.prefill_staging_rows`, docs/prefill.md): a prefill chunk routes to nearly
every expert, and every one of a layer's K residents is routed, so a layer's first page-in must wait
until a wave has computed the expert it evicts, i.e. until the layer's attention, its routing and the
host's plan are done: the link idles there (~3.6 ms a layer on the H200, h200-prefill). R staging rows,
shared by all layers, take the first page-ins of a layer without evicting anything: while layer i
computes, the runtime copies layer i+1's `stage_candidates` (R non-resident experts, the ones the
latest large steps routed first; only for a step of >= 8 pairs per expert, which routes nearly every
expert) into the staging rows, and layer i+1's `plan_step(..., staged=...)` serves them first, from those rows, as
a wave of their own (`Wave.table == STAGING`); the rest is planned as before, and once a staged expert's
wave has computed, the ones the keep policy ranks among the K are copied into slots (`Promotion`), so the
slots end as they would have without staging.
A staged expert the chunk does not route moved its bytes for nothing: it is a page-in all the same (a
miss, and in the step's union, which then counts the experts served or paged in).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from paged_experts.residency.policies import DuelPolicy, EvictionPolicy, LruPolicy

WaveTable = Literal["slots", "staging"]  # the table a wave reads: the layer's K slots, or the shared staging rows
SLOTS: WaveTable = "slots"
STAGING: WaveTable = "staging"
MAX_STAGING_ROWS = 256  # RuntimeConfig.prefill_staging_rows' bound: a sanity limit (E - K bounds it per model)
STAGE_MIN_PAIRS_PER_EXPERT = 8
"""A step stages only when it routes at least this many pairs per expert (128 tokens of top-8 over 128
experts): then nearly every expert is routed, and a staged one is almost never moved for nothing."""


@dataclass(frozen=True)
class Wave:
    """One compute pass over at most K distinct experts, after its page-ins."""

    experts: tuple[int, ...]  # distinct expert ids served in this wave
    slots: tuple[int, ...]  # slot (or staging row) holding each of `experts`, same order
    page_ins: tuple[tuple[int, int], ...]  # (expert, slot) copied from the host before the wave
    hits: int  # experts of this wave already resident when the step began
    table: WaveTable = SLOTS  # STAGING: rows copied before the step's plan (page_ins may hold unrouted experts)


@dataclass(frozen=True)
class Promotion:
    """A staged expert the keep policy ranks among the K, copied device to device from its staging row into
    the slot of an expert outside them, once wave `after` (the last of the step that reads that slot; 0, the
    STAGING wave, for an expert the step did not route) has computed: what the slots would have kept."""

    expert: int
    row: int
    slot: int
    after: int


@dataclass(frozen=True)
class StepPlan:
    waves: tuple[Wave, ...]
    union: int  # distinct experts routed in the step, and any staged one it did not route (paged in all the same)
    promotions: tuple[Promotion, ...] = ()  # staged experts moved into the slots after their waves (`_promote`)

    @property
    def hits(self) -> int:
        return sum(w.hits for w in self.waves)

    @property
    def misses(self) -> int:
        return sum(len(w.page_ins) for w in self.waves)

    @property
    def staged_unused(self) -> int:
        """Staged experts the step did not route: paged in (misses) for nothing."""
        return sum(len(w.page_ins) - len(w.experts) for w in self.waves if w.table == STAGING)


PREFILL_KEEP: tuple[str, ...] = ("recent", "frequent", "lru")
"""What a multi-wave step (a prefill chunk) leaves in the slots; see the module docstring."""
DEFAULT_PREFILL_KEEP = "recent"


def keep_rank(routed: Sequence[int] | np.ndarray, keep: str) -> dict[int, tuple[int, ...]] | None:
    """Expert -> sort key of a step's routed experts (higher = keep), from their order in the step
    (`routed` [T*k] token-major, ids >= 0): `recent` = (last index,), `frequent` = (count, last index);
    None for `lru`, which orders by expert id. In numpy: a 2,048-token chunk routes 16,384 pairs, and
    the dict over them cost the prefill's host 1.3 ms per layer on the H200 (the host is its bound)."""
    if keep == "lru":
        return None
    ids = np.asarray(routed, dtype=np.int64)  # [T*k]
    if ids.size == 0:
        return {}
    last = np.full(int(ids.max()) + 1, -1, dtype=np.int64)  # [max id + 1]
    np.maximum.at(last, ids, np.arange(ids.size))  # each expert's last index in the step
    experts = np.flatnonzero(last >= 0)
    lasts = last[experts].tolist()
    if keep == "recent":
        return {e: (i,) for e, i in zip(experts.tolist(), lasts)}
    counts = np.bincount(ids)[experts].tolist()
    return {e: (c, i) for e, c, i in zip(experts.tolist(), counts, lasts)}


class LayerResidency:
    """K slots of one layer: the expert<->slot maps, the policy and the wave planner."""

    def __init__(
        self,
        num_experts: int,
        num_slots: int,
        policy: EvictionPolicy | None = None,
        prefill_keep: str = DEFAULT_PREFILL_KEEP,
    ) -> None:
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"num_slots must be in [1, {num_experts}], got {num_slots}")
        if prefill_keep not in PREFILL_KEEP:
            raise ValueError(f"prefill residency must be one of {PREFILL_KEEP}, got {prefill_keep!r}")
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.prefill_keep = prefill_keep
        self.policy: EvictionPolicy = policy if policy is not None else LruPolicy()
        if isinstance(self.policy, DuelPolicy) and self.policy.num_slots != num_slots:
            raise ValueError(f"a duel's shadows hold {self.policy.num_slots} experts, the layer {num_slots} slots")
        self.slot_of: dict[int, int] = {e: e for e in range(num_slots)}
        self.expert_in: list[int] = list(range(num_slots))
        self.step = 0
        # Staging's history, kept by large steps only (>= STAGE_MIN_PAIRS_PER_EXPERT pairs per expert: prefill
        # chunks, which this planner always plans, also where the device plans the small steps, whose state the
        # host sees only in part): how many such steps were planned, and the last one that routed each expert.
        self.large_steps = 0
        self.last_large = np.full(num_experts, -1, dtype=np.int64)  # [E]

    def stages(self, num_pairs: int) -> bool:
        """Whether a step of `num_pairs` routed pairs is large enough to stage for (and to count in its history)."""
        return num_pairs >= STAGE_MIN_PAIRS_PER_EXPERT * self.num_experts

    def stage_candidates(self, rows: int, num_pairs: int) -> tuple[int, ...]:
        """The experts to copy into `rows` staging rows before a step of `num_pairs` routed pairs (module
        docstring): none for a step below `stages`; else up to `rows` non-resident experts, the ones the
        latest large steps routed first (a chunk most likely routes them again: those it does not were
        copied for nothing), ties by lowest id. A function of the slots and the large steps' history alone,
        which runtime and simulator keep alike whoever plans the small steps."""
        if rows <= 0 or not self.stages(num_pairs):
            return ()
        outside = np.array([e for e in range(self.num_experts) if e not in self.slot_of], dtype=np.int64)
        order = np.lexsort((outside, -self.last_large[outside]))  # the latest large step first, then id
        return tuple(outside[order[:rows]].tolist())

    def is_resident(self, expert: int) -> bool:
        return expert in self.slot_of

    def plan_step(self, routed: Iterable[int] | np.ndarray, staged: Sequence[int] = ()) -> StepPlan:
        """Plan one step over the experts routed by all tokens of the step, in token order
        (`[T*k]` flattened, duplicates allowed: the order ranks experts for `prefill_keep`). A numpy
        array (the runtime's prefill: 16,384 ids a chunk) is read in numpy; a list as it is.
        `staged`: non-resident experts copied into staging row i = their index before the plan
        (`stage_candidates`): served first, from those rows, by a STAGING wave; the rest as before."""
        if isinstance(routed, np.ndarray):
            routed = routed.reshape(-1).astype(np.int64, copy=False)
            low, high = (int(routed.min()), int(routed.max())) if routed.size else (0, 0)
            # an id out of range fails the check below; bincount (O(n), not a sort) only sees valid ones
            outside = [x for x in (low, high) if not 0 <= x < self.num_experts]
            distinct = outside or np.flatnonzero(np.bincount(routed)).tolist()
        else:
            routed = routed if isinstance(routed, list) else [int(e) for e in routed]
            distinct = sorted(set(routed))
        if distinct and not (0 <= distinct[0] and distinct[-1] < self.num_experts):
            bad = distinct[0] if distinct[0] < 0 else distinct[-1]
            raise ValueError(f"expert id {bad} out of range [0, {self.num_experts})")
        union = len(distinct)
        routed_experts = distinct  # the step's distinct routed experts (`distinct` drops the staged ones below)
        if self.stages(routed.size if isinstance(routed, np.ndarray) else len(routed)):
            self.last_large[distinct] = self.large_steps
            self.large_steps += 1
        staging: tuple[Wave, ...] = ()
        if staged:
            # the union counts what the step served or paged in: a staged expert it does not route still
            # crossed the link (a miss), so hits + misses == union holds (PagingCounters checks it)
            union = len(set(distinct) | set(staged))
            staging, distinct = self._staging_wave(staged, distinct)
        rank = keep_rank(routed, self.prefill_keep) if len(distinct) > self.num_slots or staged else None
        if len(distinct) <= self.num_slots:
            resident = [e for e in distinct if e in self.slot_of]
            missing = [e for e in distinct if e not in self.slot_of]
            waves: tuple[Wave, ...] = (self._plan_wave(resident + missing, hits=len(resident)),) if distinct else ()
        else:
            waves = self._plan_waves(distinct, rank)
        promotions = self._promote(staging[0], staging + waves, rank) if staging and rank is not None else ()
        for expert in staged:  # served from a staging row and not promoted: it never held a slot
            if expert not in self.slot_of:
                self.policy.on_evict(expert, self.step)
        self.policy.end_step(routed_experts, self.slot_of.keys(), self.step)
        self.step += 1
        return StepPlan(waves=staging + waves, union=union, promotions=promotions)

    def _promote(self, staging: Wave, waves: Sequence[Wave], rank: dict[int, tuple[int, ...]]) -> tuple[Promotion, ...]:
        """After a staged step's waves: each staged expert the keep policy ranks among the step's K best, the
        best first, takes the slot of an expert outside them: one the step did not route first (the eviction
        policy's choice, as a page-in's), then the lowest-ranked routed one, so the slots hold what they would
        have held without staging. (`lru` ranks nothing: plan_step promotes nothing for it.)"""
        keep = set(sorted(rank, key=rank.__getitem__)[-self.num_slots :])
        rows = dict(zip(staging.experts, staging.slots))
        promote = sorted((e for e in staging.experts if e in keep), key=rank.__getitem__, reverse=True)
        read_in = {e: i for i, wave in enumerate(waves) if wave.table == SLOTS for e in wave.experts}
        out = []
        for expert in promote:
            outside = [e for e in self.slot_of if e not in keep]
            unrouted = [e for e in outside if e not in rank]
            if unrouted:
                victim = self.policy.victim(unrouted, self.step)
            elif outside:
                victim = min(outside, key=rank.__getitem__)
                self.policy.on_evict(victim, self.step)
            else:
                break
            slot = self.slot_of.pop(victim)
            self.slot_of[expert] = slot
            self.expert_in[slot] = expert
            out.append(Promotion(expert, rows[expert], slot, read_in.get(victim, 0)))
        return tuple(out)

    def _staging_wave(self, staged: Sequence[int], distinct: list[int]) -> tuple[tuple[Wave, ...], list[int]]:
        """The STAGING wave of the `staged` experts the step routes (every staged one a page-in, routed or
        not), and the routed experts left for the slots."""
        if len(set(staged)) != len(staged) or any(e in self.slot_of or not 0 <= e < self.num_experts for e in staged):
            raise ValueError(f"staged experts must be distinct, in range and not resident, got {tuple(staged)}")
        routed = set(distinct)
        served = [(e, row) for row, e in enumerate(staged) if e in routed]
        for e, _ in served:
            self.policy.on_use(e, self.step)
        wave = Wave(
            experts=tuple(e for e, _ in served), slots=tuple(r for _, r in served),
            page_ins=tuple((e, row) for row, e in enumerate(staged)), hits=0, table=STAGING,
        )  # fmt: skip
        taken = {e for e, _ in served}
        return (wave,), [e for e in distinct if e not in taken]

    def _plan_waves(self, distinct: list[int], rank: dict[int, tuple[int, ...]] | None) -> tuple[Wave, ...]:
        """A step larger than K: waves of W = (K - P) // 2 experts (see the module docstring); `rank`: the
        step's keep_rank (expert -> key, higher = keep; None: 'lru')."""
        k = self.num_slots
        resident = [e for e in distinct if e in self.slot_of]
        missing = [e for e in distinct if e not in self.slot_of]
        protected: list[int] = []
        if rank is not None:
            keep = set(sorted(distinct, key=rank.__getitem__)[-k:])
            protected = sorted((e for e in resident if e in keep), key=rank.__getitem__)[-(k // 2) :] if k >= 2 else []
            missing.sort(key=rank.__getitem__)
        cycling = k - len(protected)
        width = cycling // 2 if cycling >= 2 else cycling
        pin_previous = 2 * width <= cycling
        kept = set(protected)
        order = [e for e in resident if e not in kept] + missing
        chunks = [order[i : i + width] for i in range(0, len(order), width)] or [[]]
        _spread(chunks, protected)
        routed_set = set(distinct)
        waiting = set(resident)  # routed residents whose wave has not run: never evicted
        previous: list[int] = []
        waves = []
        for chunk in chunks:
            hits = sum(1 for e in chunk if e in waiting)
            waiting.difference_update(chunk)
            pinned = kept | waiting | set(chunk) | (set(previous) if pin_previous else set())
            waves.append(self._plan_wave(chunk, hits, pinned, routed_set, rank))
            previous = chunk
        return tuple(waves)

    def _plan_wave(
        self,
        experts: list[int],
        hits: int,
        pinned: set[int] | None = None,
        routed: set[int] | None = None,
        rank: dict[int, tuple[int, ...]] | None = None,
    ) -> Wave:
        """Pages in the wave's missing experts. Victims: resident experts outside `pinned` (the wave
        itself by default); with a keep `rank`, experts not routed in this step go first (by the
        policy), then the routed ones already served, lowest rank first."""
        pinned = set(experts) if pinned is None else pinned
        missing = [e for e in experts if e not in self.slot_of]
        page_ins = []
        if missing:
            if not pinned.issuperset(experts):
                raise AssertionError("a wave's own experts must be pinned")
            # The candidates once a wave: each miss's expert is pinned, so a page-in only takes its victim out
            # of them (a scan of the K slots per miss cost a 2,048-token chunk's planner ~0.2 ms a layer).
            candidates = [r for r in self.slot_of if r not in pinned]
            if rank is None or routed is None:
                cold, warm = candidates, []
            else:
                cold = [r for r in candidates if r not in routed]
                warm = sorted((r for r in candidates if r in routed), key=rank.__getitem__, reverse=True)
            # the misses' victims from `cold` in one pass (the policy's keys once each), then from `warm`
            cold = self.policy.victims(cold, min(len(missing), len(cold)), self.step)[::-1]
            for e in missing:
                if cold:
                    victim = cold.pop()
                elif warm:  # every candidate was routed in this step and is served already: the lowest rank leaves
                    victim = warm.pop()
                    self.policy.on_evict(victim, self.step)
                else:
                    raise AssertionError(f"no slot to evict for expert {e}: {self.num_slots} slots all pinned")
                slot = self.slot_of.pop(victim)
                self.slot_of[e] = slot
                self.expert_in[slot] = e
                page_ins.append((e, slot))
        self.policy.on_uses(experts, self.step)
        return Wave(
            experts=tuple(experts),
            slots=tuple(self.slot_of[e] for e in experts),
            page_ins=tuple(page_ins),
            hits=hits,
        )


def _spread(chunks: list[list[int]], protected: Sequence[int]) -> None:
    """Serves the protected experts (pinned in their slots all step: where they compute changes no page-in
    and no eviction) in the waves between the first and the last, in rank order, a near-equal share each:
    not the first, whose compute every first page-in waits for, nor the last, whose compute is the layer's
    tail after its last page-in landed (a middle wave computes while the next one's copies run, which take
    longer); with fewer than three waves, in the last."""
    middle = range(1, len(chunks) - 1)
    if not middle:
        chunks[-1] += protected
        return
    share, extra = divmod(len(protected), len(middle))
    start = 0
    for n, i in enumerate(middle):
        end = start + share + (1 if n < extra else 0)
        chunks[i] += protected[start:end]
        start = end
