"""The fused device plan (paged_experts.residency.plan_triton), LRU and aging LFU, plans exactly what
`device.plan_step` plans: every output (pair slots, missed flags, padded miss experts and slots, stats) and
every state tensor (maps, stamps, use counts, step, spare entries) equal after every step, over long random
sequences at the served shape (E=128, K=40/42, top_k 8, 1-5 tokens), at small shapes, with steps of no miss,
steps where every pair misses and ties among pinned slots, and (aging) counts halved every 3 or 5 steps, with
and without a 2-step recency window, and the duel of LRU and aging LFU (`duel`: its shadows, selector and
per-expert last uses equal too, with routings that switch between a small pool and all experts; every other step
its plan and its shadows as two calls, the shadows reading the step's ids from the layer's buffer). Run in
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
            signs.add(int(ref.psel) > 0)
        if aging:  # the counts did their job: some expert was counted, and halved (max count < steps)
            assert 0 < int(ref.uses.max()) < steps, ref.uses.tolist()
    if duel:  # the selector chose each policy in some step
        assert signs == {False, True}, signs


def test_fused_plan_equals_torch_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    out = run_interpreted("test_device_plan_triton", "check_fused_plan_equals_torch")
    assert f"fused plan equal {len(SHAPES)} shapes x {STEPS} steps" in out


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
        bools = ("pair_missed_ptr", "shadow_ptr")
        pointers = {a: "*i1" if a in bools else "*i64" for a in fn.arg_names if a.endswith("_ptr")}
        signature = {a: pointers.get(a, "constexpr" if a in constants else "i32") for a in fn.arg_names}
        src = ASTSource(fn, signature, constants, {})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]

    for aging, duel in ((False, False), (True, False), (True, True)):  # LRU, aging LFU, their duel's plan
        constants = {"BLOCK_P": 64, "BLOCK_E": 256, "BLOCK_K": 64, "AGING": aging, "DUEL": duel}
        assert "st.global" in compile_ptx(plan_triton._plan_kernel, constants)
    for block_p in (8, 32):  # the duel's shadows at one and four tokens
        assert "st.global" in compile_ptx(plan_triton._shadow_kernel, {"BLOCK_P": block_p, "BLOCK_S": 128})
