"""Checks beside the benchmark: preflight's report, cross-engine accuracy, the cross-request leak canary."""
