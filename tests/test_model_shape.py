"""One owner of the model's shape (paged_experts.shape.ModelShape): every reader gets the same
shape and sizes from it, servers record it typed in the manifest, and the report reads a run's
model from that record (an older run's from where it used to be)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from pydantic import ValidationError

from benchsuite.engines.builtin import memory
from benchsuite.engines.llamacpp.fit import GgufFacts
from benchsuite.report.load import RunData
from benchsuite.results.manifest import Manifest, ServerRecord
from benchsuite.tools import preflight
from paged_experts.config import MoeModelConfig
from paged_experts.shape import FP8, ModelShape


def test_the_runtime_config_and_preflight_read_one_shape(tiny_model_dir: Path) -> None:
    shape = ModelShape.from_dir(tiny_model_dir)
    cfg = MoeModelConfig.from_dir(tiny_model_dir)
    assert preflight.load_shape(tiny_model_dir) == shape
    for dtype in ("float32", "bfloat16", FP8):
        assert cfg.expert_bytes(dtype) == shape.expert_bytes(dtype)
        assert cfg.slot_bytes(dtype) == shape.slot_bytes(dtype) == shape.expert_bytes(dtype) * shape.num_moe_layers
    assert cfg.kv_bytes_per_token("bfloat16") == shape.kv_bytes_per_token(2)
    (proj,) = memory.projections(tiny_model_dir, "float32", 100, range(8, 9)).values()
    assert proj.slot_bytes == shape.slot_bytes("float32")
    assert proj.non_expert_bytes == shape.non_expert_weight_bytes(4)


def test_a_config_naming_only_e_and_top_k_has_a_shape_without_sizes() -> None:
    shape = ModelShape.from_hf_config({"text_config": {"n_routed_experts": 64, "moe_topk": 6}})
    assert (shape.num_experts, shape.top_k, shape.num_layers, shape.has_dims) == (64, 6, 0, False)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelShape.from_hf_config({"num_experts": 8})


def test_a_gguf_gives_the_same_shape_with_its_moe_layers_counted_from_its_expert_tensors() -> None:
    tensors = [(f"blk.{i}.ffn_{p}_exps.weight", 10) for i in (1, 2) for p in ("gate", "up", "down")]
    facts = GgufFacts(3, 64, 4, 2, 16, 16, 1000, 32, 4, 48, (("blk.0.ffn_up.weight", 5), *tensors))
    shape = facts.shape("m")
    assert (shape.num_layers, shape.num_moe_layers, shape.num_experts, shape.top_k) == (3, 2, 32, 4)
    assert shape.expert_bytes("bfloat16") == 3 * 64 * 48 * 2 and shape.kv_bytes_per_token(2) == 2 * 3 * 2 * 16 * 2


def _manifest(tmp_path: Path, **server: object) -> RunData:
    manifest = Manifest(run_id="r", created_utc="now", matrix_source="m.yaml", matrix_hash="h", matrix={},
                        servers={"s": ServerRecord.model_validate({"kind": "builtin", **server})})  # fmt: skip
    manifest = Manifest.model_validate_json(manifest.model_dump_json())  # as stored and read back
    return RunData("r", tmp_path, manifest, pd.DataFrame(), pd.DataFrame())


def test_the_report_reads_the_recorded_shape_and_an_old_runs_facts_where_they_were(tmp_path: Path) -> None:
    shape = ModelShape(num_layers=4, num_moe_layers=4, num_experts=32, top_k=4)
    run = _manifest(tmp_path, model=shape, options={"model": "tiny"})
    assert run.manifest.servers["s"].model == shape
    assert (run.facts.model.top_k, run.facts.model.num_experts) == (4, 32)
    old = _manifest(tmp_path, version={"model_facts": {"shape": {"num_experts_per_tok": 8, "num_experts": 128}}})
    assert old.manifest.servers["s"].model is None
    assert (old.facts.model.top_k, old.facts.model.num_experts) == (8, 128)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"num_experts": 16, "num_experts_per_tok": 2}))
    older = _manifest(tmp_path, options={"model": str(tmp_path / "ckpt")})
    assert (older.facts.model.top_k, older.facts.model.num_experts) == (2, 16)
    assert _manifest(tmp_path).facts.model.top_k is None  # absent, never invented


def test_a_recorded_shape_with_an_unknown_field_is_refused() -> None:
    record = ServerRecord(model=ModelShape(4, 4, 32, 4)).model_dump(mode="json")
    record["model"]["experts"] = 32
    with pytest.raises(ValidationError):
        ServerRecord.model_validate(record)
