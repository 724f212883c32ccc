"""Whether two sides of a comparison generated the same text, prompt by prompt.

A paged engine's decode speed depends on which experts its tokens route to, and so on the tokens it generates.
Greedy decoding of a random-weight model is chaotic: a batch of another size, another GPU or another kernel
changes a logit in its last bits, a near-tie flips, and from there the text (and its routing) is another one.
Measured (one H100, 2026-12-05, configs/h200/headline.yaml, model routing, K=53, short prompts, four streams): the
same requests, served by two commits that compute the same values (7f360bd and 15d3017 differ only in how a
step's inputs are uploaded), generated other text for 2 of 4 prompts, the streams' batches having formed at
other moments; decode miss rate 0.170 against 0.134, 33.7 against 41.9 tok/s a stream. At one stream the two
runs' texts were the same; on an H200 they were other again. So where a comparison's sides
generated different text, a change in its decode figures is partly a change of the work measured, not of the
engine, and the comparison says so beside the figures.

`outputs_status` compares the measured (not warm-up), ok requests of a configuration's cells on each side: per
prompt id, the set of texts its requests generated (over the side's repeats and runs). "same": every prompt both
sides sent generated the same texts; "differ: k of n prompts"; "" where a side carried no text or no prompt id
(an engine that streams none, a run stored before `output_text`): unknown, not "same". Under synthetic routing
(paged_experts' router draws each token's experts from (seed, request, position)) other text routes to the same
experts: `outputs_status(..., synthetic=True)` says so, and `changes_work` is False for it. Only a paged engine
reads its tokens' routing off the link: in other modes (resident, offload, llama.cpp's CPU experts) a token of
other text costs the same work, which `outputs_status(..., paged=False)` says instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import pandas as pd

SAME = "same"
SYNTHETIC_NOTE = "synthetic routing: the same experts"
UNPAGED_NOTE = "not paged: the same work a token"


def texts_by_prompt(requests: pd.DataFrame, cell_ids: Iterable[str]) -> dict[str, frozenset[str]]:
    """prompt id -> the digests of the texts the measured ok requests of those cells generated for it."""
    if requests is None or requests.empty or not {"cell_id", "prompt_id", "output_text"} <= set(requests.columns):
        return {}
    mine = requests[requests["cell_id"].astype(str).isin({str(c) for c in cell_ids})]
    if "warmup" in mine:
        mine = mine[~mine["warmup"].fillna(False).astype(bool)]
    if "ok" in mine:
        mine = mine[mine["ok"].fillna(False).astype(bool)]
    found: dict[str, set[str]] = {}
    for prompt, text in zip(mine["prompt_id"], mine["output_text"]):
        if prompt is None or pd.isna(prompt) or not isinstance(text, str) or not text:
            continue
        found.setdefault(str(prompt), set()).add(hashlib.sha256(text.encode("utf-8")).hexdigest())
    return {prompt: frozenset(digests) for prompt, digests in found.items()}


def outputs_status(
    a: dict[str, frozenset[str]], b: dict[str, frozenset[str]], synthetic: bool = False, paged: bool = True
) -> str:
    """SAME, "differ: k of n prompts" (n: the prompts both sides sent; with UNPAGED_NOTE after it outside paged
    mode, SYNTHETIC_NOTE under synthetic routing), or "" when either side said nothing."""
    shared = sorted(set(a) & set(b))
    if not shared:
        return ""
    differ = sum(1 for prompt in shared if a[prompt] != b[prompt])
    if differ == 0:
        return SAME
    note = UNPAGED_NOTE if not paged else SYNTHETIC_NOTE if synthetic else None
    return f"differ: {differ} of {len(shared)} prompts" + (f" ({note})" if note else "")


def changes_work(status: str) -> bool:
    """Whether an outputs_status says the two sides decoded other work: other text, paged, the model's routing."""
    return status.startswith("differ") and SYNTHETIC_NOTE not in status and UNPAGED_NOTE not in status
