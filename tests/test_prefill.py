"""Paged prefill of long prompts (CPU): paged == resident bit for bit for every K from top_k to E with
a 320-token prompt, whole or in chunks while another sequence decodes in the same steps (pipelined
multi-wave steps, every prefill residency policy), in fp32, bf16 and block-FP8; the prefill counters
(chunks, tokens, bytes, waves, copy time within the span) and their replay through the simulator's
planner; what each policy leaves in the slots."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch

from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.residency.planner import PREFILL_KEEP, STAGING, LayerResidency
from paged_experts.runtime import RuntimeConfig

PROMPT = [(37 * i + 11) % 1000 for i in range(320)]  # 320 tokens: the union is E in every layer
SHORT = [5, 17, 300, 41]
TINY = "synth:tiny?layers=3&seed=2"  # E=32, top_k=4
TINY_FP8 = "synth:tiny-fp8?layers=2&seed=4"  # E=16, top_k=4, block-FP8 experts

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def long_prompt(model: MoeCausalLM, chunk: int, decode_steps: int = 3) -> list[torch.Tensor]:
    """A short sequence prefills, then the long prompt prefills in chunks of `chunk` tokens while the
    short one decodes in the same steps; then both decode. Every logit row is returned."""
    pool = KvPool.for_model(model, capacity_tokens=512)
    short, long = pool.new_sequence(), pool.new_sequence()
    out = model.forward([SeqChunk(short, SHORT, 0, all_logits=True)])
    token = 40
    for start in range(0, len(PROMPT), chunk):
        piece = PROMPT[start : start + chunk]
        out += model.forward(
            [SeqChunk(short, [token], short.num_tokens), SeqChunk(long, piece, start, all_logits=True)]
        )
        token += 1
    for step in range(decode_steps):
        out += model.forward(
            [SeqChunk(short, [token + step], short.num_tokens), SeqChunk(long, [7 + step], long.num_tokens)]
        )
    return out


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{what}: output {i} differs by {(a - b).abs().max().item()}"


def paged(path: str, k: int, keep: str = "recent", dtype: str = "float32", page_in: str = "auto") -> MoeCausalLM:
    rt = RuntimeConfig(mode="paged", resident_experts=k, prefill_residency=keep, dtype=dtype, page_in=page_in)  # type: ignore[arg-type]
    return MoeCausalLM.from_pretrained(path, rt)


@pytest.fixture(scope="module")
def resident_fp32() -> dict[int, list[torch.Tensor]]:
    model = MoeCausalLM.from_pretrained(TINY, RuntimeConfig(mode="resident"))
    return {chunk: long_prompt(model, chunk) for chunk in (320, 96)}


def test_long_prompt_paged_equals_resident_for_every_k(resident_fp32: dict[int, list[torch.Tensor]]) -> None:
    cfg = MoeCausalLM.from_pretrained(TINY, RuntimeConfig(mode="resident")).config
    for k in range(cfg.top_k, cfg.num_experts + 1):
        model = paged(TINY, k)
        assert_same(long_prompt(model, 320), resident_fp32[320], f"K={k}, one chunk")
        snap = model.counters.snapshot()  # the long chunk routes to every expert: ceil(E / K) waves or more per layer
        assert snap.prefill.chunks == 2 and all(c.union_max == cfg.num_experts for c in snap.layers)
        assert snap.prefill.waves >= cfg.num_layers * -(-cfg.num_experts // k)
    for k in (cfg.top_k, 9, 16, 31):
        assert_same(long_prompt(paged(TINY, k), 96), resident_fp32[96], f"K={k}, chunks of 96")


@pytest.mark.parametrize("keep", PREFILL_KEEP)
def test_every_prefill_residency_policy_equals_resident(
    keep: str, resident_fp32: dict[int, list[torch.Tensor]]
) -> None:
    for k in (4, 13):
        assert_same(long_prompt(paged(TINY, k, keep), 96), resident_fp32[96], f"{keep}, K={k}")


def test_long_prompt_bf16_paged_equals_resident() -> None:
    want = long_prompt(MoeCausalLM.from_pretrained(TINY, RuntimeConfig(mode="resident", dtype="bfloat16")), 128)
    for k in (4, 11, 24):
        assert_same(long_prompt(paged(TINY, k, dtype="bfloat16"), 128), want, f"bf16 K={k}")


def test_long_prompt_fp8_paged_equals_resident() -> None:
    resident = MoeCausalLM.from_pretrained(TINY_FP8, RuntimeConfig(mode="resident"))
    assert resident.moe_layers[0].host.is_fp8
    for chunk in (320, 128):
        want = long_prompt(resident, chunk)
        for k in range(4, 17, 3):
            assert_same(long_prompt(paged(TINY_FP8, k), chunk), want, f"FP8 K={k}, chunks of {chunk}")
        for k in (4, 9):  # page_in 'batch': weights and block scales of every run in one call (memmoves here)
            model = paged(TINY_FP8, k, page_in="batch")
            assert_same(long_prompt(model, chunk), want, f"FP8 batch page-in K={k}, chunks of {chunk}")
            assert model.moe_layers[0].shared.page_in.batch_calls > 0  # the batch ran (the bits cannot say)


def test_prefill_counters_count_the_prompt_chunks_and_replay_in_the_planner() -> None:
    k = 6
    model = paged(TINY, k)
    routed: dict[int, list[list[int]]] = {}
    model.routing_observers.append(
        lambda layer, ids, w, ctx: routed.setdefault(layer, []).append(ids.flatten().tolist())
    )
    long_prompt(model, 96, decode_steps=2)
    snap = model.counters.snapshot()
    prefill, cfg = snap.prefill, model.config
    # steps: the short prompt alone (4 tokens x 4 = 16 pairs > K), then 4 chunks of the long one
    assert (prefill.steps, prefill.chunks, prefill.tokens) == (5, 5, len(SHORT) + len(PROMPT))
    misses_in_prefill = 0
    waves_in_prefill = 0
    for layer in range(cfg.num_layers):
        ref = LayerResidency(cfg.num_experts, k)
        plans = [ref.plan_step(ids) for ids in routed[layer]]
        misses_in_prefill += sum(p.misses for p in plans[:5])
        waves_in_prefill += sum(len(p.waves) for p in plans[:5])
        assert snap.layers[layer].misses == sum(p.misses for p in plans)
    assert prefill.bytes_paged_in == misses_in_prefill * snap.expert_bytes > 0
    assert prefill.misses == misses_in_prefill and prefill.waves == waves_in_prefill
    assert prefill.layer_steps == 5 * cfg.num_layers and prefill.hits + prefill.misses < snap.total.activations
    assert 0 < prefill.copy_time_s <= prefill.span_s and 0 < prefill.copy_busy_fraction <= 1
    # the link's idle time, split, never more than the span leaves (on the CPU: the compute between inline copies)
    idle = prefill.idle_before_layer_s + prefill.idle_between_waves_s
    assert prefill.idle_before_layer_s > 0 and prefill.idle_between_waves_s > 0
    assert prefill.copy_time_s + idle <= prefill.span_s * (1 + 1e-9)
    assert snap.to_dict()["prefill"]["chunks"] == 5
    model.counters.reset()
    assert model.counters.snapshot().prefill.steps == 0


def test_the_hosts_time_in_each_paged_prefill_layer_is_split_into_waiting_and_the_rest_and_decode_adds_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PrefillCounts.host_wait_s and host_plan_s: the host's seconds in the host-planned paged layers of prefill
    steps. What blocks on the device (here the residency states' read, made 5 ms slow as a busy GPU's would be) is
    host_wait_s; the rest of the layer-step (the plan, the waves, which compute inline on the CPU, and the residency
    write-back after it, made 3 ms slow) is host_plan_s. Both sit inside the steps' wall clock; steps without a
    prompt chunk add nothing."""
    import paged_experts.moe.paged as paged_module
    from paged_experts.moe.planning import DeviceLru

    read, write_back = paged_module.pull_many, DeviceLru.push_from

    def slow_read(pairs):  # noqa: ANN001, ANN202 - pull_many's own signature
        time.sleep(0.005)
        return read(pairs) + 0.005  # the seconds the read blocked, as pull_many reports them

    def slow_write_back(lru: DeviceLru, residency) -> None:  # noqa: ANN001 - a LayerResidency
        time.sleep(0.003)
        write_back(lru, residency)

    monkeypatch.setattr(paged_module, "pull_many", slow_read)
    monkeypatch.setattr(DeviceLru, "push_from", slow_write_back)
    model = MoeCausalLM.from_pretrained(TINY, RuntimeConfig(mode="paged", resident_experts=6, device_planning="on"))
    started = time.perf_counter()
    long_prompt(model, 96, decode_steps=0)
    wall_s = time.perf_counter() - started
    prefill = model.counters.snapshot().prefill
    steps = prefill.layer_steps
    assert steps == 5 * model.config.num_layers  # every layer of the 5 prefill steps, host-planned
    # the reads' 5 ms in host_wait_s, the write-backs' 3 ms not (the ids are CPU tensors: their read waits for nothing)
    assert 0.005 * steps <= prefill.host_wait_s < 0.0075 * steps
    assert prefill.host_plan_s >= 0.003 * steps
    assert prefill.host_wait_s + prefill.host_plan_s < wall_s
    # two 1-token sequences: 8 routed pairs > K=6, so host-planned (and read, and written back) again, in no prefill
    pool = KvPool.for_model(model, capacity_tokens=64)
    a, b = pool.new_sequence(), pool.new_sequence()
    for pos in range(2):
        model.forward([SeqChunk(a, [1 + pos], pos), SeqChunk(b, [7 + pos], pos)])
    after = model.counters.snapshot().prefill
    assert (after.layer_steps, after.host_wait_s, after.host_plan_s) == (
        steps,
        prefill.host_wait_s,
        prefill.host_plan_s,
    )


