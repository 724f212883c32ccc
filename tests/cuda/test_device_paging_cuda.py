"""CUDA checks of paging planned on the device (device_residency + the Triton page-in kernel):
- the kernel copies exactly the planned rows from pinned host memory and nothing for padding;
- the fused plan kernel (residency/plan_triton.py), compiled, plans what `device.plan_step` plans,
  step by step (the interpreter test's sequences, 200 steps per shape), and a paged layer uses it;
- a device-planned paged MoE layer runs with no host synchronization;
- device-planned paged decode equals resident bit for bit (bf16, Qwen3-30B-A3B layer shapes);
- graphed paged decode equals eager paged decode within bf16 rounding up to a sequence's routing
  flip on a near-tie (tests/graph_check.py), with close counters where nothing flipped.

Plain functions, so the module also runs as a script: `python tests/cuda/test_device_paging_cuda.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from _script import check_copy_planned  # tests/cuda is on sys.path (pytest's rootdir import, or script mode)

from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.moe import StepContext
from paged_experts.residency.store import ExpertTensors
from paged_experts.runtime import RuntimeConfig

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass

TINY = "synth:tiny?layers=3&seed=5"  # 32 experts, top_k 4
QWEN2 = "synth:qwen3-30b-a3b-shape?layers=2&seed=0"  # 128 experts, top_k 8


def rt(dtype: str, **kw: object) -> RuntimeConfig:
    return RuntimeConfig(device="cuda", dtype=dtype, **kw)  # type: ignore[arg-type]


def decode(model: MoeCausalLM, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    pool = KvPool.for_model(model, capacity_tokens=512)
    seqs = [pool.new_sequence() for _ in prompts]
    last = model.forward([SeqChunk(s, p, 0) for s, p in zip(seqs, prompts)])
    out = list(last)
    for _ in range(steps):
        last = model.forward([SeqChunk(s, [int(lg[-1].argmax()) % 1000], s.num_tokens) for s, lg in zip(seqs, last)])
        out += last
    return out


def test_kernel_copies_planned_rows_from_pinned_memory() -> None:
    e, inter, hidden = 10, 96, 64

    def host_rows() -> torch.Tensor:
        return torch.randn(e, inter, hidden, dtype=torch.bfloat16).pin_memory()

    host = ExpertTensors(gate=host_rows(), up=host_rows(), down=host_rows().transpose(1, 2).contiguous().pin_memory())
    check_copy_planned(host, 7, 2)


def test_fused_plan_equals_torch_compiled() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_device_plan_triton import check_fused_plan_equals_torch

    check_fused_plan_equals_torch("cuda", steps=200)
    model = MoeCausalLM.from_pretrained(QWEN2, rt("bfloat16", mode="paged", resident_experts=40))
    assert all(m.device_residency.fused for m in model.moe_layers if m.device_residency is not None)


def test_duel_shadows_batched_at_the_step_end_equal_the_reference_eager_and_graphed() -> None:
    """The duel's shadows (DeviceResidency.defer_shadows): in line after the plan in eager steps, deferred in a captured
    one and run for every layer in one launch at the step's end (DuelShadows.flush). Three layers, each its own state
    and routing; every state tensor of every layer equals the torch reference's (`plan_step`, shadows inline): after
    every eager step; after S steps captured as the decode step runs them (each layer's plan, then a spin standing in
    for its copies and experts; the batch at the step's end), replayed twice from one state; and after S steps
    captured with no batch, so that each layer's next plan runs its pending shadows in line first (a step that does
    not batch them stays correct)."""
    import random

    from paged_experts.residency.device import DeviceResidency, DuelShadows

    cuda = torch.device("cuda")
    e, k, top_k, steps, layers = 128, 54, 8, 48, 3
    rng = random.Random(7)
    # runs of 8 steps from all experts, then from a few (shifted per layer): each shadow wins some, so the selector
    # moves both ways; one batch size a step, as in a decode step
    tokens = [rng.randint(1, 4) for _ in range(4 * steps)]

    def routed(i: int, j: int) -> torch.Tensor:
        pool = range(e) if ((i + 3 * j) // 8) % 2 else range(36)
        return torch.tensor([x for _ in range(tokens[i]) for x in rng.sample(pool, top_k)], device=cuda)

    ids = [[routed(i, j) for i in range(4 * steps)] for j in range(layers)]
    names = ("slot_of", "expert_in", "last_use", "step", "uses", "expert_last_use", "shadows", "psel")
    refs = [DeviceResidency(e, k, cuda, aging_period_steps=5, aging_window_steps=2, duel=True) for _ in range(layers)]
    for ref in refs:
        ref.fused = False  # the torch plan, shadows inline
    devs = [DeviceResidency(e, k, cuda, aging_period_steps=5, aging_window_steps=2, duel=True) for _ in range(layers)]
    assert all(dev.fused and dev.defer_shadows for dev in devs)
    batch = DuelShadows(devs)
    assert batch.table is not None and batch.table.shape == (layers, 6)

    def same(where: str) -> None:
        torch.cuda.synchronize()
        for j, (dev, ref) in enumerate(zip(devs, refs)):
            for name in names:
                assert torch.equal(getattr(dev, name), getattr(ref, name)), (where, j, name)
            assert torch.equal(dev._state, ref._state), (where, j)  # the padding between the parts too

    def batched(i: int) -> None:  # as the decode step: every layer, then the batch
        for j, dev in enumerate(devs):
            dev.plan(ids[j][i])
            torch.cuda._sleep(20000)  # the layer's copies and experts
        batch.flush()

    def unbatched(i: int) -> None:  # no batch: each layer's next plan runs its pending shadows first
        for j, dev in enumerate(devs):
            dev.plan(ids[j][i])

    signs = set()
    for i in range(steps):  # eager: the shadows in line
        for j, (dev, ref) in enumerate(zip(devs, refs)):
            ref.plan(ids[j][i])
            dev.plan(ids[j][i])
        batch.flush()  # nothing pending: a no-op
        same(f"eager step {i}")
        signs.update(int(ref.psel) > 0 for ref in refs)
    for n in sorted(set(tokens)):  # every step size's first launch of the shadows' kernels, before any capture
        batch.warm(n * top_k)
    for part, body in enumerate((batched, unbatched)):
        first = (1 + part) * steps
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(first, first + steps):
                body(i)
            batch.flush()  # the capture's last step's shadows, inside the graph
        assert all(dev.shadows_pending is None for dev in devs)
        start = [dev.state() for dev in devs]  # the capture ran nothing: every layer is still at step `first`
        for i in range(first, first + steps):
            for j, ref in enumerate(refs):
                ref.plan(ids[j][i])
            signs.update(int(ref.psel) > 0 for ref in refs)
        graph.replay()
        same(f"{body.__name__} graph")
        for dev, state in zip(devs, start):  # the same steps again from the same state: the same result
            dev.load_state(state)
        graph.replay()
        same(f"{body.__name__} graph again")
    assert signs == {False, True}, signs


def test_host_planned_steps_share_the_gpu_state_through_pinned_pushes() -> None:
    """pull_many / push_from with the state on the GPU, 48 layers at K=54 of E=128, each policy the device plans:
    host-planned steps (more pairs than K, waves on the host) between device-planned ones, every push one pinned H2D
    copy the host does not wait for, the next device plan stream-ordered after it. Every layer's state equals, word
    for word, a CPU pair's that ran the same steps."""
    import random

    from paged_experts.residency.device import DeviceResidency, pull_many
    from paged_experts.residency.planner import LayerResidency
    from paged_experts.residency.policies import AgingLfuPolicy, DuelPolicy, EvictionPolicy, LruPolicy

    e, k, top_k, layers = 128, 54, 8, 48
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def pair(device: torch.device, name: str) -> tuple[DeviceResidency, LayerResidency]:
        policy: EvictionPolicy = LruPolicy()
        if name == "lru":
            dev = DeviceResidency(e, k, device)
        else:
            duel = name == "duel"
            dev = DeviceResidency(e, k, device, aging_period_steps=5, aging_window_steps=2, duel=duel)
            policy = DuelPolicy(k, 5, 2) if duel else AgingLfuPolicy(5, 2)
        return dev, LayerResidency(e, k, policy)

    for name in ("lru", "lfu-aging", "duel"):
        rng = random.Random(5)
        gpu, ref = [pair(cuda, name) for _ in range(layers)], [pair(cpu, name) for _ in range(layers)]
        assert all(d.fused for d, _ in gpu)
        for i in range(24):
            if i % 4 == 3:  # 16 tokens: 128 pairs > K, planned on the host
                routed = [x for _ in range(16) for x in rng.sample(range(e), top_k)]
                pull_many(gpu)
                pull_many(ref)
                for (d, host), (rd, rhost) in zip(gpu, ref):
                    assert host.plan_step(routed).misses == rhost.plan_step(routed).misses, (name, i)
                    d.push_from(host)  # not waited for: the next device plan reads what it copies
                    rd.push_from(rhost)
            else:
                pool = range(e) if i % 8 < 4 else range(40)
                ids = [x for _ in range(rng.randint(1, 6)) for x in rng.sample(pool, top_k)]
                for d, _ in gpu:
                    d.plan(torch.tensor(ids, device=cuda))
                for d, _ in ref:
                    d.plan(torch.tensor(ids))
        torch.cuda.synchronize()
        for j, ((d, _), (rd, _)) in enumerate(zip(gpu, ref)):
            assert torch.equal(d.state().cpu(), rd.state()), (name, j)


