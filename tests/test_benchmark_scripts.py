"""The benchmarks/ scripts on the CPU (tiny model), each run end to end as a process.

prefill_h200: one record per cell with its provenance, and its table; no link figure without CUDA, so no floor
(never a 0). decode_h200: its cells, with the prefetch counts. Both record which weights their model name meant
(the source-weights record a server of that name records: generator version, shape, seed, vocabulary, silent
tokens), and build the host store their cells' models place, once."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchsuite.tools import device_memory
from paged_experts.weights import synth_memory
from paged_experts.weights.weights_id import source_weights

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, out: Path, *args: str) -> dict[str, Any]:
    """Runs benchmarks/<script> --out out *args from the repository root; its JSON record."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--out", str(out), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record: dict[str, Any] = json.loads(out.read_text())
    return record


def test_prefill_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    # fmt: off
    record = run_benchmark(
        "prefill_h200.py", tmp_path / "prefill.json", "--preset", "tiny", "--layers", "2", "--device", "cpu",
        "--dtype", "float32", "--ks", "6", "--routings", "qwen3-30b-a3b", "--prompt", "200", "--repeats", "2",
        "--decode", "3",
    )
    # fmt: on
    assert record["provenance"]["git_commit"] and record["link"]["error"].startswith("no CUDA device")
    assert record["source_weights"] == source_weights("synth:tiny?layers=2&seed=0")  # what a server of it records
    names = [c["cell"] for c in record["cells"]]
    assert names == ["resident/qwen3-30b-a3b", "paged:6/qwen3-30b-a3b/recent/streamed",
                     "paged:6/qwen3-30b-a3b/lru/streamed", "paged:6/qwen3-30b-a3b/recent/serial"]  # fmt: skip
    for cell in record["cells"]:
        assert "error" not in cell, cell
        assert cell["prefill_s"] > 0 and cell["floor_s"] is None and cell["router_s"] > 0
    paged = record["cells"][1]
    assert paged["prefill_bytes"] > 0 and paged["waves_per_layer"] > 1 and 0 <= paged["decode_hit_rate"] <= 1
    # the prompts' spread, and the link's idle and the host's two times per paged layer-step (medians over prompts)
    measured = paged["runs"][1:]  # the first prompt is the warm-up
    assert len(measured) == 2 and paged["prefill_s_min"] <= paged["prefill_s"] <= paged["prefill_s_max"]
    assert [paged["prefill_s_min"], paged["prefill_s_max"]] == sorted(r["prefill_s"] for r in measured)
    for column, counter in (("idle_before_layer_ms", "idle_before_layer_s"), ("host_wait_ms", "host_wait_s"),
                            ("host_plan_ms", "host_plan_s")):  # fmt: skip
        per_layer = [1e3 * r["prefill"][counter] / r["prefill"]["layer_steps"] for r in measured]
        assert paged[column] == pytest.approx(statistics.median(per_layer)), column
        assert record["cells"][0][column] is None  # resident: no paged layer-step
    assert paged["host_plan_ms"] > 0  # on the CPU the waves compute inside it
    # the host's time issuing the prompt's step over its wall time, and the thread's CPU share of that issue time
    for cell in record["cells"]:
        issue = [r["issue_s"] / r["prefill_s"] for r in cell["runs"][1:]]
        assert cell["issue_of_prefill"] == pytest.approx(statistics.median(issue)) and 0 < max(issue) <= 1
        assert 0 < cell["on_cpu"] <= 1.05
        if sys.platform.startswith("linux"):  # the rest of the issue time: waiting for a CPU; and the CPUs
            assert 0 <= cell["queued"] <= 1 and cell["cpu_ids"] and all(c >= 0 for c in cell["cpu_ids"])
            assert all(
                r["issue_voluntary_switches"] >= 0 and r["cpu_id_last"] in cell["cpu_ids"] for r in cell["runs"][1:]
            )
    table = (tmp_path / "prefill.txt").read_text()
    assert "paged:6/qwen3-30b-a3b/lru/streamed" in table and "plan ms" in table and " cpu" in table
    assert "queued" in table and "cpu ids" in table


