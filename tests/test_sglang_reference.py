"""The published PR #42557 figures load as typed rows, exactly as transcribed in the shipped file."""

from __future__ import annotations

import pytest

from benchsuite.errors import UserError
from benchsuite.tools.reference import load_reference, parse_reference


def test_rows_and_ratios() -> None:
    ref = load_reference("pr42557")
    assert ref.model == "Qwen3-30B-A3B"
    assert {m.key: m.vram_gb for m in ref.machines} == {"desktop_16gb": 16.0, "laptop_8gb": 8.0}
    single = ref.decode_rows("desktop_16gb", "gptq_int4")[0]
    assert (single.resident_experts, single.concurrency, single.paged_tok_s) == (92, 1, 205.6)
    assert single.offload_tok_s == 16.6  # the --cpu-offload-gb run's decode rate, tok/s
    assert single.paged_vs_offload == pytest.approx(205.6 / 16.6)
    assert single.paged_vs_llamacpp == pytest.approx(205.6 / 194.4)
    four = [r for r in ref.decode if r.concurrency == 4]
    assert [(r.machine, r.quant, r.resident_experts) for r in four] == [
        ("desktop_16gb", "gptq_int4", 92), ("desktop_16gb", "fp8_block", 40),
        ("desktop_16gb", "fp8_block", 24), ("laptop_8gb", "gptq_int4", 26),
    ]  # fmt: skip
    assert four[3].paged_high_tok_s == 12 and four[0].offload_tok_s is None and four[0].paged_vs_offload is None
    ttft = {(t.machine, t.quant, t.engine): (t.short_ms, t.long_2048_ms) for t in ref.ttft}
    assert ttft[("laptop_8gb", "gptq_int4", "llamacpp_best")] == (620, 2396)
    assert ref.expert_bytes == {"gptq_int4": 2.43e6, "fp8_block": 4.72e6}
    assert (ref.rules.output_tokens, ref.rules.kv_capacity_tokens, ref.rules.min_repeats) == (256, 10240, 2)
    assert ref.rules.prefix_caching is False and ref.rules.concurrency == (1, 4)


def test_unknown_reference_and_unreadable_rule() -> None:
    with pytest.raises(UserError, match="known: pr42557"):
        load_reference("pr99999")
    with pytest.raises(ValueError, match="no number"):
        parse_reference(
            "x",
            {
                "workload": {
                    "output_tokens": "many",
                    "kv_capacity_tokens": 1,
                    "prefix_caching": "off",
                    "repeats": "twice",
                }
            },
        )
