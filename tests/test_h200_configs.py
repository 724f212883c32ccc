"""configs/h200/*.yaml: every matrix validates and plans (dry run, the model paths pointed at stand-ins)
with what issue 15 asks: the built-in engine with device, dtype and its mode only, the K, N and
routing values, llama.cpp's fixed N and its 16 GB search, both prompt classes, c=1 and c=4, >= 2
repeats, the link probe; and issue 24's headline matrix (headline.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from benchsuite.cli import main
from benchsuite.config.matrix import load_matrix
from benchsuite.config.plan import build_plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "h200"
MODE_OPTIONS = {"model", "device", "dtype", "mode", "resident_experts", "n_cpu_moe", "offload_layers", "routing"}


@pytest.fixture
def stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from paged_experts.weights.synth_memory import write_weightless

    # the real shapes (48 layers, 128 experts): the matrix checks K and N against config.json when it loads
    monkeypatch.setenv("BENCH_H200_MODEL", str(write_weightless("qwen3-30b-a3b-shape", tmp_path / "q48")))
    monkeypatch.setenv("BENCH_H200_FP8_MODEL", str(write_weightless("qwen3-30b-a3b-fp8-shape", tmp_path / "q48-fp8")))
    (tmp_path / "q48.gguf").write_bytes(b"")
    monkeypatch.setenv("BENCH_H200_GGUF", str(tmp_path / "q48.gguf"))


@pytest.mark.parametrize("name", ["model", "synthetic", "offload"])
def test_each_matrix_validates_and_prints_its_plan(
    name: str, stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = CONFIGS / f"{name}.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    assert "link bandwidth: `benchsuite linkbw --json` runs once" in capsys.readouterr().out
    m = load_matrix(path).matrix
    assert m.repeats >= 2 and m.linkbw
    for workload in m.workloads.values():
        assert workload.prompt_classes == ["short", "2048"] and workload.concurrency == [1, 4]
    raw = yaml.safe_load(path.read_text())["engines"]
    for entry in raw.values():
        if entry["kind"] == "builtin":  # no performance option: the fast path is the CUDA default
            assert set(entry["options"]) <= MODE_OPTIONS
            assert entry["options"]["device"] == "cuda" and entry["options"]["dtype"] == "bfloat16"


def test_the_modes_and_values_issue_15_lists(stand_ins: None) -> None:
    plans = {name: build_plan(load_matrix(CONFIGS / f"{name}.yaml")) for name in ("model", "synthetic", "offload")}

    def values(plan: object, mode: str, option: str, fp8: bool = False) -> list[object]:
        servers = [s for s in plan.servers if s.name.endswith("-fp8") == fp8]  # type: ignore[attr-defined]
        return sorted(getattr(s.options, option) for s in servers if s.kind == "builtin" and s.options.mode == mode)

    for name in ("model", "synthetic"):
        assert values(plans[name], "paged", "resident_experts") == [16, 30, 32, 64, 92]
        assert values(plans[name], "resident", "mode") == ["resident"]
    assert values(plans["model"], "cpu-experts", "n_cpu_moe") == [12, 24]
    for name in ("model", "synthetic"):  # issue 17: FP8 paged at the published K=40 and K=24, and beyond
        assert values(plans[name], "paged", "resident_experts", fp8=True) == [24, 40, 56]
    assert values(plans["model"], "resident", "mode", fp8=True) == ["resident"]
    assert values(plans["offload"], "offload", "offload_layers") == [48]
    assert {s.options.routing for s in plans["synthetic"].servers} == {"qwen3-30b-a3b"}
    assert {s.options.routing for p in ("model", "offload") for s in plans[p].servers if s.kind == "builtin"} == {
        "model"
    }
    llama = sorted(s.options.n_cpu_moe for s in plans["model"].servers if s.kind == "llamacpp")
    assert llama == [0, 12, 24]
    (search,) = plans["model"].searches
    assert search.spec.options.n_cpu_moe == "search" and search.spec.options.vram_budget_gb == 16


def test_the_headline_matrix_issue_24_asks_for(stand_ins: None, capsys: pytest.CaptureFixture[str]) -> None:
    """configs/h200/headline.yaml: paged FP8's K searched at 16 GB (model and calibrated synthetic routing),
    llama.cpp's N searched at 16 GB, resident bf16 as the reference; short and 2,048-token prompts, c=1
    and c=4, 128 output tokens, 2 repeats, the link probe."""
    path = CONFIGS / "headline.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "link bandwidth: `benchsuite linkbw --json` runs once" in out
    m = load_matrix(path).matrix
    assert m.repeats >= 2 and m.linkbw
    for workload in m.workloads.values():
        assert workload.prompt_classes == ["short", "2048"] and workload.concurrency == [1, 4]
        assert workload.output_tokens == 128
    plan = build_plan(load_matrix(path))
    searches = {(s.spec.name, s.option): s.spec.options for s in plan.searches}
    assert set(searches) == {
        ("paged-fp8", "resident_experts"),
        ("paged-fp8-synthetic", "resident_experts"),
        ("llamacpp-16gb", "n_cpu_moe"),
    }
    assert {o.vram_budget_gb for o in searches.values()} == {16}
    assert searches[("paged-fp8-synthetic", "resident_experts")].routing == "qwen3-30b-a3b"
    assert searches[("paged-fp8", "resident_experts")].routing == "model"
    (resident,) = [s for s in plan.servers if s.kind == "builtin"]
    assert resident.options.mode == "resident" and resident.options.dtype == "bfloat16"


def test_the_overlap_matrix_issue_29_asks_for(stand_ins: None, capsys: pytest.CaptureFixture[str]) -> None:
    """configs/h200/overlap.yaml: paged FP8 at K=40, model and calibrated routing, without overlap
    and with the misses in 1 and 4 groups, beside resident FP8; the server command names what is in force."""
    path = CONFIGS / "overlap.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(load_matrix(path))
    paged = [s for s in plan.servers if s.options.mode == "paged"]
    settings = sorted(
        (s.options.routing, bool(s.options.overlap_page_in), s.options.overlap_groups or 0) for s in paged
    )
    assert settings == [(routing, on, groups) for routing in ("model", "qwen3-30b-a3b")
                        for on, groups in ((False, 0), (True, 1), (True, 4))]  # fmt: skip
    assert {s.options.resident_experts for s in paged} == {40}
    # the compute reference of the link and serial bounds: resident FP8 on each routing
    resident = sorted(s.options.routing for s in plan.servers if s.options.mode == "resident")
    assert resident == ["model", "qwen3-30b-a3b"] and len(plan.servers) == 8
    assert all(s.options.model == paged[0].options.model for s in plan.servers)
    assert out.count("--overlap-page-in --overlap-groups 4") == 2
    assert load_matrix(path).matrix.linkbw


def decode_ab(name: str, capsys: pytest.CaptureFixture[str], servers: int) -> tuple[str, list[Any]]:
    """What issue 29's decode A/B matrices (dmaproxy, switch, capcopy) share, checked on configs/h200/`name`.yaml:
    its dry run passes; paged FP8 at K=54; resident FP8 on both routings (the compute reference); `servers` servers;
    the link probe; >= 2 repeats; decode at c=1 and 4 with >= 4 warm-ups and >= 128 output tokens
    -> (the dry run's output, the paged servers)."""
    path = CONFIGS / f"{name}.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(load_matrix(path))
    paged = [s for s in plan.servers if s.options.mode == "paged"]
    assert {s.options.resident_experts for s in paged} == {54}
    resident = sorted(s.options.routing for s in plan.servers if s.options.mode == "resident")
    assert resident == ["model", "qwen3-30b-a3b"] and len(plan.servers) == servers
    m = load_matrix(path).matrix
    assert m.linkbw and m.repeats >= 2
    decode = m.workloads["decode"]
    assert decode.concurrency == [1, 4] and decode.warmup_requests >= 4 and decode.output_tokens >= 128
    return out, paged


def test_the_dmaproxy_matrix_measures_the_copy_engine_against_the_copy_kernel(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/dmaproxy.yaml: paged FP8 at K=54 on both routings, today's default against the overlapped pass
    with its misses on the copy engine (the DMA proxy) in 1 and 2 groups, beside resident FP8 on each routing; the
    server command names the copies; decode at c=1 and c=4 with warm-ups at each."""
    out, paged = decode_ab("dmaproxy", capsys, servers=8)
    settings = sorted((s.options.routing, s.options.overlap_copies or "", s.options.overlap_groups or 0) for s in paged)
    assert settings == [(routing, copies, groups) for routing in ("model", "qwen3-30b-a3b")
                        for copies, groups in (("", 0), ("dma", 1), ("dma", 2))]  # fmt: skip
    assert all(bool(s.options.overlap_page_in) == (s.options.overlap_copies == "dma") for s in paged)
    assert out.count("--overlap-page-in --overlap-groups 2 --overlap-copies dma") == 2


def test_the_switch_matrix_measures_the_graphs_own_copy_engine_copies_against_the_copy_kernel(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/switch.yaml: paged FP8 at K=54 on both routings, today's default against the overlapped pass with
    its misses copied by SWITCH lanes (one group), beside resident FP8 on each routing; the server command names the
    copies; decode at c=1 and c=4 with warm-ups at each."""
    out, paged = decode_ab("switch", capsys, servers=6)
    settings = sorted((s.options.routing, s.options.overlap_copies or "") for s in paged)
    assert settings == [(routing, copies) for routing in ("model", "qwen3-30b-a3b") for copies in ("", "switch")]
    assert all(bool(s.options.overlap_page_in) == (s.options.overlap_copies == "switch") for s in paged)
    assert out.count("--overlap-page-in --overlap-groups 1 --overlap-copies switch") == 2


def test_the_capcopy_matrix_measures_the_capped_copy_with_overlap_against_the_default(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/capcopy.yaml: paged FP8 at K=54 on both routings, today's default against the overlapped pass with
    the copy kernel capped at 16 programs, beside resident FP8 on each routing; the server command names both
    settings; decode at c=1 and c=4 with warm-ups at each."""
    out, paged = decode_ab("capcopy", capsys, servers=6)
    settings = sorted((s.options.routing, s.options.copy_programs or 0, bool(s.options.overlap_page_in)) for s in paged)
    arms = ((0, False), (16, True))  # today's default; the capped copy with the overlapped pass
    assert settings == [(r, programs, on) for r in ("model", "qwen3-30b-a3b") for programs, on in arms]
    assert all(s.options.overlap_copies in (None, "kernel") for s in paged)  # the copy kernel's copies, not lanes
    assert out.count("--copy-programs 16") == 2 and out.count("--overlap-page-in") == 2


def test_the_packed_matrix_measures_packed_rows_against_split(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/packed.yaml: paged FP8 at K=54 on both routings, split rows (today) against packed rows in one run
    id, the server command naming the layout; short and 2,048-token prompts at c=1 and c=4, two repeats."""
    path = CONFIGS / "packed.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(load_matrix(path))
    settings = sorted((s.options.routing, s.options.expert_rows or "") for s in plan.servers)
    assert settings == [(r, rows) for r in ("model", "qwen3-30b-a3b") for rows in ("packed", "split")]
    assert {s.options.resident_experts for s in plan.servers} == {54} and {s.options.mode for s in plan.servers} == {
        "paged"
    }
    assert out.count("--expert-rows packed") == 2 and out.count("--expert-rows split") == 2
    m = load_matrix(path).matrix
    assert m.linkbw and m.repeats >= 2
    chat = m.workloads["chat"]
    assert chat.concurrency == [1, 4] and set(chat.prompt_classes) == {"short", "2048"} and chat.output_tokens >= 128


def test_the_copy_matrix_measures_the_capped_copy_grid(stand_ins: None, capsys: pytest.CaptureFixture[str]) -> None:
    """configs/h200/copy.yaml: paged FP8 at K=40 on both routings with the full copy grid, the grid capped
    at 16 and 32 programs, and capped with overlap, beside resident FP8; the commands say what is in force."""
    path = CONFIGS / "copy.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(load_matrix(path))
    paged = [s for s in plan.servers if s.options.mode == "paged"]
    settings = sorted((s.options.routing, s.options.copy_programs or 0, bool(s.options.overlap_page_in)) for s in paged)
    assert settings == [(routing, programs, on) for routing in ("model", "qwen3-30b-a3b")
                        for programs, on in ((0, False), (16, False), (16, True), (32, False), (32, True))]  # fmt: skip
    assert {s.options.resident_experts for s in paged} == {40} and len(plan.servers) == 12
    resident = sorted(s.options.routing for s in plan.servers if s.options.mode == "resident")
    assert resident == ["model", "qwen3-30b-a3b"]
    assert (
        out.count("--copy-programs 16") == 4 and out.count("--overlap-page-in --overlap-groups 1 --copy-programs") == 4
    )
    assert load_matrix(path).matrix.linkbw


def test_the_ttft_matrix_measures_paged_prefill_against_its_floor(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/ttft.yaml: paged FP8 at the headline's K=42 on both routings beside resident FP8,
    2,048-token and short prompts at c=1 and 4, the link probe (the floor's denominator)."""
    path = CONFIGS / "ttft.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    capsys.readouterr()
    m = load_matrix(path).matrix
    assert m.linkbw and m.repeats >= 2
    assert [(w.prompt_classes, w.concurrency) for w in m.workloads.values()] == [(["2048", "short"], [1, 4])]
    plan = build_plan(load_matrix(path))
    assert sorted((s.options.mode, s.options.routing, s.options.resident_experts or 0) for s in plan.servers) == [
        ("paged", "model", 42), ("paged", "qwen3-30b-a3b", 42), ("resident", "model", 0)
    ]  # fmt: skip


def test_the_paged16_matrix_searches_k_at_16_gb_on_both_routings(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/paged16.yaml: resident FP8 and paged FP8 with K searched against 16 GB of peak device
    memory on the model's and the calibrated routing; warm-ups at least the highest concurrency."""
    path = CONFIGS / "paged16.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("search paged-fp8") == 2 and "resident_experts is searched" in out
    m = load_matrix(path).matrix
    assert m.linkbw and m.repeats >= 2
    for workload in m.workloads.values():
        assert workload.prompt_classes == ["short", "2048"] and workload.concurrency == [1, 4]
        assert workload.warmup_requests >= max(workload.concurrency)
    raw = yaml.safe_load(path.read_text())["engines"]
    paged = [e["options"] for e in raw.values() if e["options"].get("mode") == "paged"]
    assert [(o["resident_experts"], o["vram_budget_gb"], o.get("routing", "model")) for o in paged] == [
        ("search", 16, "model"), ("search", 16, "qwen3-30b-a3b")
    ]  # fmt: skip


def test_the_fused_matrix_measures_the_fused_page_in_on_both_routings(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/fused.yaml: paged FP8 at paged16's K=49 with and without fused_page_in on both routings,
    resident FP8 on each routing (the compute reference); the commands say which servers read through."""
    path = CONFIGS / "fused.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(load_matrix(path))
    servers = [s for s in plan.servers if s.options.mode == "paged"]
    paged = sorted((s.options.routing, bool(s.options.fused_page_in)) for s in servers)
    assert paged == [("model", False), ("model", True), ("qwen3-30b-a3b", False), ("qwen3-30b-a3b", True)]
    assert {s.options.resident_experts for s in plan.servers if s.options.mode == "paged"} == {49}
    resident = sorted(s.options.routing for s in plan.servers if s.options.mode == "resident")
    assert resident == ["model", "qwen3-30b-a3b"]
    assert out.count("--fused-page-in") == 2 and out.count("--kernel-backend triton") == 6
    m = load_matrix(path).matrix
    assert m.linkbw and m.repeats >= 2
    for workload in m.workloads.values():
        assert workload.warmup_requests >= max(workload.concurrency)


def test_the_prefill_matrix_measures_the_kernel_page_in_on_both_routings(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/kernelcopy.yaml: paged FP8 at paged16's K=49 with the prefill's page-ins as DMAs and as one copy
    kernel launch per group, on both routings, 2,048-token prompts at c=1 and c=4; resident FP8 on each routing
    (the compute reference); the commands name the copy each paged server runs."""
    path = CONFIGS / "kernelcopy.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(load_matrix(path))
    paged = sorted((s.options.routing, s.options.page_in) for s in plan.servers if s.options.mode == "paged")
    assert paged == [("model", "direct"), ("model", "kernel"), ("qwen3-30b-a3b", "direct"), ("qwen3-30b-a3b", "kernel")]
    assert {s.options.resident_experts for s in plan.servers if s.options.mode == "paged"} == {49}
    resident = sorted(s.options.routing for s in plan.servers if s.options.mode == "resident")
    assert resident == ["model", "qwen3-30b-a3b"]
    assert out.count("--page-in kernel") == 2 and out.count("--page-in direct") == 2
    _long_prompts_at_c1_and_c4(path)


def test_the_batch_copy_matrix_measures_one_driver_call_against_the_dmas_on_both_routings(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/batchcopy.yaml: paged FP8 at h200-headline-c's searched K (53 model routing, 54 calibrated) with
    the prefill's page-ins as DMAs and as one cuMemcpyBatchAsync a group, on both routings, 2,048-token prompts at
    c=1 and c=4; the two arms differ in the copy alone, and the commands name it."""
    path = CONFIGS / "batchcopy.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(load_matrix(path))
    paged = sorted((s.options.routing, s.options.resident_experts, s.options.page_in) for s in plan.servers)
    assert paged == [
        ("model", 53, "batch"), ("model", 53, "direct"), ("qwen3-30b-a3b", 54, "batch"), ("qwen3-30b-a3b", 54, "direct")
    ]  # fmt: skip
    assert all(s.options.mode == "paged" for s in plan.servers)
    assert out.count("--page-in batch") == 2 and out.count("--page-in direct") == 2
    _long_prompts_at_c1_and_c4(path)


def test_the_staging_matrix_measures_staging_rows_on_both_routings(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/staging.yaml: paged FP8 without staging rows (K=49), with 40 at K=48 and with 64 at K=47 (each
    below 16 GB: K=49 with 24 rows peaked over it), on both routings, 2,048-token prompts at c=1 and c=4 with 3
    repeats of 8 requests (a request's TTFT varied up to 1.7x inside a cell); the commands name the rows each
    server stages into."""
    path = CONFIGS / "staging.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(load_matrix(path))
    got = sorted(
        (s.options.routing, s.options.resident_experts, s.options.prefill_staging_rows or 0) for s in plan.servers
    )
    assert got == [
        ("model", 47, 64), ("model", 48, 40), ("model", 49, 0),
        ("qwen3-30b-a3b", 47, 64), ("qwen3-30b-a3b", 48, 40), ("qwen3-30b-a3b", 49, 0),
    ]  # fmt: skip
    assert out.count("--prefill-staging-rows 64") == 2 and out.count("--prefill-staging-rows 40") == 2
    m = load_matrix(path).matrix
    assert m.repeats == 3 and all(w.num_requests == 8 for w in m.workloads.values())
    _long_prompts_at_c1_and_c4(path)


def test_the_staging16_matrix_searches_k_for_each_number_of_staging_rows_at_16_gb(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/staging16.yaml: paged FP8 on the model's routing with 0, 32 and 64 staging rows, each K searched
    against 16 GB of peak device memory (the rows' bytes priced in K), 2,048-token prompts at c=1 and c=4 for the
    TTFT and short prompts at c=1 for the decode the K given up costs."""
    path = CONFIGS / "staging16.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("search paged-fp8") == 3 and "resident_experts is searched" in out
    plan = build_plan(load_matrix(path))
    searches = sorted((s.spec.options.prefill_staging_rows or 0, s.spec.options.routing) for s in plan.searches)
    assert searches == [(0, "model"), (32, "model"), (64, "model")]
    assert {s.spec.options.vram_budget_gb for s in plan.searches} == {16}
    assert {s.option for s in plan.searches} == {"resident_experts"}
    m = load_matrix(path).matrix
    assert m.linkbw and m.repeats >= 2
    prefill, decode = m.workloads["prefill"], m.workloads["decode"]
    assert prefill.prompt_classes == ["2048"] and prefill.concurrency == [1, 4]
    assert prefill.warmup_requests >= max(prefill.concurrency)
    assert decode.prompt_classes == ["short"] and decode.concurrency == [1] and decode.output_tokens >= 128


def _long_prompts_at_c1_and_c4(path: Path) -> None:
    """A prefill matrix's shared terms: the link probe, >= 2 repeats, 2,048-token prompts at c=1 and c=4 with
    warm-ups at each concurrency."""
    m = load_matrix(path).matrix
    assert m.linkbw and m.repeats >= 2
    for workload in m.workloads.values():
        assert workload.prompt_classes == ["2048"] and workload.concurrency == [1, 4]
        assert workload.warmup_requests >= max(workload.concurrency)


def test_the_gc_freeze_matrix_measures_the_freeze_against_none(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/gcfreeze.yaml: paged FP8 K=49 with the server's heap freeze (its default) and without, on the
    model's routing, 2,048-token prompts at c=1 and c=4, 3 repeats of 8 requests; the commands name the freeze."""
    path = CONFIGS / "gcfreeze.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(load_matrix(path))
    got = sorted((s.options.resident_experts, str(s.options.gc_freeze), s.options.routing) for s in plan.servers)
    assert got == [(49, "False", "model"), (49, "None", "model")]  # None: the server's default, the freeze
    assert out.count("--enable-gc-freeze") == 1 and out.count("--disable-gc-freeze") == 1
    m = load_matrix(path).matrix
    assert m.repeats == 3 and all(w.num_requests == 8 for w in m.workloads.values())
    _long_prompts_at_c1_and_c4(path)


def test_the_record_matrix_measures_recording_against_none(stand_ins: None, capsys: pytest.CaptureFixture[str]) -> None:
    """configs/h200/record.yaml: paged FP8 at 16 GB's K on each routing without and with record_routing (the A/B of
    what recording costs), both prompt classes at c=1 and c=4, 2 repeats; only the recording servers' commands name
    a trace, and the headline records nothing (its verdict is measured as users run the engines)."""
    path = CONFIGS / "record.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(load_matrix(path))
    got = sorted((s.options.resident_experts, s.options.routing, s.options.record_routing) for s in plan.servers)
    assert got == [(53, "model", False), (53, "model", True), (54, "qwen3-30b-a3b", False), (54, "qwen3-30b-a3b", True)]
    assert out.count("--record-routing") == 2
    m = load_matrix(path).matrix
    assert m.repeats == 2 and m.linkbw
    for workload in m.workloads.values():
        assert workload.prompt_classes == ["short", "2048"] and workload.concurrency == [1, 4]
    headline = build_plan(load_matrix(CONFIGS / "headline.yaml"))
    assert not any(getattr(s.options, "record_routing", False) for s in headline.servers)


@pytest.mark.parametrize(
    ("name", "arms", "prompt_classes", "repeats", "k_model"),
    [
        ("policy.yaml", ("lfu-aging", "lfu-aging:256:4", "lru"), ["short"], 2, 53),
        ("window.yaml", ("lfu-aging:256:16", "lfu-aging:256:64", "lru"), ["short"], 2, 53),
        ("policyconfirm.yaml", ("lfu-aging:256:16", "lru"), ["short", "2048"], 3, 53),
        ("duel.yaml", ("duel", "lfu-aging:256:4", "lru"), ["short"], 2, 54),
        ("duelconfirm.yaml", ("duel", "lru"), ["short", "2048"], 3, 54),
    ],
)
def test_the_policy_matrices_measure_eviction_policies_against_lru_on_both_routings(
    stand_ins: None, capsys: pytest.CaptureFixture[str], name: str, arms: tuple[str, ...],
    prompt_classes: list[str], repeats: int, k_model: int,
) -> None:  # fmt: skip
    """configs/h200/policy.yaml (LRU, `lfu-aging`, a 4-step window), window.yaml (16- and 64-step windows),
    policyconfirm.yaml (the 16-step window's confirming run), duel.yaml (the duel beside both of its arms) and
    duelconfirm.yaml (the duel's confirming run): paged FP8 at 16 GB's K on each routing (the model's: 53 before
    packed rows, 54 since; calibrated 54) with each arm, planned on the GPU (every command line passes --device cuda
    and its policy), every arm recording its routing (each cell's realized vs optimal hit rate; the traces `session.sh
    policies` replays), c=1 and c=4."""
    path = CONFIGS / name
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(load_matrix(path))
    got = sorted((s.options.resident_experts, s.options.routing, s.options.eviction_policy) for s in plan.servers)
    assert got == sorted([(k_model, "model", p) for p in arms] + [(54, "qwen3-30b-a3b", p) for p in arms])
    for arm in arms:  # the trailing space: `lfu-aging` is not counted inside `lfu-aging:256:4`
        assert out.count(f"--eviction-policy {arm} ") == 2, arm
    assert out.count("--device cuda") == len(plan.servers) == 2 * len(arms)
    assert all(s.options.record_routing for s in plan.servers)
    m = load_matrix(path).matrix
    assert m.repeats == repeats and m.linkbw
    for workload in m.workloads.values():
        assert workload.prompt_classes == prompt_classes and workload.concurrency == [1, 4]


def test_the_prefetch_matrix_measures_next_layer_prefetch_on_the_models_routing(
    stand_ins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/h200/prefetch.yaml: paged FP8 at 16 GB's K on the model's own routing (53) without and with
    next-layer prefetch, beside resident FP8 (the decode bounds' compute reference); no synthetic arm (the server
    refuses prefetch under a synthetic routing source); both prompt classes, c=1 and c=4, 2 repeats."""
    path = CONFIGS / "prefetch.yaml"
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(load_matrix(path))
    got = sorted((s.options.mode, s.options.resident_experts, s.options.prefetch_next_layer) for s in plan.servers)
    assert got == [("paged", 53, False), ("paged", 53, True), ("resident", None, False)]
    assert {s.options.routing for s in plan.servers} == {"model"}
    assert out.count("--prefetch-next-layer") == 1 and out.count("--device cuda") == 3
    m = load_matrix(path).matrix
    assert m.repeats == 2 and m.linkbw
    for workload in m.workloads.values():
        assert workload.prompt_classes == ["short", "2048"] and workload.concurrency == [1, 4]


def test_every_committed_matrix_plans(stand_ins: None, capsys: pytest.CaptureFixture[str]) -> None:
    """Every configs/h200/*.yaml loads and plans in a dry run (`session.sh` runs any of them by name, so a matrix
    added without a test of its own still fails here, not on the device), and probes the link once (`linkbw: true`:
    every H200 matrix gives the report its link and serial bounds)."""
    paths = sorted(CONFIGS.glob("*.yaml"))
    assert len(paths) >= 20
    for path in paths:
        assert main(["run", str(path), "--dry-run"]) == 0, path.name
        assert "link bandwidth" in capsys.readouterr().out, path.name
