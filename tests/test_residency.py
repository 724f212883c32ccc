"""LRU residency and wave planning against a brute-force reference over random routing sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_experts.residency import LayerResidency, LfuPolicy


class BruteForceLru:
    """The rules written out literally: a slot array, a global clock, full scans for every choice."""

    def __init__(self, num_experts: int, k: int) -> None:
        self.slots = list(range(k))  # slot -> expert
        self.last_use_step = [-1] * num_experts
        self.step = 0

    def step_once(self, routed: list[int]) -> list[tuple[tuple[int, ...], tuple[tuple[int, int], ...], int]]:
        distinct = sorted(set(routed))
        at_start = set(self.slots)
        resident = [e for e in distinct if e in at_start]
        missing = [e for e in distinct if e not in at_start]
        ordered = resident + missing
        k = len(self.slots)
        waves = []
        for w in range(0, len(ordered), k):
            wave = ordered[w : w + k]
            page_ins = []
            for e in wave:
                if e in self.slots:
                    continue
                best_slot = None
                for s, r in enumerate(self.slots):
                    if r in wave:
                        continue
                    if best_slot is None or (self.last_use_step[r], r) < (
                        self.last_use_step[self.slots[best_slot]],
                        self.slots[best_slot],
                    ):
                        best_slot = s
                assert best_slot is not None
                self.slots[best_slot] = e
                page_ins.append((e, best_slot))
            for e in wave:
                self.last_use_step[e] = self.step
            hits = sum(1 for e in wave if e in at_start)
            waves.append((tuple(wave), tuple(page_ins), hits))
        self.step += 1
        return waves


@st.composite
def routing_runs(draw: st.DrawFn) -> tuple[int, int, list[list[int]]]:
    num_experts = draw(st.integers(2, 24))
    k = draw(st.integers(1, num_experts))
    steps = draw(
        st.lists(st.lists(st.integers(0, num_experts - 1), min_size=0, max_size=3 * num_experts), min_size=1, max_size=25)
    )
    return num_experts, k, steps


@settings(max_examples=300, deadline=None)
@given(routing_runs())
def test_lru_and_waves_match_brute_force(run: tuple[int, int, list[list[int]]]) -> None:
    num_experts, k, steps = run
    layer = LayerResidency(num_experts, k)
    ref = BruteForceLru(num_experts, k)
    for routed in steps:
        resident_before = dict(layer.slot_of)
        plan = layer.plan_step(routed)
        expected = ref.step_once(routed)
        assert [(w.experts, w.page_ins, w.hits) for w in plan.waves] == expected
        distinct = set(routed)
        assert plan.union == len(distinct)
        assert plan.hits + plan.misses == plan.union
        assert plan.misses == len(distinct - set(resident_before))
        served = [e for w in plan.waves for e in w.experts]
        assert sorted(served) == sorted(distinct)  # every routed expert served exactly once
        for i, wave in enumerate(plan.waves):
            assert 1 <= len(wave.experts) <= k
            if i < len(plan.waves) - 1:
                assert len(wave.experts) == k  # only the last wave may be partial
        # The slot maps agree with each other and with the reference's slot array.
        assert layer.expert_in == ref.slots
        assert all(layer.expert_in[s] == e for e, s in layer.slot_of.items())
        assert len(layer.slot_of) == k


@settings(max_examples=200, deadline=None)
@given(routing_runs())
def test_wave_experts_sit_in_their_slots_while_served(run: tuple[int, int, list[list[int]]]) -> None:
    """Replaying page-ins on a slot array must leave every wave expert in the slot the plan names."""
    num_experts, k, steps = run
    layer = LayerResidency(num_experts, k)
    slots = list(range(k))
    for routed in steps:
        before = set(slots)
        plan = layer.plan_step(routed)
        for wave in plan.waves:
            evicted = set()
            for e, s in wave.page_ins:
                evicted.add(slots[s])
                slots[s] = e
            assert not evicted & set(wave.experts), "a wave expert was evicted by its own wave"
            for e, s in zip(wave.experts, wave.slots):
                assert slots[s] == e
            # Resident-first: no page-in in a wave while an expert resident at step start waits for a later wave.
            later = [e for w in plan.waves[plan.waves.index(wave) + 1 :] for e in w.experts]
            if wave.page_ins:
                assert not (set(later) & before)


def test_initial_slots_hold_first_k_experts() -> None:
    layer = LayerResidency(8, 3)
    assert layer.expert_in == [0, 1, 2]
    plan = layer.plan_step([0, 1, 2, 0])
    assert plan.misses == 0 and plan.hits == 3 and len(plan.waves) == 1


def test_lru_evicts_least_recent_then_lowest_id() -> None:
    layer = LayerResidency(8, 3)
    layer.plan_step([1])  # 0 and 2 never used since start; 1 used at step 0
    plan = layer.plan_step([5])
    assert plan.waves[0].page_ins == ((5, 0),)  # expert 0: never used, lowest id
    plan = layer.plan_step([6])
    assert plan.waves[0].page_ins == ((6, 2),)  # expert 2 next (never used)
    plan = layer.plan_step([7])
    assert plan.waves[0].page_ins == ((7, 1),)  # expert 1 last used at step 0, oldest now


def test_multi_wave_step_serves_union_larger_than_k() -> None:
    layer = LayerResidency(16, 4)
    plan = layer.plan_step(range(10))
    assert [len(w.experts) for w in plan.waves] == [4, 4, 2]
    assert plan.waves[0].experts == (0, 1, 2, 3) and plan.waves[0].page_ins == ()
    assert plan.hits == 4 and plan.misses == 6 and plan.union == 10


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        LayerResidency(4, 5)
    with pytest.raises(ValueError, match="out of range"):
        LayerResidency(4, 2).plan_step([4])


def test_lfu_keeps_frequent_expert() -> None:
    layer = LayerResidency(8, 2, LfuPolicy())
    for _ in range(3):
        layer.plan_step([0])
    layer.plan_step([1])
    plan = layer.plan_step([5])
    assert plan.waves[0].page_ins == ((5, 1),)  # expert 1 used once, expert 0 three times
