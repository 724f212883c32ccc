"""Planning: cell counts, stable ids, one server per resolved option set, dry-run listing."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from benchsuite.cli import main
from benchsuite.config.matrix import load_matrix
from benchsuite.config.plan import SearchTask, build_plan, make_server_spec, resolve_search, search_option
from benchsuite.engines.base import Fairness
from benchsuite.engines.llamacpp.adapter import LlamaCppOptions
from benchsuite.engines.search_settings import NCpuMoeSettings

ROOT = Path(__file__).resolve().parents[1]

MATRIX = """
name: p
repeats: 2
fairness: {kv_capacity_tokens: 4096}
engines:
  paged:
    kind: builtin
    options: {model: /models/m, mode: paged, resident_experts: [4, 8]}
  cpu:
    kind: builtin
    options: {model: /models/m, mode: cpu-experts, n_cpu_moe: 2}
workloads:
  short:
    prompt_classes: [short]
    concurrency: [1, 4]
  long:
    prompt_classes: ["128"]
    concurrency: [2]
"""


def plan_of(tmp_path: Path, text: str = MATRIX, run_id: str | None = None):
    path = tmp_path / "m.yaml"
    path.write_text(textwrap.dedent(text))
    return build_plan(load_matrix(path), run_id=run_id)


def test_counts_and_server_facts(tmp_path: Path) -> None:
    plan = plan_of(tmp_path)
    assert len(plan.servers) == 3
    # per server: (1 class x 2 conc + 1 class x 1 conc) x 2 repeats
    assert len(plan.cells) == 3 * 3 * 2
    assert {s.max_concurrency for s in plan.servers} == {4}
    assert plan.servers[0].fairness == Fairness(kv_capacity_tokens=4096, prefix_caching=False)
    assert len({c.cell_id for c in plan.cells}) == len(plan.cells)
    assert plan.run_id == f"p-{plan.matrix.matrix_hash[:8]}"
    assert plan_of(tmp_path, run_id="mine").run_id == "mine"


def test_ids_are_stable_and_change_only_with_their_spec(tmp_path: Path) -> None:
    a, b = plan_of(tmp_path), plan_of(tmp_path)
    assert [c.cell_id for c in a.cells] == [c.cell_id for c in b.cells]
    changed = plan_of(tmp_path, MATRIX.replace("n_cpu_moe: 2", "n_cpu_moe: 3"))
    same = {c.cell_id for c in a.cells} & {c.cell_id for c in changed.cells}
    assert len(same) == 2 * 3 * 2  # the two paged servers keep their ids
    assert all(c.engine == "paged" for c in a.cells if c.cell_id in same)


def test_ids_are_those_of_schema_1(tmp_path: Path) -> None:
    """Typed options hash to the ids the untyped option dicts had (a rerun of an old matrix resumes).
    An id hashes every option's value, defaults included: a new option field of an engine changes
    the ids of that engine's servers. Update these deliberately, and say so, when that happens."""
    plan = plan_of(tmp_path)
    # re-pinned when the builtin option cpu_threads was added (every builtin server id changed)
    assert [s.server_id for s in plan.servers] == ["63d2f75f0dc7", "9e5d1c6be0fb", "2cb7e0ebf4ca"]
    assert (plan.cells[0].cell_id, plan.cells[-1].cell_id) == ("3f6a34c77881", "be448f689f16")
    quickstart = build_plan(load_matrix(ROOT / "configs" / "quickstart.yaml"))
    assert [s.server_id for s in quickstart.servers] == [
        "b5c1fc82d4a0", "1589b5eeca4a", "fbdf44e2e56a", "cd7f5a4f2d42", "cdc0ea1ede8b"
    ]  # fmt: skip
    assert quickstart.cells[0].cell_id == "4c4cda6a906d"


def test_search_option_and_resolution(tmp_path: Path) -> None:
    assert search_option(LlamaCppOptions(n_cpu_moe="search", threads=4)) == "n_cpu_moe"
    assert search_option(LlamaCppOptions(n_cpu_moe={"search": {"min_n": 1}})) == "n_cpu_moe"
    assert search_option(LlamaCppOptions(n_cpu_moe=3)) is None
    plan = plan_of(tmp_path)
    spec = make_server_spec("ll", "llamacpp", LlamaCppOptions(n_cpu_moe="search"), Fairness(1), 4)
    task = SearchTask(spec=spec, option="n_cpu_moe", params={}, settings=NCpuMoeSettings())
    assert task.request == "search"
    server, cells = resolve_search(plan, task, spec.options.replaced(n_cpu_moe=7))
    assert server.options == LlamaCppOptions(n_cpu_moe=7) and server.server_id != spec.server_id
    assert server.options.placement().n_cpu_moe == 7
    assert len(cells) == 3 * 2 and all(c.params == {"n_cpu_moe": 7} for c in cells)


def test_dry_run_prints_commands_and_cells(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(textwrap.dedent(MATRIX))
    assert main(["run", str(path), "--dry-run", "--output-root", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "3 servers, 18 cells" in out
    flags = "--mode paged --device cpu --max-running-requests 4 --max-total-tokens 4096 --paged-experts-num-resident 8"
    assert flags in out
    assert "--n-cpu-moe 2" in out
    assert out.count("  cell ") == 18
    assert not (tmp_path / "out").exists()  # nothing written, nothing started


def test_only_selects_servers_by_engine_and_sweep_value_and_keeps_the_run_id(tmp_path: Path) -> None:
    from benchsuite.config.plan import select
    from benchsuite.errors import UserError

    plan = plan_of(tmp_path)
    part = select(plan, ["paged:resident_experts=8", "cpu"])
    assert part.run_id == plan.run_id  # a later run of the rest resumes the same directory
    assert sorted((s.name, dict(part.params[s.server_id])) for s in part.servers) == [
        ("cpu", {}),
        ("paged", {"resident_experts": 8}),
    ]
    kept = {s.server_id for s in part.servers}
    assert {c.cell_id for c in part.cells} == {c.cell_id for c in plan.cells if c.server_id in kept}
    assert len(select(plan, ["paged"]).servers) == 2
    with pytest.raises(UserError, match="--only paged:resident_experts=5: no server of the matrix matches"):
        select(plan, ["paged:resident_experts=5"])
    with pytest.raises(UserError, match="use ENGINE or ENGINE:OPTION=VALUE"):
        select(plan, ["paged:resident_experts"])
