"""Shared by the CUDA test modules: script mode (`python tests/cuda/test_X.py` runs every test_*
function, reports each, exits non-zero if any failed: no pytest needed on a bare GPU box), and
the page-in kernel check run over different host stores (torch-pinned, exact-size registered)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from paged_experts.kernels.copy_kernel import copy_planned, graph_safe
from paged_experts.residency.store import ExpertTensors


def check_copy_planned(host: ExpertTensors, first: int, second: int, k: int = 4) -> None:
    """copy_planned pages host rows `first` and `second` into slots 3 and 0 of k device slots,
    with two padding entries (expert E, slot k) that must move nothing."""
    assert graph_safe(torch.device("cuda")), "Triton is missing: the page-in kernel cannot run"
    e, inter, hidden = host.gate.shape
    slots = ExpertTensors.empty(k, hidden, inter, host.gate.dtype, torch.device("cuda"))
    for name in ("gate", "up", "down"):
        slots.get(name).zero_()
    experts = torch.tensor([first, second, e, e], device="cuda")  # two planned, two padding
    slot_ids = torch.tensor([3, 0, k, k], device="cuda")
    copy_planned(host, slots, experts, slot_ids)
    torch.cuda.synchronize()
    for name in ("gate", "up", "down"):
        got = slots.get(name).cpu()
        assert torch.equal(got[3], host.get(name)[first]) and torch.equal(got[0], host.get(name)[second]), name
        assert not got[1].any() and not got[2].any(), name


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (benchmarks/ is no package), registered in sys.modules under `name`: a
    dataclass of the script looks its module up there."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_tests(namespace: dict[str, Any]) -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU")
        return 2
    failures = 0
    for name, fn in sorted(namespace.items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"PASS {name}")
            except Exception as exc:  # noqa: BLE001 - report every case, then fail
                failures += 1
                print(f"FAIL {name}: {exc!r}")
    return 1 if failures else 0
