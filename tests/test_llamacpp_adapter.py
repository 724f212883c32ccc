"""The llamacpp adapter: options schema, binary lookup, exact command line, flag detection."""

from __future__ import annotations

import stat

import pytest
from pydantic import ValidationError

from benchsuite.engines.base import EngineConfigError, Fairness, ServerSpec
from benchsuite.engines.llamacpp.adapter import LlamaCppAdapter, LlamaCppOptions, find_binary

HELP = """\
-ngl, --n-gpu-layers N
-ncmoe, --n-cpu-moe N   keep the MoE weights of the first N layers in the CPU
--cache-prompt, --no-cache-prompt
-cram, --cache-ram N
-kvu, --kv-unified
"""


def _fake_binary(tmp_path, help_text=HELP, name="llama-server"):
    path = tmp_path / name
    path.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  --help) cat <<'EOT'\n{help_text}EOT\n;;\n"
        "  --version) echo 'version: 1 (abc123)' >&2;;\n"
        "  --list-devices) echo 'Available devices:';;\n"
        "esac\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _spec(options, kv=4096, conc=4, prefix_caching=False):
    return ServerSpec(
        name="lcpp",
        kind="llamacpp",
        options=LlamaCppOptions.model_validate(options),
        fairness=Fairness(kv, prefix_caching),
        max_concurrency=conc,
        server_id="abc",
    )


@pytest.fixture
def gguf_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_command_line_sets_kv_slots_caching_and_metrics(tmp_path, gguf_file):
    binary = _fake_binary(tmp_path)
    spec = _spec(
        {
            "model": str(gguf_file),
            "binary": str(binary),
            "n_cpu_moe": 7,
            "flash_attn": True,
            "threads": 2,
        }
    )
    adapter = LlamaCppAdapter()
    adapter.validate(spec)
    argv = adapter.launch_plan(spec, 8123).argv
    assert argv[:3] == [str(binary), "-m", str(gguf_file)]

    def value(flag):
        return argv[argv.index(flag) + 1]

    assert (value("--port"), value("--host"), value("-ngl")) == (
        "8123",
        "127.0.0.1",
        "999",
    )
    assert (
        value("-c"),
        value("-np"),
        value("--n-cpu-moe"),
        value("-fa"),
        value("-t"),
    ) == ("4096", "4", "7", "on", "2")
    assert {"--kv-unified", "--no-cache-prompt", "--metrics"} <= set(argv)
    assert value("--cache-ram") == "0"
    assert adapter.request_extras(spec) == {"timings_per_token": True, "cache_prompt": False}
    assert spec.options.placement().mode == "n-cpu-moe" and spec.options.placement().n_cpu_moe == 7


def test_flags_the_binary_lacks_are_not_passed(tmp_path, gguf_file):
    binary = _fake_binary(tmp_path, help_text="--n-cpu-moe N\n")
    spec = _spec({"model": str(gguf_file), "binary": str(binary)})
    argv = LlamaCppAdapter().launch_plan(spec, 1).argv
    assert not {"--kv-unified", "--no-cache-prompt", "--cache-ram"} & set(argv)
    assert "--n-cpu-moe" not in argv  # n_cpu_moe unset: everything on the GPU
    assert spec.options.placement().mode == "gpu"


def test_prefix_caching_on_keeps_llama_cpp_defaults(tmp_path, gguf_file):
    binary = _fake_binary(tmp_path)
    spec = _spec({"model": str(gguf_file), "binary": str(binary)}, prefix_caching=True)
    assert "--no-cache-prompt" not in LlamaCppAdapter().launch_plan(spec, 1).argv
    assert LlamaCppAdapter().request_extras(spec) == {"timings_per_token": True}


def test_moe_cache_mode_is_refused_when_the_build_lacks_it(tmp_path, gguf_file):
    binary = _fake_binary(tmp_path)
    spec = _spec({"model": str(gguf_file), "binary": str(binary), "moe_cache_mib": 2048})
    assert spec.options.placement().mode == "moe-cache"
    with pytest.raises(EngineConfigError, match="this llama-server build has no --moe-cache-mib"):
        LlamaCppAdapter().validate(spec)


def test_moe_cache_mode_passes_the_flag_when_supported(tmp_path, gguf_file):
    binary = _fake_binary(tmp_path, help_text=HELP + "--moe-cache-mib N\n")
    spec = _spec({"model": str(gguf_file), "binary": str(binary), "moe_cache_mib": 2048})
    adapter = LlamaCppAdapter()
    adapter.validate(spec)
    argv = adapter.launch_plan(spec, 1).argv
    assert argv[argv.index("--moe-cache-mib") + 1] == "2048"
    assert adapter.version(spec)["moe_cache_mib_supported"] is True


