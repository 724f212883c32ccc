"""A workload's ShareGPT file is checked before anything starts (benchsuite.load.dataset_check): a file
that exists but cannot give the run its prompts (not JSON nor JSON Lines, a truncated download, no
usable conversation, too few, unreadable) stops a run in one line naming the file and what is wrong
(exit 2, no results directory) and is listed by a dry run; the check never refuses a file the loader
reads, and reads no more than the prompts the run needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from benchsuite.cli import main
from benchsuite.errors import UserError
from benchsuite.load.dataset_check import sharegpt_problem
from benchsuite.load.datasets import load_sharegpt


def conversation(i: int, first: str = "human") -> dict:
    return {"id": f"c{i}", "conversations": [{"from": first, "value": f"question {i}"}, {"from": "gpt", "value": "a"}]}


GOOD_LIST = json.dumps([conversation(i) for i in range(3)], indent=1)
GOOD_LINES = "\n".join(json.dumps(conversation(i)) for i in range(3)) + "\n"
BAD = {
    "html page": ("<html><body>Not found</body></html>\n", "line 1 is not valid JSON (Expecting value)"),
    "truncated list": (GOOD_LIST[: len(GOOD_LIST) // 2], "not valid JSON"),
    "list cut after an item": (GOOD_LIST.rstrip().removesuffix("]").rstrip(), "the list does not end with ']'"),
    "bad jsonl line": (
        GOOD_LINES.replace('"c1"', "'c1'"),
        "line 2 is not valid JSON (Expecting value): neither a JSON list nor JSON Lines",
    ),
    "cut last line": (GOOD_LINES + '{"id": "c9", "conv', "line 4 is not valid JSON"),
    "empty": ("", "the file is empty"),
    "empty list": ("[]", "holds no conversation"),
    "no conversations": (json.dumps([{"id": 1, "text": "hello"}]), "no item has a 'conversations' list"),
    "no human turn": (json.dumps([conversation(i, first="gpt") for i in range(3)]), "only 0 conversations"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_malformed_file_is_named_with_what_is_wrong_and_the_loader_refuses_it_too(tmp_path: Path, name: str) -> None:
    text, expected = BAD[name]
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    problem = sharegpt_problem(path, 2)
    assert problem is not None and expected in problem, problem
    with pytest.raises(UserError):
        load_sharegpt(path, 2, 0)


@pytest.mark.parametrize("text", [GOOD_LIST, GOOD_LINES, "  \n" + GOOD_LIST + "\n\n"], ids=["list", "lines", "spaces"])
def test_a_file_the_loader_reads_passes(tmp_path: Path, text: str) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    assert sharegpt_problem(path, 3) is None
    assert len(load_sharegpt(path, 3, 0)) == 3
    assert sharegpt_problem(path, 4) == "only 3 conversations start with a human turn, the workload sends 4 requests"


def test_items_split_across_read_chunks_decode(tmp_path: Path) -> None:
    long = [{"id": i, "conversations": [{"from": "human", "value": "x" * 50_000 + str(i)}]} for i in range(8)]
    path = tmp_path / "long.json"
    path.write_text(json.dumps(long))
    assert sharegpt_problem(path, 8) is None
    path.write_text(json.dumps(long)[:-3] + "!}]")  # the last item broken past several chunks
    assert "not valid JSON" in (sharegpt_problem(path, 8) or "")


def test_the_check_reads_only_the_prompts_the_run_needs_and_the_tail(tmp_path: Path) -> None:
    """A defect in the middle of a big file, past the prompts needed, is left to the loader: the check's
    cost is bounded by the prompts the run needs, and the tail still catches a truncated download."""
    items = [json.dumps(conversation(i)) for i in range(5000)]
    path = tmp_path / "big.json"
    path.write_text("[" + ",\n".join(items[:10]) + ",\nNOT JSON,\n" + ",\n".join(items[10:]) + "]")
    assert sharegpt_problem(path, 10) is None
    assert sharegpt_problem(path, 11) is not None  # the eleventh prompt lies past the defect
    with pytest.raises(UserError):
        load_sharegpt(path, 10, 0)  # the run's loader reads the whole file and says so in one line


def test_an_unreadable_file_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(GOOD_LIST)

    def refused(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(self))  # what a file without read permission gives

    monkeypatch.setattr(Path, "open", refused)  # root (CI containers) reads a chmod-0 file anyway
    assert sharegpt_problem(path, 1) == "cannot read (Permission denied)"


def write_matrix(tmp_path: Path, dataset: Path) -> Path:
    body = {
        "name": "data",
        "output_root": str(tmp_path / "results"),
        "engines": {"resident": {"kind": "builtin", "options": {"model": "tiny", "mode": "resident"}}},
        "workloads": {"chat": {"dataset": "sharegpt", "path": dataset.name, "num_requests": 2}},
    }
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_a_malformed_dataset_stops_the_run_in_one_line_and_a_dry_run_lists_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = tmp_path / "sharegpt.jsonl"
    dataset.write_text(GOOD_LINES.replace('"c2"', "c2"))
    matrix = write_matrix(tmp_path, dataset)
    assert main(["run", str(matrix), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        f"benchsuite: error: {matrix}: workloads.chat.path: {dataset}: line 3 is not valid JSON "
        "(Expecting value): neither a JSON list nor JSON Lines"
    ]
    assert not (tmp_path / "results").exists()
    assert main(["run", str(matrix), "--dry-run"]) == 0
    assert f"  missing: {matrix}: workloads.chat.path: {dataset}: line 3 is not valid JSON" in capsys.readouterr().out


def test_a_directory_named_as_the_dataset_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "sharegpt").mkdir()
    matrix = write_matrix(tmp_path, tmp_path / "sharegpt")
    assert main(["run", str(matrix), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"benchsuite: error: {matrix}: workloads.chat.path: {tmp_path / 'sharegpt'} is a directory, not a file"
    )
