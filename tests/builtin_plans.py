"""Builtin-adapter command lines planned from a one-engine matrix (several test modules share them)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from benchsuite.config.matrix import load_matrix
from benchsuite.config.plan import build_plan
from benchsuite.engines.builtin.adapter import BuiltinAdapter

MATRIX = """
name: perf
engines:
  e:
    kind: builtin
    options: {{model: {model}, {options}}}
workloads:
  w: {{concurrency: [1, 4], num_requests: 2}}
"""


def plan_argv(tmp_path: Path, options: str) -> tuple[list[str], dict]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    path = tmp_path / "m.yaml"
    path.write_text(textwrap.dedent(MATRIX.format(model=model, options=options)))
    plan = build_plan(load_matrix(path))
    (spec,) = plan.servers
    adapter = BuiltinAdapter()
    return adapter.launch_plan(spec, 8000).argv, adapter.resolved_options(spec)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]
