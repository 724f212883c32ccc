"""The decayed and the aging LFU eviction policies (aging, eviction order), the simulator's comparison on a trace whose
answer is known by hand, the `eviction_policy` option from matrix to server command line and runtime,
and the per-cell optimal hit rate from a routing trace recorded in a real `benchsuite run` (tiny, CPU)."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from builtin_plans import flag, plan_argv
from hypothesis import example, given, settings
from hypothesis import strategies as st

from benchsuite.cli import main as cli_main
from benchsuite.config.matrix import MatrixError
from benchsuite.measure.paging import NO_TRACE_NOTE, cell_steps, replay_trace
from benchsuite.report.build import build_report_data
from benchsuite.report.paging_figures import HIT_RATE_TITLE, NO_OPTIMUM_NOTE, hit_rate_table
from benchsuite.results.stored_files import read_cells
from benchsuite.tools.simulate import SimOptions, check_policy, simulate
from paged_experts.residency.planner import LayerResidency
from paged_experts.residency.policies import (
    DEFAULT_AGING_PERIOD_STEPS,
    AgingLfuPolicy,
    ArcPolicy,
    DecayedLfuPolicy,
    DuelPolicy,
    EvictionPolicy,
    LfuPolicy,
    LruPolicy,
    OneUseACall,
    OneVictimAPick,
    RandomPolicy,
    make_policy,
)
from paged_experts.routing.trace import TraceMeta, build_trace, read_trace
from paged_experts.runtime import RuntimeConfig
from paged_experts.server.launch import parse_args


def test_scores_halve_every_half_life_and_count_once_per_step() -> None:
    p = DecayedLfuPolicy(half_life_steps=4)
    assert p.score(7, 0) == 0.0  # never used
    p.on_use(7, 0)
    p.on_use(7, 0)  # a second wave of the same step adds nothing
    assert p.score(7, 0) == 1.0 and p.score(7, 4) == pytest.approx(0.5) and p.score(7, 8) == pytest.approx(0.25)
    p.on_use(7, 4)
    assert p.score(7, 4) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="half_life_steps must be > 0"):
        DecayedLfuPolicy(0)


def test_aging_counts_halve_at_each_period_boundary_lazily_as_eagerly() -> None:
    p = AgingLfuPolicy(period_steps=4)
    assert p.uses(7, 0) == 0 and p.last_use(7) == -1
    for step in (0, 0, 1, 2, 3):  # a second wave of step 0 adds nothing
        p.on_use(7, step)
    assert p.uses(7, 3) == 4 and p.uses(7, 4) == 2 and p.uses(7, 7) == 2 and p.uses(7, 8) == 1 and p.uses(7, 12) == 0
    p.on_use(7, 5)  # the boundary at 4 halved 4 -> 2, then +1
    assert p.uses(7, 5) == 3 and p.last_use(7) == 5 and p.uses(7, 8) == 1
    # eager: every count halved whenever a step is a multiple of the period, then the step's uses added
    eager, lazy = [0] * 3, AgingLfuPolicy(period_steps=3)
    uses = [[0], [0, 1], [], [1], [2], [0], [], [], [1], [1, 2]]
    for step, used in enumerate(uses):
        if step % 3 == 0:
            eager = [c >> 1 for c in eager]
        for expert in used:
            eager[expert] += 1
            lazy.on_use(expert, step)
        assert [lazy.uses(x, step) for x in range(3)] == eager, step
    with pytest.raises(ValueError, match="period_steps must be an integer >= 1"):
        AgingLfuPolicy(0)
    assert make_policy("lfu-aging").period_steps == DEFAULT_AGING_PERIOD_STEPS  # type: ignore[attr-defined]


def test_a_recency_window_keeps_a_new_working_set_against_old_counts() -> None:
    # expert 1 used 6 times long ago; 2 and 3 make a new loop (each used every other step): without a window
    # the loop's expert is evicted before the stale favourite, with a 2-step window the favourite goes
    for window, evicted in ((0, 3), (2, 1)):
        p = AgingLfuPolicy(period_steps=1000, window_steps=window)
        for step in range(6):
            p.on_use(1, step)
        for step in range(20, 26):
            p.on_use(2 if step % 2 else 3, step)
        assert p.victim([1, 3], 26) == evicted, window  # 3 was used at step 24, two steps back


def test_aging_lfu_evicts_the_least_used_then_the_least_recent_then_the_lowest_id() -> None:
    p = AgingLfuPolicy(period_steps=100)
    for step in range(3):
        p.on_use(1, step)
    p.on_use(2, 5)
    p.on_use(3, 5)
    assert p.victim([1, 2, 0], 6) == 0  # never used: count 0
    assert p.victim([1, 2], 6) == 2  # one use against three, though more recent
    assert p.victim([3, 2], 6) == 2  # equal count and last use: the lower id
    old = AgingLfuPolicy(period_steps=2)  # the favourite ages out: 3 uses halve to 0 over four boundaries
    for step in range(3):
        old.on_use(1, step)
    old.on_use(2, 9)
    assert old.uses(1, 10) == 0 and old.victim([1, 2], 10) == 1


def test_aging_lets_a_recent_expert_outrank_an_old_favourite() -> None:
    # expert 1 used at steps 0..3, expert 2 once at step 10: plain LFU evicts 2, the aged count evicts 1
    decayed, lfu = DecayedLfuPolicy(half_life_steps=2), LfuPolicy()
    for policy in (decayed, lfu):
        for step in range(4):
            policy.on_use(1, step)
        policy.on_use(2, 10)
    assert lfu.victim([1, 2], 11) == 2
    assert decayed.score(1, 11) < decayed.score(2, 11) and decayed.victim([1, 2], 11) == 1
    # with a long half-life the four uses still weigh more than one recent use
    slow = DecayedLfuPolicy(half_life_steps=100)
    for step in range(4):
        slow.on_use(1, step)
    slow.on_use(2, 10)
    assert slow.victim([1, 2], 11) == 2


def test_eviction_order_ties_go_to_the_least_recent_then_the_lowest_id() -> None:
    p = DecayedLfuPolicy(half_life_steps=1000)
    p.on_use(5, 1)
    p.on_use(3, 2)
    p.on_use(4, 2)
    assert p.victim([0, 9, 5], 3) == 0  # never used: score 0, lowest id first
    assert p.victim([3, 4, 5], 3) == 5  # the oldest use has decayed most
    assert p.victim([4, 3], 3) == 3  # equal score and stamp: the lower id


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(2, 6),
    steps=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=14), min_size=1, max_size=25),
)
def test_a_vanishing_half_life_plans_exactly_what_lru_plans(k: int, steps: list[list[int]]) -> None:
    # every older use decays to 0: the score ties and the last use decides, LRU's own order
    lru = LayerResidency(10, k, LruPolicy())
    aged = LayerResidency(10, k, DecayedLfuPolicy(half_life_steps=1e-6))
    for routed in steps:
        assert aged.plan_step(routed) == lru.plan_step(routed)


def test_residency_runs_the_policy_it_is_given() -> None:
    # K=2 of E=4, top_k=1: experts 0 and 1 start resident; 1 is used three times, then 2 and 3 arrive
    steps = [[1], [1], [1], [0], [2], [3]]
    lru = LayerResidency(4, 2, LruPolicy())
    aged = LayerResidency(4, 2, make_policy("lfu-decay"))
    for routed in steps:
        lru.plan_step(routed)
        aged.plan_step(routed)
    assert set(lru.slot_of) == {2, 3}  # LRU evicted 1 for 2, then 0 for 3
    assert set(aged.slot_of) == {1, 3}  # the frequently used 1 stayed; 0, then 2, left
    with pytest.raises(ValueError, match="eviction policy .belady. is not one of"):
        make_policy("belady")


class SingleCalls(OneVictimAPick, OneUseACall):
    """A policy as the planner asked it before `victims` and `on_uses` existed: one `victim` a pick, one `on_use` a
    use (the mixins' loops over the wrapped policy's own single calls)."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self._policy = policy

    def victim(self, candidates: Collection[int], step: int) -> int:
        return self._policy.victim(candidates, step)

    def on_use(self, expert: int, step: int) -> None:
        self._policy.on_use(expert, step)

    def on_evict(self, expert: int, step: int) -> None:
        self._policy.on_evict(expert, step)

    def end_step(self, routed: Collection[int], residents: Collection[int], step: int) -> None:
        self._policy.end_step(routed, residents, step)