def test_the_prefill_benchmark_sets_prompts_beside_the_samplers_reads_against_prompts_without(tmp_path: Path) -> None:
    """--nvml-sampler ab: measured prompts 2, 4, ... run while benchsuite.tools.nvml_load reads (here scripted reads
    of 5 ms: no GPU), 1, 3, ... without; each cell sets the two medians side by side."""
    # fmt: off
    record = run_benchmark(
        "prefill_h200.py", tmp_path / "p.json", "--preset", "tiny", "--layers", "2", "--device", "cpu",
        "--dtype", "float32", "--ks", "6", "--routings", "qwen3-30b-a3b", "--keeps", "recent", "--paths", "streamed",
        "--prompt", "200", "--repeats", "4", "--decode", "20", "--nvml-sampler", "ab",
        "--nvml-scripted-read-s", "0.005",
    )
    # fmt: on
    for cell in record["cells"]:
        runs = cell["runs"][1:]  # after the warm-up prompt
        assert [r["nvml"] is not None for r in runs] == [False, True, False, True], cell["cell"]
        assert all(r["nvml"]["reads"] >= 1 and r["nvml"]["read_ms_max"] >= 5 for r in runs if r["nvml"])
        on = statistics.median(r["prefill_s"] for r in runs if r["nvml"])
        off = statistics.median(r["prefill_s"] for r in runs if not r["nvml"])
        assert (cell["prefill_s_nvml_on"], cell["prefill_s_nvml_off"]) == pytest.approx((on, off))
        assert cell["nvml_read_ms_max"] >= 5
    assert "nvml/off" in (tmp_path / "p.txt").read_text()