def test_device_planned_paged_layer_does_not_sync() -> None:
    model = MoeCausalLM.from_pretrained(TINY, rt("bfloat16", mode="paged", resident_experts=8))
    layer = model.moe_layers[0]
    assert layer.device_residency is not None
    x = torch.randn(2, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)  # 2 x 4 pairs <= K
    ctx = StepContext(seq_ids=(0, 1), positions=(0, 0))
    layer.forward(x, ctx, None, [])  # warm-up: Triton compiles, grouped backend decided
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            layer.forward(torch.randn_like(x), ctx, None, [])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    total = model.counters.snapshot().total
    assert total.steps == 4 and total.misses > 0


def test_device_planned_paged_equals_resident_qwen_shapes() -> None:
    prompts = [[5, 17, 300, 41, 9, 77, 3, 8]]  # batch 1: 8 pairs, one wave for K >= 8
    resident = decode(MoeCausalLM.from_pretrained(QWEN2, rt("bfloat16", mode="resident")), prompts, steps=6)
    # copy_programs: the capped copy grid (1 program: every chunk in one loop; 7: a ragged share each)
    for k, overlap, programs in ((8, False, None), (16, False, None), (64, False, None), (16, True, None),
                                 (16, False, 1), (16, True, 7)):  # fmt: skip
        model = MoeCausalLM.from_pretrained(
            QWEN2,
            rt("bfloat16", mode="paged", resident_experts=k, overlap_page_in=overlap, copy_programs=programs),
        )
        assert model.moe_layers[0].device_residency is not None
        for i, (a, b) in enumerate(zip(decode(model, prompts, steps=6), resident)):
            where = f"K={k} overlap={overlap} copy_programs={programs}"
            assert torch.equal(a, b), f"{where}: output {i} differs by {(a - b).abs().max().item()}"
        total = model.counters.snapshot().total
        assert total.misses > 0 or k == 64


