"""The README's commands as a newcomer and CI run them: (a) a virtual environment and the CPU-only torch
before the package, then the quickstart; CI's .ci/run is command (b) exactly, one step per line; the
matrix reference is a matrix that loads and recommends at least 3 repeats."""

from __future__ import annotations

import re
from pathlib import Path

from benchsuite.config.matrix import load_matrix

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def bash_block(after: str) -> str:
    section = README[README.index(after) :]
    return re.search(r"```bash\n(.*?)\n```", section, re.S).group(1)  # type: ignore[union-attr]


def test_command_a_installs_into_a_venv_with_the_cpu_torch_first() -> None:
    steps = bash_block("**(a)").split(" && ")
    assert steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"]
    # pinned: an unpinned torch can resolve to a newer build that is not CPU-only
    assert steps[2] == "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    # editable: every run records the commit and dirty flag of the code that ran (tools/machine.git_facts)
    assert steps[3:] == ["pip install -e .", "benchsuite run configs/quickstart.yaml"]


def test_ci_runs_command_b_exactly() -> None:
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    steps = [line for line in script if line and not line.startswith(("#", "set ", "export ", "cd "))]
    assert " && ".join(steps) == bash_block("**(b)")


def test_the_matrix_reference_loads_and_recommends_three_repeats(tmp_path: Path) -> None:
    section = README[README.index("## Matrix reference") :]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    (tmp_path / "m.yaml").write_text(block)
    matrix = load_matrix(tmp_path / "m.yaml").matrix
    assert matrix.repeats >= 3
    assert "1-2 degrees of freedom" in block  # the reason, beside the value
