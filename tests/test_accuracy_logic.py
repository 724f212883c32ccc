"""The accuracy check's comparison rules on hand-made completions (no server)."""

from benchsuite.checks.accuracy import Thresholds, compare_completions, summarize
from benchsuite.load.openai_http import Completion


def _c(tokens, logprobs):
    return Completion("".join(tokens), tuple(tokens), tuple(logprobs), None, len(tokens))


def test_identical_outputs_agree_fully():
    a = _c(["a", "b", "c"], [-0.1, -0.2, -0.3])
    cmp = compare_completions("p", a, a)
    assert cmp.first_divergence is None
    assert cmp.matched == 3
    report = summarize("A", "B", [cmp], Thresholds(0.99, 0.01))
    assert report.token_agreement == 1.0
    assert report.max_logprob_diff_nats == 0.0
    assert report.passed


def test_divergence_stops_comparison_and_fails():
    a = _c(["a", "b", "c", "d"], [-0.1, -0.2, -0.3, -0.4])
    b = _c(["a", "x", "c", "d"], [-0.1, -0.25, -0.3, -0.4])
    cmp = compare_completions("p", a, b)
    assert cmp.first_divergence == 1
    assert cmp.matched == 1
    assert cmp.logprob_abs_diffs == (0.0,)
    report = summarize("A", "B", [cmp], Thresholds(0.99, 0.01))
    assert report.token_agreement == 0.25
    assert not report.passed


def test_logprob_drift_without_token_change_fails_threshold():
    a = _c(["a", "b"], [-0.1, -0.2])
    b = _c(["a", "b"], [-0.1, -0.9])
    report = summarize("A", "B", [compare_completions("p", a, b)], Thresholds(0.99, 0.05))
    assert report.token_agreement == 1.0
    assert abs(report.max_logprob_diff_nats - 0.7) < 1e-12
    assert not report.passed


def test_length_mismatch_is_a_divergence():
    a = _c(["a", "b"], [-0.1, -0.2])
    b = _c(["a", "b", "c"], [-0.1, -0.2, -0.3])
    cmp = compare_completions("p", a, b)
    assert cmp.first_divergence == 2
    assert cmp.matched == 2


def test_nothing_comparable_never_passes():
    report = summarize("A", "B", [], Thresholds())
    assert report.max_logprob_diff_nats is None
    assert not report.passed