def test_aging_lfu_planned_on_the_gpu_equals_resident_and_counts_what_the_host_plans() -> None:
    for policy in ("lfu-aging", "lfu-aging:4:2", "duel", "duel:4:2"):
        check_aging_lfu(policy)


def check_aging_lfu(policy: str) -> None:
    """`lfu-aging` on the fused device plan (the default period; a 4-step period with a 2-step window), and the
    duel of LRU with it (`duel`, its selector in the plan kernel, its shadows in their own): outputs equal resident bit
    for bit, and the misses of every layer equal the host planner's over the same steps (the prompt's multi-wave step
    included: shared state)."""
    prompts = [[5, 17, 300, 41, 9, 77, 3, 8]]
    resident = decode(MoeCausalLM.from_pretrained(QWEN2, rt("bfloat16", mode="resident")), prompts, steps=12)
    for k in (8, 16):
        counts = []
        for planning in ("on", "off"):
            model = MoeCausalLM.from_pretrained(
                QWEN2,
                rt("bfloat16", mode="paged", resident_experts=k, eviction_policy=policy, device_planning=planning),
            )
            assert (model.moe_layers[0].device_residency is not None) == (planning == "on")
            for i, (a, b) in enumerate(zip(decode(model, prompts, steps=12), resident)):
                assert torch.equal(a, b), f"K={k} planning={planning}: output {i} differs"
            counts.append([(la.hits, la.misses) for la in model.counters.snapshot().layers])
        assert counts[0] == counts[1], (k, counts)
        assert sum(m for _, m in counts[0]) > 0


