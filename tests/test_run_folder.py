"""A run directory is only ever one the suite created (issue 27). Before the fix `--run-id` naming
an existing folder of the user's wrote the run's files into it, and `--new-run` then renamed the
user's whole folder aside."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_run_guard import bare_manifest, cli, weightless_model, write_matrix

from benchsuite.errors import UserError
from benchsuite.results.store import RunStore


def users_folder(root: Path, files: dict[str, str]) -> Path:
    folder = root / "out" / "mine"
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("new_run", [False, True], ids=["run-id", "new-run"])
def test_run_id_naming_a_users_folder_exits_2_and_leaves_it_alone(tmp_path: Path, new_run: bool) -> None:
    folder = users_folder(tmp_path, {"thesis.tex": "my work", "data.csv": "1,2"})
    before = snapshot(folder)
    path = write_matrix(tmp_path, weightless_model(tmp_path))
    done = cli(str(path), "--run-id", "mine", *(["--new-run"] if new_run else []))
    assert done.returncode == 2, done.stderr + done.stdout
    assert len(done.stderr.strip().splitlines()) == 1 and str(folder) in done.stderr, done.stderr
    assert "not a run directory" in done.stderr
    assert snapshot(folder) == before and sorted(p.name for p in folder.iterdir()) == ["data.csv", "thesis.tex"]
    assert sorted(p.name for p in folder.parent.iterdir()) == ["mine"]  # nothing moved aside


def test_a_manifest_json_that_is_not_a_runs_is_not_a_marker(tmp_path: Path) -> None:
    folder = users_folder(tmp_path, {"manifest.json": json.dumps({"name": "my web app", "icons": []})})
    for new_run in (False, True):
        with pytest.raises(UserError, match="not a run directory benchsuite created"):
            RunStore.open(folder, bare_manifest("h"), new_run=new_run)
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json"]


def test_the_suites_own_runs_and_empty_folders_are_used(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    RunStore.open(empty, bare_manifest("h")).close()
    assert (empty / "manifest.json").exists()
    RunStore.open(empty, bare_manifest("h")).close()  # a resume
    RunStore.open(empty, bare_manifest("h"), new_run=True).close()  # ours: moved aside
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("empty.replaced-")]) == 1


def test_a_run_stopped_before_its_manifest_is_taken_up_again(tmp_path: Path) -> None:
    """A run that stopped between taking its lock and writing its manifest (killed, or a directory
    it could not create) leaves only `.lock` behind: before, the same command was then refused as
    someone else's folder, forever."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / ".lock").write_text("")
    RunStore.open(folder, bare_manifest("h")).close()
    assert (folder / "manifest.json").exists()
    logs_only = users_folder(tmp_path, {})  # a folder with nothing of a run's but a name like one
    (logs_only / "logs").mkdir()
    with pytest.raises(UserError, match="not a run directory benchsuite created"):
        RunStore.open(logs_only, bare_manifest("h"))
