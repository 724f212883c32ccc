"""The tile tables of the Triton MoE kernels (paged_experts/kernels/moe_tiles.py): the FP8 decode
table per shape and batch (the shipped moe_tiles_fp8.json included), its env override, the large-step
(prefill) path choice, and the tuning script's refusals; no GPU needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paged_experts.kernels import moe_tiles
from paged_experts.kernels.moe_tiles import GroupedTiles, TileConfig

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_fp8_table_parses_and_keeps_rows_inside_scale_blocks() -> None:
    table = moe_tiles.load_fp8_table(moe_tiles.FP8_TABLE_PATH)
    qwen = table[moe_tiles.shape_key(2048, 768, 8)]
    assert set(qwen) >= {1, 2, 4}
    for tiles in qwen.values():
        assert set(tiles) == {"gate_up", "down"} and all(128 % c.block_n == 0 for c in tiles.values())


def test_fp8_tiles_pick_the_smallest_tuned_batch_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    one, four = TileConfig(8, 512, 4), TileConfig(32, 256, 4)
    table = {"H64_I32_k2": {1: {"gate_up": one, "down": one}, 4: {"gate_up": four, "down": four}}}
    monkeypatch.setattr(moe_tiles, "FP8_TABLE", table)
    monkeypatch.setattr(moe_tiles, "FP8_OVERRIDE", {})
    assert moe_tiles.fp8_tiles(64, 32, 2, 1)["gate_up"] == one
    assert moe_tiles.fp8_tiles(64, 32, 2, 2)["gate_up"] == four  # 2 and 3 take batch 4's tiles
    assert moe_tiles.fp8_tiles(64, 32, 2, 9)["gate_up"] == four  # past the table: its largest batch
    assert moe_tiles.fp8_tiles(64, 32, 8, 1) == moe_tiles.FP8_CONFIGS  # another shape: the defaults
    override = moe_tiles.parse_fp8_tiles("down=2x128x2xv")
    monkeypatch.setattr(moe_tiles, "FP8_OVERRIDE", override)
    got = moe_tiles.fp8_tiles(64, 32, 2, 1)
    assert got["down"] == TileConfig(2, 128, 2, pair_vector=True) and got["gate_up"] == one


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gate_up=24x512x4", "must divide the 128-row FP8 scale blocks"),
        ("gate=8x512x4", "is not <gate_up|down>"),
        ("down=8x512", "is not <gate_up|down>"),
    ],
)
def test_bad_fp8_tiles_are_refused_naming_the_source(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        moe_tiles.parse_fp8_tiles(spec)
    assert str(err.value).startswith(moe_tiles.FP8_TILES_ENV)


def test_a_bad_table_entry_names_the_file_and_batch(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tiles": {"H8_I8_k1": {"2": "gate_up=3x64x4"}}}))
    with pytest.raises(ValueError, match="t.json: H8_I8_k1 batch 2"):
        moe_tiles.load_fp8_table(path)
    assert moe_tiles.load_fp8_table(tmp_path / "missing.json") == {}


def test_prefill_path_specs_round_trip_and_refuse_bad_tiles() -> None:
    assert moe_tiles.parse_prefill("dequant") is None
    assert moe_tiles.parse_prefill("triton") == moe_tiles.GROUPED_FP8
    tiles = GroupedTiles(32, 64, 64, 8, 2)
    assert moe_tiles.parse_prefill(moe_tiles.prefill_spec(tiles)) == tiles
    assert moe_tiles.prefill_spec(None) == "dequant"
    for bad in ("triton:64x96x128x4x3", "triton:64x128", "cutlass", "dequant:1"):
        with pytest.raises(ValueError, match=moe_tiles.FP8_PREFILL_ENV):
            moe_tiles.parse_prefill(bad)


def test_the_env_overrides_reach_the_tables_at_import() -> None:
    code = (
        "from paged_experts.kernels import moe_tiles as m; "
        "print(m.fp8_tiles(2048, 768, 8, 1)['gate_up'], m.fp8_prefill(2048, 768))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        moe_tiles.FP8_TILES_ENV: "gate_up=4x128x2",
        moe_tiles.FP8_PREFILL_ENV: "dequant",
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "TileConfig(block_n=4, block_k=128, num_warps=2, pair_vector=False) None"


def test_the_tuning_script_refuses_batches_the_kernels_never_run() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fp8_tiles_h200

    tiles = fp8_tiles_h200.candidates("gate_up:8,24:512:4;down/v:4:128,256:8")
    assert [c for _, c in tiles] == [
        TileConfig(8, 512, 4),
        TileConfig(4, 128, 8, pair_vector=True),
        TileConfig(4, 256, 8, pair_vector=True),
    ]  # 24 rows would straddle a scale block: left out
    assert fp8_tiles_h200.main(["--batches", "1,8", "--no-write"]) == 2
