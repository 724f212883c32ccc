"""benchmarks/h200_report.py end to end on fixtures: the real CPU decode_h200 / serve_decode samples
(tests/data/h200, made with the commands in tests/data/h200/README.md) and a hand-made H200-shaped
decode file whose numbers make the ratios easy to check. The run must read back through the
standard store and report; every record carries its provenance; failed cells stay visible."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from benchsuite.report import h200_tables as ht
from benchsuite.report import load_run, write_report
from benchsuite.store import read_cells

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data" / "h200"
sys.path.insert(0, str(ROOT / "benchmarks"))  # h200_report and its sibling h200_cells are scripts, not a package

import h200_report

EXPERT_BYTES = 9_437_184  # one bf16 Qwen3-30B-A3B expert (3 x 2048 x 768 x 2)
DENSE_BYTES = 1_000_000_000


def _cell(mode: str, variant: str, routing: str, batch: int, tok_s: float, **more: Any) -> dict[str, Any]:
    return {"mode": mode, "variant": variant, "kernel": "loop" if "loop" in variant else "fused",
            "graphs": "graphs" if "graphs" in variant else "", "routing": routing, "layers": 48, "batch": batch, "steps": 24,
            "tok_per_s": tok_s, "ms_per_step": 1e3 * batch / tok_s, "hit_rate": 0.5, "misses_per_token": 4.0, **more}


def h200_like_decode() -> dict[str, Any]:
    """What decode_h200.py writes on the H200, with chosen numbers; one mode failed to build, one cell failed."""
    cells = []
    for routing in ("model", "qwen3-30b-a3b"):
        cells += [
            _cell("resident", "default", routing, 1, 300.0, hbm_bound_tok_per_s=400.0, hbm_fraction=0.75),
            _cell("resident", "default", routing, 4, 900.0),
            _cell("paged:32", "graphs", routing, 1, 80.0, roofline_fraction=0.95, roofline_step_s=0.0119,
                  roofline_link_step_s=0.0119, gpu_mem_peak_bytes=15 * 10**9, new_metric_x=7),
            _cell("paged:32", "host", routing, 1, 60.0, roofline_fraction=0.5, gpu_mem_peak_bytes=15 * 10**9),
            _cell("paged:32", "graphs", routing, 4, 100.0, roofline_fraction=0.91, gpu_mem_peak_bytes=15 * 10**9),
            _cell("offload", "default", routing, 1, 8.0),
            _cell("offload", "default", routing, 4, 20.0),
            {**_cell("cpu-experts:12", "default", routing, 1, 1.0), "tok_per_s": None, "error": "RuntimeError('out of memory')"},
        ]
    cells.append({"mode": "paged:64", "variant": "graphs", "kernel": "fused", "graphs": "graphs", "error": "build: OOM"})
    return {
        "schema_version": 1, "benchmark": "decode_h200",
        "command": ["python", "benchmarks/decode_h200.py", "--out", "decode_h200.json", "--batches", "1,4"],
        "model": "synth:qwen3-30b-a3b-shape?layers=48&seed=0 (in-memory random bf16 weights)",
        "provenance": {"git_commit": "f" * 40, "git_dirty": False, "torch": "2.11.0+cu130", "gpu": "NVIDIA H200", "cpu_count": 16,
                       "python": "3.11.7"},
        "link": {"link_B_per_s": 50e9, "link_source": "linkbw.json"},
        "bytes": {"expert": EXPERT_BYTES, "dense_touched_per_step": DENSE_BYTES},
        "pagein_paths": [{"experts": 8, "dma_copy_GB_per_s": 48.0, "triton_kernel_GB_per_s": 45.0}],
        "cells": cells,
    }


def _build(tmp_path: Path, decode: Path, *extra: str) -> tuple[Path, Path]:
    results, report = tmp_path / "results" / "h200-test", tmp_path / "reports" / "h200-test"
    argv = ["--decode", str(decode), *extra, "--results", str(results), "--report", str(report)]
    assert h200_report.main(argv) == 0
    return results, report


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("cpu")
    return _build(tmp, DATA / "decode_cpu_sample.json", "--serve-dir", str(DATA / "serve"), "--env", str(DATA / "env.txt"))


@pytest.fixture(scope="module")
def h200_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("h200")
    decode = tmp / "decode_h200.json"
    decode.write_text(json.dumps(h200_like_decode()))
    return _build(tmp, decode, "--llamacpp", str(DATA / "llamacpp_h200.json"), "--env", str(DATA / "env.txt"))


def _tables(report: Path) -> dict[str, pd.DataFrame]:
    csv = pd.read_csv(report / "tables.csv")
    return {name: frame.dropna(axis=1, how="all") for name, frame in csv.groupby("table")}


def test_cpu_sample_every_cell_is_a_record_with_provenance(cpu_run: tuple[Path, Path]) -> None:
    results, _ = cpu_run
    sample = json.loads((DATA / "decode_cpu_sample.json").read_text())
    cells = read_cells(results)
    assert len(cells) == len(sample["cells"]) + 2  # the serve file holds concurrency 1 and 4
    for cell in cells:
        prov = cell.extras["provenance"]
        assert prov["command"] and prov["git"]["commit"] and prov["routing_source"] and prov["input_sha256"]
        assert prov["machine"]["gpu"] == "NVIDIA H200" and prov["machine"]["pcie_link"].startswith("PCIe Gen5 x16")
        assert prov["date_utc"]
    decode = [c for c in cells if c.extras["source"] == "decode_h200"]
    assert all(c.extras["provenance"]["command"] == sample["command"] for c in decode)
    assert {c.routing for c in decode} == {"model", "synthetic:qwen3-30b-a3b"}
    assert (results / "inputs" / "decode_cpu_sample.json").read_bytes() == (DATA / "decode_cpu_sample.json").read_bytes()


def test_cpu_sample_grid_holds_the_benchmark_numbers(cpu_run: tuple[Path, Path]) -> None:
    results, report = cpu_run
    sample = json.loads((DATA / "decode_cpu_sample.json").read_text())
    resident = next(c for c in sample["cells"] if c["mode"] == "resident" and c["variant"] == "default"
                    and c["routing"] == "model" and c["batch"] == 4)
    cells = load_run(results).cells
    variants = ht.tok_s_variant_grid(cells)
    row = variants[(variants["batch"] == 4) & (variants["routing"].str.startswith("model"))].iloc[0]
    assert row["resident"] == pytest.approx(resident["tok_per_s"])
    assert row["paged K=32"] == ht.NOT_RUN and row["llama.cpp fitted"] == ht.NOT_RUN  # absent, said so, never 0
    loop = next(c for c in sample["cells"] if c["variant"] == "loop" and c["routing"] == "model" and c["batch"] == 4)
    assert row["resident [loop]"] == pytest.approx(loop["tok_per_s"])
    best = ht.tok_s_grid(cells)
    best_row = best[(best["batch"] == 4) & (best["routing"].str.startswith("model"))].iloc[0]
    assert best_row["resident"] == pytest.approx(max(resident["tok_per_s"], loop["tok_per_s"]))
    serve = ht.serve_table(cells).set_index(["config", "concurrency"])
    assert serve.loc[("paged8", 1), "status"] == "ok" and serve.loc[("resident", 1), "status"] == ht.NOT_RUN
    md = (report / "tables.md").read_text()
    assert "## H200 decode tok/s by mode (fastest variant)" in md and "SYNTHETIC" in md


def test_standard_report_reads_the_run(cpu_run: tuple[Path, Path], tmp_path: Path) -> None:
    results, report = cpu_run
    index = write_report([results], tmp_path / "plain")
    assert "Configurations (repeats with spread)" in index.read_text()
    page = (report / "index.html").read_text()
    for anchor in ("h200-grid", "h200-roofline", "h200-budget", "h200-provenance", "raw-cells"):
        assert f'id="{anchor}"' in page


def test_h200_ratios_and_failures(h200_run: tuple[Path, Path]) -> None:
    results, _ = h200_run
    cells = load_run(results).cells
    offload = ht.paged_vs_offload_table(cells)
    row = offload[(offload["routing"].str.startswith("model")) & (offload["paged_config"] == "paged K=32 [graphs]")].iloc[0]
    assert row["paged_vs_offload"] == pytest.approx(80.0 / 8.0)
    assert row["published_paged_vs_offload"] == pytest.approx(205.6 / 16.6) and row["meets_published"] == "no"

    best = ht.tok_s_grid(cells)
    b1 = best[(best["batch"] == 1) & (best["routing"].str.startswith("model"))].iloc[0]
    assert b1["paged K=32"] == 80.0 and "paged K=32: graphs" in b1["best_variant"]
    assert b1["paged K=64"] == "FAILED: build: OOM"  # a mode that failed to build fails every cell it would have had
    assert str(b1["cpu-experts N=12"]).startswith("FAILED: RuntimeError")
    assert b1["llama.cpp fitted"] == 50.0 and b1["llama.cpp fitted N"] == 30
    b4 = best[(best["batch"] == 4) & (best["routing"].str.startswith("model"))].iloc[0]
    assert b4["llama.cpp N=48"] == "FAILED: llama-bench exited with code 1"
    synthetic = best[best["routing"].str.startswith("SYNTHETIC")].iloc[0]
    assert synthetic["llama.cpp N=0"].startswith("n/a")

    roof = ht.roofline_table(cells).set_index("cell_id")
    assert roof.loc["dec-paged-32-graphs-model-b1", "meets_target"] == "yes"
    assert roof.loc["dec-paged-32-host-model-b1", "meets_target"] == "no"
    assert roof.loc["dec-paged-64-graphs-model-b1", "meets_target"] == "failed"
    resident = ht.resident_table(cells).set_index("cell_id")
    assert resident.loc["dec-resident-model-b1", "meets_target"] == "yes"  # 300 >= 250 tok/s
    assert resident.loc["dec-resident-model-b1", "hbm_fraction"] == 0.75


def test_h200_equal_budget_reports_the_winner_either_way(h200_run: tuple[Path, Path]) -> None:
    results, _ = h200_run
    run = load_run(results)
    budget = ht.equal_budget_table(run.cells, run.manifest.extra["h200"]).set_index(["routing", "batch"])
    model = ht.routing_text("model")
    b1, b4 = budget.loc[(model, 1)], budget.loc[(model, 4)]
    # batch 1: paged K=32 80 tok/s vs llama.cpp's best within 16 GB: the fitted N=30 (50), not N=0 / N=12 (over) or N=24 (unknown)
    assert b1["llamacpp_config"] == "llama.cpp fitted" and b1["paged_vs_llamacpp"] == pytest.approx(80.0 / 50.0)
    assert b1["winner"] == "paged faster (1.60x)" and b1["paged_within_budget"] == "yes"
    assert b1["paged_gpu_memory_source"].startswith("measured: gpu_mem_peak_bytes")
    assert "Q8_0" in b1["note"] and "0.53x" in b1["note"] and "llama.cpp N=24" in b1["note"]
    # batch 4: 100 vs 120: llama.cpp wins and the table says so
    assert b4["winner"] == "llama.cpp faster (1.20x)"
    assert "its own (near-uniform) router" in budget.loc[(ht.routing_text("synthetic:qwen3-30b-a3b"), 1), "note"]


def test_equal_budget_estimates_paged_memory_when_not_measured(h200_run: tuple[Path, Path]) -> None:
    results, _ = h200_run
    run = load_run(results)
    cells = run.cells.copy()
    cells["extras"] = [{**e, "bench": {k: v for k, v in e.get("bench", {}).items() if k != "gpu_mem_peak_bytes"}} for e in cells["extras"]]
    row = ht.equal_budget_table(cells, run.manifest.extra["h200"]).iloc[0]
    assert row["paged_gpu_gb"] == pytest.approx((32 * 48 * EXPERT_BYTES + DENSE_BYTES) / 1e9)
    assert row["paged_gpu_memory_source"].startswith("estimate")


def test_h200_unknown_keys_and_run_facts_are_shown(h200_run: tuple[Path, Path]) -> None:
    _, report = h200_run
    tables = _tables(report)
    keys = tables["decode_h200.json: every key of every cell"]
    assert "new_metric_x" in keys.columns and "gpu_mem_peak_bytes" in keys.columns
    assert "decode_h200.json: pagein_paths" in tables
    failed = tables["Failed and invalid cells"]
    assert "dec-cpu-experts-12-model-b1" in set(failed["cell_id"]) and "llama-n48-b4" in set(failed["cell_id"])
    provenance = tables["Provenance: one row per exact command"]
    llama = provenance[provenance["engine"] == "llama.cpp"].iloc[0]
    assert "GGML_CUDA" in llama["build_flags"] and "6500" in llama["engine_version"]


def test_parse_env_reads_the_suite_format() -> None:
    env = h200_report.parse_env((DATA / "env.txt").read_text())
    assert env["gpu_name"] == "NVIDIA H200" and env["pcie_link"].startswith("PCIe Gen5 x16")
    assert env["cpu_count"] == 16 and env["torch"] == "2.11.0+cu130" and env["packages"]["msgspec"] == "MISSING"
    assert env["date_utc"] == "2026-11-29T10:00:00+00:00" and env["git_oneline"].startswith("ce38bd4")
    assert h200_report.parse_env("") == {}


def test_refuses_to_overwrite_without_the_flag(h200_run: tuple[Path, Path], tmp_path: Path) -> None:
    results, _ = h200_run
    argv = ["--decode", str(results / "inputs" / "decode_h200.json"), "--results", str(results), "--report", str(tmp_path / "r")]
    with pytest.raises(SystemExit, match="--overwrite"):
        h200_report.main(argv)


def test_equal_budget_takes_the_fastest_paged_cell_that_fits(h200_run: tuple[Path, Path]) -> None:
    """A paged cell whose measured memory is over the budget yields to a slower one that fits."""
    results, _ = h200_run
    run = load_run(results)
    cells = run.cells.copy()

    def over(e: dict[str, Any]) -> dict[str, Any]:
        b = e.get("bench", {})
        hit = b.get("mode") == "paged:32" and b.get("variant") == "graphs" and b.get("routing") == "model" and b.get("batch") == 1
        return {**e, "bench": {**b, "gpu_mem_peak_bytes": 17 * 10**9}} if hit else e

    cells["extras"] = [over(e) for e in cells["extras"]]
    b1 = ht.equal_budget_table(cells, run.manifest.extra["h200"]).set_index(["routing", "batch"]).loc[(ht.routing_text("model"), 1)]
    assert b1["paged_tok_per_s"] == pytest.approx(60.0) and b1["paged_within_budget"] == "yes"  # the host-planned cell