def test_missing_binary_and_model_are_config_errors(tmp_path, gguf_file, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("BENCHSUITE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(EngineConfigError, match="benchsuite install llama-server"):
        LlamaCppAdapter().validate(_spec({"model": str(gguf_file)}))
    binary = _fake_binary(tmp_path)
    with pytest.raises(EngineConfigError, match="does not exist"):
        LlamaCppAdapter().validate(_spec({"model": str(tmp_path / "nope.gguf"), "binary": str(binary)}))


def test_binary_lookup_order(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cached = cache / "llama.cpp" / "0.3.36-cpu" / "bin"
    cached.mkdir(parents=True)
    cached_bin = _fake_binary(cached)
    on_path = tmp_path / "path"
    on_path.mkdir()
    monkeypatch.setenv("BENCHSUITE_CACHE_DIR", str(cache))
    monkeypatch.setenv("PATH", str(on_path))
    assert find_binary() == cached_bin
    path_bin = _fake_binary(on_path)
    assert find_binary() == path_bin
    assert find_binary(configured=str(cached_bin)) == cached_bin


def test_version_records_binary_output_and_build_stamp(tmp_path, gguf_file):
    (tmp_path / "bin").mkdir()
    binary = _fake_binary(tmp_path / "bin")  # the stamp lies beside bin/, as in the build cache
    (tmp_path / "build-stamp.json").write_text('{"cuda": false}')
    facts = LlamaCppAdapter().version(_spec({"model": str(gguf_file), "binary": str(binary)}))
    assert facts["version"] == "version: 1 (abc123)"
    assert facts["build"] == {"cuda": False}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n_cpu_moe": -1}, "n_cpu_moe"),
        ({"n_cpu_moe": "all"}, "n_cpu_moe"),
        ({"n_cpu_moe": {"search": {"nope": 1}}}, "nope"),
        ({"flash_attn": "maybe"}, "flash_attn"),
        ({"n_gpu_layer": 3}, "n_gpu_layer"),
    ],
)
def test_options_schema_rejects(options, message):
    with pytest.raises(ValidationError, match=message):
        LlamaCppOptions.model_validate(options)


def test_options_schema_accepts_search_and_yaml_booleans():
    assert LlamaCppOptions.model_validate({"n_cpu_moe": "search"}).n_cpu_moe == "search"
    assert LlamaCppOptions.model_validate({"n_cpu_moe": {"search": {"min_n": 1}}}).n_cpu_moe == {"search": {"min_n": 1}}
    assert LlamaCppOptions.model_validate({"flash_attn": False}).flash_attn == "off"


def test_command_line_of_an_hf_checkpoint_exports_nothing_until_prepare(tmp_path, tiny_model_dir, monkeypatch):
    # A dry run prints the command with the GGUF's cache path; only prepare() (before a launch) writes it.
    monkeypatch.setenv("BENCHSUITE_CACHE_DIR", str(tmp_path / "cache"))
    binary = _fake_binary(tmp_path)
    spec = _spec({"model": str(tiny_model_dir), "binary": str(binary), "gguf_type": "f32"})
    adapter = LlamaCppAdapter()
    argv = adapter.launch_plan(spec, port=18080).argv
    gguf_path = argv[argv.index("-m") + 1]
    assert gguf_path.endswith("-f32.gguf") and str(tmp_path / "cache") in gguf_path
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.gguf"))
    adapter.prepare(spec)
    assert open(gguf_path, "rb").read(4) == b"GGUF"
    assert adapter.launch_plan(spec, port=18080).argv == argv  # the same path before and after


HELP_LOAD_MODE = HELP + "-lm, --load-mode MODE\n-lv, --verbosity, --log-verbosity N\n"


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_defaults_are_the_moe_offload_tuning_written_out(tmp_path, gguf_file, monkeypatch):
    from benchsuite.engines.llamacpp import tuning

    monkeypatch.setattr(tuning, "physical_cores", lambda: 12)
    spec = _spec({"model": str(gguf_file), "binary": str(_fake_binary(tmp_path, HELP_LOAD_MODE)), "n_cpu_moe": 30})
    argv = LlamaCppAdapter().launch_plan(spec, 1).argv
    assert (_value(argv, "-fa"), _value(argv, "-b"), _value(argv, "-ub"), _value(argv, "-t")) == (
        "on",
        "2048",
        "2048",
        "12",
    )
    assert _value(argv, "--load-mode") == "none"  # host experts read into (pinned) buffers, not mmap'ed
    assert _value(argv, "-lv") == "4"  # trace: the memory lines (tuning.py), not debug (5)


def test_tuning_options_reach_the_command_line(tmp_path, gguf_file):
    options = {"flash_attn": "off", "batch_size": 1024, "ubatch_size": 256, "mmap": True, "threads": 3}
    spec = _spec({"model": str(gguf_file), "binary": str(_fake_binary(tmp_path, HELP_LOAD_MODE))} | options)
    argv = LlamaCppAdapter().launch_plan(spec, 1).argv
    assert [_value(argv, f) for f in ("-fa", "-b", "-ub", "--load-mode", "-t")] == ["off", "1024", "256", "mmap", "3"]


def test_a_build_without_load_mode_gets_no_mmap(tmp_path, gguf_file):
    binary = _fake_binary(tmp_path, HELP + "--no-mmap\n")
    argv = LlamaCppAdapter().launch_plan(_spec({"model": str(gguf_file), "binary": str(binary)}), 1).argv
    assert "--no-mmap" in argv and "--load-mode" not in argv
    mapped = _spec({"model": str(gguf_file), "binary": str(binary), "mmap": True})
    assert "--no-mmap" not in LlamaCppAdapter().launch_plan(mapped, 1).argv  # mmap is that build's default


def test_a_micro_batch_larger_than_the_batch_is_refused():
    with pytest.raises(ValidationError, match="ubatch_size 4096 exceeds batch_size 2048"):
        LlamaCppOptions.model_validate({"ubatch_size": 4096})


@pytest.mark.parametrize(
    "arg",
    ["-b", "--batch-size", "-ub", "--ubatch-size=512", "-lm", "--load-mode", "--no-mmap", "--mmap", "--mlock"],
)
def test_tuning_flags_are_refused_in_extra_args(arg):
    with pytest.raises(ValidationError, match=f"{arg.split('=')[0]} is set by option"):
        LlamaCppOptions.model_validate({"extra_args": [arg, "1"]})


def test_tuning_variables_are_owned():
    from benchsuite.engines.llamacpp.owned import OWNED_ENV

    assert {"LLAMA_ARG_BATCH", "LLAMA_ARG_UBATCH", "LLAMA_ARG_LOAD_MODE", "LLAMA_ARG_NO_MMAP"} <= set(OWNED_ENV)


def test_physical_cores_counts_allowed_cores_once_and_honours_the_cgroup_quota(tmp_path):
    from benchsuite.engines.llamacpp.tuning import physical_cores

    for cpu, core in enumerate([0, 1, 0, 1, 2, 3]):  # cpus 0/2 and 1/3 are SMT siblings
        topo = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    unlimited = tmp_path / "cpu.max"
    unlimited.write_text("max 100000\n")
    assert physical_cores({0, 1, 2, 3, 4, 5}, tmp_path / "cpu", unlimited) == 4
    assert physical_cores({0, 2}, tmp_path / "cpu", unlimited) == 1  # affinity: one core's two threads
    quota = tmp_path / "quota"
    quota.write_text("250000 100000\n")  # 2.5 CPUs -> 3
    assert physical_cores({0, 1, 2, 3, 4, 5}, tmp_path / "cpu", quota) == 3
    assert physical_cores({7}, tmp_path / "cpu", tmp_path / "missing") == 1  # no topology: the CPU counts


def test_the_search_projects_with_the_servers_micro_batch_and_flash_attention(tmp_path, gguf_file, monkeypatch):
    """A larger -ub grows the compute buffer: an N that fits only at -ub 512 must not count at 2048."""
    from test_llamacpp_fit import _qwen3_30b_a3b_shape

    from benchsuite.engines.llamacpp import adapter as adapter_module
    from benchsuite.engines.llamacpp import fit
    from benchsuite.engines.search_settings import SearchSettings

    monkeypatch.setattr(fit, "read_model_facts", lambda path: _qwen3_30b_a3b_shape(8))
    monkeypatch.setattr(adapter_module, "has_gpu_device", lambda binary: False)
    binary = str(_fake_binary(tmp_path))
    settings = SearchSettings(projection="benchsuite")

    def projected(**options):
        spec = _spec({"model": str(gguf_file), "binary": binary} | options, kv=10240)
        return LlamaCppAdapter().projections(spec, settings)

    facts = _qwen3_30b_a3b_shape(8)
    for options, flash_attn, n_ubatch in [({}, True, 2048), ({"flash_attn": "off", "ubatch_size": 512}, False, 512)]:
        for n, p in projected(**options).items():
            assert p == fit.project(facts, n, 10240, flash_attn=flash_attn, n_ubatch=n_ubatch)
    small, large = projected(ubatch_size=512)[4], projected()[4]
    budget = small.gpu_total_bytes + fit.DEFAULT_MARGIN_MIB * fit.MIB
    assert small.fits(budget, fit.DEFAULT_MARGIN_MIB * fit.MIB)
    assert not large.fits(budget, fit.DEFAULT_MARGIN_MIB * fit.MIB)  # the old flags' N no longer counts
