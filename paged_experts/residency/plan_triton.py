"""The device LRU (aging-LFU, or their duel) plan of one paged layer-step as ONE Triton kernel (`device.plan_step` is
the reference), and the duel's shadow caches, which the step's plan does not read, as a second.

`device.plan_step` is ~45 small torch ops. Inside the captured decode graph each is a kernel of about
1-1.5 us with ~0.4 us between kernels (an 8-layer FP8 profile on the H200,
benchmarks/results/h200/2026-12-02-flags-overlap), so the plan alone cost ~60-75 us per paged layer,
~3 ms of a 48-layer token, on the critical path of every decode step. Here a single program plans
the step: every vector of the plan lives in registers and the three maps are read once and written
once.

Same plan, bit for bit (tests/test_device_plan_triton.py, under Triton's interpreter on the CPU; and
tests/cuda on the GPU):
- used[e]: some pair routes to e; a miss is a used expert with no slot; misses ascending, padded
  with E; the i-th miss takes the slot of rank i, slots ranked by (last use + 1) * (E + 1) + expert
  (never-used first, then least recent, ties by expert id), slots holding a routed expert last, ties
  among those by slot index; aging LFU (`AGING`, `lfu-aging`): every count halved first when the step is a
  multiple of PERIOD, slots ranked by (count of their expert, then the LRU key), with WINDOW > 0 the slots
  used in the last WINDOW steps after every other; `DUEL` (`duel`, `DuelPolicy`): the aging order while the
  selector psel > 0, else LRU's (the aging order built only then); then (`_shadows`, a launch of its own after the
  plan's) the two shadow caches play the step over per-expert last uses (each shadow's misses evict its
  lowest-ranked unrouted experts, picked one at a time over BLOCK_S = pow2(E) experts) and psel moves by their
  misses, within +-LIMIT_MISSES. Only the next step's plan reads what the shadows write, so a captured decode step
  runs every layer's in one launch at its end (`_shadow_layers_kernel`, device.DuelShadows), off the
  layers' critical path;
- the maps updated (evicted experts lose their slot, misses get theirs), every routed pair's slot
  stamped with the step, the routed experts' counts grown by one (aging), the step counter advanced; the spare
  entries (E, K) untouched.
Everything is a comparison matrix ([pairs x experts], [slots x slots], ...) reduced along one axis:
no gather from a register vector is needed, so the kernel is plain `tl` code.
"""

from __future__ import annotations

import torch

from paged_experts.residency.policies import DUEL_LIMIT_MISSES

try:  # Triton ships with CUDA builds of torch; the CPU wheel has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

MAX_TILE = 1 << 15  # the largest comparison matrix (elements) one program holds; larger shapes keep torch


