"""--record-routing without leaving the graphed decode (paged_experts/routing/record.py): graphed decode steps hand
their routing to the observers, the recorder stages it without waiting, and the trace equals an eager model's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.routing.record import HostStage, RoutingRecorder
from paged_experts.routing.trace import read_trace
from paged_experts.runtime import RuntimeConfig

PATH = "synth:tiny?layers=2&seed=1"  # 32 experts, top_k 4
PROMPTS = ([5, 17, 300, 41, 9], [800, 2, 64], [11, 12, 13, 14])


def _model(routing: str) -> MoeCausalLM:
    model = MoeCausalLM.from_pretrained(PATH, RuntimeConfig(mode="paged", resident_experts=12, device_planning="on"))
    if routing == "synthetic":
        from paged_experts.routing.sources import make_router

        model.router_override = make_router("qwen3-30b-a3b", model.config, seed=4)
    return model


def _record(model: MoeCausalLM, path: Path, decode_steps: int, stage_bytes: int) -> RoutingRecorder:
    """A prefill of every prompt, then decode steps of 1, 2, 3, 1, ... sequences, recorded as the server records."""
    recorder = RoutingRecorder(path, model.config, source="model", model="tiny", stage_bytes=stage_bytes)
    model.routing_observers.append(recorder)
    pool = KvPool.for_model(model, capacity_tokens=128)
    seqs = [pool.new_sequence() for _ in PROMPTS]
    recorder.begin_step([(str(s.seq_id), len(p)) for s, p in zip(seqs, PROMPTS)])
    last = dict(zip(seqs, model.forward([SeqChunk(s, list(p), 0) for s, p in zip(seqs, PROMPTS)])))
    for step in range(decode_steps):
        live = seqs[: 1 + step % len(seqs)]
        recorder.begin_step([(str(s.seq_id), 1) for s in live])
        out = model.forward([SeqChunk(s, [int(last[s][-1].argmax())], s.num_tokens) for s in live])
        last.update(zip(live, out))
    recorder.close()
    return recorder


@pytest.mark.parametrize("routing", ["model", "synthetic"])
@pytest.mark.parametrize("stage_bytes", [1 << 20, 200])  # 200 bytes: the stage settles again and again
def test_graphed_steps_record_what_eager_steps_record(tmp_path: Path, routing: str, stage_bytes: int) -> None:
    eager, graphed = _model(routing), _model(routing)
    graphed.enable_cuda_graphs([1, 2, 3])
    _record(eager, tmp_path / "eager.trace", 6, stage_bytes)
    rec = _record(graphed, tmp_path / "graphed.trace", 6, stage_bytes)
    assert graphed.graph_replays == 6  # the recorder kept no step out of the graphs
    assert eager.graph_replays == 0
    a, b = read_trace(tmp_path / "eager.trace"), read_trace(tmp_path / "graphed.trace")
    assert a.steps == b.steps and len(a.steps) == 7
    assert a.ids.shape == (5 + 3 + 4 + 1 + 2 + 3 + 1 + 2 + 3, 2, 4)
    assert np.array_equal(a.ids, b.ids)
    assert a.weights is not None and b.weights is not None  # the graphs hand their routing weights too
    np.testing.assert_allclose(a.weights, b.weights, rtol=1e-3, atol=1e-3)  # the file keeps float16
    assert (rec.stage.settles > 2) == (stage_bytes == 200)


def test_stage_reuses_its_buffer_and_keeps_every_value() -> None:
    stage = HostStage(64)
    parts = [stage.put(torch.arange(4 * i, 4 * i + 4, dtype=torch.int64).view(2, 2)) for i in range(5)]
    assert stage.settles == 2  # 32 bytes a part: the third and the fifth found the buffer full
    assert [np.asarray(p).tolist() for p in parts] == [[[4 * i, 4 * i + 1], [4 * i + 2, 4 * i + 3]] for i in range(5)]
    assert stage.settles == 3  # reading the last part settled the rest
    assert np.asarray(stage.put(torch.zeros(0, 8, dtype=torch.int64))).shape == (0, 8)
    big = stage.put(torch.ones(100))  # larger than the stage: read at once
    assert isinstance(big, np.ndarray) and big.sum() == 100


def test_recorder_refuses_rows_of_another_width(tmp_path: Path) -> None:
    model = _model("model")
    rec = RoutingRecorder(tmp_path / "t.trace", model.config, source="model", model="tiny")
    rec.begin_step([("0", 2)])
    with pytest.raises(ValueError, match=r"want \[T, 4\]"):
        rec.writer.observe_rows(0, np.zeros((2, 3), dtype=np.int64), None)


def test_prepare_decode_warms_up_without_the_observers(tmp_path: Path) -> None:
    """The server attaches its recorder before `prepare_decode`: the warm-up's eager steps (batch sizes with no
    graph) are no served routing and reach no observer (before any step began, the writer would refuse them)."""
    model = _model("model")
    model.enable_cuda_graphs([1, 2])
    seen: list[int] = []
    model.routing_observers.append(lambda layer, ids, weights, ctx: seen.append(layer))
    model.prepare_decode(KvPool.for_model(model, capacity_tokens=128), max_batch=3)  # batch 3 warms up eagerly
    assert seen == [] and len(model.routing_observers) == 1


def test_a_graphed_step_costs_the_heap_a_handful_of_objects(tmp_path: Path) -> None:
    """The recorder keeps every step until the trace is written, in a server whose heap is frozen at start: a
    graphed step's routing is one writer entry (two staged tensors), not ~3 objects for each of its layers
    (h200-headline-b: full collections inside 2,048-token prefills while recording)."""
    import gc

    layers, k = 48, 8
    meta = {"num_hidden_layers": layers, "num_experts": 128, "num_experts_per_tok": k}
    rec = RoutingRecorder(tmp_path / "t.trace", meta, source="model", model="m")
    ids, weights = torch.zeros(layers, 4, k, dtype=torch.int64), torch.full((layers, 4, k), 0.125)
    rec.begin_step([("0", 4)])
    rec.observe_step(range(layers), ids, weights)  # the first step allocates the stage
    gc.collect()
    before = len(gc.get_objects())
    for step in range(1, 101):
        rec.begin_step([("0", 4)])
        rec.observe_step(range(layers), ids + step % 128, weights)
    gc.collect()
    per_step = (len(gc.get_objects()) - before) / 100
    assert per_step < 12, per_step  # a step's layout, its entry, two staged tensors (per layer: ~150)
    rec.close()
    trace = read_trace(tmp_path / "t.trace")
    assert trace.ids.shape == (101 * 4, layers, k) and int(trace.ids[-1, 0, 0]) == 100


def test_a_step_is_observed_whole_or_by_layers_not_both(tmp_path: Path) -> None:
    model = _model("model")
    rec = RoutingRecorder(tmp_path / "t.trace", model.config, source="model", model="tiny")
    rec.begin_step([("0", 2)])
    rec.writer.observe_step_rows([0, 1], np.zeros((2, 2, 4), dtype=np.int64), None)
    with pytest.raises(ValueError, match="already observed"):
        rec.writer.observe_rows(0, np.zeros((2, 4), dtype=np.int64), None)
    with pytest.raises(ValueError, match="already observed"):
        rec.writer.observe_step_rows([0, 1], np.zeros((2, 2, 4), dtype=np.int64), None)
    rec.begin_step([("0", 2)])
    with pytest.raises(ValueError, match=r"want \[2, T, 4\]"):
        rec.writer.observe_step_rows([0, 1], np.zeros((2, 2, 3), dtype=np.int64), None)
