"""The eviction policies of a layer's expert slots (which resident expert a miss evicts) and their names: those a
paged server may run (`EVICTION_POLICIES`; `DEVICE_POLICIES` on the device plan), the check of a name
(`eviction_policy_error`) and the policy it builds (`make_policy`). The wave planner (planner.py) asks them for its
victims.

This module is plain Python (no tensors) so the runtime, the paging simulator and the tests all share one
implementation: the simulator replays traces through exactly this code. docs/eviction-policy.md compares them.
"""

from __future__ import annotations

import heapq
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

DEFAULT_AGING_PERIOD_STEPS = 256
"""`lfu-aging`'s period: counts halve every 256 planned steps of a layer (set from the simulator's comparison of
periods on the calibrated routing, docs/eviction-policy.md)."""


class EvictionPolicy(Protocol):
    """Chooses which resident expert leaves its slot. `step` counts planned steps from 0."""

    def on_use(self, expert: int, step: int) -> None: ...

    def victim(self, candidates: Collection[int], step: int) -> int: ...

    def victims(self, candidates: Collection[int], count: int, step: int) -> list[int]:
        """The `count` (<= len(candidates)) experts `victim` would pick one after another from `candidates`, each
        taken out before the next pick, in that order (a wave's misses; a duel shadow's)."""
        ...

    def on_uses(self, experts: Sequence[int], step: int) -> None:
        """`on_use(e, step)` for each of `experts`, in order (a wave's experts)."""
        ...

    def on_evict(self, expert: int, step: int) -> None:
        """The planner evicted `expert` by a choice of its own, not `victim`'s: a routed expert by the step's keep
        rank, or a staged one left out of the slots. Only a policy that keeps a list of the residents (ARC) needs
        to hear of it; the others keep what they know of every expert, resident or not."""

    def end_step(self, routed: Collection[int], residents: Collection[int], step: int) -> None:
        """Step `step` is planned: it routed the distinct experts `routed`, and the slots now hold `residents`.
        Only a policy that simulates caches of its own (`DuelPolicy`'s shadows) needs it."""


class KeepsEveryExpert:
    """The policies that keep what they know of every expert, resident or not: an eviction the planner chose
    itself changes nothing they know (`EvictionPolicy.on_evict`; only ARC keeps a list of the residents)."""

    def on_evict(self, expert: int, step: int) -> None:
        pass

    def end_step(self, routed: Collection[int], residents: Collection[int], step: int) -> None:
        pass


class _PicksOne(Protocol):
    def victim(self, candidates: Collection[int], step: int) -> int: ...


class _UsesOne(Protocol):
    def on_use(self, expert: int, step: int) -> None: ...


class OneVictimAPick:
    """`victims` as one `victim` a pick: for a policy whose pick changes what it knows (ARC's pending uses) or draws
    (random), or whose keys move as it looks (Belady's cursor)."""

    def victims(self: _PicksOne, candidates: Collection[int], count: int, step: int) -> list[int]:
        left, out = list(candidates), []
        if count > len(left):
            raise ValueError(f"{count} victims asked of {len(left)} candidates")
        for _ in range(count):
            victim = self.victim(left, step)
            left.remove(victim)
            out.append(victim)
        return out


class OneUseACall:
    """`on_uses` as one `on_use` a use: for a policy with no faster one."""

    def on_uses(self: _UsesOne, experts: Sequence[int], step: int) -> None:
        for e in experts:
            self.on_use(e, step)


