"""vtoken.stats against independent references: scipy's Wilson interval and a bootstrap of the retention."""

import numpy as np
import pytest

from vtoken.stats import mean_estimate, ratio_estimate


@pytest.mark.parametrize("k, n", [(8, 16), (0, 10), (10, 10), (234, 250), (1, 3)])
def test_binary_accuracy_matches_scipy_wilson_and_lmms_eval_stderr(k, n):
    from scipy.stats import binomtest

    scores = [1.0] * k + [0.0] * (n - k)
    est = mean_estimate(scores)
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert est.value == pytest.approx(k / n) and est.n == n
    assert (est.low, est.high) == (pytest.approx(ci.low), pytest.approx(ci.high))
    assert est.se == pytest.approx(np.std(scores, ddof=1) / np.sqrt(n))  # lmms-eval's stderr of a mean
    assert 0 <= est.low <= est.value <= est.high <= 1


def test_lmms_eval_reported_stderr_at_n16():
    # the reference: lmms-eval printed ±0.128 at n=16 for an accuracy of 0.5 (8 of 16)
    assert mean_estimate([1.0] * 8 + [0.0] * 8).se == pytest.approx(0.129, abs=0.001)


def test_non_binary_scores_use_the_normal_interval():
    scores = [0.2, 0.5, 0.9, 0.4, 0.7]
    est = mean_estimate(scores)
    se = np.std(scores, ddof=1) / np.sqrt(5)
    assert est.se == pytest.approx(se) and est.low == pytest.approx(np.mean(scores) - 1.96 * se, rel=1e-3)


def test_retention_standard_error_matches_a_bootstrap():
    rng = np.random.default_rng(0)
    n = 400
    unpruned = (rng.random(n) < 0.9).astype(float)
    pruned = unpruned * (rng.random(n) < 0.75)  # pruning loses some answers the unpruned model got
    est = ratio_estimate(pruned.tolist(), unpruned.tolist())
    assert est.value == pytest.approx(pruned.mean() / unpruned.mean())
    boot = []
    for _ in range(3000):  # resample pairs: the reference the delta method approximates
        i = rng.integers(0, n, n)
        boot.append(pruned[i].mean() / unpruned[i].mean())
    assert est.se == pytest.approx(np.std(boot), rel=0.1)
    assert est.low < est.value < est.high and est.n == n


def test_identical_runs_retain_exactly_one_with_no_spread():
    scores = [1.0, 0.0, 1.0, 1.0]
    est = ratio_estimate(scores, scores)
    assert (est.value, est.se, est.low, est.high) == (1.0, 0.0, 1.0, 1.0)


def test_degenerate_inputs():
    assert ratio_estimate([0.0, 0.0], [0.0, 0.0]) is None
    with pytest.raises(ValueError, match="paired"):
        ratio_estimate([1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="no samples"):
        mean_estimate([])