def available(device: torch.device, num_experts: int, num_slots: int) -> bool:
    """True where the fused plan runs: CUDA with Triton, and a shape whose matrices fit one program (the duel's
    shadows add [pairs x experts], within the first bound since pairs <= K)."""
    if triton is None or device.type != "cuda":
        return False
    return _pow2(num_experts + 1) * _pow2(num_slots) <= MAX_TILE and _pow2(num_slots) ** 2 <= MAX_TILE


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _lowest(candidates, major, minor, n):  # pragma: no cover - runs on the GPU or under TRITON_INTERPRET
        """[BS] bool: the n candidates lowest by (major, minor), minor distinct (the LRU key), picked one by one."""
        big = 0x7FFFFFFFFFFFFFFF
        picked = candidates & False
        i = 0
        while i < n:  # not `for in range(n)`: Triton 3.6's interpreter takes no tensor bound there
            least = tl.min(tl.where(candidates, major, big), axis=0)
            tied = candidates & (major == least)
            pick = tied & (minor == tl.min(tl.where(tied, minor, big), axis=0))  # exactly one: minor is distinct
            picked = picked | pick
            candidates = candidates & ~pick
            i += 1
        return picked

    @triton.jit
    def _plan_kernel(  # pragma: no cover - runs on the GPU or under TRITON_INTERPRET
        ids_ptr, slot_of_ptr, expert_in_ptr, last_use_ptr, step_ptr, uses_ptr,
        pair_slot_ptr, pair_missed_ptr, miss_experts_ptr, miss_slots_ptr, stats_ptr,
        psel_ptr, ids_out_ptr,
        P, E, K, PERIOD, WINDOW,
        BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, AGING: tl.constexpr,
        DUEL: tl.constexpr,
    ):  # fmt: skip
        p = tl.arange(0, BLOCK_P)  # pairs, and miss ranks (at most P misses)
        e = tl.arange(0, BLOCK_E)  # experts
        k = tl.arange(0, BLOCK_K)  # slots
        pmask = p < P
        emask = e < E
        kmask = k < K
        ids = tl.load(ids_ptr + p, mask=pmask, other=-1)  # [BP]; -1 matches no expert
        ids = tl.where((ids >= 0) & (ids < E), ids, -1)  # a bad id routes nothing and stamps no slot
        pok = pmask & (ids >= 0)
        step = tl.load(step_ptr)

        # used / resident / miss per expert, from [pairs x experts]
        routes = (ids[:, None] == e[None, :]) & pmask[:, None]  # [BP, BE]
        used = tl.max(routes.to(tl.int32), axis=0) > 0  # [BE]
        slot_e = tl.load(slot_of_ptr + e, mask=emask, other=-1)  # [BE]
        miss = used & (slot_e < 0) & emask  # [BE]
        n_used = tl.sum(used.to(tl.int64), axis=0)
        n_miss = tl.sum(miss.to(tl.int64), axis=0)

        # misses ascending: the miss with running count i + 1 is the i-th
        running = tl.cumsum(miss.to(tl.int32), axis=0)  # [BE]
        is_ith = miss[None, :] & ((running[None, :] - 1) == p[:, None])  # [BP, BE]
        found = tl.max(is_ith.to(tl.int32), axis=1) > 0  # [BP]
        miss_expert = tl.where(found, tl.sum(tl.where(is_ith, e[None, :], 0), axis=1), E)  # [BP] int
        valid = found & pmask

        # victims: rank of every slot by its key (pinned = holds a routed expert: last)
        ex_k = tl.load(expert_in_ptr + k, mask=kmask, other=E)  # [BK]
        lu_k = tl.load(last_use_ptr + k, mask=kmask, other=-1)  # [BK]
        pinned = tl.max(((ids[:, None] == ex_k[None, :]) & pmask[:, None]).to(tl.int32), axis=0) > 0  # [BK]
        big = 0x7FFFFFFFFFFFFFFF
        key = tl.where(pinned | (k >= K), big, (lu_k + 1) * (E + 1) + ex_k)  # [BK] int64
        before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (k[None, :] < k[:, None]))  # [i, j]
        if AGING:  # aging LFU: (use count, last use, id), counts halved first when the step is a multiple of PERIOD
            halve = (step % PERIOD) == 0
            uses_e = tl.load(uses_ptr + e, mask=emask, other=0)  # [BE]
            uses_e = tl.where(halve, uses_e >> 1, uses_e)
            if DUEL:  # the selector's choice: the aging order while psel > 0, else LRU's, built only when chosen
                if tl.load(psel_ptr) > 0:
                    before = _aged(before, uses_ptr, ex_k, lu_k, kmask, pinned | (k >= K), halve, step, WINDOW)
            else:
                before = _aged(before, uses_ptr, ex_k, lu_k, kmask, pinned | (k >= K), halve, step, WINDOW)
        rank = tl.sum((before & kmask[None, :]).to(tl.int32), axis=1)  # [BK]: slots ranked before slot i
        takes = (rank[None, :] == p[:, None]) & kmask[None, :]  # [BP, BK]: miss j takes the slot of rank j
        victim = tl.sum(tl.where(takes, k[None, :], 0), axis=1)  # [BP]
        evicted = tl.sum(tl.where(takes, ex_k[None, :], 0), axis=1)  # [BP]: the expert it held
        miss_slot = tl.where(valid, victim, K)  # [BP]
        miss_expert = tl.where(valid, miss_expert, E)

        # each pair's slot after the page-ins: a hit keeps its slot, a miss gets its victim
        slot_hit = tl.sum(tl.where(routes, slot_e[None, :], 0), axis=1)  # [BP] (one match per pair)
        gets = (ids[:, None] == miss_expert[None, :]) & valid[None, :]  # [pairs, misses]
        missed = tl.max(gets.to(tl.int32), axis=1) > 0  # [BP]
        slot_miss = tl.sum(tl.where(gets, miss_slot[None, :], 0), axis=1)  # [BP]
        pair_slot = tl.where(missed, slot_miss, slot_hit)

        # the plan, then the state (every read above; the write sets are disjoint: evicted experts
        # are resident, misses are not)
        tl.store(pair_slot_ptr + p, pair_slot, mask=pmask)
        tl.store(pair_missed_ptr + p, missed, mask=pmask)
        tl.store(miss_experts_ptr + p, miss_expert, mask=pmask)
        tl.store(miss_slots_ptr + p, miss_slot, mask=pmask)
        tl.store(slot_of_ptr + evicted, -1, mask=valid)
        tl.store(slot_of_ptr + miss_expert, miss_slot, mask=valid)
        tl.store(expert_in_ptr + miss_slot, miss_expert, mask=valid)
        tl.store(last_use_ptr + pair_slot, step + tl.zeros_like(pair_slot), mask=pok)
        if DUEL:  # the shadows' kernel (`_shadow_kernel`, after this one) reads the step's ids from here
            tl.store(ids_out_ptr + p, ids, mask=pmask)
        if AGING:
            tl.store(uses_ptr + e, uses_e + used.to(tl.int64), mask=emask)
        tl.store(step_ptr, step + 1)
        tl.store(stats_ptr, n_used)
        tl.store(stats_ptr + 1, n_used - n_miss)
        tl.store(stats_ptr + 2, n_miss)

    @triton.jit
    def _aged(before, uses_ptr, ex_k, lu_k, kmask, last, halve, step, WINDOW):  # pragma: no cover - GPU/interpreter
        """[BK, BK] the aging LFU's order of the slots: (count of the slot's expert, halved on a period's step; with
        WINDOW > 0 the slots used in the last WINDOW steps after every other), ties by `before` (LRU's order); `last`
        [BK]: slots ranked after every other (pinned, or past K)."""
        big = 0x7FFFFFFFFFFFFFFF
        uses_k = tl.load(uses_ptr + ex_k, mask=kmask, other=0)  # [BK] the count of each slot's expert
        uses_k = tl.where(halve, uses_k >> 1, uses_k)
        recent = (lu_k >= 0) & (lu_k >= step - WINDOW) & (WINDOW > 0)  # [BK] used in the last WINDOW steps
        count = tl.where(last, big, uses_k + recent.to(tl.int64) * (1 << 40))  # [BK] (device.RECENT)
        return (count[None, :] < count[:, None]) | ((count[None, :] == count[:, None]) & before)

    @triton.jit
    def _shadow_kernel(  # pragma: no cover - runs on the GPU or under TRITON_INTERPRET
        ids_ptr, uses_ptr, step_ptr, elu_ptr, shadow_ptr, psel_ptr,
        P, E, WINDOW, LIMIT_MISSES,
        BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        """DuelPolicy.end_step of the step `_plan_kernel` just planned, for one layer (`_shadows`)."""
        _shadows(ids_ptr, uses_ptr, step_ptr, elu_ptr, shadow_ptr, psel_ptr, P, E, WINDOW, LIMIT_MISSES, BLOCK_P,
                 BLOCK_S)  # fmt: skip

    @triton.jit
    def _shadow_layers_kernel(  # pragma: no cover - runs on the GPU or under TRITON_INTERPRET
        table_ptr,
        P, E, WINDOW, LIMIT_MISSES,
        BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        """`_shadows` of every duel layer of a step in one launch, one program a layer: table [L, 6] int64 holds each
        layer's addresses (ids, uses, step, expert last uses, shadows as bytes, psel), which never move."""
        row = table_ptr + tl.program_id(0) * 6
        _shadows(
            tl.load(row).to(tl.pointer_type(tl.int64)), tl.load(row + 1).to(tl.pointer_type(tl.int64)),
            tl.load(row + 2).to(tl.pointer_type(tl.int64)), tl.load(row + 3).to(tl.pointer_type(tl.int64)),
            tl.load(row + 4).to(tl.pointer_type(tl.uint8)), tl.load(row + 5).to(tl.pointer_type(tl.int64)),
            P, E, WINDOW, LIMIT_MISSES, BLOCK_P, BLOCK_S,
        )  # fmt: skip

    @triton.jit
    def _shadows(  # pragma: no cover - runs on the GPU or under TRITON_INTERPRET
        ids_ptr, uses_ptr, step_ptr, elu_ptr, shadow_ptr, psel_ptr,
        P, E, WINDOW, LIMIT_MISSES,
        BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        """DuelPolicy.end_step of the step `_plan_kernel` just planned, from the state it left: each shadow's misses
        take its lowest-ranked unrouted experts' places, psel moves by their misses (within +-LIMIT_MISSES), the routed
        experts' last uses are stamped. A launch of its own, after the plan's: the step's plan does not read the
        shadows, so a captured step runs every layer's in one launch at its end (DeviceResidency, DuelShadows)."""
        p = tl.arange(0, BLOCK_P)  # pairs
        s = tl.arange(0, BLOCK_S)  # experts 0..E-1 (no spare entry)
        pmask = p < P
        smask = s < E
        ids = tl.load(ids_ptr + p, mask=pmask, other=-1)  # [BP] as the plan sanitized them (-1: no expert)
        step = tl.load(step_ptr) - 1  # the plan advanced it: this is the step it planned
        psel = tl.load(psel_ptr)  # as the plan read it (only this kernel writes it)
        used_s = tl.max(((ids[:, None] == s[None, :]) & pmask[:, None]).to(tl.int32), axis=0) > 0  # [BS]
        stamp = tl.load(elu_ptr + s, mask=smask, other=-1)  # [BS] last uses before this step's
        # the step's counts before its own uses: the plan halved them (on a period's step) and then added the uses
        uses_s = tl.load(uses_ptr + s, mask=smask, other=0) - used_s.to(tl.int64)  # [BS]
        lkey = (stamp + 1) * (E + 1) + s  # [BS] LRU's order, distinct
        recent_s = (stamp >= 0) & (stamp >= step - WINDOW) & (WINDOW > 0)  # [BS]
        cnt = uses_s + recent_s.to(tl.int64) * (1 << 40)  # [BS] (device.RECENT)
        sh0 = (tl.load(shadow_ptr + s, mask=smask, other=0) != 0) & smask  # [BS] LRU's shadow
        sh1 = (tl.load(shadow_ptr + (E + 1) + s, mask=smask, other=0) != 0) & smask  # [BS] the LFU's
        miss0 = used_s & ~sh0 & smask  # [BS]
        miss1 = used_s & ~sh1 & smask  # [BS]
        n0 = tl.sum(miss0.to(tl.int32), axis=0)
        n1 = tl.sum(miss1.to(tl.int32), axis=0)
        # each shadow's n misses evict its n lowest-ranked unrouted experts, picked one at a time (few: the real
        # decode misses were 0.3-0.8 a layer-step at c=1 and 3-5 at c=4 on the H200); ranking every expert
        # against every other instead ([BS x BS] int64 matrices) spills ~1.1-1.3 KB of registers at the served
        # shape, and the duel's decode step was 2.3 ms a token slower than the LFU's at the same misses
        # (h200-duel)
        keep0 = (sh0 & ~_lowest(sh0 & ~used_s, lkey, lkey, n0)) | miss0  # [BS] the shadow after the step
        keep1 = (sh1 & ~_lowest(sh1 & ~used_s, cnt, lkey, n1)) | miss1  # [BS]
        # every thread has read the shadows, last uses and psel before any writes them (the layout changes
        # above synchronize already; the barrier says so rather than relying on it)
        tl.debug_barrier()
        tl.store(shadow_ptr + s, keep0.to(tl.uint8), mask=smask)  # bytes: bool tensors viewed as uint8
        tl.store(shadow_ptr + (E + 1) + s, keep1.to(tl.uint8), mask=smask)
        tl.store(psel_ptr, tl.minimum(tl.maximum(psel + n0 - n1, -LIMIT_MISSES), LIMIT_MISSES))
        tl.store(elu_ptr + s, step + tl.zeros_like(stamp), mask=smask & used_s)


def plan_step_triton(
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
    duel_ids: torch.Tensor | None = None,
    defer_shadows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`device.plan_step`'s signature and results (arange_e unused), as one kernel launch (a duel's: two):
    flat_ids [P] int64 (P <= K) -> (pair_slot [P], pair_missed [P] bool, miss_experts [P],
    miss_slots [P], stats [3]); slot_of [E+1], expert_in [K+1], last_use [K+1], step [] updated, and with
    aging_period > 0 (aging LFU) uses [E+1], with `duel` its (expert_last_use [E+1], shadows [2, E+1], psel []).
    A duel's plan is two launches: the plan, then the shadows (`duel_shadows_triton`), which read the step's ids from
    `duel_ids` ([>= P] int64; a new buffer where None). `defer_shadows`: the plan alone; the caller launches the
    shadows (on any stream, after this one) before the layer's next plan or a read of its state."""
    aging = aging_period > 0
    if aging and uses is None:
        raise ValueError("an aging plan needs the use counts")
    if duel is not None and not aging:
        raise ValueError("a duel plan needs the aging LFU's period")
    p = flat_ids.shape[0]
    ids = flat_ids.contiguous()
    pair_slot = torch.empty(p, dtype=torch.long, device=ids.device)
    pair_missed = torch.empty(p, dtype=torch.bool, device=ids.device)
    miss_experts = torch.empty(p, dtype=torch.long, device=ids.device)
    miss_slots = torch.empty(p, dtype=torch.long, device=ids.device)
    stats = torch.empty(3, dtype=torch.long, device=ids.device)
    if defer_shadows and (duel is None or duel_ids is None):
        raise ValueError("deferred shadows need a duel and the ids buffer their launch reads")
    if duel is not None and duel_ids is None:
        duel_ids = torch.empty(p, dtype=torch.long, device=ids.device)
    _plan_kernel[(1,)](
        ids, slot_of, expert_in, last_use, step, uses if aging else last_use,
        pair_slot, pair_missed, miss_experts, miss_slots, stats,
        duel[2] if duel is not None else step, duel_ids if duel_ids is not None else ids,
        p, e, k, max(aging_period, 1), aging_window,
        BLOCK_P=_pow2(p), BLOCK_E=_pow2(e + 1), BLOCK_K=_pow2(k), AGING=aging, DUEL=duel is not None, num_warps=8,
    )  # fmt: skip
    if duel is not None and not defer_shadows:
        assert uses is not None and duel_ids is not None
        duel_shadows_triton(duel_ids, p, uses, step, *duel, e, aging_window)
    return pair_slot, pair_missed, miss_experts, miss_slots, stats


def duel_shadows_triton(
    duel_ids: torch.Tensor,
    p: int,
    uses: torch.Tensor,
    step: torch.Tensor,
    expert_last_use: torch.Tensor,
    shadows: torch.Tensor,
    psel: torch.Tensor,
    e: int,
    aging_window: int,
) -> None:
    """The duel's shadows (`DuelPolicy.end_step`) of the step a duel's `plan_step_triton` just planned, as one launch
    on the current stream, which must be ordered after that plan and before the layer's next one: duel_ids [>= P] the
    step's ids the plan stored; uses [E+1], step [] as the plan left them; expert_last_use [E+1], shadows [2, E+1]
    and psel [] updated."""
    _shadow_kernel[(1,)](
        duel_ids, uses, step, expert_last_use, shadows.view(torch.uint8), psel,
        p, e, aging_window, DUEL_LIMIT_MISSES,
        BLOCK_P=_pow2(p), BLOCK_S=_pow2(e), num_warps=8,
    )  # fmt: skip


def duel_shadows_layers_triton(table: torch.Tensor, p: int, e: int, aging_window: int) -> None:
    """`duel_shadows_triton` for every layer of `table` ([L, 6] int64 on the device: each layer's duel_ids, uses, step,
    expert_last_use, shadows (as uint8) and psel addresses, `shadow_table`) in one launch: each layer's plan of this
    step must be ordered before it, and its next plan after it."""
    _shadow_layers_kernel[(table.shape[0],)](
        table, p, e, aging_window, DUEL_LIMIT_MISSES, BLOCK_P=_pow2(p), BLOCK_S=_pow2(e), num_warps=8,
    )  # fmt: skip


def _on(got: torch.device, want: torch.device) -> bool:
    """`got` (a tensor's device: always indexed on CUDA) is `want`, which may name no index (`cuda` as a runtime
    config gives it: torch compares `cuda` and `cuda:0` as different)."""
    return got.type == want.type and (want.index is None or got.index is None or got.index == want.index)


def shadow_table(
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    device: torch.device,
) -> torch.Tensor:
    """[L, 6] int64 on `device`: per layer the addresses of (duel_ids [>= P] int64, uses [E+1] int64, step [] int64,
    expert_last_use [E+1] int64, shadows [2, E+1] bool, psel [] int64), for `duel_shadows_layers_triton`. The tensors
    must stay where they are (a DeviceResidency's state is written in place, never replaced)."""
    rows = []
    for ids, uses, step, elu, shadows, psel in layers:
        for t, dtype in ((ids, torch.long), (uses, torch.long), (step, torch.long), (elu, torch.long),
                         (shadows, torch.bool), (psel, torch.long)):  # fmt: skip
            if t.dtype != dtype or not t.is_contiguous() or not _on(t.device, device):
                raise ValueError(f"shadow_table: a {t.dtype} tensor on {t.device} (contiguous: {t.is_contiguous()}), "
                                 f"expected contiguous {dtype} on {device}")  # fmt: skip
        rows.append([t.data_ptr() for t in (ids, uses, step, elu, shadows, psel)])
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), 6).to(device)
