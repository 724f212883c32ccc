"""CUDA checks of the synthetic router's device draw (routing_draw + routing/draw_triton.py):
- the Triton kernel compiled equals the torch draw bit for bit (the interpreter test's cases, and
  Qwen3-30B-A3B's 48 layers x 128 experts x k=8 for 64 tokens at positions up to 70,000);
- `draw_device` captured in a CUDA graph, replayed with other requests and positions, equals the
  torch draw on the host (no host sync: the ids come from the inputs' device tensors);
- the router's device memory (tables + one draw) stays under 100 MB (DESIGN target; ~50 KB);
- a graphed decode step with the calibrated synthetic router routes exactly as the eager steps
  (same ids every layer, every step) and gives the same logits within bf16 rounding;
- a 2,048-token step's planned ids equal the torch draw on both sides (and the host time it costs), and a
  step's device ids stay intact while the compute stream reads them behind later steps' draws.

Plain functions, so the module also runs as a script: `python tests/cuda/test_routing_draw_cuda.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.routing.sources import RoutingProcess, make_router
from paged_experts.routing.specs import parse_spec
from paged_experts.runtime import RuntimeConfig

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass

QWEN2 = "synth:qwen3-30b-a3b-shape?layers=2&seed=0"


def test_triton_draw_equals_torch_compiled() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_routing_draw import check_triton_draw

    from paged_experts.routing import draw_triton as routing_triton

    check_triton_draw(device="cuda", n_tokens=64)
    process = RoutingProcess(48, 128, 8, parse_spec("qwen3-30b-a3b"), seed=0)
    gen = torch.Generator().manual_seed(0)
    requests = torch.randint(0, 1 << 40, (64,), generator=gen)
    positions = torch.randint(0, 70000, (64,), generator=gen)
    want = process.draw(requests, positions)  # on the host
    got = routing_triton.draw(process.tables.to("cuda"), requests.cuda(), positions.cuda())
    assert torch.equal(got.cpu(), want)


def test_device_draw_in_a_graph_and_its_memory() -> None:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    router = make_router("qwen3-30b-a3b", {"num_experts": 128, "top_k": 8, "num_layers": 48}, seed=5)
    requests = torch.zeros(8, dtype=torch.long, device="cuda")
    positions = torch.zeros(8, dtype=torch.long, device="cuda")
    out = router.draw_device(requests, positions)  # warm-up: tables copied, kernel compiled
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router.draw_device(requests, positions)
    for trial in range(3):
        req = torch.randint(0, 1000, (8,))
        pos = torch.randint(0, 10240, (8,))
        requests.copy_(req)
        positions.copy_(pos)
        graph.replay()
        assert torch.equal(out.cpu(), router.process.draw(req, pos)), trial
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated() - before
    tables_kb = router.tables(requests.device).nbytes() / 1e3
    print(f"synthetic router device memory: {used / 1e6:.2f} MB (tables {tables_kb:.0f} KB)")
    assert used < 100e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"device draw of 8 tokens x 48 layers in a graph: {start.elapsed_time(end) * 10:.1f} us")


def test_graphed_decode_with_synthetic_routing_routes_as_eager() -> None:
    prompts = [[5, 17, 300, 41], [800, 2, 64, 9, 10, 11]]
    rt = RuntimeConfig(device="cuda", dtype="bfloat16", mode="resident", kernel_backend="triton")
    runs = []
    for graphed in (True, False):
        model = MoeCausalLM.from_pretrained(QWEN2, rt)
        model.router_override = make_router("qwen3-30b-a3b", model.config, seed=1)
        seen: list[torch.Tensor] = []
        if graphed:
            model.enable_cuda_graphs([1, 2])
            model.decode_graphs.trace = seen
        else:
            model.routing_observers.append(lambda layer, ids, w, ctx, out=seen: out.append(ids.cpu()))
        pool = KvPool.for_model(model, capacity_tokens=512)
        seqs = [pool.new_sequence() for _ in prompts]
        last = model.forward([SeqChunk(s, p, 0) for s, p in zip(seqs, prompts)])
        if not graphed:
            seen.clear()  # the prefill's routing: the graphed run has no trace of it
        logits = []
        for _ in range(5):
            last = model.forward(
                [SeqChunk(s, [int(lg[-1].argmax()) % 1000], s.num_tokens) for s, lg in zip(seqs, last)]
            )
            logits += [lg.float() for lg in last]
        assert (model.graph_replays == 5) == graphed
        ids = torch.stack([t.cpu() for t in seen]) if graphed else torch.stack(seen).view(5, -1, 2, 8)
        runs.append((logits, ids))
    (lg_g, ids_g), (lg_e, ids_e) = runs
    assert torch.equal(ids_g, ids_e), "graphed steps routed differently from eager steps"
    for a, b in zip(lg_g, lg_e):
        assert ((a - b).abs().max() / b.abs().max().clamp(min=1)).item() < 5e-2


def test_a_prefill_steps_planned_ids_and_its_host_time() -> None:
    """A 2,048-token step's ids for 48 layers: drawn once, the same on the device and on the host as the
    torch draw, every layer's two views contiguous; prints the host time of a step's 48 router calls with
    the layer's take of them (issue 29 item 4: 56-68 ms a 2,048-token prompt on the H200 before
    PlannedIds), for the first step (the kernel compiled on the way) and two more."""
    import time
    from types import SimpleNamespace

    from paged_experts.moe.layer import MoeLayer

    router = make_router("qwen3-30b-a3b", {"num_experts": 128, "top_k": 8, "num_layers": 48}, seed=5)
    layer = SimpleNamespace(shared=SimpleNamespace(top_k=8, num_experts=128, device=torch.device("cuda")))
    logits = torch.randn(2048, 128, device="cuda")
    for step in range(3):
        ctx = SimpleNamespace(seq_ids=(step,) * 2048, positions=tuple(range(2048)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        taken = [MoeLayer._check_override(layer, *router(i, logits, ctx), 2048) for i in range(48)]  # type: ignore[arg-type]
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        want = router.process.draw(torch.full((2048,), step), torch.arange(2048))  # [T, L, k] on the host
        for i, (ids_dev, weights, ids_host) in enumerate(taken):
            assert ids_dev.is_cuda and ids_dev.is_contiguous() and ids_host.is_contiguous(), i
            assert torch.equal(ids_host, want[:, i]) and torch.equal(ids_dev.cpu(), want[:, i]), i
            assert weights.shape == (2048, 8)
        print(f"step {step}: 48 layers' router calls, 2,048 tokens: {host_s * 1e3:.2f} ms of host time")


def test_a_steps_device_ids_outlive_the_next_draws_while_the_compute_stream_reads_them() -> None:
    """The compute stream still reading step 0's device ids (behind a sleep) while steps 1 and 2 are drawn on
    the router's own stream: their draws must not reuse step 0's memory before that read (record_stream),
    nor may step 0's read see anything but step 0's draw."""
    from types import SimpleNamespace

    router = make_router("qwen3-30b-a3b", {"num_experts": 128, "top_k": 8, "num_layers": 48}, seed=5)
    logits = torch.randn(2048, 128, device="cuda")
    steps = [SimpleNamespace(seq_ids=(s,) * 2048, positions=tuple(range(2048))) for s in range(3)]
    planned, _ = router(7, logits, steps[0])
    want = planned.host.clone()
    torch.cuda._sleep(200_000_000)  # ~0.1 s on the compute stream before it reads step 0's ids
    seen = planned.device.clone()  # [T, k], read on the compute stream after the sleep
    del planned
    for ctx in steps[1:]:  # two more steps: the second frees step 0's draw, while the read above still waits
        router(0, logits, ctx)
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), want)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
