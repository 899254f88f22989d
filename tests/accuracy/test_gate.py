"""The gate rules on synthetic scores: pass, kernel/reference mismatch, greedy mismatch, drop past tolerance."""

import pytest
from w4a16_testing import require_module

from w4a16.accuracy.config import GateRules
from w4a16.accuracy.gate import Score, format_table, greedy_divergence_p, identical_fraction, judge

RULES = GateRules(kernel_vs_reference_stderrs=1.0, min_identical_greedy=0.95)
N = 100


def score(value, stderr=0.05, greedy=None):
    return Score(value, stderr, N, tuple(range(N)) if greedy is None else tuple(greedy))


def test_passes_when_kernel_matches_reference_and_drop_is_within_tolerance():
    v = judge("t", "acc,none", {"fp": score(0.60),
        "reference": score(0.55), "kernel": score(0.55)}, RULES, 0.08)
    assert v.passed, v.failures
    assert v.identical == 1.0


@pytest.mark.parametrize("variant", ["fp", "reference", "kernel"])
def test_a_nan_score_or_stderr_fails(variant):
    scores = {"fp": score(0.60), "reference": score(0.55), "kernel": score(0.55)}
    for broken in (score(float("nan")), score(0.55, float("nan"))):
        v = judge("t", "acc,none", {**scores, variant: broken}, RULES, 0.08)
        assert not v.passed and v.failures == [f"not a finite score or stderr: {variant}"]


def test_fails_when_kernel_and_reference_differ_by_more_than_one_stderr():
    v = judge("t", "acc,none", {"fp": score(0.60),
        "reference": score(0.55), "kernel": score(0.49)}, RULES, 0.5)
    assert not v.passed
    assert any("kernel 0.4900 vs reference 0.5500" in f for f in v.failures), v.failures


def test_a_kernel_far_above_the_reference_fails_too():
    # Rule 1 is two-sided: a kernel that scores much better than the reference computes something else.
    v = judge("t", "acc,none", {"fp": score(0.55), "reference": score(0.55), "kernel": score(0.65)}, RULES, 0.5)
    assert any("kernel 0.6500 vs reference 0.5500: |diff| 0.1000 > 0.0500" in f for f in v.failures), v.failures


def test_the_allowed_difference_is_the_references_stderr():
    scores = {"fp": score(0.55), "reference": score(0.55, 0.02), "kernel": score(0.51, 0.10)}
    v = judge("t", "acc,none", scores, RULES, 0.5)
    assert any("|diff| 0.0400 > 0.0200" in f for f in v.failures), v.failures


def test_kernel_and_reference_over_different_sample_counts_fail():
    kernel = Score(0.55, 0.05, N - 1, tuple(range(N - 1)))
    v = judge("t", "acc,none", {"fp": score(0.55), "reference": score(0.55), "kernel": kernel}, RULES, 0.5)
    assert f"kernel scored {N - 1} samples, reference {N}" in v.failures


def test_a_measured_fp_score_is_preferred_to_the_stored_expected_one():
    scores = {"fp": score(0.90), "reference": score(0.80), "kernel": score(0.80)}
    v = judge("t", "acc,none", scores, RULES, 0.05, expected=0.80)
    assert any("dropped 0.1000 below fp 0.9000" in f for f in v.failures), v.failures


def test_kernel_within_one_stderr_passes():
    v = judge("t", "acc,none", {"fp": score(0.55),
        "reference": score(0.55, 0.05), "kernel": score(0.51, 0.05)}, RULES, 0.1)
    assert v.passed, v.failures


def test_stderr_zero_still_allows_one_sample():
    # A perfect reference has stderr 0; one sample's worth (1/n) is the floor of the allowed difference.
    v = judge("t", "acc,none", {"fp": score(1.0),
        "reference": score(1.0, 0.0), "kernel": score(1.0 - 1 / N, 0.0)}, RULES, 0.1)
    assert v.passed, v.failures
    v = judge("t", "acc,none", {"fp": score(1.0),
        "reference": score(1.0, 0.0), "kernel": score(1.0 - 2 / N, 0.0)}, RULES, 0.1)
    assert not v.passed


def test_fails_when_greedy_outputs_differ_on_more_than_five_percent():
    greedy = list(range(N))
    for i in range(6):  # 94% identical
        greedy[i] = -1
    v = judge("t", "acc,none", {"fp": score(0.5),
        "reference": score(0.5), "kernel": score(0.5, greedy=greedy)}, RULES, 0.1)
    assert not v.passed
    assert v.identical == pytest.approx(0.94)
    assert any("identical on 94.0%" in f for f in v.failures), v.failures
    greedy[5] = 5  # 95% identical: passes
    assert judge("t", "acc,none", {"fp": score(0.5),
        "reference": score(0.5), "kernel": score(0.5, greedy=greedy)}, RULES, 0.1).passed


