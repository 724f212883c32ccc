"""`python -m paged_experts.server` as a real process: flags, readiness, synthetic routing labels,
routing trace recording, clean shutdown on SIGTERM, and refusal of inconsistent flags."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from benchsuite.tools.scrape import parse_prometheus
from paged_experts.routing.trace import read_trace
from paged_experts.server.launch import parse_args
from paged_experts.weights.synth import ensure_tiny

STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def wait_ready(proc: subprocess.Popen[str], base: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        try:
            if get(f"{base}/health")[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.2)
    raise AssertionError("server never became ready")


def test_parse_args_mirrors_sglang_and_llamacpp_names() -> None:
    cfg = parse_args(["--model", "/m", "--paged-experts-num-resident", "8", "--max-total-tokens", "10240",
                      "--max-running-requests", "4", "--served-model-name", "x"])  # fmt: skip
    assert (cfg.mode, cfg.resident_experts, cfg.max_total_tokens, cfg.max_running_requests) == ("paged", 8, 10240, 4)
    assert cfg.host == "127.0.0.1" and cfg.model_name == "x"
    assert parse_args(["--model-path", "/m", "--resident-experts", "4", "--mode", "paged"]).resident_experts == 4
    assert parse_args(["--model", "/m", "--n-cpu-moe", "2"]).mode == "cpu-experts"
    assert parse_args(["--model", "/m", "--mode", "offload"]).offload_layers is None  # all layers
    cfg = parse_args(["--model", "/m", "--resident-experts", "8", "--prefill-residency", "lru"])
    assert cfg.prefill_residency == "lru"


def test_cuda_graphs_and_expert_kernel_flags(tmp_path: Path) -> None:
    from paged_experts.server.launch import load_serving
    from paged_experts.server.metrics import ServerMetrics
    from paged_experts.server.options import ServeOptions

    assert parse_args(["--model", "/m", "--expert-kernel", "loop"]).expert_kernel == "loop"
    assert parse_args(["--model", "/m"]).cuda_graph_max_bs == 0  # off unless asked for
    # CUDA graphs exist only for resident or paged models on CUDA: the command line is refused at
    # parse time (test_inconsistent_flags_exit_2_naming_the_flag), options built in code at load.
    model_dir = str(ensure_tiny(tmp_path / "cache"))
    with pytest.raises(ValueError, match="--cuda-graph-max-bs"):
        load_serving(ServeOptions(model_path=model_dir, cuda_graph_max_bs=2), ServerMetrics())


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--mode", "paged"], "--paged-experts-num-resident"),
        (["--mode", "resident", "--n-cpu-moe", "2"], "--n-cpu-moe"),
        (["--max-total-tokens", "0"], "--max-total-tokens"),
        (["--routing-source", "no-such-routing"], "--routing-source"),
        (["--cuda-graph-max-bs", "-1"], "--cuda-graph-max-bs"),
        (["--cuda-graph-max-bs", "4"], "--cuda-graph-max-bs 4 needs --device cuda"),
        (["--expert-kernel", "magic"], "--expert-kernel"),
        (["--enable-torch-compile"], "--enable-torch-compile"),
        (["--kernel-backend", "triton"], "--kernel-backend"),  # Triton kernels need --device cuda
        (["--kernel-backend", "magic"], "--kernel-backend"),
        (["--prefetch-next-layer"], "--prefetch-next-layer"),  # only inside captured steps
        # paged on the CPU plans on the host: no device residency to prefetch into
        (["--resident-experts", "8", "--cuda-graph-max-bs", "1", "--prefetch-next-layer"], "--prefetch-next-layer"),
        (
            [
                "--mode",
                "paged",
                "--device",
                "cuda",
                "--resident-experts",
                "8",
                "--cuda-graph-max-bs",
                "4",
                "--routing-source",
                "qwen3-30b-a3b",
                "--prefetch-next-layer",
            ],
            "--prefetch-next-layer predicts the next layer's experts with the model's own",
        ),
        (["--prefill-residency", "recent"], "--prefill-residency 'recent' applies to mode paged, not resident"),
        (["--resident-experts", "8", "--prefill-residency", "newest"], "--prefill-residency"),
    ],
)
def test_inconsistent_flags_exit_2_naming_the_flag(argv: list[str], needle: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model", "/m", *argv])
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_server_process_serves_records_routing_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    trace_path = tmp_path / "routing" / "run.trace"
    log_path = tmp_path / "server.log"
    argv = [sys.executable, "-m", "paged_experts.server", "--model", str(ensure_tiny()), "--port", str(port),
            "--resident-experts", "8", "--max-total-tokens", "1000", "--routing-source", "qwen3-30b-a3b",
            "--record-routing", str(trace_path)]  # fmt: skip
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base)
        body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda _: post(f"{base}/v1/completions", body), range(2)))
        assert [r["usage"]["completion_tokens"] for r in results] == [6, 6]
        model = json.loads(get(f"{base}/v1/models")[1])["data"][0]
        assert model["routing"] == "synthetic:qwen3-30b-a3b" and model["routing_synthetic"] is True
        info = json.loads(get(f"{base}/server_info")[1])
        assert info["runtime"]["mode"] == "paged" and info["runtime"]["resident_experts"] == 8
        assert info["kv"] == {"capacity_tokens": 1000, "block_size": 8}  # exact capacity, not rounded
        metrics = get(f"{base}/metrics")[1]
        assert parse_prometheus(metrics)["paged_experts:routing_synthetic"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log_text = log_path.read_text()
    assert "ready: http://127.0.0.1:" in log_text and '"mode": "paged"' in log_text
    trace = read_trace(trace_path)
    assert trace.meta.synthetic and trace.meta.top_k == 4 and trace.meta.num_experts == 32
    # every prompt token and the 5 fed-back generated tokens of each request passed the router
    prompt_tokens = results[0]["usage"]["prompt_tokens"]
    per_request = trace.requests()
    assert set(per_request) == {r["id"] for r in results}  # traces name requests by response id
    assert all(sum(c.num_tokens for c in chunks) == prompt_tokens + 5 for chunks in per_request.values())
