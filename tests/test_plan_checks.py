"""What a matrix needs from the machine, checked at plan time (benchsuite.config.checklist and the
adapters' `environment` hooks): a missing llama-server and `device: cuda` without CUDA stop a run in
one line naming the fix, with exit status 2, before the results directory exists; a dry run lists
them; a dry run of the published reproduction works with nothing set and says what is missing, how
long the run takes and what it will be compared with."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchsuite.cli import main
from benchsuite.config import checklist
from benchsuite.config.matrix import load_matrix
from benchsuite.config.plan import build_plan
from benchsuite.tools import cuda_device

PR42557 = Path(__file__).resolve().parent.parent / "configs" / "pr42557"
VARIABLES = (
    "QWEN3_30B_A3B_GPTQ_INT4",
    "QWEN3_30B_A3B_FP8",
    "QWEN3_30B_A3B_IQ4_XS_GGUF",
    "QWEN3_30B_A3B_Q8_0_GGUF",
    "SHAREGPT_PATH",
)


@pytest.fixture(autouse=True)
def fresh_cuda_answer() -> None:
    cuda_device.cuda_unavailable.cache_clear()
    yield
    cuda_device.cuda_unavailable.cache_clear()


@pytest.fixture
def no_llama_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty build cache (BENCHSUITE_CACHE_DIR) and a PATH without llama-server."""
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("BENCHSUITE_CACHE_DIR", str(cache))
    monkeypatch.setenv("PATH", str(empty_bin))
    return cache


def write_matrix(tmp_path: Path, engines: dict) -> Path:
    body = {
        "name": "checks",
        "output_root": str(tmp_path / "results"),
        "engines": engines,
        "workloads": {"w": {"num_requests": 2, "concurrency": [1]}},
    }
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


LLAMA_AND_BUILTIN = {
    "llama": {"kind": "llamacpp", "options": {"model": "tiny"}},
    "best": {"kind": "llamacpp", "options": {"model": "tiny", "n_cpu_moe": "search", "vram_budget_gb": 1}},
    "resident": {"kind": "builtin", "options": {"model": "tiny", "mode": "resident"}},
}


def test_a_missing_llama_server_stops_the_run_in_one_line_before_anything_is_written(
    tmp_path: Path, no_llama_server: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_matrix(tmp_path, LLAMA_AND_BUILTIN)
    assert main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0] == (
        f"benchsuite: error: llama-server: not on PATH nor in {no_llama_server / 'llama.cpp'} (engines llama, best); "
        "run `benchsuite install llama-server` (add --cuda for a GPU build)"
    )
    # refused although the built-in engine could run: a partial run would look complete
    assert lines[1] == "the other engines can run alone: --only resident"
    assert not (tmp_path / "results").exists()


def test_a_dry_run_lists_the_missing_llama_server_and_what_is_present(
    tmp_path: Path, no_llama_server: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_matrix(tmp_path, LLAMA_AND_BUILTIN)
    assert main(["run", str(path), "--dry-run"]) == 0  # a plan may be meant for another machine
    out = capsys.readouterr().out
    assert "checklist (a run stops at every line marked missing):" in out
    assert "  missing: llama-server: not on PATH nor in" in out and "run `benchsuite install llama-server`" in out
    assert "size: 3 cells, 9 requests (warmups included), 2,304 output tokens" in out
    assert not (tmp_path / "results").exists()


def test_an_explicit_binary_that_does_not_exist_names_the_option(tmp_path: Path, no_llama_server: Path) -> None:
    path = write_matrix(tmp_path, {"llama": {"kind": "llamacpp", "options": {"model": "tiny", "binary": "/no/ls"}}})
    (line,) = checklist.environment(build_plan(load_matrix(path)))
    assert line.check.missing
    assert line.text() == (
        "missing: llama-server: /no/ls does not exist (engines.llama.options.binary) (engines llama); "
        "point engines.llama.options.binary at a llama-server, or remove it to use the build cache"
    )


def test_a_present_llama_server_is_a_checklist_line_with_its_build(tmp_path: Path, monkeypatch) -> None:
    from benchsuite.engines.llamacpp.adapter import find_binary

    found = find_binary()
    if found is None:
        pytest.skip("no llama-server built here (benchsuite install llama-server)")
    path = write_matrix(tmp_path, {"llama": {"kind": "llamacpp", "options": {"model": "tiny"}}})
    (line,) = checklist.environment(build_plan(load_matrix(path)))
    assert not line.check.missing and line.text().startswith(f"ok: llama-server: {found} (")
    assert "build" in line.text() or "GPU device" in line.text()


CUDA_BUILTIN = {"gpu": {"kind": "builtin", "options": {"model": "tiny", "mode": "resident", "device": "cuda"}}}


def test_device_cuda_without_cuda_stops_the_run_naming_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(cuda_device.OVERRIDE_ENV, "absent")
    path = write_matrix(tmp_path, CUDA_BUILTIN)
    assert main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"benchsuite: error: a CUDA device: no CUDA device ({cuda_device.OVERRIDE_ENV}=absent) (engines gpu); "
        "set `device: cpu` in their options, or run on a machine with a CUDA GPU"
    )
    assert not (tmp_path / "results").exists()
    monkeypatch.setenv(cuda_device.OVERRIDE_ENV, "present")
    cuda_device.cuda_unavailable.cache_clear()
    (line,) = checklist.environment(build_plan(load_matrix(path)))
    assert not line.check.missing


