"""Device-side residency (paged_experts.residency.device) on CPU tensors:
- its one-wave plans equal the host planner's (`LayerResidency`) step by step, with LRU, with aging LFU
  (`lfu-aging`, counts halved every few steps here) and with the duel of the two (`duel`: its shadows and selector
  equal the host's too): hits, misses, which expert goes to which slot, the slot of every pair; also when
  host-planned multi-wave steps interleave (the two share one state through pull_to / push_from);
- a model planned on the device equals resident bit for bit in fp32 and counts exactly what the
  host-planned model counts;
- the static (graph) decode body of a paged model equals eager decode, with equal counters.
"""

from __future__ import annotations

import random

import pytest
import torch

from paged_experts.kernels.copy_kernel import copy_planned
from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.residency.device import DeviceResidency
from paged_experts.residency.planner import LayerResidency
from paged_experts.residency.policies import AgingLfuPolicy, DuelPolicy, EvictionPolicy, LruPolicy, make_policy
from paged_experts.residency.store import ExpertTensors
from paged_experts.runtime import RuntimeConfig

PATH = "synth:tiny?layers=2&seed=1"  # 32 experts, top_k 4
PROMPTS = ([5, 17, 300, 41, 9], [800, 2, 64], [11, 12, 13, 14])


def _check_same_plan(dev: DeviceResidency, host: LayerResidency, routed: list[int]) -> None:
    plan = dev.plan(torch.tensor(routed))
    ref = host.plan_step(routed)
    assert len(ref.waves) == 1
    union, hits, misses = plan.stats.tolist()
    assert (union, hits, misses) == (ref.union, ref.hits, ref.misses)
    pairs = [(e, s) for e, s in zip(plan.miss_experts.tolist(), plan.miss_slots.tolist()) if e < dev.num_experts]
    assert pairs == sorted(ref.waves[0].page_ins)
    assert plan.pair_slot.tolist() == [host.slot_of[e] for e in routed]
    assert dev.expert_in[: dev.num_slots].tolist() == host.expert_in
    if dev.duel:
        _check_same_duel(dev, host)


def _check_same_duel(dev: DeviceResidency, host: LayerResidency) -> None:
    """The duel's shadows, selector and every expert's last use, device against host."""
    assert isinstance(host.policy, DuelPolicy)
    e = dev.num_experts
    assert int(dev.psel) == host.policy.psel
    assert [set(torch.nonzero(dev.shadows[i, :e]).flatten().tolist()) for i in range(2)] == list(host.policy.shadows)
    assert dev.expert_last_use[:e].tolist() == [host.policy.lru.last_use(x) for x in range(e)]


def _pair(
    e: int, k: int, aging: int | None, window: int = 0, duel: bool = False
) -> tuple[DeviceResidency, LayerResidency]:
    """A device residency and a host one of the same policy: LRU (aging None) or aging LFU of that period
    (and recency window), or with `duel` LRU against that aging LFU."""
    policy: EvictionPolicy = LruPolicy()
    if aging:
        policy = DuelPolicy(k, aging, window) if duel else AgingLfuPolicy(aging, window)
    dev = DeviceResidency(e, k, torch.device("cpu"), aging_period_steps=aging, aging_window_steps=window, duel=duel)
    return dev, LayerResidency(e, k, policy)


POLICY_CASES = [(None, 0, False), (3, 0, False), (3, 2, False), (7, 4, False), (3, 0, True), (3, 2, True), (7, 4, True)]