def check_graphed_paged(
    overlap: bool,
    compile_layers: bool = False,
    routing: str | None = None,
    backend: str = "grouped",
    groups: int = 1,
    policy: str = "lru",
    copies: str = "kernel",
    rows: str = "auto",  # RuntimeConfig.expert_rows: the default (packed on CUDA)
) -> None:
    """Graphed paged decode against eager through tests/graph_check.py: the graphed model is fed
    eager's tokens, a routing flip must sit on a near-tie of eager's router logits (bf16 rounding
    of other kernels, compiled or Triton, tips it), and every output before a sequence's flip is
    within 5e-2."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from graph_check import check_graphed_decode

    from paged_experts.routing.sources import make_router

    prompts = [[5, 17, 300, 41, 9, 77], [800, 2, 64], [11, 12, 13, 14, 15]]
    paged = rt(
        "bfloat16", mode="paged", resident_experts=12, overlap_page_in=overlap, overlap_groups=groups,
        kernel_backend=backend, eviction_policy=policy, overlap_copies=copies, expert_rows=rows,
    )  # fmt: skip
    eager_model = MoeCausalLM.from_pretrained(TINY, paged)
    model = MoeCausalLM.from_pretrained(TINY, paged)
    if routing is not None:  # the same seeded synthetic router in both: same draws step by step
        eager_model.router_override = make_router(routing, eager_model.config, seed=4)
        model.router_override = make_router(routing, model.config, seed=4)
    model.enable_cuda_graphs([1, 2, 3, 4], compile_layers=compile_layers)
    # tie_ulps 8: compiled CPU kernels moved logits by up to 2.75 ulps of the row's largest, so two
    # logits can cross by ~5.5 ulps. At 8, 25% router noise still fails (test_graph_check); smaller
    # router errors show only through the outputs compared before a flip
    result = check_graphed_decode(eager_model, model, prompts, steps=5, tie_ulps=8.0)
    bucket = 0 if backend == "triton" else 64  # triton attention: one graph for every context length
    assert model.graph_replays == 5 and model.captured_graphs == [(3, bucket)], model.captured_graphs
    flips = [f"step {f.step} seq {f.seq} layer {f.layer} ({f.margin_ulps:.2f} ulps)" for f in result.flips]
    print(
        f"graphed vs eager paged decode (bf16, overlap={overlap}, groups={groups}, backend={backend}, "
        f"compiled={compile_layers}): {result.checked} outputs checked, worst relative difference "
        f"{result.worst:.2e}; {result.skipped} skipped after near-tie flips {flips} (worst {result.worst_skipped:.2e})"
    )
    ta, tb = model.counters.snapshot().total, eager_model.counters.snapshot().total
    print(f"graphed misses {ta.misses}, eager misses {tb.misses}")
    assert ta.steps == tb.steps
    if not result.flips:  # after a flip the routings, so the misses, differ legitimately
        assert abs(ta.misses - tb.misses) <= max(2, tb.misses // 10)


def test_graphed_paged_decode_matches_eager() -> None:
    check_graphed_paged(overlap=False)


def test_graphed_paged_decode_with_overlapped_page_in_matches_eager() -> None:
    check_graphed_paged(overlap=True)
    check_graphed_paged(overlap=True, groups=3)
    check_graphed_paged(overlap=True, groups=4, backend="triton", compile_layers=True)


def test_overlapped_paged_decode_equals_resident() -> None:
    """Hits while the misses copy, then each group of misses as it lands (moe/overlap.py): paged ==
    resident bit for bit with either expert backend, at every group count (eager steps)."""
    prompts = [[5, 17, 300, 41, 9, 77, 3, 8], [800, 2, 64]]  # batch 2: 16 pairs, one wave for K >= 16
    for backend in ("grouped", "triton"):
        resident_rt = rt("bfloat16", mode="resident", kernel_backend=backend)
        resident = decode(MoeCausalLM.from_pretrained(QWEN2, resident_rt), prompts, steps=6)
        for groups in (1, 2, 8):
            runtime = rt(
                "bfloat16", mode="paged", resident_experts=16, overlap_page_in=True, overlap_groups=groups,
                kernel_backend=backend,
            )  # fmt: skip
            model = MoeCausalLM.from_pretrained(QWEN2, runtime)
            for i, (a, b) in enumerate(zip(decode(model, prompts, steps=6), resident)):
                assert torch.equal(a, b), f"{backend} G={groups}: output {i} differs by {(a - b).abs().max().item()}"
            assert model.counters.snapshot().total.misses > 0


class SlowCopies:
    """The page-in stream with the GPU held up where a test says: before copy i (in issue order)
    the copy stream sleeps when i is in `late`, so the compute stream reaches its wait first; with
    `slow_compute` the compute stream sleeps before the pass begins, so a copy that did not wait
    for the compute stream's work (the index tensors it reads) would run ahead of it."""

    def __init__(self, late: frozenset[int], slow_compute: bool) -> None:
        from paged_experts.moe.layer import page_in_stream
        from paged_experts.moe.overlap import StreamCopies

        self.inner = StreamCopies(page_in_stream(torch.device("cuda")), torch.device("cuda"))
        self.late, self.issued = late, 0
        if slow_compute:
            torch.cuda._sleep(2_000_000)  # ~1 ms on the compute stream

    def start(self, *args: object) -> object:
        if self.issued in self.late:
            with torch.cuda.stream(self.inner.copy_stream):
                torch.cuda._sleep(2_000_000)
        self.issued += 1
        return self.inner.start(*args)  # type: ignore[arg-type]

    def wait(self, started: object) -> None:
        self.inner.wait(started)