class KeyedVictim(ABC):
    """`victim` as the candidate of least `_key(step)`, a key unique to each expert (the id breaks ties) that picking
    does not change, so `victims` takes them in one pass: each candidate's key once, not once a pick (a short prompt's
    wave evicting m of c candidates took m x c keys; a host-planned 4-token step with the duel 231-240 -> 82-83 us on
    a 2-core EPYC, benchmarks/plan_step_host.py)."""

    @abstractmethod
    def _key(self, step: int) -> Callable[[int], tuple]:
        """The policy's eviction order at `step`: the least key leaves first."""

    def victim(self, candidates: Collection[int], step: int) -> int:
        return min(candidates, key=self._key(step))

    def victims(self, candidates: Collection[int], count: int, step: int) -> list[int]:
        if count > len(candidates):
            raise ValueError(f"{count} victims asked of {len(candidates)} candidates")
        return heapq.nsmallest(count, candidates, key=self._key(step))


class LruPolicy(KeyedVictim, KeepsEveryExpert):
    """Least recently used; never-used experts (the initial 0..K-1) go first, lowest id first.

    Last uses are a dense list by expert id (-1: never used), grown as ids come: a host-planned step reads every
    layer's state from the device plan and writes it back (residency/device.py), and a list takes and gives all of a
    layer's at once, where a dict was built and read an expert at a time."""

    def __init__(self) -> None:
        self._last_use: list[int] = []  # [experts seen]: step of the last use, -1 never

    def _grow(self, size: int) -> None:
        if size > len(self._last_use):
            self._last_use.extend([-1] * (size - len(self._last_use)))

    def on_use(self, expert: int, step: int) -> None:
        self._grow(expert + 1)
        self._last_use[expert] = step

    def on_uses(self, experts: Sequence[int], step: int) -> None:
        if len(experts) == 0:  # a list or an array (`not` refuses an array)
            return
        self._grow(max(experts) + 1)
        last_use = self._last_use
        for e in experts:
            last_use[e] = step

    def last_use(self, expert: int) -> int:
        return self._last_use[expert] if expert < len(self._last_use) else -1

    def set_last_use(self, expert: int, step: int) -> None:
        """The expert's last use as the device plan kept it (negative: never used)."""
        self._grow(expert + 1)
        self._last_use[expert] = max(step, -1)

    def set_last_uses(self, stamps: Sequence[int]) -> None:
        """Every expert's last use at once, expert i's at stamps[i] (negative: never used), as the device plan kept
        them: one list (a host-planned step reads every layer's state back)."""
        self._last_use = _at_least(stamps, -1)

    def set_some_last_uses(self, experts: Sequence[int], stamps: Sequence[int]) -> None:
        """`set_last_use(experts[i], stamps[i])` for each i, in one loop (the slots' stamps the device plan kept)."""
        if len(experts) == 0:  # a list or an array (`not` refuses an array)
            return
        self._grow(max(experts) + 1)
        last_use = self._last_use
        for e, stamp in zip(experts, stamps, strict=True):
            last_use[e] = stamp if stamp >= 0 else -1

    def all_last_uses(self, experts: int) -> list[int]:
        """[last_use(e) for e in range(experts)]."""
        return _padded(self._last_use, experts, -1)

    def _key(self, step: int) -> Callable[[int], tuple[int, int]]:
        last_use, n = self._last_use, len(self._last_use)
        return lambda e: (last_use[e] if e < n else -1, e)  # unique (the id breaks ties): successive minima sort


class LfuPolicy(KeyedVictim, OneUseACall, KeepsEveryExpert):
    """Least frequently used (counts every step an expert was used); ties go to the least recent."""

    def __init__(self) -> None:
        self._uses: dict[int, int] = {}
        self._last_use: dict[int, int] = {}

    def on_use(self, expert: int, step: int) -> None:
        self._uses[expert] = self._uses.get(expert, 0) + 1
        self._last_use[expert] = step

    def _key(self, step: int) -> Callable[[int], tuple[int, int, int]]:
        return lambda e: (self._uses.get(e, 0), self._last_use.get(e, -1), e)