def _policies(k: int) -> list[EvictionPolicy]:
    # the duels: the default selector limit, and one that crosses zero on a miss (the @example below reaches its LFU)
    return [LruPolicy(), LfuPolicy(), DecayedLfuPolicy(), AgingLfuPolicy(3), AgingLfuPolicy(3, 2), DuelPolicy(k, 3, 1),
            DuelPolicy(k, 3, 1, limit_misses=1), ArcPolicy(), RandomPolicy(7)]  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(2, 6),
    steps=st.lists(
        st.one_of(
            st.lists(st.integers(0, 11), min_size=1, max_size=16), st.lists(st.integers(0, 11), min_size=1, max_size=3)
        ),
        min_size=1,
        max_size=30,
    ),
)
@example(k=3, steps=[[0], [10], [0, 2, 9], [6], [0, 3, 8], [5], [9]])  # the duel's selector above 0: its LFU evicts
def test_victims_in_one_pass_plan_what_one_victim_a_pick_plans(k: int, steps: list[list[int]]) -> None:
    """Every policy, single-wave steps (at most 3 routed, <= K from K=3 up) and multi-wave ones (up to 16 of E=12):
    `victims` and `on_uses` in one pass plan what one `victim` a pick and one `on_use` a use plan, with the same slots
    and duel selectors (for ARC, random and Belady both sides run the same per-pick loop: there it checks the wrapper's
    forwarding only). The planner is the same on both sides: its own use of them is what tests/test_residency.py
    checks against a brute-force planner."""
    for bulk, single in zip(_policies(k), _policies(k), strict=True):
        if isinstance(single, DuelPolicy):  # its shadows ask its two arms for victims too
            single.lru, single.lfu = SingleCalls(single.lru), SingleCalls(single.lfu)  # type: ignore[assignment]
        fast = LayerResidency(12, k, bulk)
        slow = LayerResidency(12, k, SingleCalls(single))
        for routed in steps:
            assert fast.plan_step(routed) == slow.plan_step(routed), type(bulk).__name__
        assert fast.slot_of == slow.slot_of
        if isinstance(bulk, DuelPolicy):
            assert isinstance(single, DuelPolicy)
            assert bulk.shadows == single.shadows and bulk.psel == single.psel


