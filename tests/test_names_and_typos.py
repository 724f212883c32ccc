"""`preflight --model` takes what a matrix's `model:` takes (a preset, `synth:...`, a directory) and
well-known models by name; typos in matrix keys, command names and flags get "did you mean"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from benchsuite.cli import main
from benchsuite.config.matrix import MatrixError, load_matrix
from benchsuite.tools.model_names import model_shape


@pytest.mark.parametrize(
    ("name", "layers", "experts", "top_k"),
    [
        ("tiny", 4, 32, 4),
        ("synth:qwen3-30b-a3b-shape?layers=8", 8, 128, 8),
        ("qwen3-30b-a3b", 48, 128, 8),
        ("Qwen/Qwen3-235B-A22B", 94, 128, 8),
        ("Mixtral-8x7B-v0.1", 32, 8, 2),
        ("gpt-oss-120b", 36, 128, 4),
    ],
)
def test_a_model_by_name(name: str, layers: int, experts: int, top_k: int) -> None:
    shape = model_shape(name)
    assert (shape.num_moe_layers, shape.num_experts, shape.top_k) == (layers, experts, top_k)


def test_the_published_qwen3_shape_gives_the_published_sizes() -> None:
    shape = model_shape("Qwen3-30B-A3B")
    assert shape.kv_bytes_per_token(2) == 98_304  # DESIGN.md section 3
    assert shape.expert_bytes_int4_gptq() == pytest.approx(2.43e6, rel=0.01)


def test_preflight_takes_tiny_and_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["preflight", "--model", "tiny", "--k", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["num_experts"], report["top_k"]) == (32, 4)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_experts": 64,
                "num_experts_per_tok": 4,
                "num_hidden_layers": 6,
                "hidden_size": 128,
                "moe_intermediate_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 1000,
            }
        )
    )
    assert main(["preflight", "--model", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_experts"] == 64


def test_an_unknown_model_name_suggests_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["preflight", "--model", "qwen3-30b-a3c"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("benchsuite: error: --model 'qwen3-30b-a3c': no such directory, preset or known model; ")
    assert "did you mean Qwen3-30B-A3B" in err and len(err.splitlines()) == 1


def test_an_unknown_option_names_the_closest_allowed_one(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "t",
                "engines": {
                    "p": {"kind": "builtin", "options": {"model": "tiny", "mode": "paged", "resident_expert": 8}},
                    "l": {"kind": "llamacpp", "options": {"model": "tiny", "n_cpu_mo": 2}},
                },
                "workloads": {"w": {"concurency": [1]}},
            }
        )
    )
    with pytest.raises(MatrixError) as err:
        load_matrix(path)
    text = str(err.value)
    assert "engines.p.options.resident_expert: unknown key; did you mean resident_experts? (allowed: " in text
    assert "engines.l.options.n_cpu_mo: unknown key; did you mean n_cpu_moe? (allowed: " in text
    assert "workloads.w.concurency: unknown key; did you mean concurrency? (allowed: " in text


def test_a_key_another_engine_spells_shorter_names_the_longer_one(tmp_path: Path) -> None:
    """`model:` (the built-in and llama.cpp key) on an SGLang entry means `model_path`, not `mode`."""
    path = tmp_path / "m.yaml"
    body = {"name": "t", "engines": {"sg": {"kind": "sglang", "options": {"model": "/m"}}}, "workloads": {"w": {}}}
    path.write_text(yaml.safe_dump(body))
    with pytest.raises(MatrixError) as err:
        load_matrix(path)
    assert "engines.sg.options.model: unknown key; did you mean model_path? (allowed: " in str(err.value)


def test_an_unknown_flag_or_command_names_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "configs/quickstart.yaml", "--dry-runn", "--qiet"]) == 2
    assert capsys.readouterr().err.strip() == (
        "benchsuite: error: benchsuite run: unrecognized arguments: --dry-runn (did you mean --dry-run?) "
        "--qiet (did you mean --quiet?)"
    )
    assert main(["preflight", "--vram_gb", "16"]) == 2
    assert "--vram_gb (did you mean --vram-gb?) 16" in capsys.readouterr().err
    assert main(["rnu", "x.yaml"]) == 2
    assert capsys.readouterr().err.strip() == (
        "benchsuite: error: unknown command 'rnu'; did you mean run? (benchsuite --help lists them)"
    )
