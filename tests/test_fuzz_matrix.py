"""Bad matrix files: property-based fuzzing of the loader through the CLI, and a corpus.

`benchsuite run FILE --dry-run` on any document must end as exit 0 (it was valid and planned) or
exit 2 with an error on stderr that names the file (every problem line is `FILE: yaml.path:
message`); never a traceback, never another exit status. The fuzzer mutates a valid matrix
(delete, replace or add a key anywhere, with values of every YAML type) and also writes raw
text and raw bytes. The corpus (tests/data/bad_matrices/*.yaml) pins one expected message each,
listed in tests/data/bad_matrices/expected.yaml.
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchsuite.cli import main as cli_main

CORPUS = Path(__file__).resolve().parent / "data" / "bad_matrices"
MODEL = "/nonexistent/fuzz-model"  # a dry run never opens the model; no export, no download

BASE: dict[str, Any] = {
    "name": "fuzz",
    "output_root": "results",
    "repeats": 1,
    "fairness": {"kv_capacity_tokens": 1024, "prefix_caching": False},
    "engines": {
        "paged": {"kind": "builtin", "options": {"model": MODEL, "mode": "paged", "resident_experts": [4, 8]}},
        "cpu": {"kind": "builtin", "options": {"model": MODEL, "mode": "cpu-experts", "n_cpu_moe": 2}},
    },
    "workloads": {
        "w": {"dataset": "bundled", "prompt_classes": ["short", 64], "output_tokens": 8, "concurrency": [1, 2],
              "num_requests": 2, "warmup_requests": 0, "arrival": "closed", "seed": 0},
    },
}  # fmt: skip

WORDS = ["search", "tiny", "resident", "paged", "offload", "builtin", "llamacpp", "sglang", "short", "128",
         "poisson", "closed", "sharegpt", "random", "on", "off", "yes", "", " ", "pr42557", "model",
         "mode"]  # fmt: skip
# Integers stay small: `repeats` and sweeps multiply into cells (a huge count is its own test below).
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
    st.sampled_from(WORDS),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(WORDS) | st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
KEYS = st.one_of(
    st.sampled_from(WORDS + ["repeats", "engines", "workloads", "kind", "options", "concurrency"]),
    st.integers(-2, 2),
    st.none(),
    st.booleans(),
)


def dry_run(path: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli_main(["run", str(path), "--dry-run"])
    return code, err.getvalue()


def check_outcome(path: Path) -> None:
    code, err = dry_run(path)  # an exception escaping here fails the property
    assert code in (0, 2), (code, err)
    if code == 2:
        assert err.startswith("benchsuite: error: ") and str(path) in err, err
        assert "Traceback" not in err


@st.composite
def mutated_matrix(draw: st.DrawFn) -> Any:
    doc: Any = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 4))):
        # walk down to a random container, then delete, replace or add one entry
        node = doc
        while True:
            children = (
                list(node.items())
                if isinstance(node, dict)
                else list(enumerate(node))
                if isinstance(node, list)
                else []
            )
            containers = [(k, v) for k, v in children if isinstance(v, (dict, list)) and v]
            if not containers or draw(st.booleans()):
                break
            node = draw(st.sampled_from(containers))[1]
        op = draw(st.sampled_from(["delete", "replace", "add"]))
        if isinstance(node, dict):
            keys = list(node)
            if op == "add" or not keys:
                node[draw(KEYS)] = draw(VALUES)
            elif op == "delete":
                del node[draw(st.sampled_from(keys))]
            else:
                node[draw(st.sampled_from(keys))] = draw(VALUES)
        elif isinstance(node, list):
            if op == "add" or not node:
                node.append(draw(VALUES))
            elif op == "delete":
                node.pop(draw(st.integers(0, len(node) - 1)))
            else:
                node[draw(st.integers(0, len(node) - 1))] = draw(VALUES)
    return doc


FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@FUZZ
@given(doc=mutated_matrix())
def test_mutated_matrices_plan_or_fail_with_a_yaml_path(doc: Any, tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
    check_outcome(path)


@FUZZ
@given(text=st.text(max_size=200) | st.builds(yaml.safe_dump, VALUES))
def test_arbitrary_text_plans_or_fails_naming_the_file(text: str, tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    check_outcome(path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=120))
def test_arbitrary_bytes_plan_or_fail_naming_the_file(data: bytes, tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_bytes(b"name: fuzz\n" + data)
    check_outcome(path)


def corpus() -> list[tuple[str, str]]:
    expected = yaml.safe_load((CORPUS / "expected.yaml").read_text())
    return sorted(expected.items())


def test_every_corpus_file_has_an_expected_error() -> None:
    files = {p.name for p in CORPUS.glob("*.yaml")} - {"expected.yaml"}
    assert files == {name for name, _ in corpus()}


@pytest.mark.parametrize(("name", "message"), corpus())
def test_bad_matrix_corpus(name: str, message: str) -> None:
    if "is not set" in message:  # a dry run shows an unset variable as a placeholder; a run stops at load
        out, err_io = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err_io):
            assert cli_main(["run", str(CORPUS / name), "--dry-run"]) == 0
            assert f"missing: {message}" in out.getvalue()
            assert cli_main(["run", str(CORPUS / name), "--quiet", "--no-report"]) == 2
        code, err = 2, err_io.getvalue()
    else:
        code, err = dry_run(CORPUS / name)
    assert code == 2, err
    assert err.startswith("benchsuite: error: ") and str(CORPUS / name) in err
    assert message in err, err


def test_a_missing_file_and_a_directory_are_one_line_each(tmp_path: Path) -> None:
    code, err = dry_run(tmp_path / "absent.yaml")
    assert code == 2 and "no such matrix file" in err
    code, err = dry_run(tmp_path)
    assert code == 2 and str(tmp_path) in err and "Traceback" not in err


def test_a_repeat_count_too_large_to_plan_is_refused_quickly(tmp_path: Path) -> None:
    doc = copy.deepcopy(BASE)
    doc["repeats"] = 10**9  # 10^9 x 8 cells would take hours to plan and list
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    argv = [sys.executable, "-m", "benchsuite", "run", str(path), "--dry-run"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("planning repeats: 1000000000 did not finish in 20 s; the schema should bound repeats")
    assert done.returncode == 2 and "repeats" in done.stderr, done.stderr[-500:]


# ---- hostile YAML: aliases, nesting, duplicate keys, ${...} forms, numbers past any machine -------------


def _bomb(levels: int, fanout: int) -> str:
    lines = ["name: bomb", f"l0: &l0 [{', '.join(['x'] * fanout)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fanout)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


HOSTILE_YAML = st.one_of(
    st.builds(_bomb, st.integers(2, 12), st.integers(2, 12)),
    st.builds(
        lambda d, o, c: "name: deep\nengines: " + o * d + c * d + "\n",
        st.integers(1, 30_000),
        st.sampled_from(["[", "{a: "]),
        st.sampled_from(["]", "}"]),
    ),
    st.builds(
        lambda d: "name: deep\nengines:\n" + "".join(f"{' ' * (2 * i + 2)}k{i}:\n" for i in range(d)),
        st.integers(1, 400),
    ),
    st.sampled_from(
        ["a: &a [*a]\n", "a: &a {b: *a}\n", "engines: &e {x: [*e]}\n", "a: *undefined\n", "a: &a 1\nb: &a 2\n"]
    ),
    st.builds(
        lambda key, v1, v2: f"name: dup\n{key}: {v1}\n{key}: {v2}\n",
        st.sampled_from(["engines", "workloads", "name", "repeats"]),
        st.sampled_from(["{}", "1", "x"]),
        st.sampled_from(["{}", "2", "y"]),
    ),
    st.builds(
        lambda ref: yaml.safe_dump(
            {**BASE, "engines": {"e": {"kind": "builtin", "options": {"model": ref, "mode": "resident"}}}}
        ),
        st.sampled_from(
            [
                "${}",
                "${1BAD}",
                "${A:-${B:-x}}",
                "${A:-",
                "${A:?x}",
                "${A-x}",
                "$${lit}",
                "${ }",
                "${A:-${}}",
                "x${" * 50,
            ]
        )
        | st.text(st.sampled_from("${}:-AB1_ "), max_size=16),
    ),
    st.builds(
        lambda key, v: (
            yaml.safe_dump({**BASE, "fairness": {key: v}})
            if key == "kv_capacity_tokens"
            else yaml.safe_dump({**BASE, "workloads": {"w": {**BASE["workloads"]["w"], key: v}}})
        ),
        st.sampled_from(["kv_capacity_tokens", "num_requests", "output_tokens", "warmup_requests", "seed", "rate_rps"]),
        st.sampled_from([1e30, 10**12, 2**64, float("inf"), float("nan"), -(10**30), 10**100]),
    ),
)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(text=HOSTILE_YAML)
def test_hostile_yaml_plans_or_fails_naming_the_file(text: str, tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    check_outcome(path)


@pytest.mark.parametrize("name", ["alias_bomb.yaml", "deep_flow_nesting.yaml", "recursive_alias.yaml"])
def test_bombs_and_deep_nesting_fail_in_one_line_fast(name: str) -> None:
    argv = [sys.executable, "-m", "benchsuite", "run", str(CORPUS / name), "--dry-run"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: no answer within 20 s; alias expansion and nesting must be bounded")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-800:]
    assert "Traceback" not in done.stderr