def test_the_duels_victims_come_from_the_arm_its_selector_picks() -> None:
    """With the selector above zero the duel evicts by its aging LFU in one pass as one pick at a time does; below, by
    LRU (the two arms choose differently here: LRU the least recent, the LFU the least used)."""
    for psel, expected in ((1, [1, 3]), (-1, [0, 2])):  # 0 used most but longest ago; 1 and 3 once, lately
        duel = DuelPolicy(4, 256, 0)
        for step, experts in enumerate([[0], [0], [0], [0], [2], [2], [1], [3]]):
            duel.on_uses(experts, step)
        duel.psel = psel
        assert duel.victims([0, 1, 2, 3], 2, 8) == SingleCalls(duel).victims([0, 1, 2, 3], 2, 8) == expected


def test_uses_in_bulk_count_as_one_call_each_and_an_expert_once_a_step() -> None:
    for bulk, single in zip(_policies(4), _policies(4), strict=True):
        for step, experts in enumerate([[3, 1, 3], [1, 2], [2, 2, 5], [0, 3]]):
            bulk.on_uses(experts, step)
            for e in experts:
                single.on_use(e, step)
        assert bulk.victims(range(8), 8, 4) == SingleCalls(single).victims(range(8), 8, 4), type(bulk).__name__
    lfu = AgingLfuPolicy(8)
    lfu.on_uses([3, 3, 3], 0)
    assert lfu.uses(3, 0) == 1
    for policy in (LruPolicy(), ArcPolicy()):  # a keyed pick and one a pick
        with pytest.raises(ValueError, match="3 victims asked of 2 candidates"):
            policy.victims([1, 2], 3, 0)


def test_a_layers_whole_state_goes_in_and_out_as_lists_that_grow_with_the_ids() -> None:
    """The device plan's round trip (residency/device.py pull_many, push_from) sets and reads every expert's state at
    once: a negative count or stamp from a caller means none, ids past the lists' end read as never used, and a use
    of a new id grows them."""
    lfu = AgingLfuPolicy(4)
    lfu.set_states([3, 0, -2], [5, -1, -7], 9)  # as of step 9: epoch 2
    assert lfu.all_uses(5, 9) == [3, 0, 0, 0, 0] and lfu.all_last_uses(5) == [5, -1, -1, -1, -1]
    assert (lfu.uses(2, 9), lfu.uses(7, 9), lfu.last_use(7)) == (0, 0, -1)
    assert lfu.all_uses(2, 12) == [1, 0]  # epoch 3: halved once
    lfu.on_uses([6, 6], 13)
    assert (lfu.uses(6, 13), lfu.all_last_uses(8)[6], lfu.all_uses(8, 13)[0]) == (1, 13, 1)
    assert lfu.victims([0, 2, 6, 9], 4, 13) == [2, 9, 0, 6]  # (count, last use, id): 2 and 9 never used
    lfu.set_state(9, -1, -5, 13)
    assert (lfu.uses(9, 13), lfu.last_use(9)) == (0, -1)
    stamps = [1, 2, 3, 4]  # longer than the counts: every stamp kept; the caller's list is copied, not kept
    lfu.set_states([1], stamps, 13)
    stamps[3] = 99
    assert (lfu.all_uses(4, 13), lfu.all_last_uses(5)) == ([1, 0, 0, 0], [1, 2, 3, 4, -1])

    lru = LruPolicy()
    lru.set_last_uses([4, -3, 2])
    assert lru.all_last_uses(4) == [4, -1, 2, -1]
    lru.set_some_last_uses([5, 0], [7, -2])
    assert lru.all_last_uses(7) == [-1, -1, 2, -1, -1, 7, -1]
    assert lru.victims([0, 1, 2, 5, 9], 4, 8) == [0, 1, 9, 2]  # (last use, id)
    lru.on_uses([], 8)
    lru.on_use(12, 8)
    assert (lru.last_use(12), lru.last_use(11), lru.last_use(40)) == (8, -1, -1)


