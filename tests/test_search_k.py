"""The paged K search on synthetic memory and throughput curves (no server launched): the largest
K whose measured peak fits, found in two or three launches on a linear memory curve whatever the
projection's offset, its neighbour verified; the fastest K at or below it; the settings it reads."""

from __future__ import annotations

import pytest

from benchsuite.engines.builtin import memory
from benchsuite.errors import UserError
from benchsuite.run.search import (
    Observation,
    ResidentExpertsSettings,
    drive,
    parse_request,
    propose_fastest,
    propose_largest,
)

GB = 10**9
SLOT = 227 * 10**6  # one FP8 expert in each of 48 layers (DESIGN.md section 3)
STATIC = 5 * GB  # non-expert weights + KV: the projection's part besides the slots
BUDGET = 16 * GB
KS = list(range(32, 129))  # K >= 4 x top_k 8, up to E = 128


def guess(overhead: int) -> dict[int, int]:
    return {k: STATIC + k * SLOT + overhead for k in KS}


def engine(true_overhead: int, speed=lambda k: 10.0 + k):
    """A server whose peak is linear in K with an overhead the projection does not know."""

    def measure(k: int) -> Observation:
        peak = STATIC + k * SLOT + true_overhead
        return Observation(speed(k), peak, fits=peak <= BUDGET)

    return measure


def largest_true_k(true_overhead: int) -> int:
    return max(k for k in KS if STATIC + k * SLOT + true_overhead <= BUDGET)


@pytest.mark.parametrize("true_overhead", [0, int(0.6 * GB), int(1.0 * GB), int(2.3 * GB), int(3.0 * GB)])
def test_the_largest_fitting_k_in_at_most_three_launches(true_overhead: int) -> None:
    outcome = drive(propose_largest(KS, guess(2**30), BUDGET), engine(true_overhead))
    best = largest_true_k(true_overhead)
    assert outcome.best_n == best
    measured = {m.n for m in outcome.measurements}
    assert best + 1 in measured  # the neighbour was launched and measured over the budget
    assert outcome.launches <= 3 < outcome.linear_scan_launches


def test_a_wrong_slope_still_converges_by_bracketing() -> None:
    # the projection's slot is 20% small: each corrected guess still overshoots a little
    wrong = {k: STATIC + int(k * SLOT * 0.8) + 2**30 for k in KS}
    outcome = drive(propose_largest(KS, wrong, BUDGET), engine(int(0.8 * GB)))
    assert outcome.best_n == largest_true_k(int(0.8 * GB))
    assert outcome.launches <= 6


def test_the_largest_k_of_the_range_needs_no_neighbour() -> None:
    outcome = drive(propose_largest(KS, {k: GB for k in KS}, BUDGET), lambda k: Observation(1.0, GB, True))
    assert (outcome.best_n, outcome.launches) == (128, 1)


def test_nothing_fits_and_a_failed_launch_is_not_a_fit() -> None:
    outcome = drive(propose_largest(KS, guess(0), BUDGET), engine(20 * GB))
    # the guess's largest K, then (corrected) the smallest K: measured over, nothing below it
    assert outcome.best_n is None and [m.n for m in outcome.measurements] == [48, 32]
    # a launch that fails (an out-of-memory start) counts as over the budget, never as a fit
    failing = largest_true_k(0)
    fails = engine(0)
    outcome = drive(
        propose_largest(KS, guess(0), BUDGET), lambda k: Observation(None, None) if k == failing else fails(k)
    )
    assert outcome.best_n == failing - 1


def test_without_a_gpu_a_k_fits_by_its_guess_and_the_neighbour_is_still_launched() -> None:
    outcome = drive(propose_largest(KS, guess(2**30), BUDGET), lambda k: Observation(5.0))
    expected = max(k for k in KS if guess(2**30)[k] <= BUDGET)
    assert outcome.best_n == expected
    assert [m.n for m in outcome.measurements] == [expected, expected + 1]
    assert all(m.peak_bytes is None for m in outcome.measurements)


def test_fastest_climbs_down_from_the_largest_k_reusing_its_launches() -> None:
    # throughput peaks at K=36 while memory allows up to K=41: the fastest K is below the largest
    peak_at = 36
    speed = lambda k: 100.0 - 3 * abs(k - peak_at)  # noqa: E731
    true_overhead = int(1.5 * GB)
    outcome = drive(propose_fastest(KS, guess(2**30), BUDGET), engine(true_overhead, speed))
    largest = largest_true_k(true_overhead)
    assert largest > peak_at
    assert outcome.best_n == peak_at
    launched = [m.n for m in outcome.measurements]
    assert len(launched) == len(set(launched))  # no K launched twice
    assert outcome.launches < outcome.linear_scan_launches / 3


def test_fastest_on_a_monotone_curve_is_the_largest() -> None:
    outcome = drive(propose_fastest(KS, guess(2**30), BUDGET), engine(GB))
    assert outcome.best_n == largest_true_k(GB)


def test_settings() -> None:
    assert parse_request("search", "resident_experts") == ResidentExpertsSettings()
    assert parse_request({"search": {"objective": "fastest", "min_k": 8}}, "resident_experts").min_k == 8
    with pytest.raises(UserError, match=r"^resident_experts.search.min_n: Extra inputs are not permitted$"):
        parse_request({"search": {"min_n": 3}}, "resident_experts")


def test_k_range_keeps_one_wave_at_the_highest_concurrency_unless_told() -> None:
    assert memory.k_range(128, 8, 4, None, None) == range(32, 129)
    assert memory.k_range(128, 8, 4, 8, 64) == range(8, 65)  # min_k: top_k allows multi-wave batches
    assert memory.k_range(128, 8, 1, 2, None).start == 8  # never below top_k
    with pytest.raises(UserError, match="max concurrency 32 x top_k 8"):
        memory.k_range(128, 8, 32, None, None)


