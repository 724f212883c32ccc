"""The llamacpp adapter: options schema, binary lookup, exact command line, flag detection."""

from __future__ import annotations

import stat

import pytest
from pydantic import ValidationError

from benchsuite.engines.base import EngineConfigError, ServerSpec
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
        fairness={"kv_capacity_tokens": kv, "prefix_caching": prefix_caching},
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
