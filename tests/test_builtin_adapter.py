"""The builtin adapter's performance options: fastest measured path by default on CUDA, each one
off on demand, errors naming the YAML path, and a command line the server's own parser accepts."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from builtin_plans import MATRIX, flag, plan_argv

from benchsuite.config.matrix import MatrixError, load_matrix
from benchsuite.config.plan import build_plan
from benchsuite.engines.base import ServerSpec
from benchsuite.engines.builtin.adapter import BuiltinAdapter, BuiltinOptions
from paged_experts.server.launch import build_parser, parse_args


@pytest.mark.parametrize("mode", ["mode: resident", "mode: paged, resident_experts: 32"])
def test_cuda_defaults_are_the_fast_path_up_to_the_max_concurrency(tmp_path: Path, mode: str) -> None:
    argv, resolved = plan_argv(tmp_path, f"device: cuda, dtype: bfloat16, {mode}")
    assert flag(argv, "--cuda-graph-max-bs") == "4"  # the server's max concurrency
    assert "--enable-torch-compile" in argv and flag(argv, "--kernel-backend") == "triton"
    assert "--prefetch-next-layer" not in argv and flag(argv, "--expert-kernel") == "fused"
    assert resolved["cuda_graph_max_bs"] == 4 and resolved["torch_compile"] is True
    ns = build_parser().parse_args(argv[3:])  # the server's own parser takes every flag
    assert (ns.cuda_graph_max_bs, ns.enable_torch_compile, ns.kernel_backend) == (4, True, "triton")


@pytest.mark.parametrize(
    "options", ["device: cpu, mode: resident", "device: cuda, mode: offload, offload_layers: 2",
                "device: cuda, mode: cpu-experts, n_cpu_moe: 2"],
)  # fmt: skip
def test_modes_that_cannot_be_captured_and_the_cpu_stay_eager(tmp_path: Path, options: str) -> None:
    argv, _ = plan_argv(tmp_path, options)
    assert flag(argv, "--cuda-graph-max-bs") == "0" and "--disable-torch-compile" in argv
    assert flag(argv, "--kernel-backend") == "grouped"
    if "device: cpu" in options:
        config = parse_args(argv[3:])  # the whole server validation runs on a CPU box
        assert (config.cuda_graph_max_bs, config.enable_torch_compile, config.kernel_backend) == (0, False, "grouped")


def test_each_fast_path_option_turns_off(tmp_path: Path) -> None:
    base = "device: cuda, mode: resident"
    argv, _ = plan_argv(tmp_path, base + ", cuda_graph_max_bs: 0")
    assert (
        flag(argv, "--cuda-graph-max-bs") == "0" and "--disable-torch-compile" in argv
    )  # no graph, nothing to compile
    argv, _ = plan_argv(tmp_path, base + ", torch_compile: false")
    assert flag(argv, "--cuda-graph-max-bs") == "4" and "--disable-torch-compile" in argv
    argv, _ = plan_argv(tmp_path, base + ", kernel_backend: grouped, cuda_graph_max_bs: 2")
    assert flag(argv, "--kernel-backend") == "grouped" and flag(argv, "--cuda-graph-max-bs") == "2"
    argv, _ = plan_argv(tmp_path, "device: cuda, mode: paged, resident_experts: 16, prefetch_next_layer: true")
    assert "--prefetch-next-layer" in argv and "--enable-overlap-schedule" in argv
    argv, _ = plan_argv(tmp_path, "device: cuda, mode: paged, resident_experts: 16")
    assert "--overlap-page-in" not in argv and "--overlap-groups" not in argv  # off: the command as before
    argv, resolved = plan_argv(
        tmp_path, "device: cuda, mode: paged, resident_experts: 16, overlap_page_in: true, overlap_groups: 4"
    )
    assert "--overlap-page-in" in argv and flag(argv, "--overlap-groups") == "4"
    assert (resolved["overlap_page_in"], resolved["overlap_groups"]) == (True, 4)
    ns = build_parser().parse_args(argv[3:])
    assert (ns.overlap_page_in, ns.overlap_groups) == (True, 4)
    assert "--overlap-copies" not in argv  # unset: the command as before
    argv, resolved = plan_argv(
        tmp_path, "device: cuda, mode: paged, resident_experts: 16, overlap_page_in: true, overlap_copies: dma"
    )
    assert flag(argv, "--overlap-copies") == "dma" and resolved["overlap_copies"] == "dma"
    assert build_parser().parse_args(argv[3:]).overlap_copies == "dma"
    argv, resolved = plan_argv(
        tmp_path, "device: cuda, mode: paged, resident_experts: 16, overlap_page_in: true, overlap_copies: switch"
    )
    assert flag(argv, "--overlap-copies") == "switch" and resolved["overlap_copies"] == "switch"
    assert build_parser().parse_args(argv[3:]).overlap_copies == "switch"
    assert "--copy-programs" not in argv  # unset: the command as before
    argv, resolved = plan_argv(tmp_path, "device: cuda, mode: paged, resident_experts: 16, copy_programs: 16")
    assert flag(argv, "--copy-programs") == "16" and resolved["copy_programs"] == 16
    assert build_parser().parse_args(argv[3:]).copy_programs == 16
    assert "--fused-page-in" not in argv  # unset: the command as before
    argv, resolved = plan_argv(tmp_path, "device: cuda, mode: paged, resident_experts: 16, fused_page_in: true")
    assert "--fused-page-in" in argv and resolved["fused_page_in"] is True
    assert build_parser().parse_args(argv[3:]).fused_page_in
    assert "--page-in" not in argv and resolved["page_in"] == "direct"  # unset: the command as before, auto's choice
    argv, resolved = plan_argv(tmp_path, "device: cuda, mode: paged, resident_experts: 16, page_in: kernel")
    assert flag(argv, "--page-in") == "kernel" and resolved["page_in"] == "kernel"
    assert build_parser().parse_args(argv[3:]).page_in == "kernel"
    assert "--prefill-staging-rows" not in argv and resolved["prefill_staging_rows"] == 0  # unset: as before
    argv, resolved = plan_argv(tmp_path, "device: cuda, mode: paged, resident_experts: 16, prefill_staging_rows: 24")
    assert flag(argv, "--prefill-staging-rows") == "24" and resolved["prefill_staging_rows"] == 24
    assert build_parser().parse_args(argv[3:]).prefill_staging_rows == 24
    argv, _ = plan_argv(tmp_path, base + ", overlap_schedule: false")
    assert "--disable-overlap-schedule" in argv and not build_parser().parse_args(argv[3:]).overlap_schedule


def test_the_heap_freeze_is_written_out_on_by_default_and_turns_off(tmp_path: Path) -> None:
    argv, resolved = plan_argv(tmp_path, "device: cpu, mode: resident")
    assert "--enable-gc-freeze" in argv and "--disable-gc-freeze" not in argv and resolved["gc_freeze"] is True
    assert parse_args(argv[3:]).gc_freeze is True
    argv, resolved = plan_argv(tmp_path, "device: cpu, mode: resident, gc_freeze: false")
    assert "--disable-gc-freeze" in argv and "--enable-gc-freeze" not in argv and resolved["gc_freeze"] is False
    assert parse_args(argv[3:]).gc_freeze is False
    # unset: left out of the dumped options, so the server ids of matrices without it stay as they were
    assert "gc_freeze" not in BuiltinOptions(mode="resident").model_dump()
    assert BuiltinOptions(mode="resident", gc_freeze=False).model_dump()["gc_freeze"] is False


def test_cpu_threads_default_to_the_cores_minus_one_and_are_named(tmp_path: Path) -> None:
    from paged_experts.server.threads import default_cpu_threads

    argv, resolved = plan_argv(tmp_path, "device: cpu, mode: resident")
    assert flag(argv, "--cpu-threads") == str(default_cpu_threads()) == str(resolved["cpu_threads"])
    argv, _ = plan_argv(tmp_path, "device: cpu, mode: resident, cpu_threads: 3")
    assert flag(argv, "--cpu-threads") == "3" and parse_args(argv[3:]).cpu_threads == 3
    with pytest.raises(MatrixError, match="engines.e.options.cpu_threads"):
        plan_argv(tmp_path, "device: cpu, mode: resident, cpu_threads: 0")


def test_prefill_residency_is_written_for_paged_servers_only(tmp_path: Path) -> None:
    argv, _ = plan_argv(tmp_path, "device: cpu, mode: paged, resident_experts: 8")
    assert flag(argv, "--prefill-residency") == "recent"  # the default, written out
    argv, _ = plan_argv(tmp_path, "device: cpu, mode: paged, resident_experts: 8, prefill_residency: lru")
    assert flag(argv, "--prefill-residency") == "lru" and parse_args(argv[3:]).prefill_residency == "lru"
    argv, _ = plan_argv(tmp_path, "device: cpu, mode: resident")
    assert "--prefill-residency" not in argv


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("device: cpu, mode: resident, torch_compile: true",
         "engines.e.options.torch_compile: true needs device: cuda"),
        ("device: cpu, mode: resident, cuda_graph_max_bs: 2",
         "engines.e.options.cuda_graph_max_bs: 2 needs device: cuda"),
        ("device: cpu, mode: resident, kernel_backend: triton",
         "engines.e.options.kernel_backend: 'triton' needs device"),
        ("device: cuda, mode: offload, offload_layers: 1, cuda_graph_max_bs: 2",
         "engines.e.options.cuda_graph_max_bs: 2 needs mode resident or paged"),
        ("device: cuda, mode: resident, cuda_graph_max_bs: 0, torch_compile: true",
         "engines.e.options.torch_compile: true compiles the captured decode step"),
        ("device: cuda, mode: resident, prefetch_next_layer: true",
         "engines.e.options.prefetch_next_layer: true needs mode paged"),
        ("device: cuda, mode: paged, resident_experts: 8, routing: qwen3-30b-a3b, prefetch_next_layer: true",
         "engines.e.options.prefetch_next_layer: true predicts the next layer's experts with the model's own router, "
         "which routing replaces"),
        ("device: cuda, mode: resident, expert_kernel: fast", "engines.e.options.expert_kernel:"),
        ("device: cpu, mode: paged, resident_experts: 8, overlap_page_in: true",
         "engines.e.options.overlap_page_in: true needs mode paged and device cuda"),
        ("device: cuda, mode: paged, resident_experts: 8, prefetch_next_layer: true, overlap_page_in: true",
         "engines.e.options.overlap_page_in: true and prefetch_next_layer both use the page-in stream"),
        ("device: cuda, mode: paged, resident_experts: 8, overlap_groups: 2",
         "engines.e.options.overlap_groups: 2 applies with overlap_page_in only"),
        ("device: cuda, mode: paged, resident_experts: 8, overlap_page_in: true, overlap_groups: 0",
         "engines.e.options.overlap_groups: overlap_groups must be in [1, 64]"),
        ("device: cuda, mode: paged, resident_experts: 8, overlap_copies: dma",
         "engines.e.options.overlap_copies: 'dma' applies with overlap_page_in only"),
        ("device: cuda, mode: paged, resident_experts: 8, overlap_copies: switch",
         "engines.e.options.overlap_copies: 'switch' applies with overlap_page_in only"),
        ("device: cuda, mode: resident, copy_programs: 16",
         "engines.e.options.copy_programs: 16 needs mode paged and device cuda"),
        ("device: cuda, mode: paged, resident_experts: 8, fused_page_in: true, kernel_backend: grouped",
         "engines.e.options.fused_page_in: true needs kernel_backend triton"),
        ("device: cpu, mode: resident, prefill_staging_rows: 4",
         "engines.e.options.prefill_staging_rows: 4 applies to mode paged, not resident"),
        ("device: cpu, mode: paged, resident_experts: 8, page_in: kernel",
         "engines.e.options.page_in: 'kernel' needs device: cuda: it copies through the GPU (got cpu)"),
        ("device: cpu, mode: paged, resident_experts: 8, prefill_residency: newest",
         "engines.e.options.prefill_residency: 'newest' is not one of recent, frequent, lru"),
        ("device: cpu, mode: resident, prefill_residency: recent",
         "engines.e.options.prefill_residency: 'recent' applies to mode paged, not resident"),
    ],
)  # fmt: skip
def test_bad_performance_options_name_their_yaml_path(tmp_path: Path, options: str, message: str) -> None:
    with pytest.raises(MatrixError) as info:
        plan_argv(tmp_path, options)
    assert message in str(info.value), str(info.value)


def _paged_spec(tmp_path: Path, extra: str) -> ServerSpec:
    """The one server of a matrix with a paged CPU engine at K=16 and `extra` options (a stand-in model dir)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    path = tmp_path / "m.yaml"
    options = f"device: cpu, mode: paged, resident_experts: 16, {extra}"
    path.write_text(textwrap.dedent(MATRIX.format(model=model, options=options)))
    (spec,) = build_plan(load_matrix(path)).servers
    return spec


