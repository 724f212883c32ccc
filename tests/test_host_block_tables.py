"""`moe_grouped_fp8.host_block_tables`: the grouped FP8 kernel's row blocks of every wave of a step, laid out
on the host with the plan (moe/waves.py) instead of one `block_table` launch a wave. The blocks must be
exactly those `block_table` defines (each group's rows cut into blocks of block_m from the group's start, in
group order), so a wave computes the same bits either way; its padding (-1 blocks) is left out. The kernel's
own table against the same definition, and both tables through the kernel, run in the Triton interpreter
(tests/test_moe_triton.py `check_grouped_fp8`)."""

from __future__ import annotations

import numpy as np
import pytest

from paged_experts.kernels.moe_grouped_fp8 import ALIGN_BLOCKS, host_block_tables


def blocks_by_definition(counts: np.ndarray, block_m: int) -> list[list[tuple[int, int, int]]]:
    """Each wave's (group, first row, end row) blocks, rows counted from the wave's start."""
    waves = []
    for row in counts:
        ends = np.cumsum(row)
        waves.append([(g, int(m), int(ends[g])) for g in range(len(row))
                      for m in range(int(ends[g] - row[g]), int(ends[g]), block_m)])  # fmt: skip
    return waves


@pytest.mark.parametrize("block_m", [1, 16, 64])
@pytest.mark.parametrize("seed", range(6))
def test_every_wave_s_blocks_are_block_table_s_in_order(block_m: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    waves, groups = int(rng.integers(1, 9)), int(rng.integers(1, 60))
    counts = rng.integers(0, 150, size=(waves, groups)) * (rng.random((waves, groups)) < 0.4)  # most rows empty
    tables, starts, blocks = host_block_tables(counts, block_m)
    assert tables.dtype == np.int32 and tables.shape == (3, starts[-1]) and starts[0] == 0
    assert (starts % ALIGN_BLOCKS == 0).all()  # each wave's slice keeps one 16-byte alignment: one compiled kernel
    for w, want in enumerate(blocks_by_definition(counts, block_m)):
        assert starts[w] + blocks[w] <= starts[w + 1] < starts[w] + blocks[w] + ALIGN_BLOCKS
        got = [tuple(int(v) for v in col) for col in tables[:, starts[w] : starts[w] + blocks[w]].T]
        assert got == want, (w, counts[w])


def test_no_pairs_no_blocks() -> None:
    tables, starts, blocks = host_block_tables(np.zeros((3, 5), dtype=np.int64), 64)
    assert tables.shape == (3, 0) and starts.tolist() == [0, 0, 0, 0] and blocks.tolist() == [0, 0, 0]