def dirty_small_blocks(device: torch.device, value: int) -> None:
    """Fills the caching allocator's free small blocks with `value` (allocated, filled, freed), so a
    buffer read before the kernel that writes it holds that, not last pass's identical contents."""
    blocks = [torch.full((8,), value, dtype=torch.long, device=device) for _ in range(8192)]
    del blocks


def test_overlapped_pass_waits_for_each_group_on_the_gpu() -> None:
    """One layer's overlapped pass at the Qwen3-30B-A3B shape, bf16 and FP8 rows, both backends, eager
    and captured in a CUDA graph, with the copy stream held up before every subset of its copies, or
    the compute stream held up instead: the slots its misses go to hold NaN until their copy lands
    (a pair computed early shows), the allocator's free small blocks hold an expert id past E (a copy
    that read its group's indices before they were written copies nothing), and the output equals
    the plain pass over the landed slots, bit for bit."""
    import itertools
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_overlap_page_in import clone, poison  # the CPU test's poisoned slots

    from paged_experts import fp8
    from paged_experts.kernels.copy_kernel import copy_planned
    from paged_experts.kernels.fused import experts_over_rows, uses_triton
    from paged_experts.moe.overlap import overlapped_pass
    from paged_experts.residency.device import DeviceResidency

    e, k, top_k, h, i, groups = 128, 16, 8, 2048, 768, 3
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(e, *s, generator=gen, dtype=torch.bfloat16) / 40 for s in ((i, h), (i, h), (h, i))]
    ids = torch.tensor([[0, 3, 20, 21, 22, 5, 40, 41], [1, 2, 20, 60, 61, 62, 63, 7]], device=cuda)  # 9 misses
    x = torch.randn(2, h, device=cuda, dtype=torch.bfloat16)
    weights = torch.softmax(torch.randn(2, top_k, device=cuda), -1)
    for fp8_rows, backend in itertools.product((False, True), ("grouped", "triton")):
        if fp8_rows:
            q = [fp8.quantize(d) for d in dense]
            tensors = [w for w, _ in q] + [sc for _, sc in q]
        else:
            tensors = dense
        host = ExpertTensors(*(t.pin_memory() for t in tensors))
        start_slots = ExpertTensors(*(t[:k].to(cuda) for t in tensors))
        plan = DeviceResidency(e, k, cuda).plan(ids.reshape(-1))
        triton = uses_triton(16, cuda, backend)
        landed = clone(start_slots)
        copy_planned(host, landed, plan.miss_experts, plan.miss_slots)
        want = experts_over_rows(
            x, plan.pair_slot, weights, landed.gate, landed.up, landed.down, top_k, False, *landed.scales,
            backend=backend,
        )[0]  # fmt: skip

        def poisoned(start: ExpertTensors = start_slots, plan: object = plan) -> ExpertTensors:
            slots = clone(start)
            poison(slots, plan)  # type: ignore[arg-type]
            return slots

        copies = groups + (1 if triton else 0)
        subsets = itertools.chain.from_iterable(itertools.combinations(range(copies), n) for n in range(copies + 1))
        for late, slow_compute in [*((s, False) for s in subsets), ((), True)]:
            slots = poisoned()
            dirty_small_blocks(cuda, 1 << 40)
            held = SlowCopies(frozenset(late), slow_compute)
            got = overlapped_pass(x, weights, host, slots, plan, top_k, groups, held, triton)
            torch.cuda.synchronize()
            case = (fp8_rows, backend, late, slow_compute)
            assert torch.equal(got, want), (case, (got - want).abs().max().item())
        # captured: the per-group events become graph edges; each replay copies, then computes
        slots = poisoned()
        overlapped_pass(x, weights, host, poisoned(), plan, top_k, groups, SlowCopies(frozenset(), False), triton)
        torch.cuda.synchronize()  # warmed up (Triton compiled) before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            held = SlowCopies(frozenset({0, 1}), False)
            got = overlapped_pass(x, weights, host, slots, plan, top_k, groups, held, triton)
        for _ in range(2):
            for name in slots.names():  # poisoned again before each replay
                slots.get(name).copy_(poisoned().get(name))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(got, want), (fp8_rows, backend, "graph", (got - want).abs().max().item())


