"""report/budget.py: a run's GPU budget is its llama.cpp search's; a configuration whose measured
device memory is over it is no contender and no baseline, and the verdict's caveat names it."""

from __future__ import annotations

import pandas as pd

from benchsuite.report.budget import device_bytes, over_budget, run_budget_bytes
from benchsuite.report.caveats import budget_exclusions
from benchsuite.report.tables import fits
from benchsuite.results.manifest import ServerRecord

GB = 10**9


def cell(cell_id: str, label: str, used: int | None = None, self_mib: float | None = None) -> dict:
    extras = (
        {}
        if self_mib is None
        else {
            "engine_log": {
                "memory_breakdown_mib": {"CUDA0 (H200)": {"self": self_mib, "free": 1.0}, "Host": {"self": 9e9}}
            }
        }
    )
    return {
        "cell_id": cell_id,
        "label": label,
        "gpu_memory_used_bytes": used,
        "extras": extras,
        "budget_bytes": 16 * GB,
    }


def test_the_budget_is_the_search_s_and_absent_without_one() -> None:
    servers = {
        "a": ServerRecord.model_validate({"search": {"budget_bytes": 16 * GB}}),
        "b": ServerRecord(search=None),
        "c": ServerRecord(),
        "d": ServerRecord.model_validate({"search": {"option": "n_cpu_moe", "request": "search"}}),  # the chosen value
    }
    assert run_budget_bytes(servers) == 16 * GB
    assert run_budget_bytes({"b": ServerRecord()}) is None


def test_measured_memory_decides_for_both_engines() -> None:
    builtin_over = pd.Series(cell("1", "paged K=32", used=int(18.6 * GB)))
    builtin_in = pd.Series(cell("2", "paged K=16", used=int(11.3 * GB)))
    llama_in = pd.Series(cell("3", "llama N=30", self_mib=14475))  # its CUDA devices only, host memory ignored
    llama_over = pd.Series(cell("4", "llama N=0", self_mib=32835))
    unknown = pd.Series(cell("5", "cpu run"))
    assert device_bytes(builtin_over) == int(18.6 * GB) and device_bytes(llama_in) == 14475 * 2**20
    assert device_bytes(unknown) is None
    frame = pd.DataFrame([builtin_over, builtin_in, llama_in, llama_over, unknown])
    assert over_budget(frame.iloc[[1, 2, 4]]) is None
    assert over_budget(frame) == 32835 * 2**20
    groups = pd.DataFrame({"cell_ids": [["1"], ["2"], ["3"], ["4"], ["5"]]})
    assert [fits(row, frame) for _, row in groups.iterrows()] == [False, True, True, False, True]
    assert [label for label, _, _ in budget_exclusions(frame)] == ["llama N=0", "paged K=32"]


def test_without_a_budget_every_configuration_counts() -> None:
    frame = pd.DataFrame([cell("1", "resident", used=62 * GB)]).assign(budget_bytes=None)
    assert fits(pd.Series({"cell_ids": ["1"]}), frame) and budget_exclusions(frame) == []


def test_the_common_peak_figure_decides_before_either_engine_s_own() -> None:
    # the peak over the cell (NVML per process) is the yardstick; the old per-engine figures only fill in
    both = pd.Series({**cell("1", "paged K=40", used=int(15.2 * GB)), "peak_device_memory_bytes": int(16.8 * GB)})
    llama = pd.Series({**cell("2", "llama N=30", self_mib=14475), "peak_device_memory_bytes": int(15.9 * GB)})
    assert device_bytes(both) == int(16.8 * GB) and device_bytes(llama) == int(15.9 * GB)
    assert over_budget(pd.DataFrame([both, llama])) == int(16.8 * GB)
    missing = pd.Series({**cell("3", "cpu", used=int(1.0 * GB)), "peak_device_memory_bytes": float("nan")})
    assert device_bytes(missing) == int(1.0 * GB)


def test_a_budget_judged_by_two_figures_is_named() -> None:
    """Peak per process for one configuration, an older run's log breakdown for another: the caveat
    says the fit is not measured alike (before, the two were compared silently)."""
    from benchsuite.report.budget import mixed_figures
    from benchsuite.report.caveats import setup_caveats
    from benchsuite.results.manifest import ServerRecord

    paged = {**cell("1", "paged K=40"), "peak_device_memory_bytes": int(15.2 * GB),
             "device_memory_method": "nvml-per-process"}  # fmt: skip
    llama = cell("2", "llama N=30", self_mib=14475)
    also_peak = {
        **cell("3", "resident"),
        "peak_device_memory_bytes": 62 * GB,
        "device_memory_method": "nvml-per-process",
    }
    frame = pd.DataFrame([paged, llama, also_peak]).assign(server_id=["a", "b", "c"], routing="model")
    assert mixed_figures(frame) == {
        "llama.cpp log breakdown": ["llama N=30"],
        "peak, nvml-per-process": ["paged K=40", "resident"],
    }
    assert mixed_figures(frame.iloc[[0, 2]]) == {}  # one figure: nothing to say
    notes = setup_caveats(frame, {s: ServerRecord() for s in "abc"}, has_gpu=True)
    (note,) = [n for n in notes if "not one figure" in n]
    assert "llama N=30" in note and "paged K=40" in note