def _misses(policy: object, steps: list[list[int]], e: int, k: int) -> int:
    residency = LayerResidency(e, k, policy)  # type: ignore[arg-type]
    return sum(residency.plan_step(routed).misses for routed in steps)


# K=4 of E=64. LFU wins: experts 0 and 1 every other step, two never-seen experts every step (a scan); LRU lets the
# scan push 0 and 1 out, the counts keep them. LRU wins: four experts used for 40 steps, then the working set moves
# to four new ones, two a step; without a window the old counts keep the old set and the new one misses forever.
SCAN = [[0, 1, 10 + 2 * i, 11 + 2 * i] if i % 2 else [10 + 2 * i, 11 + 2 * i] for i in range(20)]
MOVED = [[0, 1], [2, 3]] * 20 + [[4, 5], [6, 7]] * 20


@pytest.mark.parametrize(("steps", "winner"), [(SCAN, "lfu"), (MOVED, "lru")])
def test_the_duel_follows_whichever_policy_misses_less_on_its_shadow(steps: list[list[int]], winner: str) -> None:
    e, k = 64, 4
    lru = _misses(LruPolicy(), steps, e, k)
    lfu = _misses(AgingLfuPolicy(256, 0), steps, e, k)
    duel = DuelPolicy(k, 256, 0)
    both = _misses(duel, steps, e, k)
    assert (lfu < lru) if winner == "lfu" else (lru < lfu), (lru, lfu)
    assert (duel.psel > 0) == (winner == "lfu") and abs(duel.psel) <= duel.limit_misses
    # the duel pays a few steps of the wrong policy while its selector crosses zero, then misses as the winner
    assert both <= min(lru, lfu) + 8 < max(lru, lfu), (lru, lfu, both)


def test_the_duels_shadows_play_each_policy_and_a_multi_wave_step_resets_them() -> None:
    duel = DuelPolicy(2, 256, 0)
    residency = LayerResidency(8, 2, duel)
    residency.plan_step([0])  # both shadows hold {0, 1}: a hit
    residency.plan_step([0])
    residency.plan_step([2])  # LRU's shadow evicts 1 (used never) as the LFU's does (count 0): the same
    assert duel.shadows == ({0, 2}, {0, 2}) and duel.psel == 0
    residency.plan_step([3])  # LRU's shadow evicts 0 (used at step 1) before 2 (step 2); the LFU's 2 (1 use)
    assert duel.shadows == ({2, 3}, {0, 3}) and duel.psel == 0
    residency.plan_step([0])  # LRU's shadow misses, the LFU's hits: the selector leans to the LFU
    assert duel.psel == 1 and duel.chosen() is duel.lfu
    residency.plan_step([4, 5, 6])  # 3 experts > K=2: waves by the keep rank; the shadows take the slots
    assert duel.shadows == (set(residency.slot_of), set(residency.slot_of)) and duel.psel == 1


def test_the_duel_is_a_policy_by_name_that_needs_the_slots() -> None:
    duel = make_policy("duel", 8)
    assert isinstance(duel, DuelPolicy) and (duel.period_steps, duel.window_steps) == (256, 4)
    assert isinstance(d := make_policy("duel:64:2", 8), DuelPolicy) and (d.period_steps, d.window_steps) == (64, 2)
    assert isinstance(d := make_policy("duel:64", 8), DuelPolicy) and d.window_steps == 0
    with pytest.raises(ValueError, match="needs the layer's number of slots"):
        make_policy("duel")
    for bad, message in (("duel:0", "names no period"), ("duel:4:x", "names no window"), ("lru:4", "is not one of")):
        with pytest.raises(ValueError, match=message):
            make_policy(bad, 8)
    assert check_policy("duel") == "duel" and check_policy("duel:32:2") == "duel:32:2"


def test_arc_keeps_twice_used_experts_through_a_scan_that_lru_lets_in() -> None:
    # K=3 of E=10, top_k=1: 0, 1, 2 start resident; 1 and 2 are used in two steps each (ARC's T2), then a scan of
    # experts used once. ARC evicts the never-used 0, then each scan expert for the next (T1 above its target 0);
    # LRU evicts 0, then 1 and 2, the least recent.
    steps = [[1], [2], [1], [2], [5], [6], [7], [8]]
    arc = LayerResidency(10, 3, ArcPolicy())
    lru = LayerResidency(10, 3, LruPolicy())
    for routed in steps:
        arc.plan_step(routed)
        lru.plan_step(routed)
    assert set(arc.slot_of) == {1, 2, 8}
    assert set(lru.slot_of) == {6, 7, 8}
    assert arc.plan_step([1]).hits == 1 and arc.plan_step([2]).hits == 1


