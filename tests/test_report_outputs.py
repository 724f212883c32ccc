"""benchsuite.report.outputs: the texts a configuration's measured requests generated, prompt by prompt, and
whether two sides' agree."""

from __future__ import annotations

import pandas as pd

from benchsuite.report.outputs import SAME, changes_work, outputs_status, texts_by_prompt


def _requests(rows: list[tuple[str, str, str, bool, bool]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["cell_id", "prompt_id", "output_text", "warmup", "ok"])


def test_texts_are_the_measured_ok_requests_of_the_cells_asked_for() -> None:
    requests = _requests([
        ("c1", "p0", "alpha", False, True),
        ("c1", "p0", "warm text", True, True),  # a warm-up: not measured
        ("c1", "p1", "beta", False, False),  # failed: its text is not an output
        ("c2", "p1", "gamma", False, True),  # another cell: asked for below only with c2
        ("c1", "p2", "", False, True),  # no text: nothing to compare
    ])  # fmt: skip
    one = texts_by_prompt(requests, ["c1"])
    assert set(one) == {"p0"} and len(one["p0"]) == 1
    both = texts_by_prompt(requests, ["c1", "c2"])
    assert set(both) == {"p0", "p1"}
    assert texts_by_prompt(requests, ["c1"])["p0"] != texts_by_prompt(_requests([("c", "p0", "other", False, True)]),
                                                                       ["c"])["p0"]  # fmt: skip
    assert texts_by_prompt(pd.DataFrame(), ["c1"]) == {}
    assert texts_by_prompt(requests.drop(columns=["output_text"]), ["c1"]) == {}


def test_two_sides_are_the_same_only_where_every_shared_prompt_generated_the_same_texts() -> None:
    a = {"p0": frozenset({"x"}), "p1": frozenset({"y"}), "p2": frozenset({"z"})}
    assert outputs_status(a, dict(a)) == SAME
    assert outputs_status(a, {"p0": frozenset({"x"}), "p1": frozenset({"y2"})}) == "differ: 1 of 2 prompts"
    # repeats of one side that generated two texts for a prompt differ from a side with one
    assert outputs_status({"p0": frozenset({"x", "x2"})}, {"p0": frozenset({"x"})}) == "differ: 1 of 1 prompts"
    assert outputs_status(a, {}) == "" and outputs_status({}, {}) == ""  # unknown, not the same
    synthetic = outputs_status(a, {"p0": frozenset({"q"})}, synthetic=True)
    assert synthetic.startswith("differ: 1 of 1 prompts") and not changes_work(synthetic)
    assert changes_work("differ: 1 of 1 prompts") and not changes_work(SAME) and not changes_work("")
    resident = outputs_status(a, {"p0": frozenset({"q"})}, paged=False)  # every expert resident: the same work
    assert resident == "differ: 1 of 1 prompts (not paged: the same work a token)" and not changes_work(resident)
