"""configs/h200/prefill.yaml validates and plans (dry run, the model path pointed at a stand-in) with
what issue 20 asks: resident and paged K = 16, 32, 64 under calibrated synthetic routing, both prefill
residency policies, short and 2,048-token prompts at c=1, >= 2 repeats, the link probe."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchsuite.cli import main
from benchsuite.config.matrix import load_matrix
from benchsuite.config.plan import build_plan

PATH = Path(__file__).resolve().parent.parent / "configs" / "h200" / "prefill.yaml"


def test_prefill_matrix_plans_what_the_issue_asks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from paged_experts.weights.synth_memory import write_weightless

    # the real shapes (48 layers, 128 experts): the matrix checks K against config.json when it loads
    monkeypatch.setenv("BENCH_H200_MODEL", str(write_weightless("qwen3-30b-a3b-shape", tmp_path / "q48")))
    assert main(["run", str(PATH), "--dry-run"]) == 0
    assert "link bandwidth" in capsys.readouterr().out
    matrix = load_matrix(PATH).matrix
    assert matrix.repeats >= 2 and matrix.linkbw
    (workload,) = matrix.workloads.values()
    assert workload.prompt_classes == ["short", "2048"] and workload.concurrency == [1]
    servers = build_plan(load_matrix(PATH)).servers
    paged = sorted(
        (s.options.resident_experts, s.options.prefill_residency) for s in servers if s.options.mode == "paged"
    )
    assert paged == [(k, keep) for k in (16, 32, 64) for keep in ("lru", "recent")]
    assert [s.options.mode for s in servers].count("resident") == 1
    assert {s.options.routing for s in servers} == {"qwen3-30b-a3b"}