def test_projection_is_linear_in_k_with_the_slot_of_the_served_format(tmp_path) -> None:
    from paged_experts.weights.synth import ensure_tiny

    model = ensure_tiny()
    proj = memory.projections(model, "float32", 256, range(2, 9))
    from paged_experts.config import MoeModelConfig

    cfg = MoeModelConfig.from_dir(model)
    slot = cfg.slot_bytes("float32")
    assert proj[3].gpu_total_bytes - proj[2].gpu_total_bytes == slot
    assert proj[2].kv_bytes == 256 * cfg.kv_bytes_per_token("float32")
    assert proj[8].fits(proj[8].gpu_total_bytes, 0) and not proj[8].fits(proj[8].gpu_total_bytes, 1)


def test_the_k_search_measures_the_longest_prompt_at_the_highest_concurrency(tmp_path) -> None:
    # memory decides K, and prefill activations grow with the prompt: the long class is the one measured
    from benchsuite.config.matrix import load_matrix
    from benchsuite.config.plan import build_plan, plan_cells, search_cell

    path = tmp_path / "m.yaml"
    path.write_text(
        "name: k\nengines:\n  e:\n    kind: builtin\n"
        "    options: {model: tiny, mode: paged, resident_experts: search}\n"
        "workloads:\n  a: {prompt_classes: [short], concurrency: [1, 2], num_requests: 1}\n"
        "  b: {prompt_classes: [short, '64'], concurrency: [1, 2], num_requests: 1}\nrepeats: 2\n"
    )
    plan = build_plan(load_matrix(path))
    (task,) = plan.searches
    cells = plan_cells(plan.matrix, task.spec, task.params)
    k_cell = search_cell(cells, "resident_experts")
    assert (k_cell.workload, k_cell.prompt_class, k_cell.concurrency, k_cell.repeat) == ("b", "64", 2, 0)
    n_cell = search_cell(cells, "n_cpu_moe")
    assert (n_cell.workload, n_cell.prompt_class, n_cell.concurrency, n_cell.repeat) == ("a", "short", 2, 0)


def test_a_launch_s_fit_is_its_measured_peak_else_for_k_its_guess() -> None:
    from types import SimpleNamespace

    from benchsuite.run.search import _Probe

    def result(peak: int | None, status: str = "ok") -> SimpleNamespace:
        return SimpleNamespace(status=status, decode_tok_s_p50=50.0, peak_device_memory_bytes=peak)

    k_probe = _Probe(None, None, "decode_tok_s_p50", BUDGET, guess_fits={20: True, 21: False})
    k_probe.results = {20: result(None), 21: result(None), 22: result(BUDGET + 1), 23: result(BUDGET, "failed")}
    assert [k_probe.observation(k).fits for k in (20, 21, 22)] == [True, False, False]
    assert k_probe.observation(23) == Observation(None, BUDGET, True)  # failed: no value, never 0
    n_probe = _Probe(None, None, "decode_tok_s_p50", BUDGET, guess_fits=None)
    n_probe.results = {3: result(None), 4: result(BUDGET - 1)}
    assert n_probe.observation(3) == Observation(50.0, None, None)  # N without a GPU: its projection decided
    assert n_probe.observation(4).fits is True


@pytest.mark.parametrize(("rows_option", "rows"), [("", 0), (", prefill_staging_rows: 64", 64)])
def test_the_k_search_counts_the_staging_rows_and_leaves_them_room(tmp_path, rows_option: str, rows: int) -> None:
    """Staging rows take one expert's bytes each on the device, at every K the search projects; and a server
    refuses more rows than the E - K experts outside its slots, so the search stops at K = E - rows."""
    from benchsuite.config.matrix import load_matrix
    from benchsuite.config.plan import build_plan
    from benchsuite.engines.builtin.adapter import BuiltinAdapter
    from paged_experts.config import MoeModelConfig
    from paged_experts.weights.synth_memory import write_weightless

    model = write_weightless("qwen3-30b-a3b-fp8-shape", tmp_path / "q48-fp8")  # E = 128, 48 layers
    path = tmp_path / "m.yaml"
    path.write_text(
        "name: k\nengines:\n  e:\n    kind: builtin\n"
        f"    options: {{model: {model}, device: cuda, dtype: bfloat16, mode: paged, resident_experts: search,\n"
        f"               vram_budget_gb: 16{rows_option}}}\n"
        "workloads:\n  a: {prompt_classes: [short], concurrency: [1, 4], num_requests: 1}\n"
    )
    (task,) = build_plan(load_matrix(path)).searches
    proj = BuiltinAdapter().projections(task.spec, ResidentExpertsSettings())
    cfg = MoeModelConfig.from_dir(model)
    expert = cfg.expert_bytes(cfg.expert_dtype("bfloat16"))  # one staging row: one FP8 expert with its scales
    assert expert == 4_719_744  # the H200 runs' expert_bytes
    assert {p.staging_bytes for p in proj.values()} == {rows * expert}
    assert (min(proj), max(proj)) == (32, 128 - rows)  # 4 x top_k 8 .. E - rows
    assert proj[48].gpu_total_bytes - proj[47].gpu_total_bytes == proj[48].slot_bytes
    if rows:  # rows that leave no K the search may choose: the error names them
        path.write_text(path.read_text().replace(f"prefill_staging_rows: {rows}", "prefill_staging_rows: 100"))
        (task,) = build_plan(load_matrix(path)).searches
        with pytest.raises(UserError, match=r"exceeds the largest K 28 \(prefill_staging_rows 100 leave K at most"):
            BuiltinAdapter().projections(task.spec, ResidentExpertsSettings())
