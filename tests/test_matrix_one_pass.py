"""Every matrix problem in one pass, each naming its YAML path (issue 27). Before the fix a matrix
with four bad numbers needed two runs (finite/size checks stopped before the schema's), an alias
bomb's error named a line but no key, and a 200,001-value plain list was blamed on "an alias bomb?"."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchsuite.config.matrix import load_matrix
from benchsuite.config.yaml_safe import MAX_EXPANDED_NODES
from benchsuite.errors import UserError

CORPUS = Path(__file__).parent / "data" / "bad_matrices"


def problems(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load_matrix(path)
    lines = str(err.value).splitlines()
    assert all(line.startswith(f"{path}: ") for line in lines), lines
    return lines


def test_four_bad_numbers_are_all_named_in_one_pass(tmp_path: Path) -> None:
    lines = problems(
        tmp_path,
        "name: four\nrepeats: -1\nfairness: {kv_capacity_tokens: .inf}\n"
        "engines: {e: {kind: builtin, options: {model: /m, mode: resident}}}\n"
        "workloads: {w: {concurrency: [0], num_requests: 1.0e+30}}\n",
    )
    joined = "\n".join(lines)
    for place in ("repeats:", "fairness.kv_capacity_tokens: inf is not a finite number",
                  "workloads.w.concurrency", "workloads.w.num_requests: 1e+30 is beyond"):  # fmt: skip
        assert place in joined, joined
    assert len(lines) == 4, joined  # the schema does not name the two numbers a second time


def test_an_alias_bomb_names_its_yaml_path() -> None:
    with pytest.raises(UserError, match=r"alias_bomb.yaml: f: line 7, column 4: aliases expand to more than"):
        load_matrix(CORPUS / "alias_bomb.yaml")


def test_a_long_plain_list_is_too_many_values_not_an_alias_bomb(tmp_path: Path) -> None:
    values = ", ".join(["1"] * (MAX_EXPANDED_NODES + 1))
    (line,) = problems(tmp_path, f"name: big\nworkloads: {{w: {{concurrency: [{values}]}}}}\n")
    assert "workloads.w.concurrency: line 2" in line and "too many values" in line and "alias" not in line, line