def test_compiled_graphed_paged_decode_matches_eager() -> None:
    check_graphed_paged(overlap=False, compile_layers=True)


def test_graphed_paged_decode_with_synthetic_routing_matches_eager() -> None:
    check_graphed_paged(overlap=False, compile_layers=True, routing="qwen3-30b-a3b")
    # the aging LFU's plan inside the captured, compiled step (the served configuration's kernels)
    for policy in ("lfu-aging", "duel"):
        check_graphed_paged(
            overlap=False, compile_layers=True, routing="qwen3-30b-a3b", backend="triton", policy=policy
        )


def check_prefetch_graphed(compile_layers: bool, backend: str = "grouped") -> None:
    """Next-layer prefetch inside the captured step (copy-stream fork/join in the graph): outputs
    equal the plain graphed step bit for bit (the same kernels read the same expert rows from other
    slots), every slot holds the host rows its map names, and the predictions are counted."""
    prompts = [[5, 17, 300, 41, 9, 77], [800, 2, 64]]
    outs, models = [], []
    for prefetch in (False, True):
        model = MoeCausalLM.from_pretrained(
            QWEN2,
            rt(
                "bfloat16",
                mode="paged",
                resident_experts=16,
                prefetch_next_layer=prefetch,
                kernel_backend=backend,
            ),  # fmt: skip
        )
        model.enable_cuda_graphs([1, 2], compile_layers=compile_layers)
        outs.append(decode(model, prompts, steps=6))
        models.append(model)
        assert model.graph_replays == 6
    for i, (a, b) in enumerate(zip(*outs)):
        assert torch.equal(a, b), f"output {i} differs by {(a - b).abs().max().item()}"
    model = models[1]
    torch.cuda.synchronize()
    for moe in model.moe_layers:
        dr, slots = moe.device_residency, moe.device_experts
        assert dr is not None and slots is not None
        expert_in = dr.expert_in[: dr.num_slots].cpu()
        for name in ("gate", "up", "down"):
            assert torch.equal(slots.get(name).cpu(), moe.host.get(name)[expert_in]), f"layer {moe.layer_idx} {name}"
    plain, ahead = models[0].counters.snapshot().layers, model.counters.snapshot().layers
    print(
        f"prefetch (compiled={compile_layers}): layer 1 prefetched {ahead[1].prefetched}, "
        f"used {ahead[1].prefetch_used}, "
        f"misses {ahead[1].misses} (plain {plain[1].misses})"
    )
    assert ahead[0].prefetched == 0 and ahead[1].prefetched > 0 and ahead[1].prefetch_used <= ahead[1].prefetched
    assert all(la.hits + la.misses == la.activations for la in ahead)


