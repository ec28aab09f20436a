"""The softmax kernels of `calibrate.functional.softmax` (cumulants, entropies, per-sample statistics, row chunks)
against slow obvious references (per-row Python loops over plain softmax probabilities, in
tests/support/calibrate.py); the temperature fit is tested in test_temperature.py, the ZAEC solver in test_zaec.py."""

from __future__ import annotations

import numpy as np
import pytest

import calibrate.functional.softmax as F
from calibrate.functional.softmax import entropy_from_logits, softmax_stats
from calibrate.functional.temperature import nll_derivatives
from calibrate.functional.zaec import solve_zaec
from calibrate.functional.softmax import _centred, _cumulants

from tests.support.calibrate import slow_entropy, slow_moments

EPS = np.finfo(np.float64).eps


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


def test_entropy_matches_slow_loop_and_is_stable(rng):
    z = rng.normal(size=(50, 7)) * 5
    assert np.allclose(entropy_from_logits(z), [slow_entropy(r) for r in z], atol=1e-12)
    assert entropy_from_logits(np.zeros((1, 4)))[0] == pytest.approx(np.log(4), abs=1e-15)
    huge = np.array([[1e4, -1e4, 0.0], [1e4, 1e4, -1e4], [-1e4, -1e4, -1e4]])
    h = entropy_from_logits(huge)
    assert np.all(np.isfinite(h))
    assert h == pytest.approx([0.0, np.log(2), np.log(3)], abs=1e-12)
    # shift invariance at large magnitude (float32 input is promoted to float64)
    z32 = (rng.normal(size=(20, 10)) * 30).astype(np.float32)
    assert np.allclose(entropy_from_logits(z32), entropy_from_logits(z32.astype(np.float64) + 1e4), atol=1e-9)


def test_softmax_stats_against_slow_reference(rng):
    z = rng.normal(size=(40, 6)) * 4
    t = rng.uniform(0.3, 4, size=40)
    y = rng.integers(0, 6, size=40)
    s = softmax_stats(z.astype(np.float32), t, y)
    for i in range(40):
        zi = z[i].astype(np.float32).astype(np.float64) / t[i]
        p = np.exp(zi - zi.max())
        p /= p.sum()
        assert s.prediction[i] == np.argmax(p)
        assert s.confidence[i] == pytest.approx(p.max(), abs=1e-12)
        assert s.entropy[i] == pytest.approx(slow_entropy(zi), abs=1e-12)
        assert s.nll[i] == pytest.approx(-np.log(p[y[i]]), abs=1e-10)
        onehot = np.eye(6)[y[i]]
        assert s.brier[i] == pytest.approx(((p - onehot) ** 2).sum(), abs=1e-12)
