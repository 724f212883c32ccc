"""The code a run measured with is named even without a git checkout: benchsuite.tools.machine's
content_tree_hash gives git's own tree hash of a package directory from its files (an unpacked `git archive`, an
installed wheel), so a manifest's `git.code` still says which commit's code ran."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from benchsuite.tools import machine
from benchsuite.tools.machine import FILES_SOURCE, content_tree_hash

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git to check the hashes against")


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.strip()


@needs_git
def test_the_content_hash_is_gits_tree_hash_of_the_same_files(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    pkg = repo / "pkg"
    (pkg / "sub" / "deeper").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "sub" / "mod.py").write_text("y = 2\n")
    (pkg / "sub" / "deeper" / "data.bin").write_bytes(bytes(range(256)))
    (pkg / "sub-file.txt").write_text("sorted before 'sub/' by git ('-' < '/'), after 'sub' by name\n")
    (pkg / "run.sh").write_text("#!/bin/sh\n")
    (pkg / "run.sh").chmod(0o755)
    (pkg / "others.sh").write_text("#!/bin/sh\n")
    (pkg / "others.sh").chmod(0o655)  # executable by group and others, not the owner: git stores 100644
    (pkg / "link").symlink_to("sub/mod.py")
    _git(repo.parent, "init", "-q", str(repo))
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "c")
    expected = _git(repo, "rev-parse", "HEAD:pkg")
    assert content_tree_hash(pkg) == expected
    # what a running copy adds and no commit holds: bytecode, an empty directory, install metadata
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "mod.cpython-312.pyc").write_bytes(b"\0")
    (pkg / "sub" / "mod.pyc").write_bytes(b"\0")
    (pkg / "empty").mkdir()
    (pkg / "pkg.egg-info").mkdir()
    (pkg / "pkg.egg-info" / "PKG-INFO").write_text("Name: pkg\n")
    assert content_tree_hash(pkg) == expected
    (pkg / "sub" / "mod.py").write_text("y = 3\n")  # other code: another hash
    assert content_tree_hash(pkg) != expected
    assert content_tree_hash(tmp_path / "missing") is None


@needs_git
def test_an_unpacked_archive_of_this_checkout_names_its_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This checkout's own packages, as `git archive` unpacks them (no .git): the hashes the manifest gets are
    the commit's trees, so `git rev-parse COMMIT:benchsuite` finds which code ran."""
    root = Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    archive = subprocess.run(["git", "-C", str(root), "archive", "HEAD", *machine.CODE_DIRS], capture_output=True,
                             check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    for name in machine.CODE_DIRS:
        assert content_tree_hash(tmp_path / name) == _git(root, "rev-parse", f"HEAD:{name}")
    # git_facts without a checkout anywhere (the package dir and the working directory): the files' hashes
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(machine, "installed_code_trees", lambda: {n: content_tree_hash(tmp_path / n) for n in
                                                                  machine.CODE_DIRS})  # fmt: skip
    facts = machine.git_facts(source_dir=tmp_path)
    assert facts.commit is None and facts.tree is None and facts.source == FILES_SOURCE
    assert facts.code == {name: _git(root, "rev-parse", f"HEAD:{name}") for name in machine.CODE_DIRS}


def test_the_installed_packages_are_hashed_where_python_imports_them(tmp_path: Path) -> None:
    """Where Python imports each package from, a linked package directory hashed where it points; a file that
    cannot be read names no code rather than failing the run."""
    import benchsuite
    import paged_experts

    trees = machine.installed_code_trees()
    assert trees is not None and set(trees) == set(machine.CODE_DIRS)
    for module in (benchsuite, paged_experts):
        assert trees[module.__name__] == content_tree_hash(Path(module.__file__).parent)
    linked = tmp_path / "linked"  # a copy whose package directory is a link
    linked.symlink_to(Path(paged_experts.__file__).parent)
    assert machine.package_dir("paged_experts") == Path(paged_experts.__file__).parent.resolve()
    assert content_tree_hash(linked) is None  # the link itself is not a tree...
    via_link = machine.installed_code_trees(lambda name: linked.resolve())  # ...where it points is
    assert via_link == {name: trees["paged_experts"] for name in machine.CODE_DIRS}

    def unreadable(directory: Path) -> str:  # as a file the user cannot read (root reads every file: simulated)
        raise PermissionError(13, "Permission denied", str(directory / "a.py"))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(machine, "content_tree_hash", unreadable)
        assert machine.installed_code_trees() is None  # not an error: no code named