class DecayedLfuPolicy(KeyedVictim, OneUseACall, KeepsEveryExpert):
    """LFU with aging: evict the expert of least decayed use count, ties to the least recent.

    Why: expert popularity is skewed per layer (some experts are routed several times more often than
    others) but drifts with the text, and consecutive tokens share experts (DESIGN.md section 8).
    Plain LFU keeps experts that were popular long ago; LRU forgets a popular expert after K others
    have been used once. Each use adds 1 to an expert's score and every score halves every
    `half_life_steps` planned steps, so the score counts recent uses, weighted by how recent:
    `half_life_steps` -> 0 tends to LRU, -> infinity to LFU. Scores are kept for every expert ever
    used, resident or not (a re-admitted expert keeps its history).

    Default half-life 2 steps, from the simulator (benchmarks/eviction_policies.py, results in
    benchmarks/results/cpu/eviction_policies.txt, docs/eviction-policy.md): on the calibrated synthetic
    routing it is within 0.3 points of LRU's hit rate at c=1 and 2.4 points above it at c=4, K=32;
    on the tiny model's routing 0.5-0.9 points above; longer half-lives gain more on the tiny
    model's static random-router bias and lose up to 4.5 points on the calibrated routing at K=16.
    """

    def __init__(self, half_life_steps: float = 2.0) -> None:
        if not half_life_steps > 0:
            raise ValueError(f"half_life_steps must be > 0, got {half_life_steps}")
        self.half_life_steps = float(half_life_steps)
        self._score: dict[int, float] = {}  # decayed count as of `_stamp[e]`
        self._stamp: dict[int, int] = {}  # step of the last use

    def score(self, expert: int, step: int) -> float:
        """The expert's decayed use count at `step` (0 for an expert never used)."""
        if expert not in self._stamp:
            return 0.0
        return self._score[expert] * 0.5 ** ((step - self._stamp[expert]) / self.half_life_steps)

    def on_use(self, expert: int, step: int) -> None:
        if self._stamp.get(expert) == step:  # once per step, like LFU's counts (a step may have several waves)
            return
        self._score[expert] = self.score(expert, step) + 1.0
        self._stamp[expert] = step

    def _key(self, step: int) -> Callable[[int], tuple[float, int, int]]:
        return lambda e: (self.score(e, step), self._stamp.get(e, -1), e)


