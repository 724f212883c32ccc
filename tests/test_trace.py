"""Routing trace format: writer/reader round trip, compact dtypes, validation, SGLang import, synth."""

from __future__ import annotations

import base64
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from benchsuite.cli import main as cli_main
from paged_experts.routing.trace import (
    TraceMeta,
    TraceWriter,
    import_sglang_routed_experts,
    read_trace,
    save_trace,
    synthesize_trace,
)

META = TraceMeta(num_layers=2, num_experts=16, top_k=2, source="model", model="tiny")


def _write_two_steps(path: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    ids = [torch.stack([torch.randperm(16, generator=gen)[:2] for _ in range(t)]) for t in (3, 3, 2, 2)]
    weights = [torch.softmax(torch.randn(i.shape, generator=gen), dim=-1) for i in ids]
    with TraceWriter(path, META) as w:
        w.begin_step([("a", 2), ("b", 1)])  # prefill of a (2 tokens) + decode of b
        w.observe(0, ids[0], weights[0])
        w.observe(1, ids[1], weights[1])
        w.begin_step([("a", 1), ("b", 1)])
        w.observe(0, ids[2], weights[2])
        w.observe(1, ids[3], weights[3])
    return ids, weights


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    ids, weights = _write_two_steps(path)
    trace = read_trace(path)
    assert trace.meta.num_layers == 2 and trace.meta.top_k == 2 and trace.meta.source == "model"
    assert trace.meta.weights == "recorded" and not trace.meta.synthetic
    assert [[(c.request, c.num_tokens) for c in s] for s in trace.steps] == [[("a", 2), ("b", 1)], [("a", 1), ("b", 1)]]
    assert np.array_equal(trace.step_ids(0, 0), ids[0].numpy())
    assert np.array_equal(trace.step_ids(1, 1), ids[3].numpy())
    assert np.allclose(trace.weights[3:5, 0], weights[2].numpy(), atol=1e-3)  # float16 storage
    assert [c.row_start for c in trace.requests()["a"]] == [0, 3]


def test_compact_storage(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    _write_two_steps(path)
    with zipfile.ZipFile(path) as z:
        assert np.load(io.BytesIO(z.read("ids.npy"))).dtype == np.uint8
        assert np.load(io.BytesIO(z.read("weights.npy"))).dtype == np.float16
        header = json.loads(z.read("header.json"))
    assert header["format"] == "moe-routing-trace" and header["version"] == 1 and header["requests"] == ["a", "b"]


def test_row_count_must_match_layout(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path / "bad.trace", META)
    w.begin_step([("a", 3)])
    w.observe(0, torch.zeros(2, 2, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="2 token rows, layout says 3"):
        w.close()


def test_step_without_observations_is_dropped(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "t.trace", META) as w:
        w.begin_step([("a", 4)])  # its forward raised: no layer observed
        w.begin_step([("a", 1)])
        w.observe(0, torch.tensor([[1, 2]]), None)
        w.observe(1, torch.tensor([[3, 4]]), None)
    trace = read_trace(tmp_path / "t.trace")
    assert len(trace.steps) == 1 and trace.ids.tolist() == [[[1, 2], [3, 4]]]


def test_step_whose_forward_raised_part_way_is_dropped(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "t.trace", META) as w:
        w.begin_step([("a", 2)])
        w.observe(0, torch.tensor([[1, 2], [3, 4]]), None)  # layer 1 never ran: the forward raised
        w.begin_step([("b", 1)])  # the server carries on with the next step
        w.observe(0, torch.tensor([[5, 6]]), None)
        w.observe(1, torch.tensor([[7, 8]]), None)
        assert w.dropped_steps == 1
    trace = read_trace(tmp_path / "t.trace")
    assert [[c.request for c in s] for s in trace.steps] == [["b"]]
    assert trace.ids.tolist() == [[[5, 6], [7, 8]]]


def test_weights_absent_and_config_object(tmp_path: Path) -> None:
    class Cfg:  # the runtime's MoeModelConfig field names
        num_layers, num_experts, top_k = 1, 300, 2

    path = tmp_path / "t.trace"
    with TraceWriter(path, Cfg(), source="synthetic:uniform") as w:
        w.begin_step([("r", 1)])
        w.observe(0, np.array([[299, 3]]), None)
    trace = read_trace(path)
    assert trace.weights is None and trace.meta.weights == "absent" and trace.meta.synthetic
    assert trace.ids.tolist() == [[[299, 3]]]  # E > 256 is stored as int16
    with zipfile.ZipFile(path) as z:
        assert np.load(io.BytesIO(z.read("ids.npy"))).dtype == np.int16


def test_newer_version_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    _write_two_steps(path)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    header = json.loads(members["header.json"])
    header["version"] = 99
    members["header.json"] = json.dumps(header).encode()
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    with pytest.raises(ValueError, match="version 99"):
        read_trace(path)


def _sglang_b64(arr: np.ndarray) -> str:
    return base64.b64encode(arr.astype(np.int32).tobytes()).decode()


def test_import_sglang_native_and_openai() -> None:
    rng = np.random.default_rng(0)
    # prompt 5 tokens, 4 generated: SGLang returns positions [0, 9 - 1) = 8 rows
    a = np.stack([[rng.permutation(16)[:2] for _ in range(3)] for _ in range(8)])  # [8, 3 layers, 2]
    b = np.stack([[rng.permutation(16)[:2] for _ in range(3)] for _ in range(3)])  # [3, 3, 2]
    native = {"text": "x", "meta_info": {"id": "r1", "prompt_tokens": 5, "completion_tokens": 4,
                                         "routed_experts": _sglang_b64(a)}}  # fmt: skip
    openai = {"id": "r2", "usage": {"prompt_tokens": 2}, "sglext": {"routed_experts": _sglang_b64(b)}}
    trace = import_sglang_routed_experts([native, openai], num_experts=16, num_layers=3, top_k=2)
    assert trace.meta.source == "sglang" and trace.weights is None and trace.meta.weights == "absent"
    layouts = [[(c.request, c.num_tokens) for c in s] for s in trace.steps]
    assert layouts == [[("r1", 5)], [("r1", 1)], [("r1", 1)], [("r1", 1)], [("r2", 2)], [("r2", 1)]]
    assert np.array_equal(trace.ids[:8], a) and np.array_equal(trace.ids[8:], b)
    only_moe = import_sglang_routed_experts([native], 16, 3, 2, moe_layer_ids=[1, 2])
    assert only_moe.meta.num_layers == 2 and np.array_equal(only_moe.ids, a[:, 1:])


def test_import_sglang_errors() -> None:
    with pytest.raises(ValueError, match="enable-return-routed-experts"):
        import_sglang_routed_experts([{"meta_info": {}}], 16, 3, 2)
    bad = {"meta_info": {"routed_experts": _sglang_b64(np.arange(7))}}
    with pytest.raises(ValueError, match="multiple"):
        import_sglang_routed_experts([bad], 16, 3, 2)


def test_synthesize_is_labelled_and_seeded(tmp_path: Path) -> None:
    t1 = synthesize_trace("reuse:0.5", 3, 32, 4, requests=2, tokens_per_request=10, prompt_tokens=4, seed=3)
    t2 = synthesize_trace("reuse:0.5", 3, 32, 4, requests=2, tokens_per_request=10, prompt_tokens=4, seed=3)
    assert t1.meta.synthetic and t1.meta.source == "synthetic:reuse:0.5"
    assert np.array_equal(t1.ids, t2.ids) and t1.num_tokens == 28 and len(t1.steps) == 22
    assert np.allclose(t1.weights.sum(axis=2), 1.0, atol=1e-5)
    save_trace(t1, tmp_path / "s.trace")
    back = read_trace(tmp_path / "s.trace")
    assert np.array_equal(back.ids, t1.ids) and back.meta.source == t1.meta.source


def test_cli_synth_show_import(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s.trace"
    assert cli_main(["trace", "synth", "--spec", "zipf:1.0", "--tokens", "20", "--layers", "2", "--experts", "16",
                     "--top-k", "2", "-o", str(out)]) == 0  # fmt: skip
    assert "SYNTHETIC" in capsys.readouterr().out
    assert cli_main(["trace", "show", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["label"] == "SYNTHETIC routing" and summary["decode_tokens"] == 20
    lines = tmp_path / "r.jsonl"
    lines.write_text(
        json.dumps({"meta_info": {"prompt_tokens": 1, "routed_experts": _sglang_b64(np.array([[[1, 2]], [[3, 4]]]))}})
    )
    assert cli_main(["trace", "import-sglang", str(lines), "--layers", "1", "--experts", "8", "--top-k", "2",
                     "-o", str(tmp_path / "g.trace")]) == 0  # fmt: skip
    assert read_trace(tmp_path / "g.trace").ids.tolist() == [[[1, 2]], [[3, 4]]]
    assert cli_main(["trace", "show", str(tmp_path / "missing.trace")]) == 2


def test_cli_ids_only_drops_the_weights_and_keeps_what_the_replays_read(tmp_path: Path, capsys) -> None:
    """`benchsuite trace ids-only`: the same steps, requests and ids (what the simulator and the Belady replay
    read), no weights, said in the meta; a third of the bytes; a trace without weights is copied as it is."""
    recorded, stripped = tmp_path / "r.trace", tmp_path / "s.trace"
    trace = synthesize_trace("qwen3-30b-a3b", 4, 128, 8, requests=3, tokens_per_request=64, prompt_tokens=16, seed=1)
    save_trace(trace, recorded)
    assert cli_main(["trace", "ids-only", str(recorded), "-o", str(stripped)]) == 0
    assert "ids only" in capsys.readouterr().out
    got = read_trace(stripped)
    assert got.weights is None and got.meta.weights == "absent" and "weights dropped" in got.meta.notes
    assert np.array_equal(got.ids, trace.ids) and got.steps == trace.steps and got.meta.source == trace.meta.source
    assert stripped.stat().st_size < 0.5 * recorded.stat().st_size
    again = tmp_path / "t.trace"
    assert cli_main(["trace", "ids-only", str(stripped), "-o", str(again)]) == 0
    assert read_trace(again).meta == got.meta  # nothing more to drop: no second note
    (tmp_path / "bad.trace").write_text("not a zip")
    assert cli_main(["trace", "ids-only", str(tmp_path / "bad.trace"), "-o", str(again)]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    assert cli_main(["trace", "ids-only", str(recorded), "-o", str(tmp_path / "no" / "such" / "dir.trace")]) == 2
    assert "cannot write" in capsys.readouterr().err
