"""The fused device plan (paged_experts.residency.plan_triton), LRU and aging LFU, plans exactly what
`device.plan_step` plans: every output (pair slots, missed flags, padded miss experts and slots, stats) and
every state tensor (maps, stamps, use counts, step, spare entries) equal after every step, over long random
sequences at the served shape (E=128, K=40/42, top_k 8, 1-5 tokens), at small shapes, with steps of no miss,
steps where every pair misses and ties among pinned slots, and (aging) counts halved every 3 or 5 steps, with
and without a 2-step recency window, and the duel of LRU and aging LFU (`duel`: its shadows, selector and
per-expert last uses equal too, with routings that switch between a small pool and all experts; every other step
its plan and its shadows as two calls, the shadows reading the step's ids from the layer's buffer; and several layers'
shadows in one launch, as a captured step runs them). Run in
Triton's interpreter (TRITON_INTERPRET=1, in a child process: Triton reads it at import) on the CPU;
tests/cuda runs the same check compiled."""

from __future__ import annotations

import os
import random

import pytest
import torch
from interpreted import run_interpreted

from paged_experts.residency import plan_triton
from paged_experts.residency.device import DeviceResidency, plan_step

SHAPES = ((128, 40, 8, 5), (128, 42, 8, 5), (129, 64, 8, 8), (32, 8, 4, 2), (32, 32, 4, 8), (16, 4, 4, 1))
STEPS = 40  # per shape (the interpreter runs ~0.1 s a launch)


def check_fused_plan_equals_torch(device: str = "cpu", steps: int = STEPS) -> None:
    """For every shape (E, K, top_k, most tokens) and policy (LRU; aging LFU halving every 3 steps): one state
    planned by each implementation, step by step, from random routings (every 5th step from a small expert
    pool: mostly hits)."""
    for aging, window, duel in ((None, 0, False), (3, 0, False), (5, 2, False), (3, 2, True)):
        _check_fused_plan(torch.device(device), steps, aging, window, duel)
    print("fused plan equal", len(SHAPES), "shapes x", steps, "steps")


