"""Expert residency bookkeeping for one MoE layer: which expert sits in which slot, the
eviction policy, and the wave planner.

This module is pure Python (no tensors) so the runtime, the paging simulator and the tests all
share one implementation: the simulator replays traces through exactly this code.

Rules (DESIGN.md section 4):
- slots start holding experts 0..K-1;
- a step's distinct routed experts are split into waves of at most K, resident ones first;
- an expert of the wave being served is never evicted;
- every miss pages one expert into the slot of an evicted one.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


class EvictionPolicy(Protocol):
    """Chooses which resident expert leaves its slot. `step` counts planned steps from 0."""

    def on_use(self, expert: int, step: int) -> None: ...

    def victim(self, candidates: Collection[int], step: int) -> int: ...


class LruPolicy:
    """Least recently used; never-used experts (the initial 0..K-1) go first, lowest id first."""

    def __init__(self) -> None:
        self._last_use: dict[int, int] = {}

    def on_use(self, expert: int, step: int) -> None:
        self._last_use[expert] = step

    def victim(self, candidates: Collection[int], step: int) -> int:
        return min(candidates, key=lambda e: (self._last_use.get(e, -1), e))


class LfuPolicy:
    """Least frequently used (counts every step an expert was used); ties go to the least recent."""

    def __init__(self) -> None:
        self._uses: dict[int, int] = {}
        self._last_use: dict[int, int] = {}

    def on_use(self, expert: int, step: int) -> None:
        self._uses[expert] = self._uses.get(expert, 0) + 1
        self._last_use[expert] = step

    def victim(self, candidates: Collection[int], step: int) -> int:
        return min(candidates, key=lambda e: (self._uses.get(e, 0), self._last_use.get(e, -1), e))


class BeladyPolicy:
    """Optimal offline eviction: evict the expert whose next use is farthest in the future.

    Needs the whole sequence of per-step expert sets for this layer up front, so it exists only
    for the simulator; it bounds what any online policy can reach.
    """

    def __init__(self, future_steps: Sequence[Collection[int]]) -> None:
        # next_use[s][e] would be O(steps x E); instead keep, per expert, its sorted use steps.
        self._uses: dict[int, list[int]] = {}
        for step, experts in enumerate(future_steps):
            for e in set(experts):
                self._uses.setdefault(e, []).append(step)
        self._cursor: dict[int, int] = {}

    def on_use(self, expert: int, step: int) -> None:
        pass

    def _next_use(self, expert: int, step: int) -> float:
        uses = self._uses.get(expert)
        if not uses:
            return float("inf")
        i = self._cursor.get(expert, 0)
        while i < len(uses) and uses[i] <= step:
            i += 1
        self._cursor[expert] = i
        return uses[i] if i < len(uses) else float("inf")

    def victim(self, candidates: Collection[int], step: int) -> int:
        return max(candidates, key=lambda e: (self._next_use(e, step), -e))


class RandomPolicy:
    """Random eviction (a baseline the published locality study reports); seeded, reproducible."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def on_use(self, expert: int, step: int) -> None:
        pass

    def victim(self, candidates: Collection[int], step: int) -> int:
        return self._rng.choice(sorted(candidates))


@dataclass(frozen=True)
class Wave:
    """One compute pass over at most K distinct experts, after its page-ins."""

    experts: tuple[int, ...]  # distinct expert ids served in this wave
    slots: tuple[int, ...]  # slot holding each of `experts`, same order
    page_ins: tuple[tuple[int, int], ...]  # (expert, slot) copied from the host before the wave
    hits: int  # experts of this wave already resident when the step began


@dataclass(frozen=True)
class StepPlan:
    waves: tuple[Wave, ...]
    union: int  # distinct experts routed in the step

    @property
    def hits(self) -> int:
        return sum(w.hits for w in self.waves)

    @property
    def misses(self) -> int:
        return sum(len(w.page_ins) for w in self.waves)


class LayerResidency:
    """K slots of one layer: the expert<->slot maps, the policy and the wave planner."""

    def __init__(self, num_experts: int, num_slots: int, policy: EvictionPolicy | None = None) -> None:
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"num_slots must be in [1, {num_experts}], got {num_slots}")
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.policy: EvictionPolicy = policy if policy is not None else LruPolicy()
        self.slot_of: dict[int, int] = {e: e for e in range(num_slots)}
        self.expert_in: list[int] = list(range(num_slots))
        self.step = 0

    def is_resident(self, expert: int) -> bool:
        return expert in self.slot_of

    def plan_step(self, routed: Iterable[int]) -> StepPlan:
        """Plan one step over the experts routed by all tokens of the step (duplicates allowed)."""
        distinct = sorted(set(int(e) for e in routed))
        for e in distinct:
            if not 0 <= e < self.num_experts:
                raise ValueError(f"expert id {e} out of range [0, {self.num_experts})")
        resident = [e for e in distinct if e in self.slot_of]
        missing = [e for e in distinct if e not in self.slot_of]
        ordered = resident + missing  # resident first: they are hits and need no slot
        waves = []
        k = self.num_slots
        for start in range(0, len(ordered), k):
            waves.append(self._plan_wave(ordered[start : start + k], hits=max(0, min(len(resident) - start, k))))
        self.step += 1
        return StepPlan(waves=tuple(waves), union=len(distinct))

    def _plan_wave(self, experts: list[int], hits: int) -> Wave:
        pinned = set(experts)
        page_ins = []
        for e in experts:
            if e in self.slot_of:
                continue
            candidates = [r for r in self.slot_of if r not in pinned]
            victim = self.policy.victim(candidates, self.step)
            slot = self.slot_of.pop(victim)
            self.slot_of[e] = slot
            self.expert_in[slot] = e
            page_ins.append((e, slot))
        for e in experts:
            self.policy.on_use(e, self.step)
        return Wave(
            experts=tuple(experts),
            slots=tuple(self.slot_of[e] for e in experts),
            page_ins=tuple(page_ins),
            hits=hits,
        )


POLICIES = {"lru": LruPolicy, "lfu": LfuPolicy, "random": RandomPolicy}
"""Online policies by name; Belady needs the future and is built by the simulator."""