class AgingLfuPolicy(KeyedVictim, KeepsEveryExpert):
    """LFU with aging by halving: evict the expert of least use count, ties to the least recent, then the
    lowest id; every expert's count halves (an integer shift) each time the planned steps cross a multiple of
    `period_steps`.

    Why: on long runs of the calibrated routing a layer's popular experts stay popular across requests,
    and plain LFU, which keeps them, beat LRU by 1.8-2.4 points of decode hit rate at K=54 on a trace the
    H200 recorded (65 requests; docs/eviction-policy.md), where the decayed LFU's 2-step half-life gained
    0-0.4. Aging keeps what plain LFU learns while letting a popularity that drifts away fade within a few
    periods. Integer counts make the device plan (residency/device.py, plan_triton) the same plan bit for
    bit: `uses(e, s) = count >> (s // P - epoch)` equals halving at every boundary crossed, eagerly or lazily.
    Counts are kept for every expert ever used, resident or not (a re-admitted expert keeps its history).
    """

    def __init__(self, period_steps: int = DEFAULT_AGING_PERIOD_STEPS, window_steps: int = 0) -> None:
        if int(period_steps) != period_steps or period_steps < 1:
            raise ValueError(f"period_steps must be an integer >= 1, got {period_steps}")
        if int(window_steps) != window_steps or window_steps < 0:
            raise ValueError(f"window_steps must be an integer >= 0, got {window_steps}")
        self.period_steps = int(period_steps)
        # > 0: an expert used within the last `window_steps` steps is evicted only after every other candidate
        # (`lfu-aging:<P>:<W>`): a working set that moved keeps its experts while the old one's counts age
        self.window_steps = int(window_steps)
        # dense lists by expert id, grown together as ids come (see LruPolicy: the device round trip takes and gives
        # a layer's whole state at once)
        self._count: list[int] = []  # [experts seen]: use count as of epoch `_epoch[e]` (0: no count)
        self._epoch: list[int] = []  # [experts seen]: step // period_steps of the last use, or of the state set
        self._last_use: list[int] = []  # [experts seen]: step of the last use, -1 never

    def _grow(self, size: int) -> None:
        if size > len(self._count):
            more = size - len(self._count)
            self._count.extend([0] * more)
            self._epoch.extend([0] * more)
            self._last_use.extend([-1] * more)

    def uses(self, expert: int, step: int) -> int:
        """The expert's aged use count at `step` (0 for an expert never used)."""
        if expert >= len(self._count) or not self._count[expert]:
            return 0
        return self._count[expert] >> (step // self.period_steps - self._epoch[expert])

    def last_use(self, expert: int) -> int:
        return self._last_use[expert] if expert < len(self._last_use) else -1

    def on_use(self, expert: int, step: int) -> None:
        self.on_uses((expert,), step)

    def on_uses(self, experts: Sequence[int], step: int) -> None:
        """`on_use` of each expert in order (an expert counts once a step: a step may have several waves)."""
        if len(experts) == 0:  # a list or an array (`not` refuses an array)
            return
        self._grow(max(experts) + 1)
        count, epoch_of, last_use, now = self._count, self._epoch, self._last_use, step // self.period_steps
        for e in experts:
            if last_use[e] == step:
                continue
            count[e] = (count[e] >> (now - epoch_of[e]) if count[e] else 0) + 1
            epoch_of[e] = now
            last_use[e] = step

    def set_state(self, expert: int, uses: int, last_use: int, step: int) -> None:
        """The expert's state as of `step` (the device plan's, read back before a host-planned step)."""
        self._grow(expert + 1)
        self._count[expert] = max(uses, 0)
        self._epoch[expert] = step // self.period_steps
        self._last_use[expert] = max(last_use, -1)

    def set_states(self, uses: Sequence[int], last_uses: Sequence[int], step: int) -> None:
        """`set_state` for every expert at once (expert i: uses[i], last_uses[i]), as of `step`: three lists."""
        size = max(len(uses), len(last_uses))
        self._count = _padded(_at_least(uses, 0), size, 0)
        self._epoch = [step // self.period_steps] * size
        self._last_use = _padded(_at_least(last_uses, -1), size, -1)

    def all_uses(self, experts: int, step: int) -> list[int]:
        """[uses(e, step) for e in range(experts)], without a call per expert."""
        now = step // self.period_steps
        aged = [c >> (now - ep) if c else 0 for c, ep in zip(self._count[:experts], self._epoch, strict=False)]
        return _padded(aged, experts, 0)

    def all_last_uses(self, experts: int) -> list[int]:
        """[last_use(e) for e in range(experts)], without a call per expert."""
        return _padded(self._last_use, experts, -1)

    def _key(self, step: int) -> Callable[[int], tuple[int, ...]]:
        count, epoch_of, last_use, now = self._count, self._epoch, self._last_use, step // self.period_steps
        n = len(count)

        def uses(e: int) -> int:  # `uses(e, step)` inlined: the key runs for every candidate of a wave
            return count[e] >> (now - epoch_of[e]) if e < n and count[e] else 0

        def last(e: int) -> int:
            return last_use[e] if e < n else -1

        if self.window_steps:
            since = max(step - self.window_steps, 0)  # used at or after it (never-used experts are not recent)
            return lambda e: (last(e) >= since, uses(e), last(e), e)
        return lambda e: (uses(e), last(e), e)


def _at_least(values: Sequence[int], floor: int) -> list[int]:
    """values as a list, each below `floor` raised to it (the device keeps -1 for never; a caller may give less)."""
    out = list(values)
    return out if not out or min(out) >= floor else [max(v, floor) for v in out]


def _padded(values: list[int], size: int, fill: int) -> list[int]:
    """The first `size` of values, padded with `fill` to `size` (a new list)."""
    return values[:size] + [fill] * (size - len(values))


DUEL_LIMIT_MISSES = 16
"""`DuelPolicy`'s selector saturates at +-16 misses: a few steps in which one shadow misses less move it across zero
(a new request's working set), and one lucky step does not. Set by reasoning, not measured against other limits."""
DEFAULT_DUEL_WINDOW_STEPS = 4
"""`duel`'s aging LFU is `lfu-aging:256:4`: the arm that met issue 29's 150 tok/s on the calibrated routing
(h200-policy-b)."""


class DuelPolicy(KeepsEveryExpert):
    """LRU against `lfu-aging:<P>:<W>`, chosen per layer by which of the two misses less on a cache of its own.

    Why: the two routings the H200 measures want opposite policies. On the calibrated routing a layer's popular
    experts stay popular, and `lfu-aging:256:4` missed ~18% less than LRU at c=1 and ~10% less at c=4 (+9% decode,
    h200-policy-b); on the random-weight model's greedy loops each request decodes from a small working set that
    recency keeps, and the frequency arms without a long window decoded 3-15% slower there at c=1 (`lfu-aging:256:16`
    kept LRU's rate and gave back half of the calibrated gain, docs/eviction-policy.md). ARC's two classes did not pick
    up the calibrated routing's counts (docs/eviction-policy.md). Set dueling (Qureshi et al., ISCA 2007) keeps both:
    two shadow caches of K experts (ids only, no bytes), one run by each policy on the layer's routing, count their
    misses; a saturating selector (`psel`, +-`DUEL_LIMIT_MISSES`) adds LRU's shadow misses and subtracts the LFU's
    each step, and the layer's real slots evict by the LFU while it is above zero, else by LRU.

    A step's shadows run when it is planned (`end_step`): each shadow's misses (the routed experts it does not
    hold) take the places of its lowest-ranked unrouted experts, by its own policy at that step. A step that routes
    more than K experts (a prefill chunk, planned in waves with a keep rank) moves no selector and leaves both
    shadows holding what the slots hold. The device plan (residency/device.py, plan_triton) keeps the same shadows,
    selector and per-expert last uses and makes the same plan, bit for bit.
    """

    def __init__(
        self,
        num_slots: int,
        period_steps: int = DEFAULT_AGING_PERIOD_STEPS,
        window_steps: int = DEFAULT_DUEL_WINDOW_STEPS,
        limit_misses: int = DUEL_LIMIT_MISSES,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.limit_misses = limit_misses
        self.lru = LruPolicy()
        self.lfu = AgingLfuPolicy(period_steps, window_steps)
        # [LRU's, the LFU's] shadow caches: the experts each would hold, starting as the slots do (0..K-1)
        self.shadows: tuple[set[int], set[int]] = (set(range(num_slots)), set(range(num_slots)))
        self.psel = 0  # > 0: the LFU's shadow missed less lately, the slots evict by it

    @property
    def period_steps(self) -> int:
        return self.lfu.period_steps

    @property
    def window_steps(self) -> int:
        return self.lfu.window_steps

    def chosen(self) -> EvictionPolicy:
        return self.lfu if self.psel > 0 else self.lru

    def on_use(self, expert: int, step: int) -> None:
        self.lru.on_use(expert, step)
        self.lfu.on_use(expert, step)

    def on_uses(self, experts: Sequence[int], step: int) -> None:
        self.lru.on_uses(experts, step)
        self.lfu.on_uses(experts, step)

    def victim(self, candidates: Collection[int], step: int) -> int:
        return self.chosen().victim(candidates, step)

    def victims(self, candidates: Collection[int], count: int, step: int) -> list[int]:
        return self.chosen().victims(candidates, count, step)

    def end_step(self, routed: Collection[int], residents: Collection[int], step: int) -> None:
        routed = set(routed)
        if len(routed) > self.num_slots:  # a multi-wave step: its keep rank decided the slots, not a policy
            for shadow in self.shadows:
                shadow.clear()
                shadow.update(residents)
            return
        misses = []
        arms: tuple[EvictionPolicy, EvictionPolicy] = (self.lru, self.lfu)
        for shadow, policy in zip(self.shadows, arms, strict=True):
            missed = routed - shadow
            candidates = shadow - routed  # K - |routed & shadow| >= |missed| since |routed| <= K
            shadow.difference_update(policy.victims(candidates, len(missed), step))
            shadow |= missed
            misses.append(len(missed))
        self.psel = max(-self.limit_misses, min(self.limit_misses, self.psel + misses[0] - misses[1]))

    def set_state(self, shadows: tuple[Collection[int], Collection[int]], psel: int) -> None:
        """The shadows and selector as the device plan left them (read back before a host-planned step)."""
        for mine, theirs in zip(self.shadows, shadows, strict=True):
            mine.clear()
            mine.update(theirs)
        self.psel = int(psel)


class ArcPolicy(OneVictimAPick, OneUseACall):
    """Adaptive replacement (Megiddo and Modha, FAST 2003) over a layer's slots: a simulator candidate.

    Why: the two routings the H200 measures want opposite policies. On the calibrated routing a layer's popular
    experts stay popular, and frequency (`lfu-aging`) beats LRU; on the random-weight model's greedy loops each
    request decodes from a small working set that recency keeps, and every frequency count tried lost there
    (docs/eviction-policy.md). ARC splits the residents into T1 (used in one step since they came in) and T2
    (used in two or more), evicts from T1 while it holds more than a target p, and moves p by where the misses
    come back from: an expert evicted from T1 and missed again (ghost list B1) says recency was cut too short
    (p grows); one evicted from T2 and missed again (B2) says frequency was (p shrinks). No period or window to
    tune.

    Adapted to steps: an expert counts once per step (a step routes a set, several waves may use it), and a step's
    uses take effect when it ends, lowest id first, so the order of its waves changes no later choice; an expert
    used in the current step is the most recent of all, the last to leave; p moves by a step's returning ghosts
    at its end, capped at c then (the original's tie rule for a B2 miss at |T1| = p is not kept). The planner
    tells it of the residents it evicts by its own choice (`on_evict`), so T1 and T2 hold residents only and the
    cache size c is the number of residents the policy has seen used (the K slots, once the initial 0..K-1 have
    all been used or evicted); never-used residents go first, lowest id first, as LRU's. Each list is kept in use
    order (dicts keep insertion order; a use moves the expert to the end). The victim is chosen among the
    candidates the planner gives (residents not pinned by the step): T1's least recent candidate when T1 is
    above p or T2 has none, else T2's; the ghost lists keep at most c - |T1| (B1) and 2c in all.
    """

    def __init__(self) -> None:
        self._t1: dict[int, None] = {}  # residents used in one step since they came in, least recent first
        self._t2: dict[int, None] = {}  # residents used in two or more steps, least recent first
        self._b1: dict[int, None] = {}  # evicted from T1, oldest eviction first
        self._b2: dict[int, None] = {}  # evicted from T2, oldest eviction first
        self._pending: set[int] = set()  # used in the current step: applied when it ends, lowest id first
        self._left: set[int] = set()  # used in the current step, then evicted by the planner (`on_evict`)
        self._step: int | None = None
        self.target_t1 = 0.0  # p: T1's target size

    def _cache_size(self) -> int:
        return len(self._t1) + len(self._t2)

    def _advance(self, step: int) -> None:
        """A later step: the last one's uses take effect, lowest id first, then the experts the planner evicted after
        using them leave for the ghost lists, then p is capped at c and the ghosts trimmed, once, against the whole
        cache. Uses count per step, not per call, so the order of a step's waves changes nothing (a prefill's
        protected residents may be served in any wave)."""
        if step == self._step:
            return
        for expert in sorted(self._pending):
            self._apply(expert)
        for expert in sorted(self._left):
            self._demote(expert)
        self._pending.clear()
        self._left.clear()
        self.target_t1 = min(self.target_t1, float(self._cache_size()))
        self._trim_ghosts()
        self._step = step

    def on_use(self, expert: int, step: int) -> None:
        self._advance(step)
        self._pending.add(expert)  # once per step (a step may have several waves)

    def on_evict(self, expert: int, step: int) -> None:
        """A resident the planner evicted (see EvictionPolicy): to its ghost list, as a victim goes (if the step used
        it, once that use has counted), so T1 and T2 hold residents only and c stays the cache's size."""
        self._advance(step)
        if expert in self._pending:
            self._left.add(expert)
        else:
            self._demote(expert)

    def end_step(self, routed: Collection[int], residents: Collection[int], step: int) -> None:
        pass  # ARC applies a step's uses lazily, when the next one begins (`_advance`)

    def _apply(self, expert: int) -> None:
        """One step's use of `expert`: T1 -> T2, a ghost's return moves p, a first use enters T1."""
        if expert in self._t1:
            del self._t1[expert]
        elif expert in self._t2:
            del self._t2[expert]
        elif expert in self._b1:  # evicted from T1 too soon: recency deserves more room
            self.target_t1 += max(len(self._b2) / len(self._b1), 1.0)  # capped at c when the step ends
            del self._b1[expert]
        elif expert in self._b2:  # evicted from T2 too soon: frequency deserves more room
            self.target_t1 = max(self.target_t1 - max(len(self._b1) / len(self._b2), 1.0), 0.0)
            del self._b2[expert]
        else:
            self._t1[expert] = None  # first use since it came in (or ever)
            return
        self._t2[expert] = None  # a second use, or a miss its ghost remembered

    def _demote(self, expert: int) -> None:
        """A resident leaves its slot: from T1 to ghost list B1, from T2 to B2 (untracked: nothing to remember)."""
        if expert in self._t1:
            del self._t1[expert]
            self._b1[expert] = None
        elif expert in self._t2:
            del self._t2[expert]
            self._b2[expert] = None

    def victim(self, candidates: Collection[int], step: int) -> int:
        self._advance(step)
        settled = [e for e in candidates if e not in self._pending]
        unused = [e for e in settled if e not in self._t1 and e not in self._t2]
        if unused:  # a resident never used since the slots were filled
            return min(unused)
        if not settled:  # every candidate was used in this step (a multi-wave step without a keep rank)
            victim = min(candidates)
            self._pending.discard(victim)
            self._apply(victim)  # its use counts before it leaves
        else:
            pool = set(settled)
            oldest_t1 = next((e for e in self._t1 if e in pool), None)
            oldest_t2 = next((e for e in self._t2 if e in pool), None)
            if oldest_t1 is not None and (len(self._t1) > self.target_t1 or oldest_t2 is None):
                victim = oldest_t1
            else:
                assert oldest_t2 is not None  # a non-empty settled set that is tracked is in T1 or T2
                victim = oldest_t2
        self._demote(victim)
        return victim  # the ghosts are trimmed when the step ends (the cache is whole then)

    def _trim_ghosts(self) -> None:
        c = self._cache_size()
        while self._b1 and len(self._t1) + len(self._b1) > c:
            del self._b1[next(iter(self._b1))]
        while len(self._b1) + len(self._b2) > c:
            ghosts = self._b2 if self._b2 else self._b1
            del ghosts[next(iter(ghosts))]


class BeladyPolicy(OneVictimAPick, OneUseACall, KeepsEveryExpert):
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


class RandomPolicy(OneVictimAPick, OneUseACall, KeepsEveryExpert):
    """Random eviction (a baseline the published locality study reports); seeded, reproducible."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def on_use(self, expert: int, step: int) -> None:
        pass

    def victim(self, candidates: Collection[int], step: int) -> int:
        return self._rng.choice(sorted(candidates))


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LruPolicy,
    "lfu": LfuPolicy,
    "lfu-decay": DecayedLfuPolicy,
    "lfu-aging": AgingLfuPolicy,
    "arc": ArcPolicy,
    "random": RandomPolicy,
}
"""Online policies by name that need nothing else; `duel` needs the layer's K (`make_policy`), Belady the future
(the simulator builds it)."""

EVICTION_POLICIES: tuple[str, ...] = ("lru", "lfu-aging", "lfu-decay", "duel")
"""The policies a paged server can run (`--eviction-policy`); LRU stays the default until another wins on the
H200 (docs/eviction-policy.md)."""
DEVICE_POLICIES: tuple[str, ...] = ("lru", "lfu-aging", "duel")
"""The policies the device plan runs (residency/device.py, inside the captured decode step); the others run on
the host planner only."""
DEFAULT_EVICTION_POLICY = "lru"
PARAMETRIZED_POLICIES: tuple[str, ...] = ("lfu-aging", "duel")
"""The policies that take `:<P>[:<W>]`: an aging period of P planned steps and a recency window of W."""


def eviction_policy_error(name: str) -> str | None:
    """None where a paged server can run `name`: one of `EVICTION_POLICIES`, or `lfu-aging:<P>[:<W>]` (the aging
    LFU with a period of P planned steps, an integer >= 1, and a recency window of W >= 0 steps) or `duel:<P>[:<W>]`
    (LRU against that aging LFU); else what is wrong with it."""
    base, colon, params = name.partition(":")
    choices = f"is not one of {', '.join(EVICTION_POLICIES)} (or lfu-aging:<P>[:<W>], duel:<P>[:<W>])"
    if not colon:
        return None if name in EVICTION_POLICIES else choices
    if base not in PARAMETRIZED_POLICIES:
        return choices
    match = _AGING_NAME.fullmatch(params)
    assert match is not None  # the pattern matches any text
    period, window = match["period"], match["window"]
    if not _STEPS.fullmatch(period) or not 1 <= int(period) <= MAX_AGING_STEPS:
        return f"names no period: {base}:<P>[:<W>] takes a whole number of steps P in [1, {MAX_AGING_STEPS}]"
    if window is not None and (not _STEPS.fullmatch(window) or int(window) > MAX_AGING_STEPS):
        return f"names no window: {base}:<P>:<W> takes a whole number of steps W in [0, {MAX_AGING_STEPS}]"
    return None


MAX_AGING_STEPS = 1 << 30
"""The largest `lfu-aging` period and window (steps): counts stay below 2P in an int64 beside a 2**40 window mark."""
_AGING_NAME = re.compile(r"(?P<period>[^:]*)(?::(?P<window>.*))?")
_STEPS = re.compile(r"[0-9]{1,10}")  # ASCII digits only (str.isdigit takes '²', which int() refuses)


def policy_base(name: str) -> str:
    """The policy's name without its parameter ('lfu-aging:64' -> 'lfu-aging')."""
    return name.partition(":")[0]


def make_policy(name: str, num_slots: int | None = None) -> EvictionPolicy:
    """A fresh online policy of `name` (one of `EVICTION_POLICIES` with its default parameters, or
    `lfu-aging:<P>[:<W>]`, `duel:<P>[:<W>]`); `duel` keeps shadow caches of the layer's `num_slots`."""
    problem = eviction_policy_error(name)
    if problem is not None:
        raise ValueError(f"eviction policy {name!r} {problem}")
    base, colon, params = name.partition(":")
    period, _, window = params.partition(":")
    if base == "duel":
        if num_slots is None:
            raise ValueError("eviction policy 'duel' needs the layer's number of slots")
        if not colon:
            return DuelPolicy(num_slots)
        return DuelPolicy(num_slots, int(period), int(window or 0))
    if colon:
        return AgingLfuPolicy(int(period), int(window or 0))
    return POLICIES[name]()
