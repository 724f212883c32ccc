"""configs/pr42557/*.yaml load, follow the published rules and setups, and dry-run to exact commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchsuite.config.matrix import MatrixError, load_matrix
from benchsuite.config.plan import build_plan, format_plan
from benchsuite.tools.reference import load_reference

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pr42557"
ENV = {
    "QWEN3_30B_A3B_GPTQ_INT4": "/models/qwen-int4",
    "QWEN3_30B_A3B_FP8": "/models/qwen-fp8",
    "QWEN3_30B_A3B_IQ4_XS_GGUF": "/models/qwen-iq4_xs.gguf",
    "QWEN3_30B_A3B_Q8_0_GGUF": "/models/qwen-q8_0.gguf",
    "SHAREGPT_PATH": "/data/sharegpt.json",
}
# file -> (machine, quant, Ks, GGUF env var)
SETUPS = {
    "desktop16gb_int4_k92.yaml": ("desktop_16gb", "gptq_int4", [92], "QWEN3_30B_A3B_IQ4_XS_GGUF"),
    "desktop16gb_fp8_k40_k24.yaml": ("desktop_16gb", "fp8_block", [40, 24], "QWEN3_30B_A3B_Q8_0_GGUF"),
    "laptop8gb_int4_k26.yaml": ("laptop_8gb", "gptq_int4", [26], "QWEN3_30B_A3B_IQ4_XS_GGUF"),
}


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    sharegpt = tmp_path / "sharegpt.json"  # the matrix checks that the workload file exists
    sharegpt.write_text("[]")
    monkeypatch.setenv("SHAREGPT_PATH", str(sharegpt))
    fp8_dir = tmp_path / "models" / "qwen-fp8"  # the builtin rows check that the checkpoint has a config.json
    fp8_dir.mkdir(parents=True)
    from paged_experts.weights.synth import PRESETS, hf_config_for

    config = hf_config_for(PRESETS["qwen3-30b-a3b-fp8-shape"], 151936, 151643, 151645)
    (fp8_dir / "config.json").write_text(__import__("json").dumps(config))
    monkeypatch.setenv("QWEN3_30B_A3B_FP8", str(fp8_dir))


def test_one_config_per_published_setup() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(SETUPS)
    ref = load_reference("pr42557")
    published = {(r.machine, r.quant, r.resident_experts) for r in ref.decode}
    for machine, quant, ks, _ in SETUPS.values():
        assert {(machine, quant, k) for k in ks} <= published


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_config_follows_the_published_rules(env: None, name: str) -> None:
    machine, quant, ks, gguf_var = SETUPS[name]
    ref = load_reference("pr42557")
    m = load_matrix(CONFIGS / name).matrix
    assert m.reference is not None and (m.reference.name, m.reference.machine, m.reference.quant) == (
        "pr42557",
        machine,
        quant,
    )
    assert m.repeats >= ref.rules.min_repeats == 2
    assert m.fairness.kv_capacity_tokens == ref.rules.kv_capacity_tokens == 10240
    assert m.fairness.prefix_caching is ref.rules.prefix_caching is False
    (workload,) = m.workloads.values()
    assert workload.dataset == "sharegpt" and workload.output_tokens == ref.rules.output_tokens == 256
    assert tuple(workload.concurrency) == ref.rules.concurrency == (1, 4) and workload.prompt_classes == [
        "short",
        "2048",
    ]
    fp8 = quant == "fp8_block"  # the FP8 setup also runs without SGLang: built-in engine rows
    assert {e.kind for e in m.engines.values()} == (
        {"sglang", "llamacpp", "builtin"} if fp8 else {"sglang", "llamacpp"}
    )
    if fp8:
        builtin = {name: e.options for name, e in m.engines.items() if e.kind == "builtin"}
        assert builtin["builtin_paged"]["resident_experts"] == ks and builtin["builtin_offload"]["mode"] == "offload"
        assert all(
            o["model"] == m.engines["sglang_paged"].options["model_path"] and o["device"] == "cuda"
            for o in builtin.values()
        )
    llama = m.engines["llamacpp_best"].options
    assert llama["n_cpu_moe"] == "search" and llama["model"] == ENV[gguf_var]  # IQ4_XS for int4, Q8_0 for FP8
    vram = next(mach.vram_gb for mach in ref.machines if mach.key == machine)
    assert llama["vram_budget_gb"] == vram
    paged = m.engines["sglang_paged"].options
    assert (
        paged["resident_experts"] if isinstance(paged["resident_experts"], list) else [paged["resident_experts"]]
    ) == ks


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_dry_run_prints_exact_commands(env: None, name: str) -> None:
    _, _, ks, _ = SETUPS[name]
    text = format_plan(build_plan(load_matrix(CONFIGS / name)))
    for k in ks:
        assert f"--enable-paged-experts --paged-experts-num-resident {k} --mem-fraction-static 0.88" in text
    assert text.count("--disable-radix-cache --max-total-tokens 10240 --enable-metrics") == len(ks) + 1
    assert "--cpu-offload-gb" in text and "--max-running-requests 4" in text
    assert "search llamacpp_best: n_cpu_moe is searched" in text
    builtin = len(ks) + 1 if name.startswith("desktop16gb_fp8") else 0  # builtin paged per K, builtin offload
    assert text.count("  cell ") == (len(ks) + 1 + builtin) * 2 * 2 * 2  # servers x classes x concurrencies x repeats
    if builtin:
        assert (
            all(f"--paged-experts-num-resident {k} --dtype bfloat16" in text for k in ks)
            and "--offload-layers 32" in text
        )


def test_unset_model_variable_names_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(MatrixError, match="QWEN3_30B_A3B_GPTQ_INT4 is not set"):
        load_matrix(CONFIGS / "laptop8gb_int4_k26.yaml")


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_cli_dry_run_works_with_or_without_the_variables_and_a_run_is_one_line_per_unset_one(
    env: None, name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchsuite.cli import main

    assert main(["run", str(CONFIGS / name), "--dry-run"]) == 0
    assert "/models/" in capsys.readouterr().out
    monkeypatch.delenv("SHAREGPT_PATH")
    assert main(["run", str(CONFIGS / name), "--dry-run"]) == 0  # the placeholder is listed, not refused
    assert "missing: workloads.sharegpt.path: environment variable SHAREGPT_PATH is not set" in capsys.readouterr().out
    assert main(["run", str(CONFIGS / name), "--quiet"]) == 2  # a run refuses it at load, in one line
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "workloads.sharegpt.path: environment variable SHAREGPT_PATH is not set (set it to your ShareGPT JSON file)"
    )
    assert len(err.splitlines()) == 1 and "Traceback" not in err