def test_arc_moves_its_target_by_the_ghost_a_miss_comes_back_from() -> None:
    p = ArcPolicy()
    assert p.victim([4, 0, 9], 0) == 0  # never used: lowest id first, whatever the lists hold
    for step in (0, 1):
        p.on_use(1, step)
        p.on_use(2, step)
        p.on_use(2, step)  # once per step: a second use in the same step moves nothing
    p.on_use(3, 2)  # used in one step: T1
    assert p.victim([1, 2, 3], 3) == 3  # T1 holds 1 > target 0
    p.on_use(3, 3)  # back from B1: recency was cut short, the target grows by max(|B2| / |B1|, 1) ...
    assert p.target_t1 == 0.0  # ... once step 3 has ended: a step's uses take effect together
    assert p.victim([1, 2, 3], 4) == 1  # T1 is empty: T2's least recent (1 and 2 used at step 1, 1 first)
    assert p.target_t1 == 1.0
    p.on_use(1, 5)  # back from B2: frequency was cut short, the target shrinks
    assert p.victim([2, 3, 1], 6) == 2  # T2 in use order: 2 (step 1), 3 (step 3), 1 (step 5)
    assert p.target_t1 == 0.0


def test_arc_counts_a_steps_uses_together_whatever_their_order() -> None:
    """Two policies fed one step's uses in opposite orders choose alike afterwards (the planner's waves may serve a
    prefill's protected residents early or late); an expert used in the current step leaves last."""
    a, b = ArcPolicy(), ArcPolicy()
    for step, used in enumerate([[1, 2, 3], [3, 4], [1, 5, 6, 2]]):
        for e in used:
            a.on_use(e, step)
        for e in reversed(used):
            b.on_use(e, step)
    # after step 2: T1 = 4, 5, 6 (4 used at step 1; 5 and 6 at step 2, lowest id first), T2 = 3, 1, 2; in call order
    # b's T1 would be 4, 6, 5 and its victim 6
    assert a.victim([1, 2, 3, 5, 6], 3) == b.victim([1, 2, 3, 5, 6], 3) == 5
    a.on_use(7, 4)
    assert a.victim([7, 4], 4) == 4  # 7 was used in this step: the most recent of all
    assert a.victim([7], 4) == 7  # when only this step's experts are left, the lowest id


def test_arc_hears_of_the_planners_own_evictions_and_tracks_residents_only() -> None:
    """A prefill evicts routed experts by its keep rank, not by the policy's victim: ARC hears of each (`on_evict`),
    so once a step has ended its T1 and T2 hold residents only and c is at most K (before, the three left in T1:
    c = 5 against K = 3, and a miss of one of them read as a hit of T1, not as a ghost's return)."""
    arc = ArcPolicy()
    layer = LayerResidency(6, 3, arc, "recent")
    layer.plan_step([0, 1, 2, 3, 4, 5] * 3)  # 6 experts through 3 slots: three leave by the keep rank
    layer.plan_step([0])
    arc._advance(2)  # step 1 ends: its use counts
    tracked = set(arc._t1) | set(arc._t2)
    assert tracked == set(layer.slot_of) == {0, 4, 5}
    assert not (set(arc._b1) | set(arc._b2)) & tracked  # a ghost is never a resident


@settings(max_examples=300, deadline=None)
@given(
    st.integers(2, 16).flatmap(
        lambda e: st.tuples(
            st.just(e), st.integers(1, e),
            st.lists(st.lists(st.integers(0, e - 1), max_size=3 * e), min_size=1, max_size=20),
            st.sampled_from(["recent", "frequent", "lru"]), st.integers(0, 3),
        )
    )
)  # fmt: skip
def test_arc_tracks_residents_only_through_any_run_of_steps(run: tuple[int, int, list[list[int]], str, int]) -> None:
    """Through any steps, staged or not, any keep: after each step T1 and T2 hold residents only, and every victim
    is one of its candidates (LayerResidency's own checks)."""
    num_experts, k, steps, keep, rows = run
    arc = ArcPolicy()
    layer = LayerResidency(num_experts, k, arc, keep)
    for step, routed in enumerate(steps):
        staged = layer.stage_candidates(rows, max(len(routed), 1) * 10_000)
        layer.plan_step(routed, staged=staged)
        arc._advance(step + 1)  # the step ends: its uses count
        tracked = set(arc._t1) | set(arc._t2)
        assert tracked <= set(layer.slot_of) and not (set(arc._b1) | set(arc._b2)) & tracked


def _trace(ids: list[list[int]], num_experts: int, top_k: int):
    arr = np.array(ids, dtype=np.int64).reshape(-1, 1, top_k)
    meta = TraceMeta(num_layers=1, num_experts=num_experts, top_k=top_k, source="model")
    return build_trace(meta, [[("r", 1)]] * len(ids), arr, None)