def test_the_residency_read_reports_its_own_seconds() -> None:
    """pull_many returns the seconds of its one device read, which the prefill counters file as waiting: never
    more than the whole call, and 0 when there is nothing to read."""
    from paged_experts.residency.device import pull_many

    model = MoeCausalLM.from_pretrained(TINY, RuntimeConfig(mode="paged", resident_experts=6, device_planning="on"))
    pairs = [(m.device_lru.residency, m.residency) for m in model.moe_layers]
    started = time.perf_counter()
    read_s = pull_many(pairs)
    assert 0 < read_s <= time.perf_counter() - started
    assert pull_many([]) == 0.0


def test_decode_steps_and_resident_models_count_no_prefill() -> None:
    model = paged(TINY, 8)
    pool = KvPool.for_model(model, capacity_tokens=64)
    seq = pool.new_sequence()
    model.forward([SeqChunk(seq, [1], 0)])
    model.forward([SeqChunk(seq, [2], 1)])
    assert model.counters.snapshot().prefill.steps == 0
    resident = MoeCausalLM.from_pretrained(TINY, RuntimeConfig(mode="resident"))
    long_prompt(resident, 320, decode_steps=0)
    prefill = resident.counters.snapshot().prefill  # the chunks are counted, nothing is paged
    assert (prefill.steps, prefill.chunks) == (2, 2)
    assert prefill.layer_steps == prefill.bytes_paged_in == prefill.waves == 0 and prefill.span_s == 0.0