def test_fails_on_a_drop_past_tolerance_for_both_quantized_columns():
    v = judge("t", "acc,none", {"fp": score(0.70),
        "reference": score(0.55), "kernel": score(0.55)}, RULES, 0.10)
    assert not v.passed
    assert sum("dropped 0.1500 below fp" in f for f in v.failures) == 2, v.failures


def test_a_gain_over_fp_passes():
    v = judge("t", "acc,none", {"fp": score(0.40),
        "reference": score(0.60), "kernel": score(0.60)}, RULES, 0.0)
    assert v.passed, v.failures


def test_expected_stands_in_for_a_missing_fp_run():
    scores = {"fp": None, "reference": score(0.80), "kernel": score(0.80)}
    assert not judge("gsm8k", "m", scores, RULES, 0.04, expected=0.855).passed
    assert judge("gsm8k", "m", scores, RULES, 0.06, expected=0.855).passed


def test_identical_fraction_refuses_different_sample_sets():
    with pytest.raises(ValueError, match="different samples"):
        identical_fraction((1, 2), (1,))


def test_unknown_variant_is_an_error():
    with pytest.raises(ValueError, match="unknown variant"):
        judge("t", "m", {"int8": score(0.5)}, RULES, 0.1)


def test_table_lists_every_column_and_verdict():
    ok = judge("a", "acc,none", {"fp": score(0.6), "reference": score(0.6), "kernel": score(0.6)}, RULES, 0.1)
    bad = judge("b", "acc,none", {"fp": score(0.9),
        "reference": score(0.6), "kernel": score(0.6)}, RULES, 0.1)
    table = format_table([("m", "g64-sym", ok), ("m", "g64-sym", bad)])
    header = table.splitlines()[0].split()
    assert header[:8] == ["model", "quant", "task", "metric", "fp", "reference", "kernel", "stderr"]
    assert "PASS" in table.splitlines()[2] and "FAIL" in table.splitlines()[3]


def _leaving(samples):
    """Greedy outputs that leave the reference's (range(N)) on the given samples."""
    return [-1 if i in samples else i for i in range(N)]


def test_below_the_threshold_a_control_that_diverges_as_often_passes_the_kernel():
    # bf16: a correct kernel and the float64 control each leave the reference on ~15% of the generations, mostly
    # different ones (measured on CPU: README, "Accuracy gate").
    kernel, control = _leaving(range(0, 15)), _leaving(range(8, 22))
    v = judge("t", "m", {"fp": score(0.5), "reference": score(0.5), "control": score(0.5, greedy=control),
                         "kernel": score(0.5, greedy=kernel)}, RULES, 0.1)
    assert v.passed, v.failures
    assert v.identical == pytest.approx(0.85) and v.control_identical == pytest.approx(0.86)
    assert "85% (control 86%)" in format_table([("m", "q", v)])


def test_a_kernel_that_diverges_far_more_often_than_the_control_fails():
    kernel, control = _leaving(range(0, 30)), _leaving(range(0, 5))
    v = judge("t", "m", {"fp": score(0.5), "reference": score(0.5), "control": score(0.5, greedy=control),
                         "kernel": score(0.5, greedy=kernel)}, RULES, 0.1)
    assert not v.passed
    assert any("left the reference's on 25 samples the control kept, the control on 0" in f for f in v.failures)