def test_the_prefill_benchmark_counts_the_collectors_time_in_each_prefill_and_freezes_the_heap_as_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each prompt's prefill carries the collector's CPU time and collections inside it (here forced: a threshold
    of 5 new objects runs young collections all through the step; at 50 a resident prompt of the tiny model could
    end before the count reached it, by what earlier work had left in it: the test failed after two others ran),
    and --gc-freeze on freezes the heap once per cell after its warm-up prompt and gives it back at the cell's end
    (the next cell's model is built unfrozen)."""
    import gc

    spec = importlib.util.spec_from_file_location("prefill_h200", ROOT / "benchmarks" / "prefill_h200.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "prefill_h200", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    calls: list[str] = []
    freeze, release = module.gc_pauses.freeze_heap, module.gc_pauses.release_heap

    def counted_freeze() -> int:
        calls.append("freeze")
        return int(freeze())

    def counted_release() -> None:
        calls.append("release")
        release()

    monkeypatch.setattr(module.gc_pauses, "freeze_heap", counted_freeze)
    monkeypatch.setattr(module.gc_pauses, "release_heap", counted_release)
    thresholds, frozen_before = gc.get_threshold(), gc.get_freeze_count()
    common = ["--preset", "tiny", "--layers", "2", "--device", "cpu", "--dtype", "float32", "--ks", "6",
              "--routings", "qwen3-30b-a3b", "--keeps", "recent", "--paths", "streamed", "--prompt", "200",
              "--repeats", "2", "--decode", "2"]  # fmt: skip
    gc.set_threshold(5)
    try:
        assert module.main(["--out", str(tmp_path / "off.json"), *common, "--gc-freeze", "off"]) == 0
    finally:
        gc.set_threshold(*thresholds)
    assert calls == []  # off: never frozen
    for cell in json.loads((tmp_path / "off.json").read_text())["cells"]:
        runs = cell["runs"][1:]
        assert all(r["gc_collections"][0] >= 1 and r["gc_s"] > 0 for r in runs), cell["cell"]
        assert cell["gc_ms_max"] == pytest.approx(1e3 * max(r["gc_s"] for r in runs))
        assert cell["gc_full_collections"] == sum(r["gc_collections"][2] for r in runs)
    assert module.main(["--out", str(tmp_path / "on.json"), *common]) == 0  # the default: on
    assert calls == ["freeze", "release"] * 2  # two cells (resident, paged): each its own freeze
    assert gc.get_freeze_count() == frozen_before  # every freeze given back
    assert "gc ms" in (tmp_path / "on.txt").read_text()


@pytest.mark.skipif(device_memory.open_reader() is not None, reason="this machine has NVML to read")
def test_the_prefill_benchmark_refuses_the_samplers_reads_without_nvml(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "prefill_h200.py"), "--out", str(tmp_path / "p.json"), "--device",
         "cpu", "--preset", "tiny", "--nvml-sampler", "ab"],
        capture_output=True, text=True, check=False, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 2 and "--nvml-sampler ab: nvml_load did not start: " in proc.stderr
    assert "no NVML to read" in proc.stderr and not (tmp_path / "p.json").exists()


def test_the_runs_test_tells_regimes_from_alternation() -> None:
    """benchmarks/prefill_speeds.py's runs test over a server's fast and slow halves in sending order, against the
    same halves shuffled within each cell (each cell is half slow by construction)."""
    spec = importlib.util.spec_from_file_location("prefill_speeds", ROOT / "benchmarks" / "prefill_speeds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cells = [f"c{i // 8}" for i in range(32)]  # four cells of eight requests in sending order
    regimes = [False] * 4 + [True] * 4  # each cell: its fast half first, then its slow half
    runs, mean, p = module.runs_test(regimes * 4, cells)
    assert runs == 8 and mean > 12 and p < 0.01  # long runs inside cells: regimes
    alternating = [False, True] * 16
    runs, mean, p = module.runs_test(alternating, cells)
    assert runs == 32 and p > 0.99  # more runs than any shuffle: alternation, not regimes
    assert module.runs_test([], []) == (0, 0.0, 1.0)


def test_the_median_ratio_test_tells_a_shift_from_noise() -> None:
    """benchmarks/prefill_speeds.py --against: two runs' requests compared by their medians and a shuffle test."""
    spec = importlib.util.spec_from_file_location("prefill_speeds", ROOT / "benchmarks" / "prefill_speeds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base = [550.0, 560.0, 570.0, 580.0, 590.0, 600.0, 555.0, 565.0]
    faster = [v * 0.9 - 20.0 for v in base]  # every request of the new run faster than every one of the base
    ratio, p = module.median_ratio_test(base, faster)
    assert ratio == pytest.approx(statistics.median(faster) / statistics.median(base)) and p < 0.01
    ratio, p = module.median_ratio_test(base, list(reversed(base)))  # the same requests: no shift at all
    assert ratio == 1.0 and p == 1.0
    _, p = module.median_ratio_test(base, [base[i] for i in (1, 2, 4, 5, 0, 3, 6, 7)][:6] + [575.0, 585.0])
    assert p > 0.2  # the same spread, medians within it


def test_prefill_speeds_against_matches_servers_and_says_which_run_alone_has_one() -> None:
    """--against: per (server, routing, concurrency) the measured requests of both runs (warm-ups left out);
    a server measured in one run only is listed with that run named, not dropped."""
    import pandas as pd

    spec = importlib.util.spec_from_file_location("prefill_speeds", ROOT / "benchmarks" / "prefill_speeds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def requests(rows: list[tuple[str, float, bool]]) -> pd.DataFrame:
        fixed = {"routing": "model", "concurrency": 1, "host_plan_ms": None}
        return pd.DataFrame([{**fixed, "server_id": server, "warmup": warm, "prompt_ms": ms, "issue_ms": ms - 1.0}
                             for server, ms, warm in rows])  # fmt: skip

    base = requests([("s1", 600.0, True), ("s1", 550.0, False), ("s1", 560.0, False), ("s3", 500.0, False)])
    new = requests([("s1", 400.0, True), ("s1", 500.0, False), ("s1", 510.0, False), ("s2", 450.0, False)])
    rows = {row["server_id"]: row for row in module.compare(base, new)}
    assert set(rows) == {"s1", "s2", "s3"}
    s1 = rows["s1"]
    assert (s1["base_requests"], s1["requests"]) == (2, 2) and "only" not in s1
    assert s1["prompt_ms_base"] == 555.0 and s1["prompt_ms"] == 505.0  # warm-ups (600, 400) left out
    assert s1["prompt_ms_ratio"] == pytest.approx(505.0 / 555.0) and "host_plan_ms" not in s1  # no plan: no figure
    assert rows["s2"]["only"] == "this run" and rows["s3"]["only"] == "the base run"


def test_prefill_ab_compares_two_settings_prompt_by_prompt(tmp_path: Path) -> None:
    """benchmarks/prefill_ab.py: per cell, each file's median over its measured prompts (the warm-up left out), the
    sides' pooled medians, their ratio and a shuffle test's p, the host plan and the collector's time a side."""

    def write(name: str, prefill_s: list[float], gc_full: int = 0) -> Path:
        warm_up = {"prefill_s": 9.0, "prefill": {"host_plan_s": 9.0}, "gc_s": 1.0, "gc_collections": [0, 0, 5]}
        runs = [warm_up]
        runs += [{"prefill_s": v, "prefill": {"host_plan_s": v * 0.75}, "gc_s": 0.001,
                  "gc_collections": [1, 0, gc_full if i == 0 else 0]} for i, v in enumerate(prefill_s)]  # fmt: skip
        cells = [{"cell": "paged:54/model", "runs": runs}, {"cell": "broken", "error": "OOM"}]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"cells": cells}))
        return path

    slow = [write("off1", [0.60, 0.61, 0.62, 0.59], gc_full=1), write("off2", [0.58, 0.60, 0.63, 0.61])]
    fast = [write("on1", [0.50, 0.51, 0.52, 0.49]), write("on2", [0.48, 0.50, 0.53, 0.51])]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "prefill_ab.py"), "--a", *map(str, slow),
                           "--b", *map(str, fast), "--names", "off,on"], capture_output=True, text=True,
                          check=False, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    header, row, *rest = proc.stdout.splitlines()
    assert not rest and header.split()[:3] == ["cell", "files", "off"] and "on/off" in header  # the failed cell: out
    fields = row.split()
    assert fields[0] == "paged:54/model" and fields[1:5] == ["0.605", "0.605", "0.505", "0.505"]  # each file's median
    assert fields[5:7] == ["0.605", "0.505"] and float(fields[7]) == pytest.approx(0.505 / 0.605, abs=1e-3)
    assert float(fields[8]) < 0.01  # every prompt of B faster than every one of A
    assert fields[9:11] == ["0.454", "0.379"]  # the host plan, pooled medians (0.75 of each prefill)
    assert fields[11] == "8.0/8.0" and fields[12] == "1/0"  # collector ms a side (warm-up left out), full ones


