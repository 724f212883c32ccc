"""The overlapped paged pass (paged_experts/moe/overlap.py) equals the plain pass bit for bit however
its page-ins land, and computes no pair before the rows it reads have landed.

`LateCopies` stands in for the page-in stream: a copy issued by the pass lands only when the pass
waits for one, and then in a completion order the test chooses (every permutation of the step's
copies: waiting for copy i lands every copy up to i's place in the order). Until a copy lands, the
slots it writes hold NaN, so a pair computed from a slot whose rows are still copying poisons the
output. Copies on one CUDA stream land in issue order; the other orders stand for any other stream
layout, and checking them costs nothing.

The grouped kernels run on the CPU here; moe_triton's (gate/up per group with SKIP, down once)
run in Triton's interpreter in a child process (TRITON_INTERPRET=1, as in test_moe_triton.py), on
fp32 and block-FP8 tables. tests/cuda/test_device_paging_cuda.py checks the stream version on a GPU."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from interpreted import run_interpreted

from paged_experts import fp8
from paged_experts.kernels.copy_kernel import copy_planned
from paged_experts.kernels.fused import experts_over_rows
from paged_experts.moe.overlap import miss_groups, overlapped_pass
from paged_experts.residency.device import DevicePlan, DeviceResidency
from paged_experts.residency.store import ExpertTensors

Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertTensors, int], torch.Tensor]


class LateCopies:
    """Copies that land only when the pass waits, in `order` (a permutation of their issue indices)."""

    def __init__(self, order: tuple[int, ...]) -> None:
        self.order = order
        self.issued: list[tuple[ExpertTensors, ExpertTensors, torch.Tensor, torch.Tensor, tuple[str, ...] | None]] = []
        self.landed: list[int] = []

    def start(
        self, host: ExpertTensors, slots: ExpertTensors, experts: torch.Tensor, slot_ids: torch.Tensor,
        names: tuple[str, ...] | None,
    ) -> object:  # fmt: skip
        self.issued.append((host, slots, experts.clone(), slot_ids.clone(), names))
        return len(self.issued) - 1

    def wait(self, started: object) -> None:
        assert isinstance(started, int)
        for i in self.order[: self.order.index(started) + 1]:
            if i not in self.landed:
                self.landed.append(i)
                copy_planned(*self.issued[i])


def clone(t: ExpertTensors) -> ExpertTensors:
    return ExpertTensors(*(None if x is None else x.clone() for x in (t.gate, t.up, t.down, *t.scales)))


def poison(slots: ExpertTensors, plan: DevicePlan) -> None:
    """NaN in every slot a miss of `plan` is copied to (NaN bytes in FP8 rows, NaN scales)."""
    taken = plan.miss_slots[plan.miss_slots < slots.num_rows]
    for name in slots.names():
        t = slots.get(name)
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8)[taken] = 0x7F  # an e4m3fn NaN
        else:
            t[taken] = float("nan")


def tables(e: int, k: int, h: int, i: int, quantized: bool, seed: int) -> tuple[ExpertTensors, ExpertTensors]:
    """(host store [E, ...], slots [K, ...] holding experts 0..K-1), fp32 or block-FP8."""
    gen = torch.Generator().manual_seed(seed)
    dense = [torch.randn(e, *s, generator=gen) / 8 for s in ((i, h), (i, h), (h, i))]
    if quantized:
        q = [fp8.quantize(d) for d in dense]
        host = ExpertTensors(*(w for w, _ in q), *(s for _, s in q))
    else:
        host = ExpertTensors(*dense)
    return host, ExpertTensors(
        *(None if t is None else t[:k].clone() for t in (host.gate, host.up, host.down, *host.scales))
    )


def grouped_reference(
    x: torch.Tensor, pair_rows: torch.Tensor, weights: torch.Tensor, table: ExpertTensors, top_k: int
) -> torch.Tensor:
    return experts_over_rows(
        x, pair_rows, weights, table.gate, table.up, table.down, top_k, False, *table.scales, backend="grouped"
    )[0]  # fmt: skip


def planned_step(
    gen: torch.Generator, residency: DeviceResidency, host: ExpertTensors, slots: ExpertTensors, tokens: int,
    top_k: int, reference: Reference,
) -> tuple[torch.Tensor, torch.Tensor, DevicePlan, ExpertTensors, torch.Tensor]:  # fmt: skip
    """A random step of `tokens` tokens planned on `residency`: (x [T, H], weights [T, k], plan, the slots after
    its page-ins, `reference`'s output over them), that output checked equal to resident's over the host store."""
    e, h = host.num_rows, host.gate.shape[2]
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)])  # [T, k]
    x = torch.randn(tokens, h, generator=gen)  # [T, H]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)  # [T, k]
    plan = residency.plan(ids.reshape(-1))
    landed = clone(slots)
    copy_planned(host, landed, plan.miss_experts, plan.miss_slots)
    want = reference(x, plan.pair_slot, weights, landed, top_k)
    assert torch.equal(want, reference(x, ids.reshape(-1), weights, host, top_k))  # paged == resident
    return x, weights, plan, landed, want


def check_every_order(
    e: int, k: int, top_k: int, tokens: int, h: int, i: int, quantized: bool, groups: int, triton: bool,
    reference: Reference,
) -> int:  # fmt: skip
    """Steps of one layer (a fresh plan each, with hits and misses) through the overlapped pass under
    every completion order of its copies: equal to `reference` over the landed slots and, by expert
    id, over the host store (resident), never NaN. Returns the (step, order) runs checked."""
    gen = torch.Generator().manual_seed(3)
    residency = DeviceResidency(e, k, torch.device("cpu"))
    host, slots = tables(e, k, h, i, quantized, seed=1)
    checked = 0
    for step in range(4):
        x, weights, plan, landed, want = planned_step(gen, residency, host, slots, tokens, top_k, reference)
        poison(slots, plan)
        dry = LateCopies(tuple(range(64)))
        overlapped_pass(x, weights, host, clone(slots), plan, top_k, groups, dry, triton)
        for order in itertools.permutations(range(len(dry.issued))):
            trial, late = clone(slots), LateCopies(order)
            got = overlapped_pass(x, weights, host, trial, plan, top_k, groups, late, triton)
            assert sorted(late.landed) == list(range(len(dry.issued)))  # every copy waited for
            assert not got.isnan().any(), ("a pair computed before its rows landed", step, order)
            assert torch.equal(got, want), (step, order, plan.stats.tolist())
            checked += 1
        slots = landed
    return checked


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize(("tokens", "groups"), [(1, 1), (1, 2), (1, 3), (2, 3), (2, 4)])
def test_grouped_overlap_equals_the_plain_pass_in_every_completion_order(
    tokens: int, groups: int, quantized: bool
) -> None:
    checked = check_every_order(16, 8, 4, tokens, 256, 128, quantized, groups, False, grouped_reference)
    assert checked >= 4


def test_miss_groups_deal_the_misses_round_robin() -> None:
    """Miss i of the plan (ascending expert id) is in group i mod G; hits are -1."""
    residency = DeviceResidency(16, 8, torch.device("cpu"))
    plan = residency.plan(torch.tensor([3, 9, 12, 1, 10, 15]))  # slots hold 0..7: 3 and 1 hit
    assert plan.miss_experts.tolist()[:4] == [9, 10, 12, 15]
    by_expert = dict(zip([3, 9, 12, 1, 10, 15], miss_groups(plan, 8, 3).tolist()))
    assert by_expert == {3: -1, 1: -1, 9: 0, 10: 1, 12: 2, 15: 0}


def check_triton() -> None:
    """The triton path (in the interpreter): every completion order of G gate/up copies and the
    down copy, against moe_triton.moe_pairs over the landed slots and over the host store."""
    from paged_experts.kernels import moe_triton

    def reference(x, pair_rows, weights, table, top_k):  # noqa: ANN001, ANN202
        return moe_triton.moe_pairs(x, pair_rows.contiguous(), weights, table.gate, table.up, table.down, top_k,
                                    *table.scales)  # fmt: skip

    for quantized in (False, True):
        for tokens, groups in ((1, 1), (1, 2), (2, 2)):
            n = check_every_order(12, 6, 3, tokens, 256, 128, quantized, groups, True, reference)
            print("ok", quantized, tokens, groups, n)


def test_triton_overlap_equals_moe_pairs_in_every_completion_order_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    out = run_interpreted("test_overlap_page_in", "check_triton", timeout_s=900)
    assert out.count("ok ") == 6, out
