"""benchmarks/llamacpp_h200.py: parsers and the source trim without binaries; with the CPU
llama.cpp build (`benchsuite install llama-server`), the synthetic GGUF loads in llama-server and
the bench subcommand writes the JSON the report converter reads."""

from __future__ import annotations

import importlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import aiohttp
import pytest

from benchsuite.engines.llamacpp.build import install_dir

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "llamacpp_h200.py"
CPU_BIN = install_dir(cuda=False) / "bin"
sys.path.insert(0, str(ROOT / "benchmarks"))
cells_mod = importlib.import_module("llamacpp_h200_cells")
script = importlib.import_module("llamacpp_h200")

needs_cpu_build = pytest.mark.skipif(
    not all((CPU_BIN / b).is_file() for b in ("llama-batched-bench", "llama-fit-params", "llama-server")),
    reason=f"no CPU llama.cpp build in {CPU_BIN}: run `benchsuite install llama-server`",
)
CELL_KEYS = {
    "n_cpu_moe",
    "label",
    "batch",
    "tok_per_s",
    "gpu_mem_bytes",
    "prompt_tokens",
    "gen_tokens",
    "command",
    "raw",
}


def test_fit_arguments_name_the_host_layers() -> None:
    # What llama-fit-params prints on one GPU: the last layers' experts on the host, the first of
    # them partially (its up tensor stays on the GPU).
    out = '-c 1024 -ngl 49 -ot "blk\\.45\\.ffn_(gate|gate_up|down).*=CPU,blk\\.46\\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU,blk\\.47\\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU"\n'
    fitted = cells_mod.parse_fit_args(out)
    assert fitted.ngl == 49
    assert fitted.host_layers == (45, 46, 47)
    assert fitted.partial_layers == (45,)
    assert fitted.overrides[1] == "blk\\.46\\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU"
    cfg = cells_mod.fit_config(fitted, 16.0, default_ngl=99, use_fit_ngl=True)
    assert cfg.label == "fit 16 GB (N=3, 1 of them partly)" and cfg.n_cpu_moe == 3
    # The H200 run's fit also named block 48 of a 48-layer model (the output layer's index): no tensor.
    phantom = cells_mod.parse_fit_args(out.replace('exps=CPU"', 'exps=CPU,blk\\.48\\.ffn_(up)_(ch|)exps=CPU"'), 48)
    assert phantom.host_layers == (45, 46, 47) and len(phantom.overrides) == 4
    assert cfg.model_args == ("-ngl", "49", "-ot", ",".join(fitted.overrides))
    nothing = cells_mod.parse_fit_args("-c 1024 -ngl 49\n")
    assert nothing.host_layers == () and nothing.overrides == ()


def test_cells_take_the_measured_row_and_sum_cuda_buffers() -> None:
    row = '{{"n_kv_max": 1024, "pl": {pl}, "pp": 16, "tg": 32, "t_tg": {t}, "speed_tg": {s}}}'
    text = "\n".join([
        "0.00.012.340 I load_tensors:        CUDA0 model buffer size = 1000.00 MiB",
        "0.00.012.340 I load_tensors:   CPU_Mapped model buffer size =  500.00 MiB",
        "0.00.012.778 I llama_kv_cache:        CUDA0 KV buffer size =    24.00 MiB",
        "0.00.015.979 I sched_reserve:      CUDA0 compute buffer size =   100.00 MiB",
        row.format(pl=1, t=1.0, s=32.0), row.format(pl=4, t=1.0, s=128.0),
        row.format(pl=1, t=0.5, s=64.0), row.format(pl=4, t=0.8, s=160.0),
    ])  # fmt: skip
    shape = cells_mod.Shape(ctx=1024, prompt_tokens=16, gen_tokens=32, batches=(1, 4), threads=16)
    cfg = cells_mod.n_cpu_moe_config(12, ngl=99)
    cells = cells_mod.cells_from_output(cfg, shape, ["llama-batched-bench"], text, 0)
    # The second (warm) row of each batch size counts.
    assert [c["tok_per_s"] for c in cells] == [64.0, 160.0]
    assert [c["warmup_tok_per_s"] for c in cells] == [32.0, 128.0]
    assert all(c["gpu_mem_bytes"] == 1124 * 2**20 for c in cells)
    assert all(CELL_KEYS <= c.keys() and "error" not in c for c in cells)
    failed = cells_mod.cells_from_output(cfg, shape, ["x"], "CUDA error: out of memory", 1)
    assert all(c["tok_per_s"] is None and "exit status 1" in c["error"] for c in failed)


