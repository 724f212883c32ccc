"""matrix.yaml validation: sweeps, YAML-path errors, exit status 2 without a traceback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from benchsuite.cli import main
from benchsuite.config.matrix import MatrixError, load_matrix

GOOD = """
name: t
engines:
  paged:
    kind: builtin
    options: {model: /m, mode: paged, resident_experts: [4, 8]}
  res:
    kind: builtin
    options: {model: /m, mode: resident}
workloads:
  w:
    prompt_classes: [short, 64]
    concurrency: [1, 2]
    num_requests: 3
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def errors_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(MatrixError) as info:
        load_matrix(write(tmp_path, text))
    return str(info.value)


def test_sweeps_expand_and_params_hold_only_swept_keys(tmp_path: Path) -> None:
    vm = load_matrix(write(tmp_path, GOOD))
    paged = vm.option_sets["paged"]
    assert [s.params for s in paged] == [{"resident_experts": 4}, {"resident_experts": 8}]
    assert paged[0].options.mode == "paged" and paged[0].options.device == "cpu"
    assert vm.option_sets["res"][0].params == {}
    assert vm.matrix.workloads["w"].prompt_classes == ["short", "64"]


def test_bad_sweep_value_names_its_index_and_bound(tmp_path: Path) -> None:
    msg = errors_of(tmp_path, GOOD.replace("[4, 8]", "[4, 0, 8]"))
    assert "engines.paged.options.resident_experts[1]: must be >= 1" in msg
    assert len(msg.splitlines()) == 1


def test_unknown_keys_name_the_closest_and_list_the_allowed_ones(tmp_path: Path) -> None:
    text = GOOD.replace("mode: resident}", "mode: resident, devce: cpu}").replace(
        "num_requests: 3", "num_requests: 3\n    concurency: [1]"
    )
    text += "colour: red\n"
    lines = errors_of(tmp_path, text).splitlines()
    # structural errors and engine option errors in one pass
    assert any("workloads.w.concurency: unknown key; did you mean concurrency? (allowed: " in line for line in lines)
    assert any(
        line.endswith(
            "colour: unknown key (allowed: canary, engines, env, fairness, inputs, linkbw, name, output_root, "
            "reference, repeat_order, repeats, workloads)"
        )
        for line in lines
    )
    assert any("engines.res.options.devce: unknown key; did you mean device? (allowed: " in line for line in lines)


def test_literal_and_cross_field_errors(tmp_path: Path) -> None:
    msg = errors_of(tmp_path, GOOD.replace("kind: builtin\n    options: {model: /m, mode: resident}", "kind: vllm"))
    assert "engines.res.kind: must be one of 'builtin', 'llamacpp' or 'sglang'" in msg
    msg = errors_of(tmp_path, GOOD.replace("mode: paged, resident_experts: [4, 8]", "mode: paged"))
    assert "engines.paged.options: mode paged needs resident_experts" in msg
    msg = errors_of(tmp_path, GOOD.replace("num_requests: 3", "num_requests: 3\n    arrival: poisson"))
    assert "workloads.w: arrival: poisson needs rate_rps" in msg
    msg = errors_of(tmp_path, GOOD.replace("[short, 64]", "[short, long]"))
    assert "workloads.w.prompt_classes: prompt class 'long' must be 'short' or a token count in [1, 16777216]" in msg


def test_file_and_syntax_errors(tmp_path: Path) -> None:
    with pytest.raises(MatrixError, match="no such matrix file"):
        load_matrix(tmp_path / "absent.yaml")
    assert "YAML syntax error at line 4, column 6: mapping values are not allowed here" in errors_of(
        tmp_path, "name: t\nengines:\n  a: b\n    c: d\n"
    )
    assert "key False is not text; quote it" in errors_of(tmp_path, GOOD.replace("  res:", "  off:"))
    assert "must be a YAML mapping" in errors_of(tmp_path, "- a\n- b\n")
    (tmp_path / "m.yaml").write_bytes(b"name: x\n\x80")
    with pytest.raises(MatrixError, match="not UTF-8 text"):
        load_matrix(tmp_path / "m.yaml")