def test_graphed_prefetch_matches_plain_graphed() -> None:
    check_prefetch_graphed(compile_layers=False)


def test_compiled_triton_graphed_prefetch_matches_plain_graphed() -> None:
    check_prefetch_graphed(compile_layers=True, backend="triton")


def test_triton_expert_backend() -> None:
    """moe_triton (decode-sized kernels): paged == resident bit for bit with it, close to the
    grouped GEMM backend, and graph-capturable."""
    prompts = [[5, 17, 300, 41, 9, 77, 3, 8]]
    grouped = decode(MoeCausalLM.from_pretrained(QWEN2, rt("bfloat16", mode="resident")), prompts, steps=4)
    triton = {"kernel_backend": "triton"}
    resident = decode(MoeCausalLM.from_pretrained(QWEN2, rt("bfloat16", mode="resident", **triton)), prompts, steps=4)
    paged = decode(
        MoeCausalLM.from_pretrained(QWEN2, rt("bfloat16", mode="paged", resident_experts=16, **triton)),
        prompts,
        steps=4,
    )
    for a, b in zip(paged, resident):
        assert torch.equal(a, b)
    worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(resident, grouped))
    print(f"triton vs grouped experts (bf16): worst relative difference {worst:.2e}")
    assert worst < 5e-2
    check_graphed_paged(overlap=False, backend="triton")


