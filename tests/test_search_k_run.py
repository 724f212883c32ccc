"""The paged K search through `benchsuite run` on the real built-in server (tiny model, CPU), the
device memory injected at the sampler seam only: a reader that reports, for each live server
process of this test, memory linear in the K on its command line plus an overhead the projection
does not know. The search launches real servers, finds the largest K whose peak fits in three
launches, records every candidate (ruled-out ones with their projection), and the chosen K runs
the workload; `--dry-run` prints the search's command template with {K}."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import yaml

from benchsuite.cli import main
from benchsuite.engines.builtin import memory
from benchsuite.tools import device_memory

KV_TOKENS = 1024
CHOSEN = 20  # the largest K whose scripted peak fits the budget below
UNKNOWN_SLOTS = 3.5  # the scripted overhead, in slots: what the projection cannot know


def write_matrix(tmp_path: Path, model: Path, budget_gb: float) -> Path:
    body = {
        "name": "ksearch",
        "output_root": str(tmp_path / "results"),
        "fairness": {"kv_capacity_tokens": KV_TOKENS, "prefix_caching": False},
        "engines": {
            "paged": {
                "kind": "builtin",
                "options": {
                    "model": str(model),
                    "mode": "paged",
                    "resident_experts": "search",
                    "vram_budget_gb": budget_gb,
                },
            }
        },  # fmt: skip
        "workloads": {
            "w": {
                "dataset": "bundled",
                "prompt_classes": ["short"],
                "output_tokens": 4,
                "concurrency": [2],
                "num_requests": 2,
                "warmup_requests": 0,
            }
        },  # fmt: skip
    }
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


class LinearInK:
    """Scripted device memory of this test's servers: projection(K) + UNKNOWN_SLOTS slots."""

    def __init__(self, model: Path, projections: dict[int, memory.KProjection]) -> None:
        self.model, self.projections = str(model), projections

    def read(self) -> device_memory.DeviceSnapshot:
        used = {}
        for proc in psutil.process_iter(["pid", "cmdline"]):
            argv = proc.info["cmdline"] or []
            if self.model in argv and "--paged-experts-num-resident" in argv:
                k = int(argv[argv.index("--paged-experts-num-resident") + 1])
                p = self.projections[k]
                used[proc.info["pid"]] = p.gpu_total_bytes + int(UNKNOWN_SLOTS * p.slot_bytes)
        return device_memory.DeviceSnapshot(used, sum(used.values()))

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_k_search_runs_end_to_end(tiny_model_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    projections = memory.projections(tiny_model_dir, "float32", KV_TOKENS, range(8, 33))
    slot = projections[8].slot_bytes
    budget = projections[CHOSEN].gpu_total_bytes + int((UNKNOWN_SLOTS + 0.5) * slot)
    monkeypatch.setattr(device_memory, "open_reader", lambda: LinearInK(tiny_model_dir, projections))
    path = write_matrix(tmp_path, tiny_model_dir, budget / 1e9)
    assert main(["run", str(path), "--no-report"]) == 0
    out = capsys.readouterr().out
    (run_dir,) = (tmp_path / "results").iterdir()
    stored = [json.loads(p.read_text())["cell"] for p in (run_dir / "cells").glob("*.json")]
    searched = {c["extras"]["search_n"]: c for c in stored if "search_n" in c["extras"]}
    # the default overhead guess (1 GiB) lets no tiny K through: K=8 first, then the measured
    # correction says K=20, then its neighbour K=21 is verified over the budget
    assert sorted(searched) == [8, CHOSEN, CHOSEN + 1]
    assert searched[CHOSEN]["extras"]["chosen"] and not searched[CHOSEN + 1]["extras"]["chosen"]
    assert searched[CHOSEN + 1]["extras"]["search_outcome"] == "over budget"
    for k, c in searched.items():
        assert c["peak_device_memory_bytes"] == projections[k].gpu_total_bytes + int(UNKNOWN_SLOTS * slot)
        assert c["device_memory_method"] == device_memory.PER_PROCESS
    # what the sampler did is kept per cell, and each request's share of it in its wait for the first token (on the
    # requests' clock: a share is never longer than that wait, and the shares never exceed the cell's reads)
    for payload in (json.loads(p.read_text()) for p in (run_dir / "cells").glob("*.json")):
        sampler, sent = payload["cell"]["extras"]["memory_sampler"], payload["requests"]
        assert sampler["interval_s"] == device_memory.SAMPLE_INTERVAL_S and sampler["reads"] >= 1
        assert 0 <= sampler["read_ms_median"] <= sampler["read_ms_max"] and sampler["read_s_total"] >= 0
        for r in sent:
            assert 0 <= r["sampler_read_s"] <= r["t_first_token_s"] - r["t_sent_s"]
        assert sum(r["sampler_read_s"] for r in sent) <= sampler["read_s_total"] + 1e-9
    workload = [c for c in stored if "search_n" not in c["extras"]]
    assert workload and all(c["status"] == "ok" and c["resident_experts"] == CHOSEN for c in workload)
    assert all(c["peak_device_memory_bytes"] <= budget for c in workload)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (record,) = [s["search"] for s in manifest["servers"].values() if "candidates" in (s["search"] or {})]
    outcomes = {c["n"]: c["outcome"] for c in record["candidates"]}
    assert record["option"] == "resident_experts" and record["best_n"] == CHOSEN and record["launches"] == 3
    ruled = sorted(k for k, o in outcomes.items() if o == "ruled out")
    assert ruled and ruled == list(range(ruled[0], 33))  # the projection alone exceeds the budget there
    assert all(projections[k].gpu_total_bytes > budget for k in ruled)
    assert f"best K={CHOSEN}" in out and "measured over the budget: K=21" in out
    (chosen_server,) = [s for s in manifest["servers"].values() if s.get("argv") and s["search"] and
                        "request" in s["search"]]  # fmt: skip
    assert chosen_server["argv"][chosen_server["argv"].index("--paged-experts-num-resident") + 1] == str(CHOSEN)


def test_dry_run_prints_the_k_search_template(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    path = write_matrix(tmp_path, tiny_model_dir, 1.0)
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "search paged: resident_experts is searched" in out
    assert "--paged-experts-num-resident {K}" in out
    assert "({K}: each candidate the memory projection lets through; one cell per launch: " in out


def test_a_search_request_outside_mode_paged_names_its_yaml_path(tmp_path: Path, capsys) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(
        "name: bad\nengines:\n  e:\n    kind: builtin\n    options: {model: tiny, mode: resident, "
        "resident_experts: {search: {objective: quickest}}}\nworkloads:\n  w: {concurrency: [1], num_requests: 1}\n"
    )
    assert main(["run", str(path), "--dry-run"]) == 2
    assert "engines.e.options" in capsys.readouterr().err
