"""SWITCH lanes on a GPU (paged_experts/residency/switch_lanes.py): a graph captured once copies, at every replay, the
host rows that a device tensor names at that replay into each lane's row, on the copy engines; a lane whose id is
negative or past the experts copies nothing; split and packed rows alike. Then copy_overlap.py's `switch` arms run
beside the compute with every row checked (its own checks), none an error.

This is the first run of conditional nodes with memcpy bodies on the device: a driver that refuses them fails here
with its CUresult named (cuGraphAddMemcpyNode into a body, or the capture's instantiation).

Plain functions, so the module also runs as a script: `python tests/cuda/test_switch_lanes_cuda.py`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from _script import load_benchmark  # tests/cuda is on sys.path (pytest's rootdir import, or script mode)

from paged_experts.residency import switch_lanes
from paged_experts.residency.store import ExpertTensors

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass

E, H, INTER = 12, 2048, 768  # Qwen3-30B-A3B's expert shape, FP8 rows of 4.7 MB


def _tables(packed: bool) -> tuple[ExpertTensors, ExpertTensors]:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    host = ExpertTensors.empty(E, H, INTER, torch.bfloat16, cpu, pin=True, is_fp8=True, packed=packed)
    gen = torch.Generator().manual_seed(1)
    for name in host.names():
        raw = host.get(name).view(torch.uint8)
        raw.copy_(torch.randint(1, 120, raw.shape, dtype=torch.uint8, generator=gen))  # no zero byte: a miss shows
    dst = ExpertTensors.empty(6, H, INTER, torch.bfloat16, cuda, is_fp8=True, packed=packed)
    return host, dst


def _clear(dst: ExpertTensors) -> None:
    for name in dst.names():
        dst.get(name).view(torch.uint8).zero_()


def _check(host: ExpertTensors, dst: ExpertTensors, want: dict[int, int]) -> None:
    """dst row r holds host row want[r]; every other row is still zero."""
    torch.cuda.synchronize()
    for name in host.names():
        got, src = dst.get(name).view(torch.uint8).cpu(), host.get(name).view(torch.uint8)
        for r in range(dst.num_rows):
            if r in want:
                assert torch.equal(got[r], src[want[r]]), f"{name}: row {r} is not expert {want[r]}"
            else:
                assert not got[r].any(), f"{name}: row {r} was written"


def check_lanes(packed: bool) -> None:
    host, dst = _tables(packed)
    lanes = switch_lanes.SwitchLanes(host, dst, rows=[0, 2, 3, 5])
    experts = torch.tensor([7, -1, 3, E], dtype=torch.long, device="cuda")  # lanes 1 and 3 select nothing
    graph = torch.cuda.CUDAGraph()
    _clear(dst)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        lanes.capture(experts)
    assert lanes.nodes_added == 4 * E * (1 if packed else 6)
    _clear(dst)
    graph.replay()
    _check(host, dst, {0: 7, 3: 3})
    # the device chooses at each replay: new ids, the same graph
    experts.copy_(torch.tensor([11, 0, E + 5, 4], dtype=torch.long))
    _clear(dst)
    graph.replay()
    _check(host, dst, {0: 11, 2: 0, 5: 4})
    for _ in range(20):  # repeated replays keep copying (a handle left at a stale value would show)
        graph.replay()
    experts.fill_(-1)
    _clear(dst)
    graph.replay()
    _check(host, dst, {})


def test_split_rows_lanes_copy_the_rows_the_device_names_at_each_replay() -> None:
    check_lanes(packed=False)


def test_packed_rows_lanes_copy_the_rows_the_device_names_at_each_replay() -> None:
    check_lanes(packed=True)


def test_copy_overlaps_switch_arms_land_their_rows_beside_the_compute() -> None:
    bench = load_benchmark("copy_overlap")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "co.json"
        # fmt: off
        status = bench.main([
            "--out", str(out), "--experts", "24", "--slots", "16", "--m", "2,5", "--tokens", "4", "--programs", "",
            "--wide", "", "--no-proxy", "--switch", "m,8", "--rows", "packed", "--repeats", "3", "--warmup", "1",
        ])
        # fmt: on
        record = json.loads(out.read_text())
    errors = [(r["copy"], r["m"], r.get("error")) for r in record["rows"] if "error" in r]
    assert status == 0 and not errors, errors
    assert [(r["copy"], r["m"]) for r in record["rows"]] == [
        (c, m) for m in (2, 5) for c in ("dma", "kernel", "switch", "switch:8")
    ]
    for r in record["rows"]:
        if r["copy"].startswith("switch"):
            assert r["lanes"] == (r["m"] if r["copy"] == "switch" else 8)
            assert r["switch_nodes"] == r["lanes"] * 24 and r["copy_gbps"] > 0


def test_graphed_decode_with_switch_copies_equals_graphed_with_kernel_copies() -> None:
    """RuntimeConfig.overlap_copies='switch' in captured decode steps (moe/overlap.py SwitchCopies): the same graphed
    model with the copy kernel's copies and with SWITCH lanes gives the same outputs bit for bit (only what copies
    the bytes differs), packed and split rows, one group and three; a batch of 2 (16 pairs) misses more than the 4
    lanes, so the kernel's overflow copies run too."""
    from test_device_paging_cuda import QWEN2, decode, rt

    from paged_experts.model import MoeCausalLM

    prompts = [[5, 17, 300, 41, 9, 77, 3, 8], [800, 2, 64]]
    fp8 = "synth:qwen3-30b-a3b-fp8-shape?layers=2&seed=0"  # block-FP8 rows: the layout the lanes are for
    for name, rows, groups in ((QWEN2, "auto", 1), (QWEN2, "split", 1), (QWEN2, "auto", 3), (fp8, "auto", 1)):
        outs = {}
        for copies in ("kernel", "switch"):
            runtime = rt(
                "bfloat16", mode="paged", resident_experts=16, overlap_page_in=True, overlap_groups=groups,
                overlap_copies=copies, kernel_backend="triton", expert_rows=rows,
            )  # fmt: skip
            model = MoeCausalLM.from_pretrained(name, runtime)
            model.enable_cuda_graphs([1, 2])
            outs[copies] = decode(model, prompts, 6)
            assert model.graph_replays > 0, (name, rows, groups, copies)  # steps captured and replayed
            assert model.counters.snapshot().total.misses > 0
            if copies == "switch":  # the captures went through the lanes (not the kernel's copies alone)
                lanes = [x for m in model.moe_layers for x in m.device_lru.switch_lanes.values()]
                assert sum(x.nodes_added for x in lanes) > 0, (name, rows, groups)
        for i, (a, b) in enumerate(zip(outs["switch"], outs["kernel"], strict=True)):
            assert torch.equal(a, b), (
                f"{name} rows {rows}, G={groups}: output {i} differs by {(a - b).abs().max().item()}"
            )


def test_graphed_decode_with_switch_copies_matches_eager() -> None:
    from test_device_paging_cuda import check_graphed_paged

    check_graphed_paged(overlap=True, backend="triton", copies="switch")


if __name__ == "__main__":
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
