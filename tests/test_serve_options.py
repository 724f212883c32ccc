"""paged_experts.server.options: one declaration of the server's options. The parser generated from it
reads back every command line `ServeOptions.argv` writes, an option the server does not declare cannot
be written, and a rule broken in a matrix and on the command line is the same rule, blamed on the same
option, worded in each one's names."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from benchsuite.engines.builtin.adapter import MATRIX_NAMES, BuiltinOptions
from paged_experts.server.options import FLAGS, ServeOptions, build_parser, parse_args, problems

EVERY_OPTION = [f.name for f in fields(ServeOptions)]


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"mode": "paged", "resident_experts": 8, "prefill_residency": "lru", "eviction_policy": "lfu-decay"},
        {"mode": "offload", "offload_layers": 3, "dtype": "bfloat16", "overlap_schedule": False},
        {"mode": "cpu-experts", "n_cpu_moe": 2, "cpu_threads": 3, "max_connections": 7, "header_timeout": 2.5},
        {"routing_source": "qwen3-30b-a3b", "routing_seed": 4, "record_routing": "/r/t.trace", "port": 0},
        {"served_model_name": "x", "expert_kernel": "loop", "log_level": "debug", "chunked_prefill_size": 64},
        {"mode": "paged", "resident_experts": 8, "device": "cuda", "overlap_page_in": True, "overlap_groups": 3},
        {"mode": "paged", "resident_experts": 8, "device": "cuda", "copy_programs": 16},
        {"mode": "paged", "resident_experts": 8, "device": "cuda", "overlap_page_in": True, "overlap_copies": "dma"},
        {"mode": "paged", "resident_experts": 8, "device": "cuda", "overlap_page_in": True, "overlap_copies": "switch"},
        {"mode": "paged", "resident_experts": 8, "device": "cuda", "kernel_backend": "triton", "fused_page_in": True},
        {"mode": "paged", "resident_experts": 8, "device": "cuda", "page_in": "kernel"},
        {"mode": "paged", "resident_experts": 8, "prefill_staging_rows": 12},
        {"gc_freeze": False},
    ],
)
def test_the_generated_parser_reads_back_what_argv_writes(changes: dict[str, object]) -> None:
    options = ServeOptions(model_path="/m", **changes)  # type: ignore[arg-type]
    assert parse_args(options.argv(EVERY_OPTION)) == options


def test_the_heap_freeze_is_on_unless_disabled() -> None:
    assert parse_args(["--model", "/m"]).gc_freeze is True
    assert parse_args(["--model", "/m", "--disable-gc-freeze"]).gc_freeze is False
    assert parse_args(["--model", "/m", "--disable-gc-freeze", "--enable-gc-freeze"]).gc_freeze is True  # the last
    assert ServeOptions(model_path="/m", gc_freeze=False).argv(["gc_freeze"]) == ["--disable-gc-freeze"]
    assert ServeOptions(model_path="/m").argv(["gc_freeze"]) == ["--enable-gc-freeze"]
    with pytest.raises(SystemExit):
        parse_args(["--model", "/m", "--gc-freeze", "off"])  # a switch, not a value


def test_an_option_the_server_does_not_declare_cannot_be_written() -> None:
    with pytest.raises(KeyError):
        ServeOptions(model_path="/m").argv(["model_path", "no_such_option"])


def test_every_option_has_one_flag_and_help_lists_them_in_declaration_order() -> None:
    text = build_parser().format_help()
    flags = [f.metadata["flag"].name for f in fields(ServeOptions)]
    assert len(set(flags)) == len(flags)
    positions = [re.search(rf"\n  {flag}\b(?!-)", text).start() for flag in flags]  # type: ignore[union-attr]
    assert positions == sorted(positions)


@pytest.mark.parametrize(
    ("values", "option", "server_words", "matrix_words"),
    [
        ({"device": "cpu", "kernel_backend": "triton"}, "kernel_backend",
         "--kernel-backend 'triton' needs --device cuda", "'triton' needs device: cuda"),
        ({"device": "cuda", "mode": "resident", "cuda_graph_max_bs": 0, "enable_torch_compile": True},
         "enable_torch_compile", "--enable-torch-compile compiles the captured decode step",
         "true compiles the captured decode step: it needs CUDA graphs (cuda_graph_max_bs > 0)"),
        ({"device": "cuda", "mode": "paged", "eviction_policy": "lfu-decay"}, "eviction_policy",
         "--eviction-policy 'lfu-decay' runs on the host planner only", "'lfu-decay' runs on the host planner only"),
        ({"device": "cpu", "mode": "paged", "overlap_page_in": True}, "overlap_page_in",
         "--overlap-page-in needs mode paged and device cuda", "true needs mode paged and device cuda"),
        ({"device": "cuda", "mode": "paged", "overlap_groups": 4}, "overlap_groups",
         "--overlap-groups 4 applies with --overlap-page-in only", "4 applies with overlap_page_in only"),
        ({"device": "cuda", "mode": "paged", "overlap_copies": "dma"}, "overlap_copies",
         "--overlap-copies 'dma' applies with --overlap-page-in only", "'dma' applies with overlap_page_in only"),
        ({"device": "cuda", "mode": "paged", "overlap_copies": "switch"}, "overlap_copies",
         "--overlap-copies 'switch' applies with --overlap-page-in only", "'switch' applies with overlap_page_in only"),
        ({"device": "cuda", "mode": "paged", "overlap_page_in": True, "overlap_copies": "dma", "copy_programs": 8},
         "overlap_copies", "--overlap-copies 'dma' runs no copy kernel for --copy-programs to cap",
         "'dma' runs no copy kernel for copy_programs to cap"),
        ({"device": "cpu", "mode": "paged", "copy_programs": 8}, "copy_programs",
         "--copy-programs 8 needs mode paged and device cuda", "8 needs mode paged and device cuda"),
        ({"device": "cuda", "mode": "paged", "copy_programs": 0}, "copy_programs",
         "--copy-programs must be in [1, 65535]", "copy_programs must be in [1, 65535]"),
        ({"device": "cpu", "mode": "paged", "fused_page_in": True}, "fused_page_in",
         "--fused-page-in needs mode paged and device cuda", "true needs mode paged and device cuda"),
        ({"device": "cuda", "mode": "paged", "fused_page_in": True, "kernel_backend": "grouped"}, "fused_page_in",
         "--fused-page-in needs --kernel-backend triton", "true needs kernel_backend triton"),
        ({"device": "cuda", "mode": "paged", "fused_page_in": True, "overlap_page_in": True}, "fused_page_in",
         "--fused-page-in and --overlap-page-in are two ways", "true and overlap_page_in are two ways"),
        ({"device": "cpu", "mode": "resident", "prefill_staging_rows": 4}, "prefill_staging_rows",
         "--prefill-staging-rows 4 applies to mode paged, not resident", "4 applies to mode paged, not resident"),
        ({"device": "cpu", "mode": "paged", "page_in": "kernel"}, "page_in",
         "--page-in 'kernel' needs --device cuda: it copies through the GPU", "'kernel' needs device: cuda"),
    ],
)  # fmt: skip
def test_a_rule_is_one_rule_worded_for_the_server_and_the_matrix(
    values: dict[str, object], option: str, server_words: str, matrix_words: str
) -> None:
    (server,) = problems(values, FLAGS)
    (matrix,) = problems(values, MATRIX_NAMES)
    assert server.option == matrix.option == option
    assert server_words in server.message and matrix_words in matrix.message


def test_the_matrix_refuses_what_the_server_refuses() -> None:
    with pytest.raises(ValueError, match="torch_compile\n.*true needs device: cuda"):
        BuiltinOptions(device="cpu", mode="resident", torch_compile=True)
    with pytest.raises(SystemExit):
        parse_args(["--model", "/m", "--enable-torch-compile", "--cuda-graph-max-bs", "1"])