def test_decode_benchmark_runs_on_the_cpu_and_records_its_weights(tmp_path: Path) -> None:
    # fmt: off
    record = run_benchmark(
        "decode_h200.py", tmp_path / "decode.json", "--device", "cpu", "--preset", "tiny", "--layers", "2",
        "--seed", "3", "--modes", "resident,paged:8/graphs+prefetch", "--batches", "1", "--routings", "model",
        "--prompt", "4", "--warmup", "1", "--steps", "3", "--graphs", "1",
    )
    # fmt: on
    assert record["source_weights"] == source_weights("synth:tiny?layers=2&seed=3")
    assert record["source_weights"]["id"] != source_weights("synth:tiny?layers=2&seed=0")["id"]
    resident, paged = record["cells"]
    assert "error" not in resident and "error" not in paged
    assert resident["hit_rate"] == 1.0 and resident["steps"] == paged["steps"] == 3
    assert 0 <= paged["prefetch_used_per_step"] <= paged["prefetched_per_step"] and paged["prefetched_per_step"] > 0
    assert paged["prefetch_accuracy"] is None or 0 <= paged["prefetch_accuracy"] <= 1


class _CountingCache(dict[tuple[object, ...], Any]):
    """synth_memory's host-store cache, counting the stores generated into it."""

    def __init__(self) -> None:
        super().__init__()
        self.stores = 0

    def __setitem__(self, key: tuple[object, ...], value: Any) -> None:
        self.stores += 1
        super().__setitem__(key, value)