def test_router_override_time_is_counted_in_prefill_steps() -> None:
    from paged_experts.routing.sources import make_router

    model = paged(TINY, 8)
    model.router_override = make_router("qwen3-30b-a3b", model.config, seed=1)
    long_prompt(model, 320, decode_steps=0)
    prefill = model.counters.snapshot().prefill
    assert prefill.router_s > 0 and prefill.misses > 0


def test_a_step_with_a_prompt_chunk_hands_back_the_host_side_of_that_step_alone() -> None:
    from paged_experts.routing.sources import make_router

    model = paged(TINY, 8)
    model.router_override = make_router("qwen3-30b-a3b", model.config, seed=1)
    pool = KvPool.for_model(model, capacity_tokens=512)
    short, long = pool.new_sequence(), pool.new_sequence()
    assert model.run_step([SeqChunk(short, SHORT, 0)]).prefill is not None  # a 4-token prompt is a chunk too
    before = model.counters.snapshot().prefill
    step = model.run_step([SeqChunk(short, [40], len(SHORT)), SeqChunk(long, PROMPT, 0)])
    after = model.counters.snapshot().prefill
    got = step.prefill
    assert got is not None and (got.chunks, got.tokens) == (1, len(PROMPT))  # the decode token is no chunk
    assert got.layer_steps == model.config.num_layers == after.layer_steps - before.layer_steps
    # this step's figures, not the run's: the counters' growth over the step
    assert got.host_plan_s == pytest.approx(after.host_plan_s - before.host_plan_s)
    assert got.host_wait_s == pytest.approx(after.host_wait_s - before.host_wait_s)
    assert got.router_s == pytest.approx(after.router_s - before.router_s) and got.router_s > 0
    assert got.host_plan_s > 0 and got.host_wait_s + got.host_plan_s + got.router_s <= got.issue_s
    assert 0 < got.issue_cpu_s <= got.issue_s + 1e-3  # one thread's CPU time never exceeds its wall time
    if sys.platform.startswith("linux"):  # how the rest went: waiting for a CPU, switches, the CPUs (thread_clock)
        assert got.issue_run_delay_s is not None and 0 <= got.issue_run_delay_s <= got.issue_s - got.issue_cpu_s + 1e-3
        assert got.issue_voluntary_switches is not None and got.issue_voluntary_switches >= 0
        assert got.issue_involuntary_switches is not None and got.issue_involuntary_switches >= 0
        assert (
            got.cpu_id_first is not None and got.cpu_id_last is not None and min(got.cpu_id_first, got.cpu_id_last) >= 0
        )
    assert model.run_step([SeqChunk(short, [41], len(SHORT) + 1), SeqChunk(long, [7], len(PROMPT))]).prefill is None
    model.counters.reset()  # the figures of a step that opened before a reset are gone with it
    assert model.counters.prefill_steps_opened == 0 and model.counters.prefill_step_host(-1) is None


