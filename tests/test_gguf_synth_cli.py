"""`benchsuite gguf synth`: the synthetic GGUF with its facts and tokenizer beside it; the llamacpp
adapter records the facts and cuts exact-length prompts with that tokenizer; with the CPU llama.cpp
build, llama-server loads the file and generates."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from benchsuite.cli import main as cli_main
from benchsuite.engines.base import Fairness, ServerSpec
from benchsuite.engines.llamacpp.adapter import LlamaCppAdapter, LlamaCppOptions
from benchsuite.engines.llamacpp.build import install_dir
from benchsuite.engines.llamacpp.gguf_synth import read_facts, write_synthetic_gguf
from paged_experts.weights.synth import PRESETS

CPU_SERVER = install_dir(cuda=False) / "bin" / "llama-server"


@pytest.fixture(scope="module")
def synth_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "tiny2.gguf"
    assert (
        cli_main(
            ["gguf", "synth", "--preset", "tiny", "--layers", "2", "--seed", "3", "--out", str(out), "--workers", "1"]
        )
        == 0
    )
    return out


def spec(model: Path) -> ServerSpec:
    return ServerSpec("ll", "llamacpp", LlamaCppOptions(model=str(model)), Fairness(256), 1, "sid")


def test_facts_beside_the_file_say_how_it_was_made(synth_gguf: Path, tmp_path: Path) -> None:
    facts = read_facts(synth_gguf)
    assert facts is not None
    p = PRESETS["tiny"]
    assert (facts["preset"], facts["layers"], facts["seed"], facts["expert_type"]) == ("tiny", 2, 3, "Q8_0")
    assert facts["bytes"] == synth_gguf.stat().st_size and facts["path"] == str(synth_gguf.resolve())
    assert facts["shape"]["num_experts"] == p.num_experts and facts["shape"]["num_hidden_layers"] == 2
    assert facts["expert_bytes"] == 3 * p.hidden_size * p.moe_intermediate_size // 32 * 34
    same = write_synthetic_gguf(tmp_path / "same.gguf", preset="tiny", layers=2, seed=3, workers=1)
    assert same.path.read_bytes() == synth_gguf.read_bytes()  # the command adds files beside, changes no byte
    assert read_facts(same.path) is None  # no facts file: another GGUF records nothing


def test_exact_length_prompts_use_the_tokenizer_beside_the_file(synth_gguf: Path) -> None:
    hf_dir = LlamaCppAdapter().tokenizer_dir(spec(synth_gguf))
    assert hf_dir == synth_gguf.with_name(synth_gguf.name + ".hf").resolve() and (hf_dir / "tokenizer.json").is_file()


def test_bad_preset_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["gguf", "synth", "--preset", "nope", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "--preset 'nope': not a preset" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.llamacpp
@pytest.mark.skipif(not CPU_SERVER.is_file(), reason="no CPU llama.cpp build: run `benchsuite install llama-server`")
async def test_llama_server_loads_the_synthetic_gguf_and_generates(synth_gguf: Path, tmp_path: Path) -> None:
    from benchsuite.run.process import EngineProcess, free_port

    assert LlamaCppAdapter().version(spec(synth_gguf))["model_facts"]["seed"] == 3  # what the manifest records
    port = free_port()
    argv = [str(CPU_SERVER), "-m", str(synth_gguf), "--port", str(port), "-c", "256", "-t", "1", "-ngl", "0"]
    body = {"prompt": "The capital of France is", "n_predict": 4, "temperature": 0}
    async with (
        EngineProcess(argv, None, tmp_path / "server.log", f"http://127.0.0.1:{port}/health", 60),
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}/completion", json=body) as resp,
    ):
        assert resp.status == 200
        done = await resp.json()
    assert done["tokens_predicted"] == 4 and done["tokens_evaluated"] > 1
    print(json.dumps(read_facts(synth_gguf), indent=1))