# fmt: off
@pytest.mark.parametrize(("script", "args"), [
    ("decode_h200.py", ["--device", "cpu", "--preset", "tiny", "--layers", "2", "--modes", "resident",
                        "--batches", "1", "--routings", "model", "--prompt", "4", "--warmup", "1", "--steps", "2"]),
    ("prefill_h200.py", ["--device", "cpu", "--preset", "tiny", "--layers", "2", "--ks", "6",
                         "--routings", "qwen3-30b-a3b", "--prompt", "40", "--repeats", "1", "--decode", "1"]),
])
# fmt: on
def test_a_benchmark_builds_one_host_store(
    script: str, args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store built up front (its build time and pinning recorded) is the one the cells' models place: it was
    built without the preset's silent tokens, so every cell's model generated a second store (2 x 58 GB pinned at
    48 layers while the first stayed referenced)."""
    cache = _CountingCache()
    monkeypatch.setattr(synth_memory, "_CACHE", cache)
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), ROOT / "benchmarks" / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    assert module.main(["--out", str(tmp_path / "r.json"), *args]) == 0
    assert cache.stores == 1


def test_the_copy_overlap_benchmark_runs_its_arms_on_the_cpu_and_checks_every_copy(tmp_path: Path) -> None:
    """benchmarks/copy_overlap.py on the CPU: every copy arm (DMA stand-in, full grid, capped, wide, proxy) moves the m
    experts' rows (the script checks each slot's bytes, else it exits non-zero), one row per arm and m with both
    issue orders, and the record says no overlap was measured."""
    # fmt: off
    record = run_benchmark(
        "copy_overlap.py", tmp_path / "co.json", "--device", "cpu", "--hidden", "256", "--inter", "128",
        "--experts", "16", "--slots", "12", "--m", "2,3", "--top-k", "2", "--tokens", "2", "--programs", "4",
        "--wide", "4", "--repeats", "2", "--warmup", "1",
    )
    # fmt: on
    assert record["concurrent"] is False and record["device"] == "cpu"
    row_bytes = record["expert_shape"]["row_bytes"]
    assert row_bytes == 3 * 256 * 128 + 3 * 4 * 2 * 1  # gate, up, down FP8 bytes and their [2, 1] / [1, 2] scales
    got = [(r["copy"], r["m"]) for r in record["rows"]]
    assert got == [(c, m) for m in (2, 3) for c in ("dma", "kernel", "kernel:4", "wide:4", "proxy")]
    for r in record["rows"]:
        assert "error" not in r, r
        assert r["bytes"] == r["m"] * row_bytes and r["copy_ms"] > 0 and r["compute_ms"] > 0 and r["issue_ms"] > 0
        assert r["compute_passes"] >= 1
        assert set(r["copy_first"]) == set(r["compute_first"]) == {"span_ms", "copy_ms", "compute_ms", "hidden"}


def test_the_copy_overlap_benchmark_keeps_every_row_when_an_arm_copies_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An arm whose copy misses its rows fails its check: its row carries the error, the arms after it still run, the
    record is written after every row, and the exit status says an arm failed."""
    spec = importlib.util.spec_from_file_location("copy_overlap", ROOT / "benchmarks" / "copy_overlap.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "copy_overlap", bench)  # its dataclass looks its module up there
    spec.loader.exec_module(bench)
    real = bench.copy_fn

    def broken_kernel(mech: str, setup: Any, pairs: list[tuple[int, int]]) -> Any:
        if mech != "kernel":
            return real(mech, setup, pairs)
        return real(mech, setup, pairs[1:])  # the first pair's row is never copied

    monkeypatch.setattr(bench, "copy_fn", broken_kernel)
    out = tmp_path / "co.json"
    # fmt: off
    status = bench.main([
        "--out", str(out), "--device", "cpu", "--hidden", "256", "--inter", "128", "--experts", "16", "--slots", "12",
        "--m", "2", "--top-k", "2", "--tokens", "2", "--programs", "4", "--wide", "", "--repeats", "1", "--warmup", "1",
    ])
    # fmt: on
    assert status == 1
    assert bench.main(["--show", str(out)]) == 0  # the stored record's table, failed row included
    rows = json.loads(out.read_text())["rows"]
    assert [r["copy"] for r in rows] == ["dma", "kernel", "kernel:4", "proxy"]
    assert "error" not in rows[0] and "error" not in rows[2] and "error" not in rows[3]
    assert rows[1]["error"].startswith("AssertionError:") and "does not hold expert" in rows[1]["error"]


def test_the_copy_overlap_benchmark_refuses_a_missing_gpu_and_too_few_slots(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "copy_overlap.py"), "--out", str(tmp_path / "x.json"), *args],
            capture_output=True, text=True, check=False, timeout=120, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip

    import torch

    if not torch.cuda.is_available():
        done = run()
        assert done.returncode == 2 and "no CUDA device" in done.stderr
    done = run("--device", "cpu", "--slots", "10", "--top-k", "8")
    assert done.returncode == 2 and "too few for the compute's top_k 8" in done.stderr
    done = run("--device", "cpu", "--experts", "20", "--slots", "16", "--m", "5")
    assert done.returncode == 2 and "needs 5 experts outside the --slots 16" in done.stderr
    for lanes in ("3", "17", "x"):  # fewer lanes than copies, more than slots, not a count
        done = run("--device", "cpu", "--experts", "24", "--slots", "16", "--m", "2,4", "--switch", f"m,{lanes}")
        assert done.returncode == 2 and "--switch" in done.stderr and "4..16" in done.stderr, done.stderr
    done = run("--device", "cpu", "--experts", "210", "--slots", "140", "--m", "65", "--switch", "m")
    assert done.returncode == 2 and "65..64" in done.stderr, done.stderr  # more copies than the setter has lanes
    assert not (tmp_path / "x.json").exists()


