"""Exact-size pinned store (paged_experts/residency/pinned.py) on the CPU, through a fake registrar: the
layout, the three views, one registration of the exact size, and its release when the last tensor
that can reach the block (views and their slices) is gone. tests/cuda/test_pinned_cuda.py runs the
same on a GPU with the real driver calls."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from paged_experts.residency import pinned
from paged_experts.residency.store import ExpertTensors

E, H, INTER = 6, 64, 40  # down's rows are 64 x 40 x 2 = 5120 bytes: not a multiple of the alignment


class FakeRegistrar:
    """Records the driver calls; `register` answers `code`."""

    def __init__(self, code: int = 0, unusable_reason: str | None = None) -> None:
        self.code = code
        self.unusable_reason = unusable_reason
        self.calls: list[tuple[str, ...]] = []

    def register(self, ptr: int, nbytes: int) -> int:
        self.calls.append(("register", hex(ptr), str(nbytes)))
        return self.code

    def unregister(self, ptr: int) -> int:
        self.calls.append(("unregister", hex(ptr)))
        return 0

    def error_name(self, code: int) -> str:
        return f"CUDA_ERROR_FAKE ({code})"

    def synchronize(self) -> None:
        self.calls.append(("synchronize",))


@pytest.fixture(autouse=True)
def fresh_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pinned, "_LEDGER", pinned._Ledger())
    monkeypatch.delenv(pinned.ENV, raising=False)


def shapes(e: int = E) -> list[tuple[int, ...]]:
    return [(e, INTER, H), (e, INTER, H), (e, H, INTER)]  # gate, up, down


def test_plan_aligns_each_tensor_and_rounds_only_to_the_alignment() -> None:
    lay = pinned.plan(shapes(), torch.bfloat16)
    row = INTER * H * 2
    assert lay.nbytes == (E * row, E * row, E * row)  # 30720 each
    assert lay.offsets == (0, 32768, 65536)
    assert lay.total_bytes == 3 * 32768
    assert all(off % pinned.ALIGN_BYTES == 0 for off in lay.offsets)
    exact = pinned.plan([(4096,), (1,), (2048,)], torch.float32)
    assert exact.offsets == (0, 16384, 20480) and exact.total_bytes == 20480 + 8192


def test_views_have_the_shapes_dtypes_strides_and_disjoint_bytes() -> None:
    fake = FakeRegistrar()
    gate, up, down = pinned.empty_pinned(shapes(), torch.bfloat16, fake)
    lay = pinned.plan(shapes(), torch.bfloat16)
    assert [t.shape for t in (gate, up, down)] == [torch.Size(s) for s in shapes()]
    assert {t.dtype for t in (gate, up, down)} == {torch.bfloat16}
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in (gate, up, down))
    assert down.stride() == (H * INTER, INTER, 1)
    base = gate.data_ptr()
    assert [t.data_ptr() - base for t in (gate, up, down)] == list(lay.offsets)
    assert base % pinned.ALIGN_BYTES == 0
    assert fake.calls == [("register", hex(base), str(lay.total_bytes))]
    assert gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr() == down.untyped_storage().data_ptr()
    for i, t in enumerate((gate, up, down)):  # writing one view changes no other
        t.fill_(float(i + 1))
    assert (gate == 1).all() and (up == 2).all() and (down == 3).all()
    s = pinned.stats()
    assert (s.method, s.registered_bytes, s.registered_blocks, s.torch_bytes) == ("register", lay.total_bytes, 1, 0)


def test_block_is_unregistered_once_when_the_last_view_or_slice_is_gone() -> None:
    fake = FakeRegistrar()
    gate, up, down = pinned.empty_pinned(shapes(), torch.bfloat16, fake)
    base = gate.data_ptr()
    row = down[2:4]  # a slice, as the direct page-in takes: it keeps the block too
    del gate, up
    gc.collect()
    assert [c[0] for c in fake.calls] == ["register"]
    del down
    gc.collect()
    assert [c[0] for c in fake.calls] == ["register"] and pinned.stats().registered_blocks == 1
    row.fill_(5.0)  # still mapped
    del row
    gc.collect()
    # synchronize first: a copy queued from a freed slice may still be reading the block
    assert fake.calls[1:] == [("synchronize",), ("unregister", hex(base))]
    assert pinned.stats().registered_bytes == 0 and pinned.stats().registered_blocks == 0


def test_store_keeps_the_block_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRegistrar()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "_cuda_driver", lambda: fake)
    store = ExpertTensors.empty(E, H, INTER, torch.bfloat16, torch.device("cpu"), pin=True)
    assert store.gate.untyped_storage().data_ptr() == store.down.untyped_storage().data_ptr()
    assert pinned.stats().registered_bytes == pinned.plan(shapes(), torch.bfloat16).total_bytes
    plain = ExpertTensors.empty(E, H, INTER, torch.bfloat16, torch.device("cpu"))  # pin=False: torch.empty as before
    assert plain.gate.untyped_storage().data_ptr() != plain.up.untyped_storage().data_ptr()
    del store
    gc.collect()
    assert [c[0] for c in fake.calls] == ["register", "synchronize", "unregister"]


def fake_torch_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.empty(pin_memory=True) needs a GPU; the ledger is what these tests check."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **kw: real_empty(*a, **kw))


@pytest.mark.parametrize(
    ("fake", "reason"),
    [
        (FakeRegistrar(code=2), "cuMemHostRegister of 98304 bytes: CUDA_ERROR_FAKE (2)"),
        (
            FakeRegistrar(unusable_reason="device 0 reports CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 0"),
            "device 0 reports",
        ),
    ],
)
def test_falls_back_to_torch_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fake: FakeRegistrar, reason: str
) -> None:
    fake_torch_pinned(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="paged_experts.residency.pinned"):
        gate, up, down = pinned.empty_pinned(shapes(), torch.bfloat16, fake)
    assert reason in caplog.text
    assert gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()
    assert "unregister" not in [c[0] for c in fake.calls]
    s = pinned.stats()
    assert s.registered_bytes == 0 and s.torch_bytes == 3 * E * INTER * H * 2
    assert s.torch_rounded_bytes == 3 * 32768 and s.fallback_reasons[0].startswith(reason)
    del gate, up, down
    gc.collect()
    assert pinned.stats().torch_bytes == 0


def test_env_selects_torchs_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch_pinned(monkeypatch)
    fake = FakeRegistrar()
    monkeypatch.setenv(pinned.ENV, "torch")
    pinned.empty_pinned(shapes(), torch.bfloat16, fake)
    assert fake.calls == [] and pinned.stats().method == "torch" and pinned.stats().fallback_reasons == ()
    monkeypatch.setenv(pinned.ENV, "cudaHostAlloc")
    with pytest.raises(ValueError, match="PAGED_EXPERTS_PINNED='cudaHostAlloc': expected one of register, torch"):
        pinned.empty_pinned(shapes(), torch.bfloat16, fake)