def test_hash_is_stable_and_ignores_output_root(tmp_path: Path) -> None:
    a = load_matrix(write(tmp_path, GOOD)).matrix_hash
    assert load_matrix(write(tmp_path, GOOD + "output_root: elsewhere\n")).matrix_hash == a
    assert load_matrix(write(tmp_path, GOOD + "repeats: 2\n")).matrix_hash != a


def test_cli_exits_2_with_one_line_per_problem_and_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, GOOD.replace("[4, 8]", "[0, 8]").replace("num_requests: 3", "num_requests: 0"))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "workloads.w.num_requests: must be >= 1 (got 0)" in err


def test_sharegpt_path_is_relative_to_the_matrix_and_must_exist(tmp_path: Path) -> None:
    text = GOOD.replace("num_requests: 3", "num_requests: 3\n    dataset: sharegpt\n    path: data/sg.json")
    assert "workloads.w.path: no such file: " + str(tmp_path / "data" / "sg.json") in errors_of(tmp_path, text)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sg.json").write_text("[]")
    vm = load_matrix(write(tmp_path, text))
    assert vm.matrix.workloads["w"].path == str(tmp_path / "data" / "sg.json")
    assert "needs path" in errors_of(tmp_path, text.replace("    path: data/sg.json\n", ""))


def test_synthetic_routing_spec_is_checked_and_labelled(tmp_path: Path) -> None:
    from benchsuite.config.plan import build_plan
    from benchsuite.engines.builtin.adapter import BuiltinAdapter

    msg = errors_of(tmp_path, GOOD.replace("mode: resident}", "mode: resident, routing: zipf}"))
    assert "engines.res.options.routing: unknown routing spec 'zipf'" in msg
    plan = build_plan(
        load_matrix(write(tmp_path, GOOD.replace("mode: resident}", "mode: resident, routing: Zipf:1.2}")))
    )
    res = next(s for s in plan.servers if s.name == "res")
    assert res.options.placement().routing == "synthetic:zipf:1.2"
    assert "--routing-source Zipf:1.2 --routing-seed 0" in " ".join(BuiltinAdapter().launch_plan(res, 1).argv)


def test_huge_matrices_are_refused_before_planning(tmp_path: Path) -> None:
    assert "repeats: must be <= 1000 (got 1000000000)" in errors_of(tmp_path, GOOD + "repeats: 1000000000\n")
    text = GOOD.replace("concurrency: [1, 2]", f"concurrency: {list(range(1, 401))}") + "repeats: 1000\n"
    assert "the matrix makes 2400000 cells (engines x workloads x repeats); at most 100000" in errors_of(tmp_path, text)
    sweep = "[" + ", ".join(str(k) for k in range(1, 400)) + "]"
    text = GOOD.replace("mode: resident}", f"mode: cpu-experts, n_cpu_moe: {sweep}, startup_timeout_s: {sweep}}}")
    assert "engines.res.options: the sweeps make 159201 servers; at most 100000" in errors_of(tmp_path, text)


ENV_MATRIX = """
name: t
engines:
  res:
    kind: builtin
    options: {model: "${BENCH_TEST_MODEL}", mode: resident, device: "${BENCH_TEST_DEVICE:-cpu}"}
workloads:
  sharegpt:
    dataset: sharegpt
    path: ${BENCH_TEST_SHAREGPT}
    num_requests: 3
"""


