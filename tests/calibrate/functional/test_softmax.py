"""The calibration kernels of `calibrate.functional` against slow obvious references written here (per-row Python
loops over plain softmax probabilities); the ZAEC solver's own properties are in test_calibrate_zaec.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

import calibrate.functional.softmax as F
from calibrate.functional import (
    TS_BETA_MIN,
    entropy_from_logits,
    fit_temperature,
    nll_derivatives,
    softmax_stats,
    solve_zaec,
)
from calibrate.functional.softmax import _centred, _cumulants
from calibrate.functional.zaec import _moments, _moments32

EPS = np.finfo(np.float64).eps
EPS32 = float(np.finfo(np.float32).eps)


def slow_moments(z: np.ndarray, beta: float) -> tuple[float, float, float, float]:
    """(log sum_k exp(beta z_k - max), E_p[z], Var_p(z), third central moment) of one row under p = softmax(beta z),
    each from plain Python sums over the classes (math.fsum: correctly rounded)."""
    zs = [float(v) for v in z]
    m = max(zs)
    w = [math.exp(beta * (v - m)) for v in zs]
    s = math.fsum(w)
    p = [x / s for x in w]
    mean = math.fsum(pi * v for pi, v in zip(p, zs))
    var = math.fsum(pi * (v - mean) ** 2 for pi, v in zip(p, zs))
    k3 = math.fsum(pi * (v - mean) ** 3 for pi, v in zip(p, zs))
    return math.log(s), mean, var, k3


def test_cumulants_against_slow_moments(rng):
    """log-sum, mean, variance and third central moment of the centred rows, for random rows and temperatures."""
    for k in (2, 7, 40):
        z = rng.normal(size=(30, k)) * rng.uniform(0.1, 5, size=(30, 1))
        beta = rng.uniform(0.2, 3, size=30)
        zc, top = _centred(z)
        log_s, m1, var, k3 = _cumulants(zc.copy(), top, beta)
        for i in range(30):
            ref = slow_moments(zc[i], beta[i])
            # errors: a few eps per class term, times the size of the j-th power of the centred logits
            scale = float(np.abs(zc[i]).max()) + 1.0
            for j, (got, want) in enumerate(zip((log_s[i], m1[i], var[i], k3[i]), ref)):
                assert abs(got - want) <= 16 * k * EPS * scale ** max(j, 1), (k, i, j)


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


def test_softmax_stats_ties_and_one_class():
    """Ties: the first maximal class, like numpy's argmax; K = 1: confidence 1, entropy, NLL and Brier 0."""
    s = softmax_stats(np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]]), 1.0, [2, 0])
    assert s.prediction.tolist() == [1, 0]
    assert s.confidence[1] == pytest.approx(1 / 3, abs=4 * EPS)
    one = softmax_stats(np.array([[5.0], [-2.0]]), [0.5, 3.0], [0, 0])
    assert one.confidence.tolist() == [1.0, 1.0] and one.entropy.tolist() == [0.0, 0.0]
    assert one.nll.tolist() == [0.0, 0.0] and one.brier.tolist() == [0.0, 0.0]
    assert softmax_stats(np.zeros((2, 3))).nll is None
    with pytest.raises(ValueError, match="temperatures must be finite and > 0"):
        softmax_stats(np.zeros((2, 3)), [1.0, 0.0])


def test_chunk_size_never_changes_a_kernel(rng, monkeypatch):
    """Row chunks bound memory only: every row is computed on its own, so any chunk size gives the same bits."""
    z = rng.normal(size=(300, 13)) * 4
    zs = rng.normal(size=(300, 13))
    y = rng.integers(0, 13, size=300)
    t = rng.uniform(0.5, 2, size=300)
    before = (entropy_from_logits(z), softmax_stats(z, t, y), nll_derivatives(z, y, 1.3), solve_zaec(zs, z))
    monkeypatch.setattr(F, "CHUNK_ELEMENTS", 5 * 13)
    after = (entropy_from_logits(z), softmax_stats(z, t, y), nll_derivatives(z, y, 1.3), solve_zaec(zs, z))
    assert np.array_equal(before[0], after[0])
    for name in ("prediction", "confidence", "entropy", "nll", "brier"):
        assert np.array_equal(getattr(before[1], name), getattr(after[1], name)), name
    # nll_derivatives sums chunk totals in float64: equal up to the order of the additions
    assert after[2][4] == 300
    assert np.allclose(after[2][:4], before[2][:4], rtol=300 * EPS * 16, atol=0)
    assert np.array_equal(before[3].temperature, after[3].temperature)


def test_float32_moments_steer_close_to_float64(rng):
    """The float32 evaluation that only steers the ZAEC search agrees with the float64 one to float32 precision."""
    k = 20
    z = rng.normal(size=(50, k)) * 3
    beta = rng.uniform(0.3, 2, size=50)
    zc, top = _centred(z)
    h, v, k3 = _moments(zc, top, beta)
    h32, v32, k32 = _moments32(zc.astype(np.float32), top, beta)
    # a few float32 eps per class term, times the size of beta * zc (entropy) or of zc^2 (variance)
    assert np.all(np.abs(h32 - h) <= 64 * k * EPS32 * (np.abs(zc).max(axis=1) * beta + 1.0))
    assert np.all(np.abs(v32 - v) <= 64 * k * EPS32 * (np.abs(zc).max(axis=1) + 1.0) ** 2)