def test_a_degenerate_control_does_not_calibrate_the_greedy_rule():
    """A control that leaves the reference on every sample would count no sample against the kernel (the sign test
    counts only samples the control kept): below the floor the kernel fails instead of passing on p = 1."""
    kernel, control = _leaving(range(0, 30)), _leaving(range(0, N))
    assert greedy_divergence_p(score(0.5).greedy, kernel, control)[2] == 1.0
    v = judge("t", "m", {"fp": score(0.5), "reference": score(0.5), "control": score(0.5, greedy=control),
                         "kernel": score(0.5, greedy=kernel)}, RULES, 0.1)
    assert not v.passed and any("the control, identical on 0.0%, is below 50% itself" in f for f in v.failures)
    # At the floor the control calibrates as before.
    kernel, control = _leaving(range(0, 90)), _leaving(range(N // 2, N))
    v = judge("t", "m", {"fp": score(0.5), "reference": score(0.5), "control": score(0.5, greedy=control),
                         "kernel": score(0.5, greedy=kernel)}, RULES, 0.1)
    assert v.control_identical == 0.5
    assert any("the kernel left the reference's on 50 samples the control kept, the control on 10" in f
               for f in v.failures), v.failures


def test_a_control_over_other_samples_is_a_failure_not_a_crash():
    short = Score(0.5, 0.05, N - 1, tuple(range(N - 1)))
    v = judge("t", "m", {"fp": score(0.5),
        "reference": score(0.5), "control": short, "kernel": score(0.5)}, RULES, 0.1)
    assert not v.passed and v.failures == [f"control scored {N - 1} samples, reference {N}"]


def test_without_a_control_below_the_threshold_still_fails():
    v = judge("t", "m", {"fp": score(0.5),
        "reference": score(0.5), "kernel": score(0.5, greedy=_leaving(range(10)))}, RULES, 0.1)
    assert not v.passed and any("no control run" in f for f in v.failures), v.failures


def test_greedy_divergence_p_is_the_one_sided_sign_test():
    reference = list(range(6))
    # The kernel alone leaves samples 0-2, the control alone sample 5; both leave 3, neither 4.
    kernel, control = [-1, -1, -1, -1, 4, 5], [0, 1, 2, -1, 4, -1]
    assert greedy_divergence_p(reference, kernel, control) == (3, 1, pytest.approx(5 / 16))
    assert greedy_divergence_p(reference, reference, reference) == (0, 0, 1.0)
    assert greedy_divergence_p(reference, [-1] * 6, reference)[2] == pytest.approx(1 / 64)
    with pytest.raises(ValueError, match="different samples"):
        greedy_divergence_p(reference, kernel, control[:5])


def test_a_rule_that_cannot_be_applied_fails():
    """A run of some columns only is a measurement, not a pass: rule 1 needs reference and kernel, rule 2 an fp
    score or a stored expected one."""
    only_fp = judge("t", "m", {"fp": score(0.6)}, RULES, 0.1)
    assert only_fp.failures == ["not gated: no reference and no kernel column (rule 1 compares the two)"]
    no_kernel = judge("t", "m", {"fp": score(0.6), "reference": score(0.6)}, RULES, 0.1)
    assert no_kernel.failures == ["not gated: no kernel column (rule 1 compares the two)"]
    no_fp = judge("t", "m", {"reference": score(0.6), "kernel": score(0.6)}, RULES, 0.1)
    assert no_fp.failures == ["not gated against the fp model: no fp score and no stored expected score"]
    assert judge("t", "m", {"reference": score(0.6), "kernel": score(0.6)}, RULES, 0.1, expected=0.6).passed


def test_a_score_over_fewer_samples_than_asked_for_fails():
    """The 1/n floor and the tolerances are set for the task's sample count: a dataset or an lm-eval run that
    scored fewer (for the same count in every column, so rule 1 alone would not see it) must not pass."""
    scores = {"fp": score(0.6), "reference": score(0.6), "kernel": score(0.6)}
    assert judge("t", "m", scores, RULES, 0.1, samples=N).passed
    v = judge("t", "m", scores, RULES, 0.1, samples=N + 1)
    assert v.failures == [f"scored fewer samples than the {N + 1} asked for: fp {N}, reference {N}, kernel {N}"]
    v = judge("t", "m", {**scores, "control": score(0.6)}, RULES, 0.1, samples=N + 1)
    assert v.failures == [f"scored fewer samples than the {N + 1} asked for: fp {N}, reference {N}, control {N}, "
                          f"kernel {N}"]


def test_greedy_outputs_take_each_docs_most_likely_choice_or_its_text():
    from w4a16.accuracy.harness import greedy_outputs

    samples = [
        {"doc_id": 1, "resps": [[(-1.0, False)], [(-0.2, True)], [(-3.0, False)]]},
        {"doc_id": 0, "resps": [[(-0.5, True)], [(-2.0, False)]]},
        {"doc_id": 1, "resps": [[(-9.0, False)], [(-9.0, False)], [(-0.1, True)]]},  # another filter's entry
        {"doc_id": 2, "resps": [["4 + 4 = 8"]]},
    ]
    assert greedy_outputs(samples) == (0, 1, "4 + 4 = 8")


def test_a_score_counts_the_samples_scored_not_those_asked_for(monkeypatch, tmp_path):
    """The short-sample rule of judge() reads Score.n: it must be what lm-eval scored."""
    lm_eval = require_module("lm_eval", "lm-eval comes with the eval extra, which nox -s tests installs")

    from w4a16.accuracy.config import TaskSpec
    from w4a16.accuracy.harness import evaluate

    task = TaskSpec("t", "acc,none", limit=5)
    scored = [{"doc_id": d, "resps": [[(-1.0, False)], [(-0.5, True)]]} for d in range(3)]
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kwargs: {
        "results": {"t": {"acc,none": 0.5, "acc_stderr,none": 0.1}}, "samples": {"t": scored}})
    result = evaluate(None, task, None, None, tmp_path)
    assert (result.value, result.stderr, result.n, result.greedy) == (0.5, 0.1, 3, (1, 1, 1))


def test_a_p_value_exactly_at_greedy_divergence_p_passes_the_kernel():
    """The kernel fails only when p is *below* greedy_divergence_p (gates.toml: "with probability below
    greedy_divergence_p"; README: "p < 0.01"): p equal to it passes, the next smaller p fails. The sign test's p is
    a dyadic fraction, so a threshold of 1/64 is hit exactly: 6 samples the kernel alone leaves give p = 2**-6."""
    rules = GateRules(kernel_vs_reference_stderrs=1.0, min_identical_greedy=0.95, greedy_divergence_p=1 / 64)
    reference = score(0.5).greedy
    for left, p, passes in ((6, 1 / 64, True), (7, 1 / 128, False)):
        kernel = _leaving(range(left))  # below min_identical_greedy (94%, 93%): the sign test decides
        assert greedy_divergence_p(reference, kernel, reference) == (left, 0, p)
        v = judge("t", "m", {"fp": score(0.5), "reference": score(0.5), "control": score(0.5),
                             "kernel": score(0.5, greedy=kernel)}, rules, 0.1)
        assert v.identical < rules.min_identical_greedy and v.control_identical == 1.0
        assert v.passed is passes, (f"kernel alone leaving {left} samples gives p = {p} against "
                                    f"greedy_divergence_p = {rules.greedy_divergence_p}: expected "
                                    f"{'a pass' if passes else 'a failure'}, got {v.failures}")
    # three digits: two could print a p just below the threshold as the threshold itself ("p = 0.01 < 0.01")
    assert v.failures[-1].endswith("(p = 0.00781 < 0.015625)"), v.failures


@pytest.mark.parametrize("variant", ["fp", "reference", "kernel"])
def test_an_infinite_score_or_stderr_fails_on_its_own(variant):
    """An infinite stderr on the reference would allow any kernel difference, an infinite score is no measurement:
    either fails the task with that one reason, not with rule failures computed from it."""
    scores = {"fp": score(0.60), "reference": score(0.55), "kernel": score(0.55)}
    for broken in (score(float("inf")), score(float("-inf")), score(0.55, float("inf"))):
        v = judge("t", "acc,none", {**scores, variant: broken}, RULES, 0.08)
        assert v.failures == [f"not a finite score or stderr: {variant}"], (broken, v.failures)


def test_greedy_outputs_over_no_samples_are_an_error():
    # No per-sample outputs cannot show that kernel and reference generate the same text: an error, not 0/0.
    with pytest.raises(ValueError, match="no greedy outputs to compare"):
        identical_fraction((), ())


def test_a_drop_of_exactly_the_tolerance_passes():
    """The tolerance is the largest drop allowed: 0.8 -> 0.7 with tolerance 0.1 passes, though 0.8 - 0.7 is
    0.10000000000000009 in floating point; 0.8 -> 0.69 fails."""
    at = judge("t", "m", {"fp": score(0.8), "reference": score(0.7), "kernel": score(0.7)}, RULES, 0.1)
    assert at.passed, at.failures
    past = judge("t", "m", {"fp": score(0.8), "reference": score(0.69), "kernel": score(0.69)}, RULES, 0.1)
    assert sum("dropped 0.1100 below fp 0.8000" in f for f in past.failures) == 2, past.failures


def test_a_baseline_score_of_zero_still_gates():
    """An fp model (or a stored expected score) of 0.0 is a baseline like any other: the drop rule applies, the
    task is not reported as ungated."""
    scores = {"fp": score(0.0), "reference": score(0.0), "kernel": score(0.0)}
    assert judge("t", "m", scores, RULES, 0.0).passed
    no_fp = {"reference": score(0.0), "kernel": score(0.0)}
    v = judge("t", "m", no_fp, RULES, 0.0, expected=0.0)
    assert v.passed, v.failures
    v = judge("t", "m", no_fp, RULES, -0.1, expected=0.0)  # a tolerance demanding a gain of 0.1 over 0.0
    assert v.failures == ["reference 0.0000 dropped 0.0000 below expected 0.0000 (tolerance -0.1)",
                          "kernel 0.0000 dropped 0.0000 below expected 0.0000 (tolerance -0.1)"]


def test_the_tables_stderr_column_is_the_references():
    # Rule 1 allows the reference's stderr: the column shows that one, not the kernel's.
    v = judge("t", "acc,none", {"fp": score(0.6), "reference": score(0.6, 0.02), "kernel": score(0.6, 0.07)},
              RULES, 0.1)
    row = format_table([("m", "g64-sym", v)]).splitlines()[2].split()
    assert row[7] == "0.0200", row
    only_kernel = judge("t", "acc,none", {"kernel": score(0.6, 0.07)}, RULES, 0.1)
    assert format_table([("m", "g64-sym", only_kernel)]).splitlines()[2].split()[7] == "0.0700"
