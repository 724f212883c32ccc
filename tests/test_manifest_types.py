"""The manifest's typed blocks (machine, git, link, fingerprint, fairness, search, canary) write the
JSON the plain dicts wrote: stored runs of every layout read and write back unchanged, an older
block keeps exactly its keys, a producer's block has the keys it always had, a typo is refused."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import pydantic
import pytest

from benchsuite.results.manifest import Manifest, ServerRecord
from benchsuite.results.server_facts import CanaryResult, SearchCandidate, SearchRecord
from benchsuite.results.stored_files import read_manifest_file
from benchsuite.tools.linkbw import probe_in_subprocess
from benchsuite.tools.machine import GitFacts, MachineFacts, machine_facts

ROOT = Path(__file__).resolve().parents[1]
ARCHIVES = sorted((ROOT / "results" / "archive").glob("*.tar.xz"))  # the device machine's runs, packed (its README)
STORED = [*ARCHIVES, ROOT / "tests/data/report_fixture/manifest.json"]


def _stored_manifest(path: Path, into: Path) -> Path:
    """A stored manifest's path: the file itself, or an archived run's `<run>/manifest.json` unpacked into `into`."""
    if path.suffix != ".xz":
        return path
    run = path.name.removesuffix(".tar.xz")
    with tarfile.open(path, "r:xz") as tar:
        member = tar.extractfile(f"{run}/manifest.json")
        assert member is not None
        (into / run).mkdir(parents=True)
        (into / run / "manifest.json").write_bytes(member.read())
    return into / run / "manifest.json"


def _without_later_fields(written: dict[str, Any], stored: dict[str, Any]) -> dict[str, Any]:
    """`written` less the empty fields Manifest and ServerRecord gained after the file was stored
    (`model: null`, `link_bandwidth: null`, ...): only the blocks inside must write back as stored."""

    def known(out: dict[str, Any], was: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in out.items() if k in was or v not in (None, {}, [])}

    servers = {sid: known(entry, stored["servers"][sid]) for sid, entry in written["servers"].items()}
    return {**known(written, stored), "servers": servers}


def _stored_id(path: Path) -> str:
    return path.name.removesuffix(".tar.xz") if path.suffix == ".xz" else path.parent.name


@pytest.mark.parametrize("stored_path", STORED, ids=_stored_id)
def test_stored_manifests_read_and_write_back_unchanged(stored_path: Path, tmp_path: Path) -> None:
    path = _stored_manifest(stored_path, tmp_path)
    stored = json.loads(path.read_text())
    manifest = read_manifest_file(path)
    assert isinstance(manifest.machine, MachineFacts) and isinstance(manifest.git, GitFacts)
    assert _without_later_fields(manifest.to_json(), stored) == stored


def test_every_committed_run_is_one_folder_named_as_its_archive() -> None:
    """results/archive/<run>.tar.xz holds `<run>/` alone (unpacked with `-C results` it lands where the write-ups cite
    it), its manifest and cells among them, plain files and folders only, no routing traces."""
    assert len(ARCHIVES) >= 14  # the runs packed on 2026-12-07
    for archive in ARCHIVES:
        run = archive.name.removesuffix(".tar.xz")
        with tarfile.open(archive, "r:xz") as tar:
            members = tar.getmembers()
        names = {m.name for m in members}
        assert all(n == run or n.startswith(f"{run}/") for n in names), archive.name
        assert f"{run}/manifest.json" in names and any(n.startswith(f"{run}/cells/") for n in names), archive.name
        assert all(m.isfile() or m.isdir() for m in members), archive.name
        assert not any("/routing/" in n for n in names), archive.name


def test_a_version_1_manifest_reads_into_the_typed_blocks() -> None:
    manifest = read_manifest_file(ROOT / "tests/data/results_v1/manifest.json")
    assert manifest.git.model_dump() == {"commit": manifest.git.commit, "dirty": False}  # only what it stored
    assert manifest.machine.gpus == [] and manifest.machine.hostname
    assert all(s.fairness.kv_capacity_tokens for s in manifest.servers.values())


def test_an_older_block_keeps_exactly_its_keys_and_a_typo_is_refused() -> None:
    git = GitFacts.model_validate({"commit": "c", "dirty": False})  # before `tree` and `source`
    assert git.tree is None and git.model_dump(mode="json") == {"commit": "c", "dirty": False}
    search = SearchRecord.model_validate(
        {
            "option": "n_cpu_moe",
            "budget_bytes": 5,
            "candidates": [
                {"n": 3, "outcome": "ruled out", "projected_bytes": 7, "projection": {"source": "fit"}, "value": None}
            ],
        }
    )
    assert search.model_dump()["candidates"] == [  # no peak_device_memory_bytes: the older record had none
        {"n": 3, "outcome": "ruled out", "projected_bytes": 7, "projection": {"source": "fit"}, "value": None}
    ]
    with pytest.raises(pydantic.ValidationError):
        GitFacts.model_validate({"comit": "c"})
    with pytest.raises(pydantic.ValidationError):
        ServerRecord.model_validate({"canary": {"passed": True, "leak": []}})


def test_the_producers_write_every_key_they_always_wrote(tmp_path: Path) -> None:
    machine = machine_facts().model_dump(mode="json")
    assert set(machine) == {"hostname", "os", "wsl", "python", "cpu_model", "cpu_cores_logical",
                            "cpu_cores_physical", "ram_bytes", "gpus", "gpu_probe", "packages"}  # fmt: skip
    failed = probe_in_subprocess(("false",)).model_dump(mode="json")
    assert set(failed) == {"command", "measured_unix_s", "error"}  # no figure, and no null one
    ruled = SearchCandidate(n=1, outcome="ruled out", projected_bytes=2, projection={}, value=None, cell_id=None,
                            peak_device_memory_bytes=None)  # fmt: skip
    assert ruled.model_dump() == {"n": 1, "outcome": "ruled out", "projected_bytes": 2, "projection": {},
                                  "value": None, "cell_id": None, "peak_device_memory_bytes": None}  # fmt: skip
    assert CanaryResult(error="boom").model_dump() == {"error": "boom"}
    manifest = Manifest(run_id="r", created_utc="t", matrix_source="m", matrix_hash="h", matrix={},
                        git=GitFacts(commit="c", dirty=True, tree="t", source="package"))  # fmt: skip
    written = manifest.with_server("s", canary=CanaryResult(marker="M", requests_checked=2, leaks=[],
                                                           interference=[], passed=True)).to_json()  # fmt: skip
    assert written["git"] == {"commit": "c", "dirty": True, "tree": "t", "source": "package"}
    assert written["servers"]["s"]["canary"] == {"marker": "M", "requests_checked": 2, "leaks": [],
                                                 "interference": [], "passed": True}  # fmt: skip
    assert written["servers"]["s"]["fairness"] == {} and written["link_bandwidth"] is None