def test_the_trace_replay_stages_as_the_server_does(tmp_path: Path) -> None:
    """The realized-vs-optimal replay of a paged server's trace takes its staging rows (its plans stage too)."""
    replays = []
    for extra in ("", ", prefill_staging_rows: 24"):
        spec = _paged_spec(tmp_path, f"record_routing: true{extra}")
        replays.append(BuiltinAdapter().trace_replay(spec))
    assert [(r.resident_experts, r.staging_rows) for r in replays if r is not None] == [(16, 0), (16, 24)]


def test_a_recording_server_is_given_time_to_write_its_trace(tmp_path: Path) -> None:
    """A server with record_routing writes its trace when told to stop (tens of MB on the H200): its launch plan
    asks the runner to wait for that before SIGKILL; any other server keeps the default grace."""
    from benchsuite.engines.builtin.adapter import TRACE_STOP_GRACE_S

    graces = []
    for record in ("false", "true"):
        spec = _paged_spec(tmp_path, f"record_routing: {record}")
        graces.append(BuiltinAdapter().launch_plan(spec, 8000).stop_grace_s)
    assert graces == [5.0, TRACE_STOP_GRACE_S]


@pytest.mark.parametrize(
    ("options", "flag_value", "in_force"),
    [
        ("device: cuda, mode: paged, resident_experts: 16", None, "packed"),  # 'auto': packed, paged on CUDA
        ("device: cpu, mode: paged, resident_experts: 16", None, "split"),
        ("device: cuda, mode: offload, offload_layers: 2", None, "split"),
        ("device: cuda, mode: resident", None, "split"),
        ("device: cuda, mode: paged, resident_experts: 16, expert_rows: split", "split", "split"),
        ("device: cpu, mode: paged, resident_experts: 16, expert_rows: packed", "packed", "packed"),
        ("device: cuda, mode: paged, resident_experts: 16, expert_rows: auto", "auto", "packed"),
    ],
)  # fmt: skip
def test_the_expert_layout_is_written_only_when_set_and_recorded_as_in_force(
    tmp_path: Path, options: str, flag_value: str | None, in_force: str
) -> None:
    """A matrix without `expert_rows` launches the server without the flag (the server's 'auto'; server ids and
    command lines of earlier runs stay), and the manifest's resolved options say which layout ran."""
    argv, resolved = plan_argv(tmp_path, options)
    assert (flag(argv, "--expert-rows") if "--expert-rows" in argv else None) == flag_value
    assert resolved["expert_rows"] == in_force