def test_recent_leaves_the_last_tokens_experts_where_lru_does_not() -> None:
    """After a long prompt, `recent` slots hold the experts the prompt's last tokens routed to."""
    k = 8
    models = {keep: paged(TINY, k, keep) for keep in ("recent", "lru")}
    last: dict[int, list[int]] = {}
    models["recent"].routing_observers.append(
        lambda layer, ids, w, ctx: last.__setitem__(layer, ids[-2:].flatten().tolist())
    )
    for model in models.values():
        pool = KvPool.for_model(model, capacity_tokens=512)
        model.forward([SeqChunk(pool.new_sequence(), PROMPT, 0)])
    kept = {  # the host planner's slots (on the CPU, every paged layer plans on the host)
        keep: [set(m.residency.expert_in) for m in model.moe_layers]
        for keep, model in models.items()  # type: ignore
    }
    for layer, experts in last.items():
        assert set(experts) <= kept["recent"][layer]
    assert any(not set(experts) <= kept["lru"][layer] for layer, experts in last.items())


def test_prefill_marks_do_not_pile_up_without_snapshots() -> None:
    """A server that is never scraped keeps at most 64 prefill steps' marks; the totals stay exact."""
    from paged_experts.residency.counters import PagingCounters

    counters = PagingCounters(num_layers=2, expert_bytes=10, mode="paged")
    for i in range(200):
        counters.prefill_begin(chunks=1, tokens=5, start=float(i))
        counters.prefill_copy(30, float(i), i + 0.25, opens_layer=True)
        counters.prefill_layer_end(end=i + 0.5, waves=3, hits=1, misses=3)
        assert len(counters._prefill.steps) <= 64
    p = counters.snapshot().prefill
    assert (p.steps, p.chunks, p.tokens, p.waves, p.bytes_paged_in) == (200, 200, 1000, 600, 6000)
    assert (
        p.span_s == pytest.approx(100.0)
        and p.copy_time_s == pytest.approx(50.0)
        and p.copy_busy_fraction == pytest.approx(0.5)
    )


