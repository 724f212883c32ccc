"""The quickstart matrix plans what the README promises, and the real built-in server runs a
reduced version of it end to end (server process, load, counters, store)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from benchsuite.cli import main
from benchsuite.config.matrix import load_matrix
from benchsuite.config.plan import build_plan
from benchsuite.results.manifest import ServerRecord
from paged_experts.shape import ModelShape

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"


def test_quickstart_plans_four_modes_two_k_values_three_concurrencies_three_repeats() -> None:
    plan = build_plan(load_matrix(QUICKSTART))
    modes = sorted(s.options.mode for s in plan.servers)
    assert modes == ["cpu-experts", "offload", "paged", "paged", "resident"]
    assert sorted(s.options.resident_experts for s in plan.servers if s.options.mode == "paged") == [8, 16]
    assert {s.options.model for s in plan.servers} == {"tiny"}
    assert sorted({c.concurrency for c in plan.cells}) == [1, 2, 4]
    assert len(plan.cells) == 5 * 3 * 3  # three repeats, so every ratio has an interval
    assert plan.matrix.matrix.repeat_order == "interleaved"  # each repeat meets the machine at another time


@pytest.mark.slow
def test_reduced_quickstart_runs_on_the_real_builtin_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    body = yaml.safe_load(QUICKSTART.read_text())
    body["repeats"] = 1
    options = {"model": str(tiny_model_dir), "mode": "paged", "resident_experts": 8}
    body["engines"] = {"paged": {"kind": "builtin", "options": options}}
    # class "24": exact-length prompts sent as token ids, so the server's usage must say 24
    body["workloads"]["bundled"].update(
        prompt_classes=["24"], concurrency=[2], num_requests=3, warmup_requests=1, output_tokens=6
    )
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    assert main(["run", str(path), "--output-root", str(tmp_path / "results"), "--quiet", "--no-report"]) == 0
    (run_dir,) = (tmp_path / "results").iterdir()
    (cell_file,) = (run_dir / "cells").glob("*.json")
    payload = json.loads(cell_file.read_text())
    cell = payload["cell"]
    assert cell["status"] == "ok", cell["reason"]
    assert cell["mode"] == "paged" and cell["routing"] == "model" and cell["params"] == {}  # nothing swept
    # K from the YAML: a typed field of the cell, the same value the server was started with
    assert cell["resident_experts"] == 8 and cell["n_cpu_moe"] is None and cell["options"]["resident_experts"] == 8
    # performance options in force, defaults resolved for this device and mode (CPU: eager, grouped kernels)
    assert (cell["options"]["cuda_graph_max_bs"], cell["options"]["kernel_backend"]) == (0, "grouped")
    assert cell["expert_activations"] > 0 and 0.0 < cell["miss_rate"] <= 1.0
    measured = [r for r in payload["requests"] if not r["warmup"]]
    assert len(measured) == 3 and all(r["ok"] and r["output_tokens"] == 6 for r in measured)
    # warmup_requests 1 at c=2 is raised to one per stream (Workload.warmups_at), both streams at once; the
    # server's first request goes alone (cold), so its first cell sends one more: 3 warm-ups
    warm = [r for r in payload["requests"] if r["warmup"]]
    assert len(warm) == 3 and warm[0]["cold"] and not any(r["cold"] for r in warm[1:])
    assert max(r["t_sent_s"] for r in warm[1:]) < min(r["t_done_s"] for r in warm[1:])  # in flight together
    assert [r["prompt_tokens"] for r in payload["requests"]] == [24] * 6
    assert len({r["prompt_id"] for r in measured}) == 3
    (server,) = json.loads((run_dir / "manifest.json").read_text())["servers"].values()
    assert server["argv"][1:3] == ["-m", "paged_experts.server"]
    assert server["argv"][server["argv"].index("--paged-experts-num-resident") + 1] == "8"
    # the model's shape recorded typed at launch (the adapter's model_shape): the report reads it from here
    shape = ModelShape.from_dir(tiny_model_dir)
    assert (server["model"]["top_k"], server["model"]["num_experts"]) == (shape.top_k, shape.num_experts)
    assert ServerRecord.model_validate(server).model == shape