def test_the_copy_overlap_benchmark_runs_switch_arms_on_packed_rows_on_the_cpu(tmp_path: Path) -> None:
    """`--switch m,L` adds a `switch` arm (as many lanes as copies) and `switch:L` per m, after the others; on the CPU
    they run the copy's CPU fallback, so only the plumbing and the rows' check (packed rows here: one byte row an
    expert) are exercised. The graph's figures exist on a GPU only (tests/cuda/test_switch_lanes_cuda.py)."""
    # fmt: off
    record = run_benchmark(
        "copy_overlap.py", tmp_path / "co.json", "--device", "cpu", "--hidden", "256", "--inter", "128",
        "--experts", "16", "--slots", "12", "--m", "2,3", "--top-k", "2", "--tokens", "2", "--programs", "",
        "--wide", "", "--no-proxy", "--switch", "m,6", "--rows", "packed", "--repeats", "2", "--warmup", "1",
    )
    # fmt: on
    assert [(r["copy"], r["m"]) for r in record["rows"]] == [
        (c, m) for m in (2, 3) for c in ("dma", "kernel", "switch", "switch:6")
    ]
    assert record["args"]["rows"] == "packed"
    for r in record["rows"]:
        assert "error" not in r, r
        assert "switch_nodes" not in r  # no graph on the CPU