def test_the_links_idle_time_is_split_by_what_it_waited_for() -> None:
    """prefill idle_before_layer_s / idle_between_waves_s: the page-in stream's gaps, before each layer's first
    page-in (from the step's start, then from the previous layer's last page-in) and between one layer's
    page-ins; with the copies and the tail they add up to the span. Marks in seconds, as on the CPU."""
    from paged_experts.residency.counters import PagingCounters

    counters = PagingCounters(num_layers=3, expert_bytes=10, mode="paged")
    counters.prefill_begin(chunks=1, tokens=100, start=10.0)
    # layer 0: copies 10.5-11 and 11.25-12 (0.5 before it, 0.25 between its waves)
    counters.prefill_copy(10, 10.5, 11.0, opens_layer=True)
    counters.prefill_copy(10, 11.25, 12.0, opens_layer=False)
    counters.prefill_layer_end(end=12.5, waves=3, hits=1, misses=2)
    # layer 1 pages nothing; layer 2: 13-13.5, then 13.5-14 (1.0 before it, none between)
    counters.prefill_copy(10, 13.0, 13.5, opens_layer=True)
    counters.prefill_copy(10, 13.5, 14.0, opens_layer=False)
    counters.prefill_layer_end(end=14.75, waves=2, hits=0, misses=2)
    p = counters.snapshot().prefill
    assert p.idle_before_layer_s == pytest.approx(1.5) and p.idle_between_waves_s == pytest.approx(0.25)
    assert p.copy_time_s == pytest.approx(2.25) and p.span_s == pytest.approx(4.75)
    tail = p.span_s - p.copy_time_s - p.idle_before_layer_s - p.idle_between_waves_s
    assert tail == pytest.approx(0.75)  # layer 2's last copy (14.0) to the step's end (14.75)
    d = p.to_dict()
    assert d["idle_before_layer_s"] == pytest.approx(1.5) and d["idle_between_waves_s"] == pytest.approx(0.25)


def test_a_reused_step_context_opens_a_new_step() -> None:
    """Page-ins wait only for their step's start: a layer run twice under one context is two steps."""
    from paged_experts.moe import StepContext

    model = paged(TINY, 8)
    ctx = StepContext(seq_ids=(0,) * 40, positions=tuple(range(40)))
    x = torch.randn(40, model.config.hidden_size)
    for _ in range(2):
        for layer in model.moe_layers:
            layer.forward(x, ctx, None, [])
    assert model.counters.snapshot().prefill.steps == 2


def test_page_ins_wait_for_the_wave_that_last_read_their_slot() -> None:
    """The dependencies the page-in stream waits on, replayed over a real multi-wave plan: every
    page-in waits for the last earlier wave that served its slot, never a later one, and never for
    the wave just before it (that one computes while the copy runs)."""
    from paged_experts.moe.streaming import wait_groups

    assert wait_groups([(9, 3), (8, 1), (7, 0)], {1: 2, 0: 0}) == [(-1, [(9, 3)]), (0, [(7, 0)]), (2, [(8, 1)])]
    residency = LayerResidency(64, 16)
    plan = residency.plan_step([(7 * i) % 64 for i in range(400)])
    slot_wave: dict[int, int] = {}
    for j, wave in enumerate(plan.waves):
        groups = wait_groups(wave.page_ins, slot_wave)
        assert sorted(p for _, pairs in groups for p in pairs) == sorted(wave.page_ins)
        for after, pairs in groups:
            assert after <= j - 2 and all(slot_wave.get(s, -1) == after for _, s in pairs)
        for s in wave.slots:
            slot_wave[s] = j
    assert len(plan.waves) > 4


