"""The source-weights fingerprint (paged_experts.weights.weights_id), what the adapters record of it, and
the report's refusal to call two servers "the same model" without it (report/caveats.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchsuite.engines.base import Fairness, ServerSpec
from benchsuite.engines.builtin.adapter import BuiltinAdapter, BuiltinOptions
from benchsuite.engines.llamacpp.adapter import LlamaCppAdapter, LlamaCppOptions
from benchsuite.engines.llamacpp.gguf_synth import read_facts, write_with_facts
from benchsuite.report.caveats import same_model_caveat, source_id
from benchsuite.results.manifest import ServerRecord
from paged_experts.weights import weights_id
from paged_experts.weights.synth import write_checkpoint
from paged_experts.weights.synth_memory import write_weightless


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wid")
    facts = write_with_facts(root / "t.gguf", "tiny", 2, 1, workers=1)
    return {
        "weightless": write_weightless("tiny", root / "w", layers=2, seed=1),
        "checkpoint": write_checkpoint("tiny", root / "c", layers=2, seed=1),
        "other_seed": write_weightless("tiny", root / "w2", layers=2, seed=2),
        "gguf": Path(facts["path"]),
    }


def test_one_recipe_for_the_weightless_dir_the_checkpoint_the_synth_path_and_the_gguf(made: dict[str, Path]) -> None:
    a = weights_id.source_weights(made["weightless"])
    assert a["kind"] == "recipe" and a["id"].startswith("gen-")
    assert weights_id.source_weights(made["checkpoint"])["id"] == a["id"]
    assert weights_id.source_weights("synth:tiny?layers=2&seed=1")["id"] == a["id"]
    facts = read_facts(made["gguf"])
    assert facts is not None and facts["source_weights"]["id"] == a["id"]
    assert weights_id.source_weights(made["other_seed"])["id"] != a["id"]
    assert weights_id.source_weights("synth:tiny?layers=3&seed=1")["id"] != a["id"]


def test_the_fp8_preset_of_a_shape_has_its_dense_presets_source() -> None:
    dense = weights_id.source_weights("synth:qwen3-30b-a3b-shape?layers=2")
    assert weights_id.source_weights("synth:qwen3-30b-a3b-fp8-shape?layers=2")["id"] == dense["id"]


def test_content_hash_of_a_checkpoint_sees_a_changed_sampled_byte(made: dict[str, Path], tmp_path: Path) -> None:
    copy = Path(shutil.copytree(made["checkpoint"], tmp_path / "copy"))
    (copy / "source_weights.json").unlink()  # a checkpoint not made here: hashed
    before = weights_id.source_weights(copy)
    assert before["kind"] == "content" and "sampled" in before["covers"]
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the last sample ends at the file's end
    weights.write_bytes(bytes(data))
    assert weights_id.source_weights(copy)["id"] != before["id"]


def test_adapters_record_source_and_format(made: dict[str, Path]) -> None:
    b = BuiltinAdapter().version(
        ServerSpec(
            "b", "builtin", BuiltinOptions(model=str(made["weightless"]), mode="resident"), Fairness(10240), 1, "b"
        )
    )
    assert b["weights"]["format"] == "float32, experts float32"
    spec = ServerSpec("l", "llamacpp", LlamaCppOptions(model=str(made["gguf"])), Fairness(10240), 1, "l")
    llama = LlamaCppAdapter()._weights(spec)
    assert llama["source"]["id"] == b["weights"]["source"]["id"]
    assert llama["format"] == "GGUF experts Q8_0, attention Q8_0, embeddings BF16, output BF16"


def test_a_gguf_without_facts_has_an_unknown_source(made: dict[str, Path], tmp_path: Path) -> None:
    bare = tmp_path / "bare.gguf"
    shutil.copy(made["gguf"], bare)
    w = LlamaCppAdapter()._weights(
        ServerSpec("l", "llamacpp", LlamaCppOptions(model=str(bare)), Fairness(10240), 1, "l")
    )
    assert w["source"]["id"] is None and "no facts file" in w["source"]["covers"]


def _record(engine: str, source: str | None) -> ServerRecord:
    version = {"weights": {"source": {"id": source}, "format": "x"}} if source != "absent" else {}
    return ServerRecord(engine=engine, kind="builtin", version=version)


def test_same_model_caveat_names_the_servers() -> None:
    assert same_model_caveat([("s1", _record("paged", "gen-1")), ("s2", _record("llamacpp", "gen-1"))]) is None
    assert same_model_caveat([("s1", _record("paged", "gen-1"))]) is None  # nothing compared
    differ = same_model_caveat([("s1", _record("paged", "gen-1")), ("s2", _record("llamacpp", "gen-2"))])
    assert differ is not None and "they differ" in differ and "paged (gen-1)" in differ and "llamacpp (gen-2)" in differ
    unknown = same_model_caveat([("s1", _record("paged", "gen-1")), ("s2", _record("llamacpp", "absent"))])
    assert unknown is not None and "unknown" in unknown and "llamacpp (unknown)" in unknown
    assert source_id(ServerRecord()) is None


def test_an_export_records_its_checkpoints_source_and_tokenizer(made: dict[str, Path], tmp_path: Path) -> None:
    from benchsuite.engines.llamacpp.gguf_export import export_gguf

    out = export_gguf(made["checkpoint"], tmp_path / "x.gguf", "f32").path
    facts = read_facts(out)
    assert facts is not None and facts["made_by"] == "benchsuite gguf export" and facts["random_weights"]
    assert facts["source_weights"]["id"] == weights_id.source_weights(made["weightless"])["id"]
    spec = ServerSpec("l", "llamacpp", LlamaCppOptions(model=str(out)), Fairness(10240), 1, "l")
    assert LlamaCppAdapter().tokenizer_dir(spec) == made["checkpoint"].resolve()  # exact-length prompts work
    assert LlamaCppAdapter()._weights(spec)["format"] == "GGUF experts F32, attention F32, embeddings F32, output F32"


def test_the_first_screen_caveats_carry_it() -> None:
    import pandas as pd

    from benchsuite.report.caveats import setup_caveats

    cells = pd.DataFrame(
        {"server_id": ["s1", "s2"], "routing": ["model", "model"], "cell_id": ["c1", "c2"], "extras": [{}, {}]}
    )
    servers = {"s1": _record("paged", "gen-1"), "s2": _record("llamacpp", "gen-2")}
    assert any(c.startswith("Not shown to be the same model") for c in setup_caveats(cells, servers, has_gpu=True))
    servers["s2"] = _record("llamacpp", "gen-1")
    assert not any("same model" in c for c in setup_caveats(cells, servers, has_gpu=True))


def test_a_recipe_id_is_pinned_across_releases() -> None:
    """Ids are recorded in cached models, GGUF facts and every run's fingerprint: one that changes
    without the weights changing makes the report call two runs of one model different models and
    refuses a resume. The recipe's generator label is an identity, not the module's import path."""
    from paged_experts.weights.weights_id import source_weights

    assert source_weights("synth:tiny?layers=2")["id"] == "gen-b546f38f62b823bb"
