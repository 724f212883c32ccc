"""Matrix `linkbw: true`: the link probe runs once per run, in a child process, before the first
server; its figure (or why there is none) is stored in the manifest as `link_bandwidth`; turning it on
keeps the run id; a resumed run does not measure again. The engine is test_runner's fake."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_runner import fake_engine, matrix, only_run_dir, run_cli  # noqa: F401 (autouse: the fake engine)

import benchsuite.tools.linkbw
from benchsuite.config.matrix import load_matrix


def with_linkbw(path: Path) -> Path:
    body = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**body, "linkbw": True}))
    return path


def test_a_scripted_probe_is_stored_once_and_keeps_the_run_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = matrix(tmp_path, {"e": {}}, concurrency=[1], num_requests=2)
    plain_hash = load_matrix(path).matrix_hash
    count = tmp_path / "probes"
    script = (f"import json, pathlib; p = pathlib.Path({str(count)!r}); "
              "p.write_text(p.read_text() + 'x' if p.exists() else 'x'); "
              "print(json.dumps({'paging_gb_per_s': 51.5, 'device': 'scripted', 'schema_version': 1}))")  # fmt: skip
    monkeypatch.setattr(benchsuite.tools.linkbw, "PROBE_ARGV", (sys.executable, "-c", script))
    with_linkbw(path)
    assert load_matrix(path).matrix_hash == plain_hash
    assert run_cli(str(path)) == 0
    manifest = json.loads((only_run_dir(tmp_path) / "manifest.json").read_text())
    link = manifest["link_bandwidth"]
    assert link["paging_gb_per_s"] == 51.5 and link["device"] == "scripted" and "error" not in link
    assert run_cli(str(path)) == 0  # resumed: the figure is kept, not measured again
    assert count.read_text() == "x"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA record")
def test_without_cuda_the_run_says_why_and_its_cells_stand(tmp_path: Path) -> None:
    path = with_linkbw(matrix(tmp_path, {"e": {}}, concurrency=[1], num_requests=2))
    assert run_cli(str(path)) == 0
    manifest = json.loads((only_run_dir(tmp_path) / "manifest.json").read_text())
    link = manifest["link_bandwidth"]
    assert "paging_gb_per_s" not in link and "needs a CUDA GPU" in link["error"]
    assert link["command"][-2:] == ["linkbw", "--json"]
