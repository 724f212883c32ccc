"""The A/A check: two runs of one matrix on one machine, compared, flag nothing.

Each "run" measures two configurations (a fast and a slow scripted server) at two concurrencies, three
repeats each, through the real load generator, metrics and store. Noise is injected where a shared
machine puts it: one slow-down factor per cell (machine load drifts between cells and between runs),
not per request, so the requests of one cell share it. A test over requests (the old compare:
Mann-Whitney U on per-request samples) flagged such runs; the test over repeats must not. A third run
whose slow configuration really is 2.5 x slower is the positive control: that change must be flagged.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from benchsuite.load.loadgen import LoadSpec, run_load
from benchsuite.measure import metrics
from benchsuite.records import CellResult, LoadRequest
from benchsuite.report import compare_runs
from benchsuite.report.build import build_report_data
from benchsuite.results.manifest import Manifest
from benchsuite.results.store import RunStore

try:  # tests/ as a package or as a plain directory on sys.path (pytest's default prepend mode)
    from fakes import FakeServer, Script
except ImportError:
    from fakes import FakeServer, Script  # type: ignore[no-redef]

BASE_ITL_S = {"fast": 0.002, "slow": 0.003}
CELL_NOISE_SIGMA = (
    0.25  # log-normal factor per cell (+-25%): it, not the test machine's own jitter, is the noise that matters
)
REPEATS = 3
CONCURRENCY = (1, 2)


async def _measure_run(root: Path, run_id: str, seed: int, slow_factor: float = 1.0, repeats: int = REPEATS) -> Path:
    run_dir = root / run_id
    run_dir.mkdir(parents=True)
    manifest = Manifest(
        run_id=run_id,
        created_utc="2026-12-01T00:00:00+00:00",
        matrix_source="aa.yaml",
        matrix_hash="aa-matrix",
        matrix={},
        git={"commit": "aa-commit", "dirty": False, "tree": "aa-tree"},
    )
    (run_dir / "manifest.json").write_text(json.dumps(manifest.to_json()))
    store = RunStore(run_dir)
    rng = random.Random(seed)
    requests = [LoadRequest(f"p{i}", "short", f"prompt {i}", 12) for i in range(6)]
    async with FakeServer() as server:
        for repeat in range(repeats):  # interleaved, as the quickstart runs them
            for name, itl_s in BASE_ITL_S.items():
                for concurrency in CONCURRENCY:
                    factor = rng.lognormvariate(0.0, CELL_NOISE_SIGMA) * (slow_factor if name == "slow" else 1.0)
                    server.script = Script(itl_s=itl_s * factor, ttft_s=0.004 * factor)
                    cell_id = f"{run_id}-{name}-c{concurrency}-r{repeat}"
                    records = await run_load(
                        server.url,
                        requests,
                        LoadSpec(concurrency=concurrency, warmup=1),
                        cell_id=cell_id,
                        model_name="fake",
                        extras={},
                        cold_first=False,
                    )
                    base = CellResult(
                        cell_id=cell_id,
                        run_id=run_id,
                        engine=name,
                        engine_kind="builtin",
                        mode=name,
                        server_id=name,
                        params={},
                        workload="w",
                        prompt_class="short",
                        concurrency=concurrency,
                        repeat=repeat,
                        status="ok",
                    )
                    store.write_cell(metrics.summarize(records, base=base), records)
    store.rebuild_tables()
    return run_dir


async def test_two_runs_of_one_matrix_flag_nothing_and_a_real_change_is_flagged(tmp_path: Path) -> None:
    run_1 = await _measure_run(tmp_path, "aa-1", seed=1)
    run_2 = await _measure_run(tmp_path, "aa-2", seed=2)
    aa = compare_runs(run_1, run_2)
    assert len(aa.rows) == 2 * len(CONCURRENCY) * 3 and set(aa.rows["n_a"]) == {REPEATS}
    assert aa.same_source is not None  # the comparison says it is A/A
    assert aa.flagged.empty, aa.flagged[["configuration", "concurrency", "metric", "change", "p_value"]].to_string()
    slower = await _measure_run(tmp_path, "slower", seed=3, slow_factor=2.5)
    ab = compare_runs(run_1, slower)
    flagged = ab.flagged
    assert set(flagged["configuration"]) == {"slow · defaults"} and set(flagged["verdict"]) == {"REGRESSED"}
    assert set(flagged[flagged["metric"] == "decode_tok_s"]["concurrency"]) == set(CONCURRENCY)


async def test_one_repeat_a_side_gives_no_verdict_instead_of_a_false_one(tmp_path: Path) -> None:
    # The quickstart's old shape (repeats: 1): the per-request test flagged 9 of these 12 rows.
    run_1 = await _measure_run(tmp_path, "one-1", seed=5, repeats=1)
    run_2 = await _measure_run(tmp_path, "one-2", seed=6, repeats=1)
    aa = compare_runs(run_1, run_2)
    assert aa.flagged.empty and len(aa.rows) == 12
    assert set(aa.rows["verdict"]) == {"not enough repeats (1 and 1; 2 a side needed)"}


async def test_the_verdict_within_a_run_uses_the_repeats(tmp_path: Path) -> None:
    run = await _measure_run(tmp_path, "one", seed=4, slow_factor=1.6)
    data = build_report_data([run])
    groups = data.groups
    fast = groups[(groups["mode"] == "fast") & (groups["concurrency"] == 1)].iloc[0]
    slow = groups[(groups["mode"] == "slow") & (groups["concurrency"] == 1)].iloc[0]
    assert fast["decode_tok_s_p50"].n == REPEATS and len(fast["decode_tok_s_p50"].values) == REPEATS
    assert fast["decode_tok_s_p50"].median > slow["decode_tok_s_p50"].median