def test_moe_triton_kernels_bf16() -> None:
    """moe_triton's routing and per-pair expert kernels and attn_triton's decode attention compiled, in bf16,
    against torch (the interpreter test's checks at the GPU's dtype), and at the Qwen3-30B-A3B layer shape."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_moe_triton import check_attention, check_kernels, reference_moe

    from paged_experts.experts import route
    from paged_experts.kernels import moe_triton

    check_kernels(device="cuda", dtype=torch.bfloat16, tol=2e-2)
    check_attention(device="cuda", dtype=torch.bfloat16, tol=2e-2)
    e, h, i, k = 128, 2048, 768, 8
    gen = torch.Generator(device="cuda").manual_seed(1)
    gate, up = (torch.randn(e, i, h, device="cuda", generator=gen, dtype=torch.bfloat16) / 40 for _ in range(2))
    down = torch.randn(e, h, i, device="cuda", generator=gen, dtype=torch.bfloat16) / 30
    for b in (1, 4):
        x = torch.randn(b, h, device="cuda", generator=gen, dtype=torch.bfloat16)
        ids, w = route(torch.randn(b, e, device="cuda", generator=gen), k, True)
        got = moe_triton.moe_pairs(x, ids.reshape(-1), w, gate, up, down, k).float()
        want = reference_moe(x, ids.reshape(-1), w, gate, up, down, k)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        print(f"moe_pairs vs fp32 reference at the Qwen3-30B-A3B shape, B={b}: max relative error {rel:.2e}")
        assert rel < 2e-2


def _decode_on(model: MoeCausalLM, pool: KvPool, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    seqs = [pool.new_sequence() for _ in prompts]
    last = model.forward([SeqChunk(s, p, 0) for s, p in zip(seqs, prompts)])
    out = list(last)
    for _ in range(steps):
        last = model.forward([SeqChunk(s, [int(lg[-1].argmax()) % 1000], s.num_tokens) for s, lg in zip(seqs, last)])
        out += last
    for s in seqs:
        pool.free(s)
    return out


def test_prepared_triton_graphs_serve_every_context_length_and_leave_the_model_as_loaded() -> None:
    """The serving path: triton backend, compiled layers, graphs prepared before any request. One
    graph per batch size serves contexts across several 64-token blocks of the attention kernel;
    outputs equal a model whose graphs were captured on first use, bit for bit, and every slot holds
    the expert its map names after the warm-up rewound the residency."""
    prompts = [list(range(3, 3 + 70)), [800, 2, 64], list(range(500, 500 + 130))]
    outs, models = [], []
    for prepare in (True, False):
        model = MoeCausalLM.from_pretrained(
            QWEN2, rt("bfloat16", mode="paged", resident_experts=32, kernel_backend="triton")
        )
        model.enable_cuda_graphs([1, 2, 3, 4], compile_layers=True)
        pool = KvPool.for_model(model, capacity_tokens=1024)
        if prepare:
            model.prepare_decode(pool, max_batch=4)
            assert model.captured_graphs == [(1, 0), (2, 0), (3, 0), (4, 0)], model.captured_graphs
            assert model.counters.snapshot().total.steps == 0
        outs.append(_decode_on(model, pool, prompts, steps=12))
        models.append(model)
    assert models[1].captured_graphs == [(3, 0)], models[1].captured_graphs  # contexts 3..143: one graph
    for i, (a, b) in enumerate(zip(*outs)):
        assert torch.equal(a, b), f"output {i} differs by {(a - b).abs().max().item()}"
    ta, tb = (m.counters.snapshot().total for m in models)
    assert (ta.steps, ta.hits, ta.misses, ta.union_sum) == (tb.steps, tb.hits, tb.misses, tb.union_sum)
    torch.cuda.synchronize()
    for moe in models[0].moe_layers:
        dr, slots = moe.device_residency, moe.device_experts
        expert_in = dr.expert_in[: dr.num_slots].cpu()
        for name in ("gate", "up", "down"):
            assert torch.equal(slots.get(name).cpu(), moe.host.get(name)[expert_in]), f"layer {moe.layer_idx} {name}"


def test_recorded_routing_stays_in_the_graphs() -> None:
    """--record-routing's recorder on a graphed paged model: every decode step replays its graph, the recorder
    stages the ids and weights to pinned memory without a device wait (no settle with a 64 MiB stage; with a
    2 KiB one it settles mid-run), and the trace holds exactly the routing the graphs computed."""
    import tempfile

    from paged_experts.routing.record import RoutingRecorder
    from paged_experts.routing.trace import read_trace

    prompts = [[5, 17, 300, 41, 9, 77], [800, 2, 64]]
    for stage_bytes in (64 << 20, 2048):
        model = MoeCausalLM.from_pretrained(QWEN2, rt("bfloat16", mode="paged", resident_experts=16))
        model.enable_cuda_graphs([1, 2])
        assert model.decode_graphs is not None
        path = Path(tempfile.mkdtemp()) / "r.trace"
        rec = RoutingRecorder(path, model.config, source="model", model="qwen2", stage_bytes=stage_bytes)
        model.routing_observers.append(rec)
        model.decode_graphs.trace = []
        pool = KvPool.for_model(model, capacity_tokens=512)
        seqs = [pool.new_sequence() for _ in prompts]
        rec.begin_step([(str(s.seq_id), len(p)) for s, p in zip(seqs, prompts)])
        last = model.forward([SeqChunk(s, p, 0) for s, p in zip(seqs, prompts)])
        for _ in range(6):
            rec.begin_step([(str(s.seq_id), 1) for s in seqs])
            last = model.forward(
                [SeqChunk(s, [int(lg[-1].argmax()) % 1000], s.num_tokens) for s, lg in zip(seqs, last)]
            )
        assert model.graph_replays == 6
        assert (rec.stage.settles == 0) == (stage_bytes == 64 << 20), rec.stage.settles
        rec.close()
        trace = read_trace(path)
        graphed = torch.stack(model.decode_graphs.trace).cpu().long()  # [steps, layers, B, k]
        decoded = trace.ids[len(prompts[0]) + len(prompts[1]) :]  # [steps x B, layers, k]
        assert torch.equal(torch.from_numpy(decoded).view(6, 2, 2, -1).transpose(1, 2), graphed)
        assert trace.weights is not None and (trace.weights[-12:].sum(-1) > 0.5).all()


if __name__ == "__main__":
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