@pytest.mark.parametrize(("aging", "window", "duel"), POLICY_CASES)
@pytest.mark.parametrize("seed", range(6))
def test_device_plan_equals_host_lru(seed: int, aging: int | None, window: int, duel: bool) -> None:
    """Random routings; every 20 steps the pool switches between all experts and a few (a small working set:
    the duel's selector moves both ways)."""
    rng = random.Random(seed)
    e, k, top_k = 32, rng.choice([4, 6, 8, 13, 32]), 4
    dev, host = _pair(e, k, aging, window, duel)
    for i in range(60):
        tokens = rng.randint(1, max(1, k // top_k))
        pool = range(e) if (i // 20) % 2 == 0 else range(k // 2 + top_k)
        routed = [x for _ in range(tokens) for x in rng.sample(pool, top_k)]
        if len(routed) > k:
            routed = routed[:k]
        _check_same_plan(dev, host, routed)


@pytest.mark.parametrize(
    ("aging", "window", "duel"), [(None, 0, False), (5, 0, False), (256, 0, False), (256, 4, False), (5, 2, True),
                                  (256, 4, True)]
)  # fmt: skip
def test_device_plan_equals_host_lru_at_the_served_shape(aging: int | None, window: int, duel: bool) -> None:
    """E=128, K=40, top_k 8 (the H200 configuration): batches of 1-5 tokens, ties among pinned slots,
    steps with no miss and steps where every pair misses; LRU, aging LFU (short and served period) and their
    duel (`duel`'s default: 256, 4)."""
    rng = random.Random(7)
    e, k, top_k = 128, 40, 8
    dev, host = _pair(e, k, aging, window, duel)
    chose_lfu = 0
    for step in range(200):
        pool = range(e) if step % 7 else range(12)  # every 7th step from a small set: mostly hits
        routed = [x for _ in range(rng.randint(1, k // top_k)) for x in rng.sample(pool, top_k)]
        chose_lfu += int(dev.psel) > 0
        _check_same_plan(dev, host, routed)
    assert chose_lfu > 0 if duel else chose_lfu == 0  # the duel planned steps by the LFU's order too


@pytest.mark.parametrize(("aging", "duel"), [(None, False), (2, False), (2, True)])
def test_compiled_device_plan_equals_host_lru(aging: int | None, duel: bool) -> None:
    """`DeviceResidency.compile()` (torch.compile of the plan, used by compiled graphed decode)
    plans what the host plans (LRU, aging LFU, their duel), step by step, with state mutated in place as eagerly."""
    rng = random.Random(11)
    e, k, top_k = 32, 8, 4
    dev, host = _pair(e, k, aging, duel=duel)
    dev.compile()
    for _ in range(30):
        routed = [x for _ in range(rng.randint(1, 2)) for x in rng.sample(range(e), top_k)]
        _check_same_plan(dev, host, routed)


@pytest.mark.parametrize(
    ("aging", "window", "duel"), [(None, 0, False), (3, 0, False), (4, 0, False), (4, 3, False), (4, 3, True)]
)
def test_host_planned_steps_share_the_device_state(aging: int | None, window: int, duel: bool) -> None:
    """Multi-wave steps plan on the host after pull_to; push_from hands the state back (aging LFU: every
    expert's count and the residents' last uses, across period boundaries on either side; the duel: its shadows,
    which a multi-wave step sets to the slots, its selector and every expert's last use)."""
    rng = random.Random(3)
    e, k, top_k = 32, 8, 4
    dev, ref = _pair(e, k, aging, window, duel)
    host = _pair(e, k, aging, window, duel)[1]
    for i in range(80):
        if i % 5 == 4:  # a 6-token step: 24 pairs > K, waves on the host
            routed = [x for _ in range(6) for x in rng.sample(range(e), top_k)]
            if i % 10 == 9:  # 24 pairs of at most K experts: one wave, planned on the host (the duel's shadows play it)
                routed = [x for _ in range(6) for x in rng.sample(range(k), top_k)]
            dev.pull_to(host)
            if duel:
                _check_same_duel(dev, host)
            assert host.plan_step(routed).misses == ref.plan_step(routed).misses
            dev.push_from(host)
            if duel:
                _check_same_duel(dev, ref)
        else:
            pool = range(e) if (i // 20) % 2 == 0 else range(k)
            routed = rng.sample(pool, top_k) + rng.sample(pool, top_k)
            _check_same_plan(dev, ref, routed)
    assert dev.expert_in[:k].tolist() == ref.expert_in
    if aging:
        last = int(dev.step) - 1
        lfu = ref.policy.lfu if isinstance(ref.policy, DuelPolicy) else ref.policy
        assert isinstance(lfu, AgingLfuPolicy)
        assert dev.uses[:e].tolist() == [lfu.uses(x, last) for x in range(e)]


@pytest.mark.parametrize(("e", "k"), [(32, 8), (128, 54), (7, 7), (60, 1)])
def test_the_state_is_views_of_one_buffer_in_disjoint_parts(e: int, k: int) -> None:
    """A push is one copy into one buffer: every part of a duel's state is a view of it, the parts do not overlap
    (the shadows' bytes included, whatever E's parity), each starts 16-byte aligned (as a tensor of its own: Triton
    specializes on it) and only padding lies between them; the padding stays zero through a pull and a push."""
    dev = DeviceResidency(e, k, torch.device("cpu"), aging_period_steps=4, aging_window_steps=2, duel=True)
    parts = [dev.slot_of, dev.expert_in, dev.last_use, dev.step, dev.uses, dev.expert_last_use, dev.psel, dev.shadows]
    start = dev._state.data_ptr()
    spans = sorted((t.data_ptr() - start, t.data_ptr() - start + t.numel() * t.element_size()) for t in parts)
    assert all(t.untyped_storage().data_ptr() == dev._state.untyped_storage().data_ptr() for t in parts)
    assert all(t.data_ptr() % 16 == 0 for t in parts)
    assert spans[0][0] == 0 and all(0 <= b[0] - a[1] < 16 for a, b in zip(spans, spans[1:]))  # in order, no overlap
    assert dev._state.numel() * 8 - spans[-1][1] < 8  # after the shadows' bytes, their last word's padding only
    padding = torch.ones(dev._state.numel() * 8, dtype=torch.bool)  # [bytes]
    for a, b in spans:
        padding[a:b] = False
    host = LayerResidency(e, k, DuelPolicy(k, 4, 2))
    dev.plan(torch.tensor([e - 1, 0][:k]))
    dev.pull_to(host)
    host.plan_step(list(range(e - min(e, 2 * k), e)))  # up to 2K pairs: waves on the host (one where E <= K)
    dev._state.view(torch.uint8)[padding] = 255  # a push writes the whole buffer, its padding as zeros
    dev.push_from(host)
    assert not dev._state.view(torch.uint8)[padding].any()
    assert spans[-1][1] - spans[-1][0] == 2 * (e + 1)  # the [2, E+1] shadow flags, one byte each
    # the starting state: identity slots, no uses, the shadows holding the slots' experts
    dev = DeviceResidency(e, k, torch.device("cpu"), aging_period_steps=4, aging_window_steps=2, duel=True)
    assert dev.slot_of.tolist() == [*range(k), *[-1] * (e + 1 - k)]
    assert dev.expert_in.tolist() == [*range(k), e] and dev.last_use.tolist() == [-1] * (k + 1)
    assert int(dev.step) == 0 and int(dev.psel) == 0 and dev.uses.tolist() == [0] * (e + 1)
    assert dev.shadows.tolist() == [[i < k for i in range(e + 1)]] * 2


def test_device_plan_refuses_a_host_policy_it_does_not_share() -> None:
    with pytest.raises(TypeError, match="plans LRU"):
        DeviceResidency(32, 8, torch.device("cpu")).pull_to(LayerResidency(32, 8, AgingLfuPolicy(4)))
    with pytest.raises(TypeError, match="every 4 steps"):
        DeviceResidency(32, 8, torch.device("cpu"), aging_period_steps=4).pull_to(
            LayerResidency(32, 8, AgingLfuPolicy(8))
        )
    with pytest.raises(TypeError, match=r"every 4 steps \(window 2\)"):
        DeviceResidency(32, 8, torch.device("cpu"), aging_period_steps=4, aging_window_steps=2).pull_to(
            LayerResidency(32, 8, AgingLfuPolicy(4))
        )
    with pytest.raises(TypeError, match=r"plans duel every 4 steps \(window 2\), the host AgingLfuPolicy"):
        DeviceResidency(32, 8, torch.device("cpu"), aging_period_steps=4, aging_window_steps=2, duel=True).pull_to(
            LayerResidency(32, 8, AgingLfuPolicy(4, 2))
        )
    with pytest.raises(TypeError, match="every 4 steps"):
        DeviceResidency(32, 8, torch.device("cpu"), aging_period_steps=4).pull_to(
            LayerResidency(32, 8, DuelPolicy(8, 4))
        )
    with pytest.raises(ValueError, match="needs the aging LFU's period"):
        DeviceResidency(32, 8, torch.device("cpu"), duel=True)


def test_device_plan_refuses_more_pairs_than_slots() -> None:
    with pytest.raises(ValueError, match="at most K=4"):
        DeviceResidency(32, 4, torch.device("cpu")).plan(torch.arange(5))


def test_copy_planned_moves_only_valid_entries() -> None:
    host = ExpertTensors(gate=torch.randn(6, 3, 2), up=torch.randn(6, 3, 2), down=torch.randn(6, 2, 3))
    slots = ExpertTensors(gate=torch.zeros(3, 3, 2), up=torch.zeros(3, 3, 2), down=torch.zeros(3, 2, 3))
    copy_planned(host, slots, torch.tensor([4, 1, 6]), torch.tensor([2, 0, 3]))  # third entry is padding
    for name in ("gate", "up", "down"):
        assert torch.equal(slots.get(name)[2], host.get(name)[4])
        assert torch.equal(slots.get(name)[0], host.get(name)[1])
        assert not slots.get(name)[1].any()


def _scenario(model: MoeCausalLM, decode_steps: int = 4, pool: KvPool | None = None) -> list[torch.Tensor]:
    pool = pool or KvPool.for_model(model, capacity_tokens=128)
    seqs = [pool.new_sequence() for _ in PROMPTS]
    out = model.forward([SeqChunk(s, p, 0, all_logits=True) for s, p in zip(seqs, PROMPTS)])
    last = list(out)  # each sequence's latest logits (a step's output holds only the rows it ran)
    for step in range(decode_steps):
        n = 1 + step % len(seqs)  # batch 1, 2, 3, 1: device-planned and host-planned steps
        chunks = [SeqChunk(s, [int(last[i][-1].argmax())], s.num_tokens) for i, s in enumerate(seqs[:n])]
        step_out = model.forward(chunks)
        assert len(step_out) == n
        last[:n] = step_out
        out += step_out
    return out


def _paged(k: int, planning: str, overlap: bool = False, groups: int = 1, policy: str = "lru") -> MoeCausalLM:
    rt = RuntimeConfig(
        mode="paged", resident_experts=k, device_planning=planning, overlap_page_in=overlap, overlap_groups=groups,  # type: ignore[arg-type]
        eviction_policy=policy,
    )  # fmt: skip
    return MoeCausalLM.from_pretrained(PATH, rt)


@pytest.mark.parametrize(
    ("k", "overlap", "groups", "policy"),
    [(4, False, 1, "lru"), (8, False, 1, "lru"), (12, False, 1, "lru"), (8, True, 1, "lru"), (12, True, 1, "lru"),
     (8, True, 2, "lru"), (12, True, 3, "lru"), (12, True, 12, "lru"), (8, False, 1, "lfu-aging"),
     (12, True, 2, "lfu-aging"), (8, False, 1, "duel:4:2"), (12, True, 2, "duel")],
)  # fmt: skip
def test_device_planned_model_equals_resident_and_counts_like_host(
    k: int, overlap: bool, groups: int, policy: str
) -> None:
    """overlap=True: the hits, then each of `groups` groups of misses, as grouped passes (a second
    stream on CUDA), still bit-exact; `lfu-aging` planned on the device counts what the host's counts."""
    resident = _scenario(MoeCausalLM.from_pretrained(PATH, RuntimeConfig(mode="resident")))
    on, off = _paged(k, "on", overlap, groups, policy), _paged(k, "off", policy=policy)
    assert all(m.device_residency is not None for m in on.moe_layers)
    assert all(m.device_residency is None for m in off.moe_layers)
    for i, (a, b, r) in enumerate(zip(_scenario(on), _scenario(off), resident)):
        assert torch.equal(a, r), f"K={k}: device-planned output {i} differs from resident"
        assert torch.equal(b, r)
    ta, tb = on.counters.snapshot(), off.counters.snapshot()
    for la, lb in zip(ta.layers, tb.layers):
        assert (la.hits, la.misses, la.union_sum, la.waves, la.bytes_paged_in, la.bytes_h2d) == (
            lb.hits,
            lb.misses,
            lb.union_sum,
            lb.waves,
            lb.bytes_paged_in,
            lb.bytes_h2d,
        )
    assert ta.total.misses > 0


def test_static_decode_of_device_planned_paged_model_matches_eager() -> None:
    k = 12  # batch sizes 1..3 fit one wave (3 x 4 <= 12)
    eager, static = _paged(k, "on"), _paged(k, "on")
    static.enable_cuda_graphs([1, 2, 3, 4])
    assert static.decode_graphs is not None and static.decode_graphs.batch_sizes == (1, 2, 3)  # 4 x 4 > 12 stays eager
    a_out, b_out = _scenario(static, decode_steps=6), _scenario(eager, decode_steps=6)
    assert static.graph_replays == 6
    for a, b in zip(a_out, b_out):
        assert (a - b).abs().max().item() <= 1e-4 * max(b.abs().max().item(), 1.0)
    ta, tb = static.counters.snapshot().total, eager.counters.snapshot().total
    assert (ta.steps, ta.union_sum, ta.hits, ta.misses, ta.bytes_h2d) == (
        tb.steps,
        tb.union_sum,
        tb.hits,
        tb.misses,
        tb.bytes_h2d,
    )


def test_overlap_needs_device_planning() -> None:
    with pytest.raises(ValueError, match="overlap_page_in needs"):
        RuntimeConfig(mode="paged", resident_experts=8, overlap_page_in=True)  # CPU 'auto' plans on the host
    with pytest.raises(ValueError, match="overlap_groups applies with overlap_page_in only"):
        RuntimeConfig(mode="paged", resident_experts=8, device_planning="on", overlap_groups=2)
    with pytest.raises(ValueError, match=r"overlap_groups must be in \[1, 64\], got 0"):
        RuntimeConfig(mode="paged", resident_experts=8, device_planning="on", overlap_page_in=True, overlap_groups=0)


def test_graphs_refuse_paged_layers_planned_on_the_host() -> None:
    with pytest.raises(ValueError, match="device planning"):
        _paged(8, "off").enable_cuda_graphs([1])


@pytest.mark.parametrize("mode", ["resident", "paged"])
def test_static_decode_with_synthetic_routing_matches_eager(mode: str) -> None:
    """The calibrated synthetic router in the graph: its ids for every layer are drawn inside the
    step from the request ordinals and positions in its inputs; same draws as the eager path (one
    plan per step), so same counters."""
    from paged_experts.routing.sources import make_router

    def build() -> MoeCausalLM:
        model = (
            _paged(12, "on") if mode == "paged" else MoeCausalLM.from_pretrained(PATH, RuntimeConfig(mode="resident"))
        )
        model.router_override = make_router("qwen3-30b-a3b", model.config, seed=4)
        return model

    eager, static = build(), build()
    static.enable_cuda_graphs([1, 2, 3])
    a_out, b_out = _scenario(static, decode_steps=5), _scenario(eager, decode_steps=5)
    assert static.graph_replays == 5
    for a, b in zip(a_out, b_out):
        assert (a - b).abs().max().item() <= 1e-4 * max(b.abs().max().item(), 1.0)
    ta, tb = static.counters.snapshot().total, eager.counters.snapshot().total
    assert (ta.steps, ta.union_sum, ta.hits, ta.misses) == (tb.steps, tb.union_sum, tb.hits, tb.misses)


def _prefetching(k: int) -> MoeCausalLM:
    rt = RuntimeConfig(mode="paged", resident_experts=k, device_planning="on", prefetch_next_layer=True)
    return MoeCausalLM.from_pretrained(PATH, rt)


def _slots_hold_their_experts(model: MoeCausalLM) -> None:
    """Every slot's weights are the host rows of the expert the device maps say it holds."""
    for moe in model.moe_layers:
        dr, slots = moe.device_residency, moe.device_experts
        assert dr is not None and slots is not None
        expert_in = dr.expert_in[: dr.num_slots].tolist()
        assert sorted(dr.slot_of[: dr.num_experts].ge(0).nonzero().reshape(-1).tolist()) == sorted(expert_in)
        for name in ("gate", "up", "down"):
            assert torch.equal(slots.get(name), moe.host.get(name)[expert_in]), f"layer {moe.layer_idx} {name}"


@pytest.mark.parametrize("k", [4, 8, 12])
def test_next_layer_prefetch_changes_no_output_and_counts_its_page_ins(k: int) -> None:
    """Prefetch (graphed steps: layer i+1's router on layer i's residual, predicted experts paged
    in ahead) only moves experts earlier: outputs equal the plain graphed steps bit for bit, every
    slot holds what its map says, hits + misses == union, and the predicted experts count as
    prefetched (used: those the step then routed to), their bytes in bytes_h2d."""
    sizes = [1, 2, 3]
    plain, ahead = _paged(k, "on"), _prefetching(k)
    plain.enable_cuda_graphs(sizes)
    ahead.enable_cuda_graphs(sizes)
    assert ahead.decode_graphs is not None and ahead.decode_graphs.prefetch and not plain.decode_graphs.prefetch  # type: ignore[union-attr]
    a_out, b_out = _scenario(ahead, decode_steps=8), _scenario(plain, decode_steps=8)
    assert ahead.graph_replays == plain.graph_replays > 0
    for a, b in zip(a_out, b_out):
        assert torch.equal(a, b)
    _slots_hold_their_experts(ahead)
    snap = ahead.counters.snapshot()
    first, second = snap.layers  # 2 layers: only the second is predicted (from the first)
    assert first.prefetched == 0 and second.prefetched > 0
    assert 0 <= second.prefetch_used <= second.prefetched
    for layer in snap.layers:
        assert layer.hits + layer.misses == layer.activations
        assert layer.bytes_h2d == layer.bytes_paged_in == (layer.misses + layer.prefetched) * snap.expert_bytes
    assert plain.counters.snapshot().total.prefetched == 0


@pytest.mark.parametrize(("k", "sizes"), [(8, {2}), (12, {2, 3})])  # K=8: 3 rows route 12 pairs > K, host-planned
def test_prefetch_counts_equal_a_count_from_what_was_predicted_and_routed(
    k: int, sizes: set[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """experts_prefetched and prefetch_used, the H200 report's prefetch_accuracy, counted a second way: each
    prefetch's distinct predicted experts not resident before it (prefetched), of those the ones the layer's
    next pass routed to (used). Two sequences of one prompt decode side by side (their rows predict and route
    alike: an expert both name counts once), a third joins every other step (batches of 2 and 3)."""
    from paged_experts.moe.paged import PagedLayer

    model = _prefetching(k)
    model.enable_cuda_graphs([2, 3])
    pending: dict[int, set[int]] = {}  # layer -> experts its prefetch paged in, until its pass
    expected = {"prefetched": 0, "used": 0}
    prefetched_rows: list[int] = []  # each prefetch's batch size
    real_prefetch, real_pass = PagedLayer.prefetch, PagedLayer.decode_pass

    def prefetch(self: PagedLayer, predicted: torch.Tensor, copy_stream: object) -> None:
        lru = self.device_lru
        assert lru is not None and self.layer_idx not in pending
        assert torch.equal(predicted[0], predicted[1])  # the twin rows: what is counted once
        resident = set(lru.residency.expert_in[: lru.residency.num_slots].tolist())
        paged_in = set(predicted.reshape(-1).tolist()) - resident
        pending[self.layer_idx] = paged_in
        expected["prefetched"] += len(paged_in)
        prefetched_rows.append(predicted.shape[0])
        real_prefetch(self, predicted, copy_stream)  # type: ignore[arg-type]

    def decode_pass(self: PagedLayer, h: torch.Tensor, ids: torch.Tensor, *args: object) -> object:
        paged_in = pending.pop(self.layer_idx, None)
        if paged_in is not None:
            expected["used"] += len(paged_in & set(ids.reshape(-1).tolist()))
        return real_pass(self, h, ids, *args)  # type: ignore[arg-type]

    pool = KvPool.for_model(model, capacity_tokens=128)
    seqs = [pool.new_sequence() for _ in range(3)]
    last = model.forward([SeqChunk(s, p, 0) for s, p in zip(seqs, (PROMPTS[0], PROMPTS[0], PROMPTS[1]))])
    monkeypatch.setattr(PagedLayer, "prefetch", prefetch)
    monkeypatch.setattr(PagedLayer, "decode_pass", decode_pass)
    before = model.counters.snapshot().total
    for step in range(10):
        n = 2 + step % 2  # the twins every step, the third every other
        step_out = model.forward(
            [SeqChunk(s, [int(last[i][-1].argmax())], s.num_tokens) for i, s in enumerate(seqs[:n])]
        )
        last[:n] = step_out
    after = model.counters.snapshot().total
    assert not pending  # every prefetch was followed by its layer's pass
    assert set(prefetched_rows) == sizes  # the batch sizes that fit one wave prefetched
    assert expected["prefetched"] > expected["used"] > 0  # the scenario predicts right and wrong
    assert (after.prefetched - before.prefetched, after.prefetch_used - before.prefetch_used) == (
        expected["prefetched"],
        expected["used"],
    )


def test_prefetch_needs_device_planning_and_excludes_overlap() -> None:
    with pytest.raises(ValueError, match="prefetch_next_layer needs"):
        RuntimeConfig(mode="paged", resident_experts=8, prefetch_next_layer=True)  # CPU 'auto': host planning
    with pytest.raises(ValueError, match="choose one"):
        RuntimeConfig(
            mode="paged", resident_experts=8, device_planning="on", prefetch_next_layer=True, overlap_page_in=True
        )


def test_graphed_decode_traces_the_routed_ids_it_counted() -> None:
    """`GraphedDecoder.trace` holds each step's routed ids [layers, B, k]; replaying them through
    the host LRU planner from the state before the steps gives the misses the runtime counted."""
    model = _paged(12, "on")
    model.enable_cuda_graphs([1, 2, 3])
    pool = KvPool.for_model(model, capacity_tokens=128)
    seqs = [pool.new_sequence() for _ in range(3)]
    last = model.forward([SeqChunk(s, p, 0) for s, p in zip(seqs, PROMPTS)])
    host = []
    for moe in model.moe_layers:
        lr = LayerResidency(model.config.num_experts, 12)
        moe.device_residency.pull_to(lr)  # type: ignore[union-attr]
        host.append(lr)
    model.counters.reset()
    assert model.decode_graphs is not None
    model.decode_graphs.trace = []
    for _ in range(5):
        last = model.forward([SeqChunk(s, [int(lg[-1].argmax())], s.num_tokens) for s, lg in zip(seqs, last)])
    trace = torch.stack(model.decode_graphs.trace)  # [steps, layers, B, k]
    assert trace.shape == (5, 2, 3, model.config.top_k)
    replayed = [sum(host[i].plan_step(trace[s, i].reshape(-1).tolist()).misses for s in range(5)) for i in range(2)]
    assert replayed == [layer.misses for layer in model.counters.snapshot().layers]


@pytest.mark.parametrize("routing", ["model", "synthetic"])
def test_prepare_decode_runs_every_step_shape_and_leaves_the_model_as_loaded(routing: str) -> None:
    """Before serving, `prepare_decode` builds every static step (batch sizes x KV buckets of the
    pool) and runs eager steps of the other batch sizes, then rewinds the residency and zeroes the
    counters: outputs and counters then equal an unprepared model's, and every slot holds the expert
    its map names (a warm-up that rewound the map but not the slots would serve other weights)."""
    from paged_experts.routing.sources import make_router

    def build() -> MoeCausalLM:
        model = _paged(12, "on")
        if routing == "synthetic":
            model.router_override = make_router("qwen3-30b-a3b", model.config, seed=4)
        model.enable_cuda_graphs([1, 2, 3])
        return model

    prepared, plain = build(), build()
    pool = KvPool.for_model(prepared, capacity_tokens=128)
    prepared.prepare_decode(pool, max_batch=4)
    graphs = prepared.decode_graphs
    assert graphs is not None
    assert sorted((b, length) for b, length, _ in graphs._entries) == [(b, L) for b in (1, 2, 3) for L in (64, 128)]
    _slots_hold_their_experts(prepared)
    assert prepared.counters.snapshot().total.steps == 0
    if routing == "synthetic":  # the warm-up's sequences took request ordinals: fresh routers number from 0
        plain.router_override = make_router("qwen3-30b-a3b", plain.config, seed=4)
        prepared.router_override = make_router("qwen3-30b-a3b", prepared.config, seed=4)
    a_out = _scenario(prepared, decode_steps=6, pool=pool)
    b_out = _scenario(plain, decode_steps=6)
    for a, b in zip(a_out, b_out):
        assert torch.equal(a, b)
    ta, tb = prepared.counters.snapshot().total, plain.counters.snapshot().total
    assert (ta.steps, ta.union_sum, ta.hits, ta.misses, ta.bytes_h2d) == (
        tb.steps,
        tb.union_sum,
        tb.hits,
        tb.misses,
        tb.bytes_h2d,
    )


def test_the_device_plan_of_each_policy_the_server_runs_shares_its_hosts_settings() -> None:
    cpu = torch.device("cpu")
    for name, period, window, duel in (
        ("lru", None, 0, False),
        ("lfu-aging", 256, 0, False),
        ("lfu-aging:16:4", 16, 4, False),
        ("duel", 256, 4, True),
        ("duel:8:2", 8, 2, True),
    ):
        policy = make_policy(name, 8)
        dev = DeviceResidency.for_policy(policy, 32, 8, cpu)
        assert (dev.aging_period_steps, dev.aging_window_steps, dev.duel) == (period, window, duel), name
        dev.pull_to(LayerResidency(32, 8, policy))  # the one state: pull_to refuses a host policy it does not share
    with pytest.raises(TypeError, match="not DecayedLfuPolicy"):
        DeviceResidency.for_policy(make_policy("lfu-decay", 8), 32, 8, cpu)
