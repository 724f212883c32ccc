"""The page-in copy and expert-row layout choices, declared once (no torch: the server's options and benchsuite's
schema read them).

How host-planned page-ins (prefill waves, steps above one wave, offload) copy host rows to device rows
(`store.PageInEngine`): `direct`, a DMA per tensor and run of rows; `kernel`, one Triton copy launch per
group of rows (CUDA); `batch`, every tensor's runs of rows in one `cuMemcpyBatchAsync` (CUDA driver 12.8+;
memmoves on the CPU); `staged`, through a pinned staging buffer (CUDA); `index`, a copy_ a run of rows on the
CPU (index_select then index_copy_ to another device). `auto` is `direct` on CUDA and `index` elsewhere.

What a page-in copies is laid out by `ExpertRows` (`store.ExpertTensors`): `split`, a tensor each; `packed`,
one byte row an expert; `auto`, packed for mode paged on CUDA and split elsewhere (RuntimeConfig.rows_layout).
"""

from __future__ import annotations

from typing import Literal, get_args

PageIn = Literal["auto", "direct", "kernel", "batch", "staged"]
"""What a runtime, a server flag or a matrix option may ask for."""
PAGE_IN_CHOICES: tuple[str, ...] = get_args(PageIn)
PAGE_IN_STRATEGIES: tuple[str, ...] = ("index", *(c for c in PAGE_IN_CHOICES if c != "auto"))
"""What a PageInEngine runs: `auto` resolved (the runtime resolves it by device)."""

ExpertRows = Literal["auto", "split", "packed"]
"""The paged and offloaded layers' expert layout a runtime, a server flag or a matrix option may ask for."""
EXPERT_ROWS: tuple[str, ...] = get_args(ExpertRows)


def resolve_expert_rows(expert_rows: str | None, mode: str, device: str) -> Literal["split", "packed"]:
    """The layout in force: `expert_rows` as asked, or for 'auto' (and None, a matrix's unset option) packed in mode
    paged on CUDA, where it was measured to win (configs/h200/packed.yaml), split elsewhere."""
    if expert_rows in ("split", "packed"):
        return expert_rows  # type: ignore[return-value]  # one of the two literals
    return "packed" if mode == "paged" and device == "cuda" else "split"