def test_pack_source_keeps_the_build_tree_only_and_is_byte_stable(tmp_path: Path) -> None:
    top = "llama_cpp_python-0.3.36/"
    files = {
        top + "llama_cpp/__init__.py": b"x",
        top + script.PREFIX[len(top) :] + "CMakeLists.txt": b"cmake",
        script.PREFIX + "ggml/src/ggml-cuda/mmq.cu": b"cuda",
        script.PREFIX + "ggml/src/ggml-vulkan/v.cpp": b"vk",
        script.PREFIX + "models/ggml-vocab.gguf": b"big",
        script.PREFIX + "tools/server/server.cpp": b"srv",
        script.PREFIX + "tools/server/tests/t.py": b"t",
    }
    sdist = tmp_path / "sdist.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    a = script.pack_source(sdist, tmp_path / "a" / "s.tar.gz")
    b = script.pack_source(sdist, tmp_path / "b" / "s.tar.gz")
    assert a["sha256"] == b["sha256"]
    with tarfile.open(a["path"]) as tar:
        names = sorted(tar.getnames())
    assert names == sorted(
        script.PREFIX + n for n in ("CMakeLists.txt", "ggml/src/ggml-cuda/mmq.cu", "tools/server/server.cpp")
    )


def test_failures_are_recorded_and_the_rest_goes_on(tmp_path: Path) -> None:
    """No binaries: the fit and every launch fail with their reason; a spent deadline skips."""
    bench = importlib.import_module("llamacpp_h200_bench")
    common = ["--gguf", str(tmp_path / "none.gguf"), "--bin-dir", str(tmp_path / "nobin"), "--n-cpu-moe", "0,12"]
    assert bench.bench_main([*common, "--out", str(tmp_path / "a")]) == 1
    record = json.loads((tmp_path / "a" / "llamacpp_h200.json").read_text())
    assert record["fit"]["error"] == "llama-fit-params exit status 127"
    assert [c["label"] for c in record["cells"]] == ["N=0", "N=0", "N=12", "N=12"]
    assert all(c["tok_per_s"] is None and "cannot start" in c["error"] for c in record["cells"])
    assert bench.bench_main([*common, "--out", str(tmp_path / "b"), "--deadline-s", "1"]) == 1
    record = json.loads((tmp_path / "b" / "llamacpp_h200.json").read_text())
    assert all(c["error"].startswith("skipped: ") for c in record["cells"])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny2.gguf"
    subprocess.run(
        [sys.executable, str(SCRIPT), "gguf", "--preset", "tiny", "--layers", "2", "--out-file", str(path), "--workers", "2"],
        check=True, timeout=120,
    )  # fmt: skip
    return path


@pytest.mark.llamacpp
@needs_cpu_build
def test_bench_writes_the_schema_on_the_cpu_build(tiny_gguf: Path, tmp_path: Path) -> None:
    facts = json.loads(tiny_gguf.with_name(tiny_gguf.name + ".json").read_text())
    assert facts["expert_type"] == "Q8_0" and facts["layers"] == 2 and facts["bytes"] == tiny_gguf.stat().st_size
    out = tmp_path / "out"
    argv = [sys.executable, str(SCRIPT), "bench", "--cpu", "--gguf", str(tiny_gguf), "--out", str(out),
            "--n-cpu-moe", "0,2", "--gen-tokens", "8", "--threads", "1", "--deadline-s", "60"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((out / "llamacpp_h200.json").read_text())
    assert record["schema_version"] == 1 and record["benchmark"] == "llamacpp_h200"
    assert {"git_commit", "git_dirty", "gpu", "cpu_count", "llama_cpp_python_version", "llama_version_text",
            "build_flags", "build_s"} <= record["provenance"].keys()  # fmt: skip
    assert record["provenance"]["build_flags"]["cuda"] is False
    assert {"path", "bytes", "layers", "expert_type", "expert_bytes", "write_s", "seed"} <= record["gguf"].keys()
    assert {"budget_gb", "n_cpu_moe", "command", "output_tail"} <= record["fit"].keys()
    cells = record["cells"]
    assert [(c["label"], c["batch"]) for c in cells] == [
        ("fit 16 GB (N=0)", 1), ("fit 16 GB (N=0)", 4), ("N=0", 1), ("N=0", 4), ("N=2", 1), ("N=2", 4),
    ]  # fmt: skip
    for c in cells:
        assert CELL_KEYS <= c.keys() and "error" not in c, c
        assert c["tok_per_s"] > 0 and c["gen_tokens"] == 8 and c["gpu_mem_bytes"] is None
    assert "--n-cpu-moe" in cells[-1]["command"] and "2" in cells[-1]["command"]
    assert (out / "llamacpp_h200.txt").read_text().count("tok/s") == len(cells)


@pytest.mark.llamacpp
@needs_cpu_build
async def test_llama_server_loads_the_synthetic_gguf_and_generates(tiny_gguf: Path, tmp_path: Path) -> None:
    from benchsuite.process import EngineProcess, free_port

    port = free_port()
    argv = [
        str(CPU_BIN / "llama-server"),
        "-m",
        str(tiny_gguf),
        "--port",
        str(port),
        "-c",
        "256",
        "-t",
        "1",
        "-ngl",
        "0",
    ]
    body = {"prompt": "The capital of France is", "n_predict": 4, "temperature": 0}
    async with (
        EngineProcess(argv, None, tmp_path / "server.log", f"http://127.0.0.1:{port}/health", 60),
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}/completion", json=body) as resp,
    ):
        assert resp.status == 200
        done = await resp.json()
    assert done["tokens_predicted"] == 4 and done["tokens_evaluated"] > 1