def test_the_prefill_benchmark_names_its_kernel_copy_paths_and_refuses_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prefill_h200.py's page-in paths: `kernel` is page_in kernel with the full grid, `kernel:P` the same capped at P
    programs; a cap below 1 or an unknown path is refused at the command line (exit 2), before any cell runs."""
    spec = importlib.util.spec_from_file_location("prefill_h200", ROOT / "benchmarks" / "prefill_h200.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "prefill_h200", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    assert module.path_page_in("streamed") == ("auto", None) and module.path_page_in("serial") == ("auto", None)
    assert module.path_page_in("batch") == ("batch", None) and module.path_page_in("kernel") == ("kernel", None)
    assert module.path_page_in("kernel:16") == ("kernel", 16)
    for bad in ("kernel:0", "kernel:", "kernel:x", "kernel:\u00b2", "kernel:08", "dma"):
        with pytest.raises(ValueError, match="choose from"):
            module.path_page_in(bad)
    out = tmp_path / "p.json"

    def refused(paths: str) -> str:
        done = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "prefill_h200.py"), "--out", str(out), "--device", "cpu",
             "--preset", "tiny", "--layers", "2", "--ks", "6", "--paths", paths],
            capture_output=True, text=True, check=False, timeout=120, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert done.returncode == 2 and not out.exists(), done.stderr
        return done.stderr

    assert "--paths: page-in path 'kernel:0'" in refused("streamed,kernel:0")
    assert "the kernel copy needs --device cuda" in refused("streamed,kernel:8")


def test_decode_h200_maps_the_switch_variant_to_switch_copies_with_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """`paged:K/overlap+switch` is RuntimeConfig(overlap_page_in=True, overlap_copies='switch'); `switch` without
    `overlap` is refused by the runtime's own rule, and the other variants keep the kernel's copies."""
    spec = importlib.util.spec_from_file_location("decode_h200", ROOT / "benchmarks" / "decode_h200.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "decode_h200", bench)
    spec.loader.exec_module(bench)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the config's own check; nothing runs here
    mode, options = bench.parse_variant("paged:54/graphs+triton+overlap+switch")
    rt = bench.runtime_for(mode, "cuda", options)
    assert (rt.overlap_page_in, rt.overlap_copies, rt.resident_experts) == (True, "switch", 54)
    mode, options = bench.parse_variant("paged:54/graphs+overlap")
    assert bench.runtime_for(mode, "cuda", options).overlap_copies == "kernel"
    mode, options = bench.parse_variant("paged:54/graphs+switch")
    with pytest.raises(ValueError, match="overlap_copies='switch' applies with overlap_page_in only"):
        bench.runtime_for(mode, "cuda", options)


def test_decode_h200_caps_a_variants_copy_grid_by_its_own_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """`capN` sets copy_programs=N for its variant alone (over --copy-programs), so capped and full-grid arms run in
    one process; two caps, a zero or a misspelled cap are refused."""
    spec = importlib.util.spec_from_file_location("decode_h200", ROOT / "benchmarks" / "decode_h200.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "decode_h200", bench)
    spec.loader.exec_module(bench)
    _, options = bench.parse_variant("paged:54/graphs+triton+overlap+cap16")
    assert bench.variant_programs(options, None) == 16 and bench.variant_programs(options, 32) == 16
    _, plain = bench.parse_variant("paged:54/graphs+triton")
    assert bench.variant_programs(plain, None) is None and bench.variant_programs(plain, 32) == 32
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the config's own check; nothing runs here
    mode, capped = bench.parse_variant("paged:54/graphs+triton+overlap+cap16")
    assert bench.runtime_for(mode, "cuda", capped, bench.variant_programs(capped, None)).copy_programs == 16
    mode, host = bench.parse_variant("paged:54/host+cap16")  # host-planned steps have no copy kernel to cap
    assert bench.runtime_for(mode, "cuda", host, bench.variant_programs(host, None)).copy_programs is None
    with pytest.raises(SystemExit, match="one capN a variant"):
        bench.parse_variant("paged:54/cap16+cap32")  # refused when parsed, before any mode builds
    for bad in ("paged:54/cap0", "paged:54/cap", "paged:54/capx"):
        with pytest.raises(SystemExit, match="unknown options"):
            bench.parse_variant(bad)


def test_alloc_probe_refuses_without_a_cuda_device_in_one_line() -> None:
    """benchmarks/alloc_probe.py measures the driver's allocations: without CUDA it says so and exits non-zero (the
    devices hidden from the child, so this runs on a GPU machine too)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "alloc_probe.py"), "--ks", "55,57"],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 1
    assert "alloc_probe.py: needs a CUDA device (it measures the driver's allocations)" in proc.stderr


def test_the_plan_kernel_benchmark_checks_each_policy_against_the_host_planner_on_the_cpu(tmp_path: Path) -> None:
    record = run_benchmark(
        "plan_kernel.py", tmp_path / "plan.json", "--device", "cpu", "--steps", "40", "--repeats", "1",
        "--batches", "1,4,8", "--slots", "32",
    )  # fmt: skip
    cells = record["cells"]
    # B=8 routes 64 pairs, more than K=32: host-planned, so no device cell
    assert {(c["routing"], c["batch"], c["policy"]) for c in cells} == {
        (r, b, p) for r in ("calibrated", "loop") for b in (1, 4) for p in ("lru", "lfu-aging:256:4", "duel")
    }
    assert all(c["mismatch"] is None and c["eager_us"] > 0 and c["steps"] == 40 for c in cells)
    assert all("graphed_us" not in c for c in cells)  # no graph on the CPU
    # four streams of calibrated routing miss more a step than one
    by = {(c["routing"], c["batch"], c["policy"]): c["misses_per_step"] for c in cells}
    assert by[("calibrated", 4, "lru")] > by[("calibrated", 1, "lru")] > 0