@pytest.mark.parametrize("case", ["plain", "staging", "host-blocking copy"])
def test_page_ins_are_issued_once_their_slots_last_reader_is(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """page_in_after over real multi-wave plans: each wave's copies may go once the last earlier wave reading
    one of their slots has computed, at most wave j-2 (the previous wave is pinned); and in a real CPU prefill
    the host issues them right after that compute (and the copies of every earlier wave), before wave j-1's
    launches (the copies run inline there: one issued too early also breaks paged == resident above); also
    with staging rows (a STAGING wave first, its copies issued before the plan). A copy that blocks the host
    (page_in='staged', CUDA only: marked here by hand) keeps the old order, just before its wave."""
    from paged_experts.moe.streaming import LayerCopies, page_in_after

    residency = LayerResidency(64, 16)
    for routed in ([(7 * i) % 64 for i in range(400)], [(5 * i + 3) % 64 for i in range(300)]):
        plan = residency.plan_step(routed)
        after = page_in_after(plan.waves)
        last_read: dict[int, int] = {}
        for j, wave in enumerate(plan.waves):
            assert after[j] == max((last_read.get(s, -1) for _, s in wave.page_ins), default=-1)
            assert after[j] <= j - 2 or not wave.page_ins
            last_read.update((s, j) for s in wave.slots)
        assert len(plan.waves) > 4 and any(a >= 0 for a in after)

    calls: list[tuple[str, int]] = []  # ("plan", -1), ("copy", wave), ("compute", wave) in the order issued
    afters: list[list[int]] = []  # page_in_after of each planned layer-step
    staging_waves = [0]
    plan_step, page_in, computed = LayerResidency.plan_step, LayerCopies.page_in, LayerCopies.computed

    def planned(self: LayerResidency, *args: object, **kwargs: object) -> object:
        out = plan_step(self, *args, **kwargs)  # type: ignore[arg-type]
        afters.append(page_in_after(out.waves))
        staging_waves[0] += sum(1 for w in out.waves if w.table == STAGING)
        calls.append(("plan", -1))
        return out

    def copied(self: LayerCopies, index: int, *args: object) -> None:
        calls.append(("copy", index))
        page_in(self, index, *args)  # type: ignore[arg-type]

    def done(self: LayerCopies, wave: object) -> None:
        calls.append(("compute", len(self.done)))
        computed(self, wave)  # type: ignore[arg-type]

    monkeypatch.setattr(LayerResidency, "plan_step", planned)
    monkeypatch.setattr(LayerCopies, "page_in", copied)
    monkeypatch.setattr(LayerCopies, "computed", done)
    model = staged(TINY, 8, 6) if case == "staging" else paged(TINY, 8)
    blocking = case == "host-blocking copy"
    model.moe_layers[0].shared.page_in.blocks_host = blocking  # type: ignore[attr-defined]
    long_prompt(model, 320, decode_steps=0)
    monkeypatch.undo()
    assert (staging_waves[0] > 0) == (case == "staging")

    steps: list[list[tuple[str, int]]] = []  # each layer-step's calls after its plan
    for call in calls:
        if call[0] == "plan":
            steps.append([])
        elif steps:
            steps[-1].append(call)
    early = 0
    for after, seq in zip(afters, steps):
        for j in range(len(after)):
            if ("copy", j) in seq:
                at = seq.index(("copy", j))
                last_compute = max((i for kind, i in seq[:at] if kind == "compute"), default=-1)
                want = max(after[: j + 1] + ([j - 1] if blocking else []))
                assert last_compute == want, (j, after, seq)
                early += last_compute < j - 1  # before the new order: always j - 1
    assert early == 0 if blocking else early > 10


def staged(path: str, k: int, rows: int, dtype: str = "float32") -> MoeCausalLM:
    runtime = RuntimeConfig(mode="paged", resident_experts=k, prefill_staging_rows=rows, dtype=dtype)
    return MoeCausalLM.from_pretrained(path, runtime)


def test_staging_rows_equal_resident(
    resident_fp32: dict[int, list[torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """RuntimeConfig.prefill_staging_rows: each layer's first page-ins of a chunk copied into shared rows while
    the layer before computes, served from there, the ones the keep policy ranks among the K promoted into the
    slots (the decode steps after the prompt read them there): the same bits as resident, fp32, bf16, FP8."""
    from paged_experts.moe.staging import StagingRows

    promoted = [0]
    promote = StagingRows.promote

    def counted(self: StagingRows, slots: object, promotions: tuple) -> None:
        promoted[0] += len(promotions)
        promote(self, slots, promotions)  # type: ignore[arg-type]

    monkeypatch.setattr(StagingRows, "promote", counted)
    for k, rows in ((4, 1), (4, 8), (13, 4), (24, 8), (28, 4)):
        for chunk in (320, 96):
            model = staged(TINY, k, rows)
            assert_same(
                long_prompt(model, chunk), resident_fp32[chunk], f"K={k}, {rows} staging rows, chunks of {chunk}"
            )
    assert promoted[0] > 0
    want = long_prompt(MoeCausalLM.from_pretrained(TINY, RuntimeConfig(mode="resident", dtype="bfloat16")), 128)
    assert_same(long_prompt(staged(TINY, 11, 6, dtype="bfloat16"), 128), want, "bf16 K=11, 6 rows")
    want = long_prompt(MoeCausalLM.from_pretrained(TINY_FP8, RuntimeConfig(mode="resident")), 128)
    before = promoted[0]
    assert_same(long_prompt(staged(TINY_FP8, 7, 4), 128), want, "FP8 K=7, 4 rows")
    assert promoted[0] > before  # FP8 rows and their scales promoted


@pytest.mark.parametrize(("device_planning", "k"), [("off", 6), ("on", 8)])
def test_staging_counts_as_page_ins_and_replays_in_the_simulator(device_planning: str, k: int) -> None:
    """What a staged run counts (per layer and for the prefill) is what the simulator's replay of the same
    routing with the same staging rule plans (every layer but the first stages); bytes = misses x expert
    bytes. With device planning (K=8: the two-token decode steps fit one wave and are planned on the device,
    whose state the host sees only in part) the replay still stages what the runtime staged."""
    from benchsuite.tools.simulate import replay_layer

    rows = 5
    runtime = RuntimeConfig(
        mode="paged", resident_experts=k, prefill_staging_rows=rows, device_planning=device_planning
    )
    model = MoeCausalLM.from_pretrained(TINY, runtime)
    plain = MoeCausalLM.from_pretrained(
        TINY, RuntimeConfig(mode="paged", resident_experts=k, device_planning=device_planning)
    )
    routed: dict[int, list[np.ndarray]] = {}
    model.routing_observers.append(
        lambda layer, ids, w, ctx: routed.setdefault(layer, []).append(ids.flatten().numpy().copy())
    )
    for m in (model, plain):
        long_prompt(m, 96, decode_steps=2)
        pool = KvPool.for_model(m, capacity_tokens=512)
        seq = pool.new_sequence()
        m.forward([SeqChunk(seq, PROMPT[:200], 0)])  # a large step, then 12 one-token steps (device-planned
        for step in range(12):  # with device planning on), then another large step
            m.forward([SeqChunk(seq, [9 + step], seq.num_tokens)])
        m.forward([SeqChunk(pool.new_sequence(), PROMPT[100:300], 0)])
    snap, base = model.counters.snapshot(), plain.counters.snapshot()
    cfg = model.config
    for layer in range(cfg.num_layers):
        replay = replay_layer(routed[layer], cfg.num_experts, k, "lru", staging_rows=rows, stages=layer > 0)
        assert snap.layers[layer].misses == int(replay.misses.sum()), layer
        assert snap.layers[layer].hits == int(replay.hits.sum()), layer
    p = snap.prefill
    assert p.bytes_paged_in == p.misses * snap.expert_bytes > 0
    assert p.hits + p.misses == base.prefill.hits + base.prefill.misses  # the same routing, served once each
    # the staging copies open their layer's page-ins: the idle split still adds up within the span
    assert p.idle_before_layer_s > 0 and p.copy_time_s + p.idle_before_layer_s + p.idle_between_waves_s <= p.span_s
    prefill_waves, staging_waves, prefill_unused = 0, 0, 0  # the runtime's prefill waves are the planner's
    for layer in range(cfg.num_layers):
        ref = LayerResidency(cfg.num_experts, k)
        for step, ids in enumerate(routed[layer]):
            stage = ref.stage_candidates(rows, ids.size) if layer > 0 else ()
            plan = ref.plan_step(ids.tolist(), staged=stage)
            if step in (0, 1, 2, 3, 4, 7, 20):  # steps with a prompt: the short one, the long one's four chunks,
                prefill_waves += len(plan.waves)  # then the two 200-token prompts
                prefill_unused += plan.staged_unused
                staging_waves += sum(w.table == STAGING and len(w.page_ins) > 0 for w in plan.waves)
    assert p.waves == prefill_waves and p.staged_unused == prefill_unused  # staged, paged in, not routed
    # three chunks of 96 tokens with a decode token (388 pairs >= 8 x 32) and the two 200-token prompts stage in
    # every layer but the first; the last chunk (32 tokens: 132 pairs) and the short prompt (16 pairs) do not
    assert staging_waves == 5 * (cfg.num_layers - 1)


def test_staging_needs_paged_mode_and_room_outside_the_slots() -> None:
    with pytest.raises(ValueError, match="prefill_staging_rows applies to mode='paged'"):
        RuntimeConfig(mode="resident", prefill_staging_rows=4)
    with pytest.raises(ValueError, match=r"prefill_staging_rows must be in \[0, 256\]"):
        RuntimeConfig(mode="paged", resident_experts=4, prefill_staging_rows=-1)
    with pytest.raises(ValueError, match="exceeds the 4 experts a layer keeps outside its K=28 slots"):
        staged(TINY, 28, 5)