def test_simulator_ranks_the_policies_on_a_trace_with_a_known_answer() -> None:
    # E=4, top_k=1, K=2 (slots 0, 1): a hot expert 1 interleaved with a scan over 2, 3, 2, 3.
    # LRU: 1 hit, then [2] evicts 0, [1] hit, [3] evicts 2, [1] hit, [2] evicts 3, [1] hit, [3] evicts 2
    # -> 4 hits 4 misses; the aged count keeps 1 too. No policy does better: one slot serves the
    # scan, whose every step names the expert it is not holding.
    ids = [[1], [2], [1], [3], [1], [2], [1], [3]]
    lru, aged, opt = simulate(_trace(ids, 4, 1), SimOptions(ks=(2,), policies=("lru", "lfu-decay:4", "belady")))
    assert (lru.total.hits, lru.total.misses) == (4, 4)
    assert (aged.total.hits, aged.total.misses) == (4, 4)
    assert (opt.total.hits, opt.total.misses) == (4, 4)
    # a hot expert 1 followed by a scan of two experts each used twice: LRU evicts 1 at the first
    # scan miss and misses it again; the aged count keeps 1 and gives up the scan's slot instead
    ids = [[1], [1], [1], [1], [2], [3], [1], [2], [3], [1]]
    lru, aged, opt = simulate(_trace(ids, 4, 1), SimOptions(ks=(2,), policies=("lru", "lfu-decay:4", "belady")))
    # LRU: 4 hits; [2] evicts 0; [3] evicts 1; [1] evicts 2; [2] evicts 3; [3] evicts 1; [1] evicts 2
    assert (lru.total.hits, lru.total.misses) == (4, 6)
    # aged LFU: 4 hits; [2] evicts 0; [3] evicts 2 (score 1 < 1's); [1] hit; [2] evicts 3; [3] evicts 2; [1] hit
    assert (aged.total.hits, aged.total.misses) == (6, 4)
    assert opt.total.hits >= aged.total.hits
    assert check_policy("lfu-decay:8") == "lfu-decay:8" and check_policy("lfu-aging:64") == "lfu-aging:64"
    aging = simulate(_trace(ids, 4, 1), SimOptions(ks=(2,), policies=("lfu-aging:100",)))[0]
    assert (aging.total.hits, aging.total.misses) == (6, 4)  # counts: 1 keeps its four uses, as above
    # ARC (simulator only): [2] evicts the never-used 0; [3] evicts 2 (T1, above its target 0); [1] hit; [2] evicts
    # 3 and comes back from B1 (target 1); [3] evicts T2's least recent 1; [1] evicts 2: between LRU and the counts
    arc = simulate(_trace(ids, 4, 1), SimOptions(ks=(2,), policies=(check_policy("arc"),)))[0]
    assert (arc.total.hits, arc.total.misses) == (5, 5)
    for bad in ("lfu-decay:0", "lfu-decay:x", "arc:2", "lfu-aging:0", "lfu-aging:2.5", "lfu-aging:x"):
        with pytest.raises(ValueError, match="unknown policy"):
            check_policy(bad)


def test_cli_accepts_a_half_life_and_names_a_bad_one(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.trace"
    from paged_experts.routing.trace import save_trace

    save_trace(_trace([[1], [2], [1], [3]], 4, 1), path)
    assert cli_main(["simulate", str(path), "--k", "2", "--policy", "lru,lfu-decay:4,belady"]) == 0
    out = capsys.readouterr().out
    assert "lfu-decay:4" in out and "belady" in out
    assert cli_main(["simulate", str(path), "--k", "2", "--policy", "lfu-decay:-1"]) == 2
    assert "--policy: unknown policy 'lfu-decay:-1'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("device", "policy", "steps", "duel"), [("cpu", "lfu-aging:16", (16, 0), False), ("cuda", "duel", (256, 4), True)]
)
def test_an_aging_policy_reaches_the_server_and_its_device_plan(
    tmp_path: Path, device: str, policy: str, steps: tuple[int, int], duel: bool
) -> None:
    from paged_experts.model import MoeCausalLM

    options = f"device: {device}, mode: paged, resident_experts: 8, eviction_policy: {policy}"
    argv, resolved = plan_argv(tmp_path, options)
    assert flag(argv, "--eviction-policy") == policy and resolved["eviction_policy"] == policy
    rt = RuntimeConfig(mode="paged", resident_experts=8, eviction_policy=policy, device_planning="on")
    moe = MoeCausalLM.from_pretrained("synth:tiny?layers=1&seed=1", rt).moe_layers[0]
    dev = moe.device_residency
    assert dev is not None and dev.duel == duel and (dev.aging_period_steps, dev.aging_window_steps) == steps
    host = moe.residency.policy
    assert isinstance(host, DuelPolicy if duel else AgingLfuPolicy) and (host.period_steps, host.window_steps) == steps