def test_this_machines_torch_answers_the_cuda_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The real check, without the override: on a CPU box (CI) `device: cuda` is the no-CUDA case."""
    import torch

    monkeypatch.delenv(cuda_device.OVERRIDE_ENV, raising=False)
    why = cuda_device.cuda_unavailable()
    assert (why is None) == torch.cuda.is_available()
    if why is not None:
        assert why.startswith(f"torch {torch.__version__}")
        (line,) = checklist.environment(build_plan(load_matrix(write_matrix(tmp_path, CUDA_BUILTIN))))
        assert line.check.missing and line.check.found == why


def test_the_published_reproduction_dry_runs_with_nothing_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(cuda_device.OVERRIDE_ENV, "absent")
    assert main(["run", str(PR42557 / "desktop16gb_fp8_k40_k24.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--model-path '${QWEN3_30B_A3B_FP8}'" in out  # placeholders in the exact commands
    assert "is the placeholders'; the real run's follows from the variables' values" in out
    for line in (
        "  missing: engines.sglang_paged.options.model_path: environment variable QWEN3_30B_A3B_FP8 is not set",
        "  missing: engines.llamacpp_best.options.model: environment variable QWEN3_30B_A3B_Q8_0_GGUF is not set",
        "  missing: workloads.sharegpt.path: environment variable SHAREGPT_PATH is not set",
        "  missing: a CUDA device: no CUDA device",
        "  QWEN3_30B_A3B_FP8: unset; HF checkpoint directory of Qwen/Qwen3-30B-A3B-FP8",
        "  SHAREGPT_PATH: unset; ShareGPT_V3_unfiltered_cleaned_split.json",
        "size: 56 cells, 1,064 requests (warmups included), 272,384 output tokens; about 8.6 h at the published "
        "decode rates (tok/s: paged 87.7 (31 at 4 requests), llama.cpp best 45.2 (55 at 4 requests), offload 2.9)",
        "published figures (pr42557, Qwen3-30B-A3B) the report sets beside yours:",
        "  desktop_16gb fp8_block (decode tok/s per stream, c=1): paged K=40 87.7, llama.cpp best 45.2, offload 2.9",
        "  desktop_16gb fp8_block TTFT p50 paged: 284 ms short, 443 ms at 2,048",
    ):
        assert line in out, line
    assert "SGLang: " in out and "llama-server: " in out  # installed or not, each says which
    assert "no such model" not in out  # an unset variable is listed once, as unset


def test_inputs_do_not_change_the_run_id(tmp_path: Path) -> None:
    path = write_matrix(tmp_path, CUDA_BUILTIN)
    before = build_plan(load_matrix(path)).run_id
    body = yaml.safe_load(path.read_text())
    body["inputs"] = {"MY_MODEL": "where to get it"}
    path.write_text(yaml.safe_dump(body))
    assert build_plan(load_matrix(path)).run_id == before


def test_sglang_needs_its_package_and_a_cuda_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cuda_device.OVERRIDE_ENV, "absent")
    here = {"s": {"kind": "sglang", "options": {"model_path": "/m", "mode": "unpaged"}}}
    cuda, sglang = checklist.environment(build_plan(load_matrix(write_matrix(tmp_path, here))))  # missing first
    assert cuda.check.missing and cuda.check.subject == "a CUDA device" and "run SGLang on a machine" in cuda.text()
    assert sglang.check.subject == "SGLang"  # installed here or not, the line says which
    other = {"s": {"kind": "sglang", "options": {"model_path": "/m", "mode": "unpaged", "python": "/no/python"}}}
    (line,) = checklist.environment(build_plan(load_matrix(write_matrix(tmp_path, other))))
    # another interpreter's torch decides about CUDA at launch; this one only checks that it exists
    assert line.check.missing and line.check.found == "interpreter /no/python does not exist (nor on PATH)"
    # a bare name is looked up on PATH, as the launch looks it up
    on_path = {"s": {"kind": "sglang", "options": {"model_path": "/m", "mode": "unpaged", "python": "python3"}}}
    (line,) = checklist.environment(build_plan(load_matrix(write_matrix(tmp_path, on_path))))
    assert not line.check.missing and line.check.found == "interpreter python3"


def test_the_cuda_line_names_the_device_by_nvml_never_by_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.get_device_name initializes CUDA in the orchestrating process; the engines' device
    memory must not share the GPU with such a context. The name comes from NVML."""
    import torch

    from benchsuite.tools import cuda_device, device_memory

    def no_torch_cuda(*args: object) -> str:
        raise AssertionError("CUDA initialized in the orchestrator")

    monkeypatch.setattr(torch.cuda, "get_device_name", no_torch_cuda)
    monkeypatch.delenv(cuda_device.OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(device_memory, "gpu_names", lambda: ["NVIDIA H200", "NVIDIA H200"])
    assert cuda_device.cuda_description() == "NVIDIA H200 (2 on this machine)"
    monkeypatch.setattr(device_memory, "gpu_names", lambda: None)
    assert cuda_device.cuda_description() == "a CUDA device (its name unread: NVML did not answer)"


def test_gpu_names_without_nvml_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchsuite.tools import device_memory

    def absent(*args: object) -> None:
        raise device_memory.NvmlError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(device_memory, "NvmlReader", absent)
    assert device_memory.gpu_names() is None
