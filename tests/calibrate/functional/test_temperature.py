"""The temperature-scaling kernels of `calibrate.functional.temperature` (NLL derivatives, the temperature fit)
against slow obvious references written here and in tests/support/calibrate.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from calibrate.functional.softmax import softmax_stats
from calibrate.functional.temperature import TS_BETA_MIN, fit_temperature, nll_derivatives

from tests.support.calibrate import slow_moments

EPS = np.finfo(np.float64).eps



def test_nll_derivatives_against_slow_sums_and_merge_across_splits(rng):
    """Sums of NLL(beta), its slope E_p[z] - z_y, curvature Var_p(z) and third derivative, and the count; a random
    split into two calls adds up to the one call (the statistics are mergeable across shards)."""
    n, k = 200, 9
    z = rng.normal(size=(n, k)) * 3
    y = rng.integers(0, k, size=n)
    beta = 0.7
    f, g, h, t, count = nll_derivatives(z, y, beta)
    ref = np.zeros(4)
    for i in range(n):
        log_s, mean, var, k3 = slow_moments(z[i], beta)
        m = z[i].max()
        ref += (log_s - beta * (z[i, y[i]] - m), mean - z[i, y[i]], var, k3)
    assert count == n
    # n rows, each a few eps * K of its size (|z| <= ~15): a sum of n such errors
    for j, (got, want) in enumerate(zip((f, g, h, t), ref)):
        assert abs(got - want) <= 64 * n * k * EPS * 15.0 ** max(j, 1), j
    # the NLL sum equals the per-sample NLLs of softmax_stats at T = 1 / beta
    assert f == pytest.approx(softmax_stats(z, 1.0 / beta, y).nll.sum(), rel=0, abs=64 * n * k * EPS * 15)
    cut = rng.permutation(n)
    a, b = cut[:77], cut[77:]
    parts = np.add(nll_derivatives(z[a], y[a], beta), nll_derivatives(z[b], y[b], beta))
    assert parts[4] == n
    for j in range(4):
        assert abs(parts[j] - (f, g, h, t)[j]) <= 64 * n * k * EPS * 15.0 ** max(j, 1)


def slow_mean_nll(z: np.ndarray, y: np.ndarray, temperature: float) -> float:
    total = 0.0
    for row, label in zip(z, y):
        r = row / temperature
        m = r.max()
        total += m + math.log(math.fsum(math.exp(v - m) for v in r)) - r[label]
    return total / len(y)


def test_fit_temperature_is_the_nll_minimum_and_streams(rng):
    """The fitted T is the NLL minimum of a slow golden-section search in log T; every pass calls `batches` once."""
    z = rng.normal(size=(400, 6)) * 2
    y = np.where(rng.uniform(size=400) < 0.6, z.argmax(axis=1), rng.integers(0, 6, size=400))
    calls = []

    def batches():
        calls.append(1)
        return [(z[:150], y[:150]), (z[150:], y[150:])]

    t, passes = fit_temperature(batches)
    assert passes == len(calls) and 1 <= passes <= 10
    lo, hi = math.log(0.05), math.log(20.0)
    phi = (math.sqrt(5) - 1) / 2
    for _ in range(80):  # golden section on a convex function of log T (convex in beta = 1/T, unimodal in log T)
        a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
        if slow_mean_nll(z, y, math.exp(a)) < slow_mean_nll(z, y, math.exp(b)):
            hi = b
        else:
            lo = a
    assert t == pytest.approx(math.exp((lo + hi) / 2), rel=1e-6)


def test_fit_temperature_stopping_rule_bounds_and_empty_input():
    """Separable data: the NLL keeps falling as T -> 0 but flattens exponentially, so the fit stops where the mean
    slope times beta is below `tol` (T < 1); every prediction wrong: the optimum is T -> infinity and T is the upper
    bound of the search range; no samples: a clear error."""
    right = np.eye(3) * 10
    y = np.array([0, 1, 2])
    t, _ = fit_temperature(lambda: [(right, y)], tol=1e-10)
    _, g, _, _, n = nll_derivatives(right, y, 1 / t)
    assert t < 1 and abs(g / n) / t <= 1e-10
    t_wrong, _ = fit_temperature(lambda: [(right, np.array([1, 2, 0]))])
    assert t_wrong == pytest.approx(1 / TS_BETA_MIN, rel=1e-6)
    with pytest.raises(ValueError, match="at least one labelled"):
        fit_temperature(lambda: [])