def test_the_plan_kernel_benchmark_runs_the_fused_kernel_in_the_interpreter(tmp_path: Path) -> None:
    """The script's own kernel variants (K=54, B=1 and 4, each policy) in Triton's interpreter: the plan equal to the
    host planner's at every step, which the GPU call checks compiled before it times anything."""
    pytest.importorskip("triton")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plan_kernel.py"), "--out", str(tmp_path / "plan.json"),
         "--device", "cpu", "--fused", "--steps", "20", "--repeats", "1", "--routings", "calibrated"],
        capture_output=True, text=True, check=False, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    cells = json.loads((tmp_path / "plan.json").read_text())["cells"]
    assert [(c["batch"], c["policy"]) for c in cells] == [
        (b, p) for b in (1, 4) for p in ("lru", "lfu-aging:256:4", "duel")
    ]
    assert all(c["fused"] and c["mismatch"] is None and "error" not in c for c in cells)


def test_the_plan_kernel_benchmark_reports_a_plan_that_differs_from_the_hosts() -> None:
    spec = importlib.util.spec_from_file_location("plan_kernel", ROOT / "benchmarks" / "plan_kernel.py")
    assert spec is not None and spec.loader is not None
    plan_kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_kernel)
    ids = torch.from_numpy(plan_kernel.step_ids("calibrated", 20, 1, 128, 8, 0))  # [20, 8]
    assert ids.shape == (20, 8)
    dr = plan_kernel.device_residency("duel", 128, 32, torch.device("cpu"))
    assert plan_kernel.check_plan(dr, "duel", ids) is None
    # the device's slots 0 and 1 swap their experts (a consistent state the host does not hold)
    dr = plan_kernel.device_residency("duel", 128, 32, torch.device("cpu"))
    dr.expert_in[:2] = torch.tensor([1, 0])
    dr.slot_of[:2] = torch.tensor([1, 0])
    message = plan_kernel.check_plan(dr, "duel", ids)
    assert message is not None and message.startswith("step 0: ")


def test_the_residency_roundtrip_benchmark_times_each_policy_and_leaves_the_state_as_it_was() -> None:
    """benchmarks/residency_roundtrip.py: a line per policy with its pull and push milliseconds; a pull then a push
    (what it times) leaves a layer's device state as it was, so the repeats time the same work."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "residency_roundtrip.py"), "--layers", "2", "--experts", "8",
         "--slots", "4", "--repeats", "2"],
        capture_output=True, text=True, check=False, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in proc.stdout.splitlines()[2:]}
    assert set(rows) == {"lru", "lfu-aging", "duel"}
    for pull, push, total in rows.values():
        assert pull > 0 and push > 0 and total == pytest.approx(pull + push, abs=0.02)
    spec = importlib.util.spec_from_file_location("residency_roundtrip", ROOT / "benchmarks" / "residency_roundtrip.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    device, residency = module.layer_pair("duel", 8, 4)
    device.shadows[0, :8] = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=device.shadows.dtype)
    device.psel.fill_(3)
    device.uses[:8] = torch.arange(8)
    before = device.state()
    from paged_experts.residency.device import pull_many

    pull_many([(device, residency)])
    device.push_from(residency)
    assert torch.equal(before, device.state())


def test_the_plan_step_benchmark_times_each_policy_on_the_same_routing() -> None:
    """benchmarks/plan_step_host.py: a row per policy, decode steps in us and each chunk in ms with its waves and
    misses; every policy plans the same draws (the seed), so a chunk larger than K runs in waves under each."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plan_step_host.py"), "--experts", "16", "--top-k", "2",
         "--slots", "4", "--tokens", "3,24", "--batch", "1", "--decode", "3", "--repeats", "2"],
        capture_output=True, text=True, check=False, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in proc.stdout.splitlines()[2:]}
    assert set(rows) == {"lru", "lfu-aging:256:4", "duel"}
    for decode_us, ms_3, waves_3, misses_3, ms_24, waves_24, misses_24 in rows.values():
        assert decode_us > 0 and ms_3 > 0 and ms_24 > 0
        assert waves_3 >= 1 and waves_24 > 1 and 0 <= misses_3 <= 6 and misses_24 > 0
