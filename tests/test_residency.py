"""LRU residency and wave planning against a brute-force reference over random routing sequences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_experts.residency import planner
from paged_experts.residency.planner import PREFILL_KEEP, SLOTS, STAGING, LayerResidency, Promotion
from paged_experts.residency.policies import POLICIES, LfuPolicy


class BruteForceLru:
    """The rules written out literally: a slot array, a global clock, full scans for every choice.
    A step whose union fits K is one wave (resident first); a larger one is cut into waves of
    (K - protected) // 2 with the previous wave pinned too (the module docstring's rules)."""

    def __init__(self, num_experts: int, k: int, keep: str = "recent") -> None:
        self.slots = list(range(k))  # slot -> expert
        self.last_use_step = [-1] * num_experts
        self.step = 0
        self.keep = keep

    def _rank(self, routed: list[int], e: int) -> tuple[int, ...]:
        last = max(i for i, r in enumerate(routed) if r == e)
        return (last,) if self.keep == "recent" else (routed.count(e), last)

    def _waves(
        self, routed: list[int], distinct: list[int], at_start: set[int]
    ) -> tuple[list[list[int]], set[int], bool]:
        """(waves, protected, previous wave pinned)."""
        k = len(self.slots)
        resident = [e for e in distinct if e in at_start]
        missing = [e for e in distinct if e not in at_start]
        if len(distinct) <= k:
            return ([resident + missing] if distinct else []), set(), False
        protected: list[int] = []
        if self.keep != "lru":
            by_rank = sorted(distinct, key=lambda e: self._rank(routed, e))
            top = set(by_rank[len(by_rank) - k :])
            protected = [e for e in by_rank if e in top and e in at_start]
            protected = protected[max(0, len(protected) - k // 2) :] if k >= 2 else []
            missing = sorted(missing, key=lambda e: self._rank(routed, e))
        cycling = k - len(protected)
        width = cycling // 2 if cycling >= 2 else cycling
        order = [e for e in resident if e not in protected] + missing
        waves = [order[w : w + width] for w in range(0, len(order), width)]
        if len(waves) < 3:
            waves[-1] = waves[-1] + protected
        else:  # the middle waves share the protected ones in rank order, the first ones one more
            middle = len(waves) - 2
            for n, e in enumerate(protected):  # protected one by one: the m-th share covers its first sizes
                sizes = [len(protected) // middle + (m < len(protected) % middle) for m in range(middle)]
                m = next(m for m in range(middle) if n < sum(sizes[: m + 1]))
                waves[1 + m] = waves[1 + m] + [e]
        return waves, set(protected), 2 * width <= cycling

    def step_once(self, routed: list[int]) -> list[tuple[tuple[int, ...], tuple[tuple[int, int], ...], int]]:
        distinct = sorted(set(routed))
        at_start = set(self.slots)
        waves, protected, pin_previous = self._waves(routed, distinct, at_start)
        multi = len(waves) > 1
        out = []
        served: set[int] = set()
        for j, wave in enumerate(waves):
            waiting = {e for w in waves[j + 1 :] for e in w if e in at_start}
            previous = set(waves[j - 1]) if j and pin_previous else set()
            page_ins = []
            for e in wave:
                if e in self.slots:
                    continue
                best_slot, best_key = None, None
                for s, r in enumerate(self.slots):
                    if r in wave or r in protected or r in waiting or r in previous:
                        continue
                    if multi and self.keep != "lru":
                        key = (0, self.last_use_step[r], r) if r not in distinct else (1, *self._rank(routed, r))
                    else:
                        key = (self.last_use_step[r], r)
                    if best_key is None or key < best_key:
                        best_slot, best_key = s, key
                assert best_slot is not None
                assert self.slots[best_slot] not in distinct or self.slots[best_slot] in served
                self.slots[best_slot] = e
                page_ins.append((e, best_slot))
            for e in wave:
                self.last_use_step[e] = self.step
            served.update(wave)
            out.append((tuple(wave), tuple(page_ins), sum(1 for e in wave if e in at_start)))
        self.step += 1
        return out


@st.composite
def routing_runs(draw: st.DrawFn) -> tuple[int, int, list[list[int]]]:
    num_experts = draw(st.integers(2, 24))
    k = draw(st.integers(1, num_experts))
    steps = draw(
        st.lists(
            st.lists(st.integers(0, num_experts - 1), min_size=0, max_size=3 * num_experts), min_size=1, max_size=25
        )
    )
    return num_experts, k, steps


@settings(max_examples=300, deadline=None)
@given(routing_runs(), st.sampled_from(PREFILL_KEEP))
def test_lru_and_waves_match_brute_force(run: tuple[int, int, list[list[int]]], keep: str) -> None:
    num_experts, k, steps = run
    layer = LayerResidency(num_experts, k, prefill_keep=keep)
    ref = BruteForceLru(num_experts, k, keep)
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
        for wave in plan.waves:
            assert 1 <= len(wave.experts) <= k
        assert len(plan.waves) == (1 if distinct else 0) or len(distinct) > k  # one wave whenever the union fits K
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
            # No page-in evicts an expert resident at step start that a later wave of the step serves.
            later = {e for w in plan.waves[plan.waves.index(wave) + 1 :] for e in w.experts}
            assert not (evicted & later & before)


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
    """Waves of K/2 (nothing protected: no resident is among the step's 4 latest experts), hits first."""
    layer = LayerResidency(16, 4)
    plan = layer.plan_step(range(10))
    assert [len(w.experts) for w in plan.waves] == [2, 2, 2, 2, 2]
    assert plan.waves[0].experts == (0, 1) and plan.waves[0].page_ins == ()
    assert plan.hits == 4 and plan.misses == 6 and plan.union == 10


def test_page_ins_never_take_the_previous_waves_slots() -> None:
    """Wave j+1 copies while wave j computes: its victims are never wave j's (nor its own) experts."""
    layer = LayerResidency(64, 16)
    routed = [(7 * i) % 64 for i in range(400)]
    plan = layer.plan_step(routed)
    for before, wave in zip(plan.waves, plan.waves[1:]):
        assert not {s for _, s in wave.page_ins} & set(before.slots)


def test_recent_keeps_what_the_last_tokens_routed() -> None:
    """A chunk over experts 4..15 with K=4 whose last tokens route 5, 4, 7, 6: `recent` leaves those
    four resident, `lru` the highest-id misses whatever the order; both page in the same experts."""
    routed = [e for t in range(30) for e in (4 + t % 12, 4 + (t + 5) % 12)] + [5, 4, 7, 6]
    recent, lru = LayerResidency(16, 4), LayerResidency(16, 4, prefill_keep="lru")
    assert recent.plan_step(routed).misses == lru.plan_step(routed).misses == 12
    assert sorted(recent.expert_in) == [4, 5, 6, 7]
    assert sorted(lru.expert_in) == [12, 13, 14, 15]
    frequent = LayerResidency(16, 4, prefill_keep="frequent")
    frequent.plan_step([5] * 9 + [6] * 7 + [7] * 5 + [8] * 3 + list(range(9, 16)))
    assert sorted(frequent.expert_in) == [5, 6, 7, 8]


def test_recent_keeps_routed_residents_in_place() -> None:
    """A resident among the step's latest experts is protected (never evicted), not paged again."""
    layer = LayerResidency(32, 8)
    routed = list(range(8, 32)) + [3, 2]  # 3 and 2 resident, used last
    plan = layer.plan_step(routed)
    # waves of 3: 8 9 10 | 11 12 13 3 | 14 15 16 2 | ... | 29 30 31: served in the middle, kept in place throughout
    assert plan.waves[1].experts[-1] == 3 and plan.waves[2].experts[-1] == 2 and len(plan.waves) == 8
    assert not {2, 3} & set(plan.waves[0].experts + plan.waves[-1].experts)
    assert {2, 3} <= set(layer.expert_in)
    assert all(e not in (2, 3) for w in plan.waves for e, _ in w.page_ins)


@settings(max_examples=200, deadline=None)
@given(routing_runs(), st.sampled_from(PREFILL_KEEP))
def test_a_numpy_step_plans_what_the_same_list_plans(run: tuple[int, int, list[list[int]]], keep: str) -> None:
    """The runtime hands a prefill chunk's routed ids as a numpy array (read in numpy: distinct ids by
    bincount, keep ranks by maximum.at); every plan and the state after it equal the list's."""
    num_experts, k, steps = run
    by_list, by_array = (
        LayerResidency(num_experts, k, prefill_keep=keep),
        LayerResidency(num_experts, k, prefill_keep=keep),
    )
    for routed in steps:
        want, got = by_list.plan_step(routed), by_array.plan_step(np.array(routed, dtype=np.int64))
        assert got == want
        assert by_array.expert_in == by_list.expert_in and by_array.slot_of == by_list.slot_of


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        LayerResidency(4, 5)
    with pytest.raises(ValueError, match="out of range"):
        LayerResidency(4, 2).plan_step([4])
    # numpy steps too, either end; a huge id is refused before anything sized by it is allocated
    for bad in (np.array([1, -2, 3]), np.array([[0, 1], [2, 7]]), np.array([1, 10**15])):
        with pytest.raises(ValueError, match="out of range"):
            LayerResidency(4, 2).plan_step(bad)
    with pytest.raises(ValueError, match="prefill residency must be one of"):
        LayerResidency(4, 2, prefill_keep="newest")


def test_lfu_keeps_frequent_expert() -> None:
    layer = LayerResidency(8, 2, LfuPolicy())
    for _ in range(3):
        layer.plan_step([0])
    layer.plan_step([1])
    plan = layer.plan_step([5])
    assert plan.waves[0].page_ins == ((5, 1),)  # expert 1 used once, expert 0 three times


def test_stage_candidates_are_what_the_latest_large_steps_routed_outside_the_slots() -> None:
    """Staging (RuntimeConfig.prefill_staging_rows): none below 8 pairs per expert; else up to R non-resident
    experts, the ones the latest large steps routed first, ties by id. Small steps leave no history (the device
    plans them where it can, and the host would not see it)."""
    r = LayerResidency(16, 4)  # slots hold 0..3
    assert r.stage_candidates(3, 8 * 16 - 1) == () and r.stage_candidates(0, 10_000) == ()
    assert r.stage_candidates(3, 8 * 16) == (4, 5, 6)  # no history: by id
    r.plan_step([4, 5, 9, 1])  # a small step: the slots hold 1, 4, 5, 9, no history
    r.plan_step([10, 11] * 64)  # a large step (128 pairs) routes 10 and 11: they evict 1 and 4
    r.plan_step([12, 13, 14, 15])  # a small step evicts 5, 9, 10, 11
    assert r.stage_candidates(4, 1000) == (10, 11, 0, 1)
    assert (r.large_steps, r.last_large[10], r.last_large[12]) == (1, 0, -1)


def test_a_staged_step_serves_the_staged_experts_first_and_plans_the_rest() -> None:
    """plan_step(routed, staged): a STAGING wave of the routed staged experts from their rows (every staged one a
    page-in, routed or not), the rest planned as without them; the union counts them all."""
    routed = [e for t in range(40) for e in ((t * 3) % 16, (t * 5 + 1) % 16)]  # every one of the 16 experts
    plain, staged_r = LayerResidency(16, 4), LayerResidency(16, 4)
    want = plain.plan_step(routed)
    staged = staged_r.stage_candidates(3, 8 * 16)  # (4, 5, 6): non-resident
    got = staged_r.plan_step(routed, staged=(*staged, 15))  # 15: also non-resident
    first = got.waves[0]
    assert first.table == STAGING and first.experts == (*staged, 15) and first.slots == (0, 1, 2, 3)
    assert first.page_ins == ((4, 0), (5, 1), (6, 2), (15, 3)) and first.hits == 0
    assert all(w.table == SLOTS for w in got.waves[1:])
    assert got.union == want.union == 16 and got.misses == want.misses and got.hits == want.hits
    served = [e for w in got.waves for e in w.experts]
    assert sorted(served) == list(range(16))  # each routed expert in exactly one wave
    # staged experts the keep policy ranks among the K (the last tokens' 2, 15, 5, 4) are promoted into the slots
    # of lower-ranked ones after the waves: the slots end as they would have without staging
    # each one once the wave that last reads its slot computed: 0 (slot 0, protected among the routed rest, served
    # in the middle wave 2), 12 (slot 1, wave 9), 10 (slot 3, wave 10)
    assert got.promotions == (Promotion(4, 0, 0, 2), Promotion(5, 1, 1, 9), Promotion(15, 3, 3, 10))
    assert got.waves[2].experts == (3, 0) and got.waves[3].experts == (14, 2)  # the protected 0 and 2
    assert got.waves[9].experts == (12,) and got.waves[9].slots == (1,) and not staged_r.is_resident(6)
    assert sorted(staged_r.slot_of) == sorted(plain.slot_of) == [2, 4, 5, 15]
    assert all(staged_r.slot_of[p.expert] == p.slot for p in got.promotions)
    lru = LayerResidency(16, 4, prefill_keep="lru").plan_step(routed, staged=(4, 5))
    assert lru.promotions == ()  # lru ranks nothing: staged experts stay out
    unrouted = LayerResidency(16, 4).plan_step([0, 1, 7, 8], staged=(9,))  # 9 is not routed: moved for nothing
    assert unrouted.waves[0].experts == () and unrouted.waves[0].page_ins == ((9, 0),) and unrouted.misses == 3
    assert unrouted.union == 5 == unrouted.hits + unrouted.misses  # served or paged in: 0, 1, 7, 8 and 9
    assert unrouted.staged_unused == 1 and got.staged_unused == 0
    for bad in ((0,), (9, 9), (16,)):  # resident, twice, out of range
        with pytest.raises(ValueError, match="staged experts must be distinct"):
            LayerResidency(16, 4).plan_step([0, 1, 7, 8], staged=bad)


def test_promotions_do_not_depend_on_the_slot_maps_order() -> None:
    """The runtime rebuilds the slot map in slot order when it reads the device's state back; the simulator keeps
    insertion order: a promotion's victim (an unrouted resident first, by the eviction policy) is the same in
    both, so the replay stays exact. An unrouted victim's slot is read by no wave: promoted after the STAGING wave."""
    routed = [0, 1, 2, 3] * 40  # a large step (160 pairs >= 8 x 16) routing four experts
    results = []
    for order in (list(range(6)), list(reversed(range(6)))):
        r = LayerResidency(16, 6)  # slots hold 0..5: 4 and 5 are not routed
        r.slot_of = {e: r.slot_of[e] for e in order}
        plan = r.plan_step(routed + [9, 8] * 2, staged=(8, 9))  # the last tokens route 9 and 8: ranked first
        results.append((plan.promotions, dict(sorted(r.slot_of.items()))))
    assert results[0] == results[1]
    promotions, slots = results[0]
    assert {p.expert for p in promotions} == {8, 9} and all(p.after == 0 for p in promotions)
    assert set(slots) == {0, 1, 2, 3, 8, 9}  # the unrouted 4 and 5 gave their slots


@settings(max_examples=200, deadline=None)
@given(routing_runs(), st.sampled_from(PREFILL_KEEP), st.sampled_from(sorted(POLICIES)), st.integers(0, 3))
def test_where_the_protected_residents_are_served_changes_no_page_in(
    run: tuple[int, int, list[list[int]]], keep: str, policy: str, rows: int
) -> None:
    """The protected residents are served in the middle waves (so the first wave stays small and the layer's
    tail after its last page-in is short), no longer in the last. They are pinned all step, so every wave's
    page-ins, each step's promotions and the slots after it must be what serving them last gave: the same plans
    side by side, one with `_spread` put back to serving them last, for every policy, staged or not."""
    num_experts, k, steps = run
    middle, last = (
        LayerResidency(num_experts, k, POLICIES[policy](), keep),
        LayerResidency(num_experts, k, POLICIES[policy](), keep),
    )
    monkey = pytest.MonkeyPatch()
    for routed in steps:
        staged = middle.stage_candidates(rows, max(len(routed), 1) * 10_000)  # any step stages, for the comparison
        got = middle.plan_step(routed, staged=staged)
        with monkey.context() as m:
            m.setattr(planner, "_spread", lambda chunks, protected: chunks[-1].extend(protected))
            want = last.plan_step(routed, staged=staged)
        assert [w.page_ins for w in got.waves] == [w.page_ins for w in want.waves]
        assert sorted(e for w in got.waves for e in w.experts) == sorted(e for w in want.waves for e in w.experts)
        assert (got.hits, got.misses, got.union) == (want.hits, want.misses, want.union)
        assert [(p.expert, p.row, p.slot) for p in got.promotions] == [
            (p.expert, p.row, p.slot) for p in want.promotions
        ]
        assert middle.slot_of == last.slot_of and middle.expert_in == last.expert_in
        if len(got.waves) >= 3 and got.waves[-1].table == SLOTS:  # the tail wave holds no protected resident now
            assert len(got.waves[-1].experts) <= len(want.waves[-1].experts)