def test_option_is_written_for_paged_servers_and_leaves_other_server_ids_alone(tmp_path: Path) -> None:
    argv, resolved = plan_argv(tmp_path, "device: cpu, mode: paged, resident_experts: 8")
    assert flag(argv, "--eviction-policy") == "lru" and resolved["eviction_policy"] == "lru"
    argv, _ = plan_argv(tmp_path, "device: cpu, mode: paged, resident_experts: 8, eviction_policy: lfu-decay")
    assert flag(argv, "--eviction-policy") == "lfu-decay" and parse_args(argv[3:]).eviction_policy == "lfu-decay"
    argv, resolved = plan_argv(tmp_path, "device: cpu, mode: resident")
    assert "--eviction-policy" not in argv and resolved["eviction_policy"] is None
    from benchsuite.engines.builtin.adapter import BuiltinOptions

    unset = BuiltinOptions(mode="paged", resident_experts=8)
    assert "eviction_policy" not in unset.model_dump(mode="json")  # the dump the server id hashes
    assert BuiltinOptions(mode="paged", resident_experts=8, eviction_policy="lru").model_dump()["eviction_policy"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("device: cpu, mode: paged, resident_experts: 8, eviction_policy: arc",
         "engines.e.options.eviction_policy: 'arc' is not one of lru, lfu-aging, lfu-decay"),
        ("device: cpu, mode: resident, eviction_policy: lru",
         "engines.e.options.eviction_policy: 'lru' applies to mode paged, not resident"),
        ("device: cuda, mode: paged, resident_experts: 8, eviction_policy: lfu-decay",
         "engines.e.options.eviction_policy: 'lfu-decay' runs on the host planner only"),
    ],
)  # fmt: skip
def test_bad_eviction_policy_names_its_yaml_path(tmp_path: Path, options: str, message: str) -> None:
    with pytest.raises(MatrixError) as info:
        plan_argv(tmp_path, options)
    assert message in str(info.value), str(info.value)