def _check_fused_plan(dev: torch.device, steps: int, aging: int | None, window: int, duel: bool = False) -> None:
    signs = set()  # the duel's choices over every shape
    for e, k, top_k, most in SHAPES:
        rng = random.Random(e * 1000 + k)
        ref = DeviceResidency(e, k, dev, aging_period_steps=aging, aging_window_steps=window, duel=duel)
        fused = DeviceResidency(e, k, dev, aging_period_steps=aging, aging_window_steps=window, duel=duel)
        period = aging or 0
        for step in range(steps):
            if duel:  # runs of 8 steps from all experts, then from a few: each shadow wins some
                pool = range(e) if (step // 8) % 2 else range(min(e, k // 2 + top_k))
            else:
                pool = range(e) if step % 5 else range(min(e, top_k + 3))
            tokens = rng.randint(1, max(1, min(most, k // top_k)))
            routed = [x for _ in range(tokens) for x in rng.sample(pool, top_k)]
            ids = torch.tensor(routed, dtype=torch.long, device=dev)
            want = plan_step(
                ids, ref.slot_of, ref.expert_in, ref.last_use, ref.step, ref._arange_e, e, k, ref.uses, period, window,
                (ref.expert_last_use, ref.shadows, ref.psel) if duel else None,
            )  # fmt: skip
            deferred = duel and step % 2 == 1  # the plan alone, then the shadows' launch, as a captured step runs them
            got = plan_triton.plan_step_triton(
                ids, fused.slot_of, fused.expert_in, fused.last_use, fused.step, fused._arange_e, e, k, fused.uses,
                period, window, (fused.expert_last_use, fused.shadows, fused.psel) if duel else None,
                duel_ids=fused._duel_ids if deferred else None, defer_shadows=deferred,
            )  # fmt: skip
            if deferred:
                plan_triton.duel_shadows_triton(
                    fused._duel_ids, len(routed), fused.uses, fused.step, fused.expert_last_use, fused.shadows,
                    fused.psel, e, window,
                )  # fmt: skip
            names = ("pair_slot", "pair_missed", "miss_experts", "miss_slots", "stats")
            for name, a, b in zip(names, got, want):
                assert a.dtype == b.dtype and torch.equal(a, b), (aging, e, k, step, name, a.tolist(), b.tolist())
            for name in ("slot_of", "expert_in", "last_use", "step", "uses", "expert_last_use", "shadows", "psel"):
                a, b = getattr(fused, name), getattr(ref, name)
                assert torch.equal(a, b), (aging, e, k, step, name, a.tolist(), b.tolist())
            assert torch.equal(fused._state, ref._state), (aging, e, k, step)  # the padding between the parts too
            signs.add(int(ref.psel) > 0)
        if aging:  # the counts did their job: some expert was counted, and halved (max count < steps)
            assert 0 < int(ref.uses.max()) < steps, ref.uses.tolist()
    if duel:  # the selector chose each policy in some step
        assert signs == {False, True}, signs


def check_shadow_layers_equal_torch(device: str = "cpu", steps: int = 40) -> None:
    """A step of L duel layers (each its own state and routing) as a captured step runs it: every layer's plan with
    its shadows deferred, then one launch of every layer's shadows (`duel_shadows_layers_triton`); every third step
    the shadows in line instead, so both orders alternate on one state. Every state tensor equals the torch
    reference's after every step, and the selector moves both ways."""
    dev = torch.device(device)
    signs = set()  # the selector's choices over both shapes
    for e, k, top_k, most in ((128, 40, 8, 5), (32, 8, 4, 2)):
        period, window, layers = 3, 2, 3
        refs = [DeviceResidency(e, k, dev, aging_period_steps=period, aging_window_steps=window, duel=True)
                for _ in range(layers)]  # fmt: skip
        fused = [DeviceResidency(e, k, dev, aging_period_steps=period, aging_window_steps=window, duel=True)
                 for _ in range(layers)]  # fmt: skip
        table = plan_triton.shadow_table(
            [(f._duel_ids, f.uses, f.step, f.expert_last_use, f.shadows, f.psel) for f in fused], dev
        )
        rngs = [random.Random(e * 1000 + k + layer) for layer in range(layers)]
        for step in range(steps):
            batched = step % 3 != 2
            tokens = rngs[0].randint(1, max(1, min(most, k // top_k)))  # one batch a step: every layer's P equal
            for layer, (ref, fu, rng) in enumerate(zip(refs, fused, rngs)):
                pool = range(e) if ((step + 4 * layer) // 8) % 2 else range(min(e, k // 2 + top_k))
                ids = torch.tensor([x for _ in range(tokens) for x in rng.sample(pool, top_k)], device=dev)
                plan_step(
                    ids, ref.slot_of, ref.expert_in, ref.last_use, ref.step, ref._arange_e, e, k, ref.uses, period,
                    window, (ref.expert_last_use, ref.shadows, ref.psel),
                )  # fmt: skip
                plan_triton.plan_step_triton(
                    ids, fu.slot_of, fu.expert_in, fu.last_use, fu.step, fu._arange_e, e, k, fu.uses, period, window,
                    (fu.expert_last_use, fu.shadows, fu.psel), duel_ids=fu._duel_ids, defer_shadows=batched,
                )  # fmt: skip
            if batched:
                plan_triton.duel_shadows_layers_triton(table, tokens * top_k, e, window)
            for layer, (ref, fu) in enumerate(zip(refs, fused)):
                for name in ("slot_of", "expert_in", "last_use", "step", "uses", "expert_last_use", "shadows", "psel"):
                    a, b = getattr(fu, name), getattr(ref, name)
                    assert torch.equal(a, b), (e, k, step, layer, name, a.tolist(), b.tolist())
                assert torch.equal(fu._state, ref._state), (e, k, step, layer)  # the padding too
                signs.add(int(ref.psel) > 0)
    assert signs == {False, True}, signs
    print("shadow layers equal")


def check_deferred_steps_equal_torch(device: str = "cpu", steps: int = 33) -> None:
    """DeviceResidency and DuelShadows as a captured decode step drives them (capture faked: the interpreter runs the
    kernels as the graph would): each layer's plan defers its shadows, `DuelShadows.flush` runs them for all in one
    launch; every third step no batch, so each layer's next plan runs its pending shadows first; a state read flushes
    too. Every state tensor equals the torch reference's after every step."""
    from unittest import mock

    from paged_experts.residency.device import DuelShadows

    dev = torch.device(device)
    e, k, top_k, layers = 64, 24, 4, 3
    rng = random.Random(11)
    refs = [DeviceResidency(e, k, dev, aging_period_steps=3, aging_window_steps=2, duel=True) for _ in range(layers)]
    devs = [DeviceResidency(e, k, dev, aging_period_steps=3, aging_window_steps=2, duel=True) for _ in range(layers)]
    for d in devs:  # the CPU keeps the torch plan; here the kernels, in the interpreter
        d.fused, d.defer_shadows = True, True
    batch = DuelShadows(devs)
    assert batch.table is not None
    names = ("slot_of", "expert_in", "last_use", "step", "uses", "expert_last_use", "shadows", "psel")
    with mock.patch.object(torch.cuda, "is_current_stream_capturing", return_value=False):  # eager
        for d in devs:  # some history first, so that a warm-up that wrote to a layer would show
            d.plan(torch.tensor(rng.sample(range(e), top_k), device=dev))
        for d in devs:  # ids no plan routed: shadows played over them would move (the next plan rewrites the buffer)
            d._duel_ids.copy_(torch.tensor(rng.sample(range(e), k), device=dev))
        before = [d.state() for d in devs]
        for n in (1, 2, 3):  # the kernels' first launches, before a capture: on scratch copies, no layer moves
            batch.warm(n * top_k)
    for d, old in zip(devs, before):
        assert torch.equal(d.state(), old)
    for ref, old in zip(refs, before):  # the references start where the layers are
        ref.load_state(old)
    signs = set()
    with mock.patch.object(torch.cuda, "is_current_stream_capturing", return_value=True):
        try:
            batch.warm(top_k)
            raise AssertionError("warm inside a capture must refuse")
        except RuntimeError as exc:
            assert "before the capture" in str(exc)
        for step in range(steps):
            tokens = rng.randint(1, 3)
            for layer, (ref, d) in enumerate(zip(refs, devs)):
                pool = range(e) if ((step + 3 * layer) // 6) % 2 else range(k // 2 + top_k)
                ids = torch.tensor([x for _ in range(tokens) for x in rng.sample(pool, top_k)], device=dev)
                ref.fused = False
                ref.plan(ids)
                d.plan(ids)
                assert d.shadows_pending == tokens * top_k
            if step % 3 == 2 and step < steps - 1:  # no batch, no read: each layer's next plan flushes first
                assert all(d.shadows_pending is not None for d in devs)
                continue
            if step % 3 != 2:
                batch.flush()
                assert all(d.shadows_pending is None for d in devs)
            for layer, (ref, d) in enumerate(zip(refs, devs)):
                state = d.state()  # flushes what is pending (the last step's, unbatched), as a real read must
                for name in names:
                    got, want = getattr(d, name), getattr(ref, name)
                    assert torch.equal(got, want), (step, layer, name, got.tolist(), want.tolist())
                assert torch.equal(state, ref.state())  # the whole buffer: the parts and the shadows' padding
                signs.add(int(ref.psel) > 0)
    assert signs == {False, True}, signs
    print("deferred steps equal")


def test_fused_plan_equals_torch_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    out = run_interpreted("test_device_plan_triton", "check_fused_plan_equals_torch")
    assert f"fused plan equal {len(SHAPES)} shapes x {STEPS} steps" in out


def test_deferred_shadows_of_a_captured_step_equal_torch_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    assert "deferred steps equal" in run_interpreted("test_device_plan_triton", "check_deferred_steps_equal_torch")


def test_every_layers_shadows_in_one_launch_equal_torch_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    assert "shadow layers equal" in run_interpreted("test_device_plan_triton", "check_shadow_layers_equal_torch")


def test_the_shadow_table_takes_a_device_named_without_index_and_refuses_wrong_tensors() -> None:
    """A runtime names `cuda` without an index, its tensors say `cuda:0` (torch compares the two as different): the
    table matches the type and an index where both name one. A tensor of another dtype, layout or device is refused:
    the kernel would read its bytes as int64 or bytes at the wrong place."""
    dev = DeviceResidency(16, 4, torch.device("cpu"), aging_period_steps=3, duel=True)
    parts = dev.shadow_addresses()
    for named in (torch.device("cpu"), torch.device("cpu", 0)):
        table = plan_triton.shadow_table([parts, parts], named)
        assert table.shape == (2, 6) and table.dtype == torch.long
        assert table[0].tolist() == [t.data_ptr() for t in parts]
    bad = (parts[0].int(), *parts[1:])
    with pytest.raises(ValueError, match="expected contiguous torch.int64"):
        plan_triton.shadow_table([bad], torch.device("cpu"))
    strided = (torch.zeros(8, dtype=torch.long)[::2], *parts[1:])
    with pytest.raises(ValueError, match="contiguous: False"):
        plan_triton.shadow_table([strided], torch.device("cpu"))
    with pytest.raises(ValueError, match="on cpu"):
        plan_triton.shadow_table([parts], torch.device("meta"))


def test_the_fused_plan_runs_only_on_cuda_and_at_shapes_that_fit_one_program() -> None:
    assert not plan_triton.available(torch.device("cpu"), 128, 40)
    assert not DeviceResidency(128, 40, torch.device("cpu")).fused  # the CPU keeps the torch plan
    if plan_triton.triton is not None:
        assert plan_triton.available(torch.device("cuda"), 128, 128)
        assert not plan_triton.available(torch.device("cuda"), 512, 256)  # [256 x 1024] > one program


def test_the_fused_plan_compiles_for_the_h200() -> None:
    """The real compiler (the interpreter type-checks nothing): sm_90, the served shape's blocks."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter compiles nothing")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_ptx(fn, constants: dict[str, object]) -> str:  # noqa: ANN001 - a Triton JITFunction
        kinds = {"pair_missed_ptr": "*i1", "shadow_ptr": "*u8"}  # the shadows go as bytes (bool viewed as uint8)
        pointers = {a: kinds.get(a, "*i64") for a in fn.arg_names if a.endswith("_ptr")}
        signature = {a: pointers.get(a, "constexpr" if a in constants else "i32") for a in fn.arg_names}
        src = ASTSource(fn, signature, constants, {})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]

    for aging, duel in ((False, False), (True, False), (True, True)):  # LRU, aging LFU, their duel's plan
        constants = {"BLOCK_P": 64, "BLOCK_E": 256, "BLOCK_K": 64, "AGING": aging, "DUEL": duel}
        assert "st.global" in compile_ptx(plan_triton._plan_kernel, constants)
    for block_p in (8, 32):  # the duel's shadows at one and four tokens
        assert "st.global" in compile_ptx(plan_triton._shadow_kernel, {"BLOCK_P": block_p, "BLOCK_S": 128})
        # every layer's shadows in one launch: the addresses read from the table, cast to pointers
        assert "st.global" in compile_ptx(plan_triton._shadow_layers_kernel, {"BLOCK_P": block_p, "BLOCK_S": 128})