def test_env_references_expand_into_the_manifest_and_the_run_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchsuite.config.plan import build_plan
    from benchsuite.results.manifest import build_manifest

    for name in ("BENCH_TEST_MODEL", "BENCH_TEST_DEVICE", "BENCH_TEST_SHAREGPT"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "a.json").write_text("[]")
    (tmp_path / "b.json").write_text("[]")
    monkeypatch.setenv("BENCH_TEST_MODEL", "/models/m1")
    monkeypatch.setenv("BENCH_TEST_SHAREGPT", str(tmp_path / "a.json"))
    vm = load_matrix(write(tmp_path, ENV_MATRIX))
    assert vm.option_sets["res"][0].options.model == "/models/m1"
    assert vm.option_sets["res"][0].options.device == "cpu"  # the default after :-
    manifest = build_manifest(build_plan(vm)).to_json()
    assert manifest["matrix"]["engines"]["res"]["options"]["model"] == "/models/m1"
    assert manifest["matrix"]["workloads"]["sharegpt"]["path"] == str(tmp_path / "a.json")
    assert "${" not in str(manifest["matrix"])
    # another file behind the same variable is another run
    monkeypatch.setenv("BENCH_TEST_SHAREGPT", str(tmp_path / "b.json"))
    assert load_matrix(write(tmp_path, ENV_MATRIX)).matrix_hash != vm.matrix_hash
    monkeypatch.setenv("BENCH_TEST_SHAREGPT", str(tmp_path / "a.json"))
    assert load_matrix(write(tmp_path, ENV_MATRIX)).matrix_hash == vm.matrix_hash
    # $${ is a literal ${
    literal = load_matrix(write(tmp_path, ENV_MATRIX.replace('"${BENCH_TEST_MODEL}"', '"/m/$${X}"')))
    assert literal.option_sets["res"][0].options.model == "/m/${X}"


def test_an_unset_variable_is_one_line_naming_path_and_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BENCH_TEST_MODEL", "/models/m1")
    monkeypatch.delenv("BENCH_TEST_SHAREGPT", raising=False)
    path = write(tmp_path, ENV_MATRIX)
    assert main(["run", str(path), "--dry-run"]) == 0  # a dry run lists it with the plan
    assert "missing: workloads.sharegpt.path: environment variable BENCH_TEST_SHAREGPT" in capsys.readouterr().out
    assert main(["run", str(path), "--quiet"]) == 2  # a run stops when the matrix loads
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.strip().endswith(
        "workloads.sharegpt.path: environment variable BENCH_TEST_SHAREGPT is not set "
        "(set it to your ShareGPT JSON file)"
    )
    monkeypatch.delenv("BENCH_TEST_MODEL")
    msg = errors_of(tmp_path, ENV_MATRIX)
    assert "engines.res.options.model: environment variable BENCH_TEST_MODEL is not set" in msg


def test_reference_is_a_name_or_a_published_setup(tmp_path: Path) -> None:
    plain = load_matrix(write(tmp_path, GOOD + "reference: pr42557\n"))
    assert plain.as_json()["reference"] == "pr42557"  # the plain form stays a string in the manifest
    setup = load_matrix(write(tmp_path, GOOD + "reference: {name: pr42557, machine: laptop_8gb, quant: gptq_int4}\n"))
    assert setup.as_json()["reference"] == {"name": "pr42557", "machine": "laptop_8gb", "quant": "gptq_int4"}
    assert setup.matrix_hash != plain.matrix_hash
    msg = errors_of(tmp_path, GOOD + "reference: {name: pr42557, machine: desktop_8gb}\n")
    assert "reference.machine: 'desktop_8gb' is not a machine of pr42557 (known: desktop_16gb, laptop_8gb)" in msg
    msg = errors_of(tmp_path, GOOD + "reference: {name: pr42557, quant: int8}\n")
    assert "reference.quant: 'int8' is not a quant of pr42557 (known: fp8_block, gptq_int4)" in msg
    msg = errors_of(tmp_path, GOOD + "reference: {name: pr42557, machine: laptop_8gb, quant: fp8_block}\n")
    assert "reference: pr42557 published no figures for machine laptop_8gb with quant fp8_block" in msg
    assert "reference.name: must be one of 'pr42557'" in errors_of(tmp_path, GOOD + "reference: {name: pr1}\n")
    assert "reference.name: must be one of 'pr42557'" in errors_of(tmp_path, GOOD + "reference: pr1\n")


def test_canary_and_max_error_rate_are_checked(tmp_path: Path) -> None:
    vm = load_matrix(write(tmp_path, GOOD + "canary: true\n"))
    assert vm.matrix.canary is True and vm.matrix.workloads["w"].max_error_rate == 0.0
    assert load_matrix(write(tmp_path, GOOD)).matrix.canary is False
    text = GOOD.replace("num_requests: 3", "num_requests: 3\n    max_error_rate: 1.5")
    assert "workloads.w.max_error_rate: must be <= 1.0 (got 1.5)" in errors_of(tmp_path, text)