def test_server_flag_and_runtime_refuse_what_they_cannot_run(capsys) -> None:
    assert parse_args(["--model", "/m", "--resident-experts", "8"]).eviction_policy is None
    for argv, message in (
        (["--eviction-policy", "lru"], "--eviction-policy 'lru' applies to mode paged, not resident"),
        (["--resident-experts", "8", "--device", "cuda", "--eviction-policy", "lfu-decay"],
         "--eviction-policy 'lfu-decay' runs on the host planner only"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            parse_args(["--model", "/m", *argv])
        assert info.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ValueError, match="runs on the host planner only"):
        RuntimeConfig(mode="paged", resident_experts=8, eviction_policy="lfu-decay", device_planning="on")
    RuntimeConfig(mode="paged", resident_experts=8, eviction_policy="lfu-decay")  # CPU: the host planner
    # the aging LFU runs on the device plan too, at its default period or one given
    RuntimeConfig(mode="paged", resident_experts=8, eviction_policy="lfu-aging", device_planning="on")
    RuntimeConfig(mode="paged", resident_experts=8, eviction_policy="lfu-aging:64", device_planning="on")
    for bad, message in (("lfu-aging:0", "names no period"), ("lfu-aging:x", "names no period"),
                         ("lfu-aging:\u00b2", "names no period"), ("lfu-aging:" + "9" * 23, "names no period"),
                         ("lfu-aging:4:", "names no window"), ("lfu-aging:4:-1", "names no window"),
                         ("lfu-aging:4:\u00b2", "names no window"), ("lfu-aging:4:2:1", "names no window"),
                         ("lru:4", "is not one of lru, lfu-aging, lfu-decay")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            RuntimeConfig(mode="paged", resident_experts=8, eviction_policy=bad)
        with pytest.raises(SystemExit) as info:
            parse_args(["--model", "/m", "--resident-experts", "8", "--eviction-policy", bad])
        assert info.value.code == 2 and f"--eviction-policy {bad!r} {message}" in capsys.readouterr().err
    assert parse_args(["--model", "/m", "--resident-experts", "8", "--device", "cuda", "--eviction-policy",
                       "lfu-aging:64"]).eviction_policy == "lfu-aging:64"  # fmt: skip
    policy = make_policy("lfu-aging:64")
    assert isinstance(policy, AgingLfuPolicy) and (policy.period_steps, policy.window_steps) == (64, 0)
    policy = make_policy("lfu-aging:64:4")
    assert isinstance(policy, AgingLfuPolicy) and (policy.period_steps, policy.window_steps) == (64, 4)
    # next-layer prefetch plans its predictions as steps: they would count as uses of the aging LFU
    with pytest.raises(ValueError, match="prefetch_next_layer plans each prediction as a step of its own"):
        RuntimeConfig(mode="paged", resident_experts=8, eviction_policy="lfu-aging", device_planning="on",
                      prefetch_next_layer=True)  # fmt: skip
    with pytest.raises(SystemExit) as info:
        parse_args(["--model", "/m", "--resident-experts", "8", "--device", "cuda", "--eviction-policy", "lfu-aging",
                    "--prefetch-next-layer", "--cuda-graph-max-bs", "4"])  # fmt: skip
    assert info.value.code == 2 and "would count as uses: use lru with it" in capsys.readouterr().err
    assert parse_args(["--model", "/m", "--resident-experts", "8", "--device", "cuda", "--eviction-policy",
                       "lfu-aging"]).eviction_policy == "lfu-aging"  # fmt: skip


@pytest.mark.slow
def test_benchsuite_run_stores_the_optimal_hit_rate_from_the_recorded_trace(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = {"model": str(tiny_model_dir), "mode": "paged", "resident_experts": 8}
    body = {
        "name": "optimal", "output_root": str(tmp_path / "results"),
        "engines": {"rec": {"kind": "builtin", "options": {**model, "record_routing": True,
                                                           "eviction_policy": ["lru", "lfu-decay", "duel"]}},
                    "plain": {"kind": "builtin", "options": model}},
        "workloads": {"w": {"output_tokens": 12, "concurrency": [1, 2], "num_requests": 2, "warmup_requests": 1}},
    }  # fmt: skip
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    assert cli_main(["run", str(path), "--quiet", "--no-report"]) == 0
    (run_dir,) = (tmp_path / "results").iterdir()
    cells = read_cells(run_dir)
    assert len(cells) == 8
    for cell in cells:
        realized = 1 - cell.miss_rate
        if cell.engine == "plain":
            assert cell.hit_rate_optimal is None and cell.extras["hit_rate_optimal_note"] == NO_TRACE_NOTE
            continue
        assert cell.hit_rate_optimal is not None and cell.hit_rate_optimal >= realized - 1e-12
        policy = cell.params["eviction_policy"]
        (trace_path,) = [p for p in (run_dir / "routing").iterdir() if p.stem == cell.server_id]
        trace = read_trace(trace_path)
        scrapes = json.loads((run_dir / "engine_metrics" / f"{cell.cell_id}.json").read_text())
        start, end = cell_steps(trace, scrapes["before"], scrapes["after"])
        # the replay of the server's own policy over the cell's steps reproduces its counters exactly
        replayed = replay_trace(trace, 8, "recent", policy)
        counts = (int(replayed.hits[start:end].sum()), int(replayed.misses[start:end].sum()))
        assert counts == (cell.expert_hits, cell.expert_misses), cell.cell_id
        assert replay_trace(trace, 8, "recent").hit_rate(start, end) == cell.hit_rate_optimal
    table = build_report_data([run_dir]).tables[HIT_RATE_TITLE]
    assert len(table) == 8 and table["hit_rate_optimal"].notna().sum() == 6
    plain = table[table["hit_rate_optimal"].isna()]
    assert (plain["note"] == NO_TRACE_NOTE).all() and (plain["configuration"].str.startswith("plain")).all()
    assert (table["of_optimal"].dropna() <= 1 + 1e-12).all()


def test_cell_steps_come_from_the_layer_step_counter_and_refuse_what_does_not_line_up() -> None:
    trace = _trace([[1], [2], [1], [3]], 4, 1)  # one layer, 4 steps
    at = lambda n: {"paged_experts:moe_steps_total": float(n)}  # noqa: E731
    assert cell_steps(trace, at(1), at(3)) == (1, 3)
    lru = replay_trace(trace, 2, "recent", "lru")  # slots 0, 1: step 1 misses 2, step 2 hits 1
    assert list(lru.hits[1:3]) == [0, 1] and lru.hit_rate(1, 3) == 0.5 and lru.hit_rate(2, 2) is None
    with pytest.raises(ValueError, match="the trace holds 4 steps"):
        cell_steps(trace, at(1), at(5))
    with pytest.raises(ValueError, match="have no"):
        cell_steps(trace, {}, at(2))
    two_layers = build_trace(TraceMeta(num_layers=2, num_experts=4, top_k=1, source="model"), [[("r", 1)]] * 2,
                             np.zeros((2, 2, 1), dtype=np.int64), None)  # fmt: skip
    with pytest.raises(ValueError, match="not a whole number of 2-layer steps"):
        cell_steps(two_layers, at(1), at(2))


def test_hit_rate_table_says_why_an_optimum_is_missing() -> None:
    base = {"mode": "paged", "engine": "p", "concurrency": 1, "prompt_class": "short", "repeat": 0,
            "resident_experts": 8}  # fmt: skip
    cells = pd.DataFrame([
        {**base, "cell_id": "a", "miss_rate": 0.25, "hit_rate_optimal": 0.9, "extras": {}},
        {**base, "cell_id": "b", "miss_rate": 0.5, "hit_rate_optimal": None, "extras": {"hit_rate_optimal_note": "x"}},
        {**base, "cell_id": "c", "miss_rate": 0.5, "hit_rate_optimal": None, "extras": {}},
        {**base, "cell_id": "d", "mode": "resident", "miss_rate": None, "hit_rate_optimal": None, "extras": {}},
    ])  # fmt: skip
    rows = hit_rate_table(cells).set_index("cell_id")
    assert list(rows.index) == ["a", "b", "c"]
    assert rows.loc["a", "hit_rate"] == 0.75 and rows.loc["a", "of_optimal"] == pytest.approx(0.75 / 0.9)
    assert rows.loc["b", "note"] == "x" and rows.loc["c", "note"] == NO_OPTIMUM_NOTE
