"""ZAEC and the other calibrators: the paper's Propositions 1 and 2 as properties over many random cases,
against slow obvious references written here (per-sample scipy brentq, plain softmax loops)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import brentq

from calibrate import CALIBRATORS, entropy_from_logits, parse_calibrator, softmax_stats, solve_zaec, zaec_temperature
from calibrate.calibrators import (
    ZAEC_T_MAX,
    ZAEC_TOL,
    SaLS,
    TemperatureScaling,
    fit_temperature,
    parse_calibrators,
)
from calibrate.synthetic import synthetic_logits


def slow_entropy(z: np.ndarray) -> float:
    z = np.asarray(z, dtype=np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    nz = p > 0
    return float(-(p[nz] * np.log(p[nz])).sum())


def root_or_one(z: np.ndarray, level: float) -> float:
    """The T >= 1 with H(softmax(z / T)) = level by brentq (1 when H(z) is already above the level)."""
    if slow_entropy(z) >= level:
        return 1.0
    return brentq(lambda T: slow_entropy(z / T) - level, 1.0, ZAEC_T_MAX, xtol=1e-15, rtol=1e-15)


def random_pair(rng, n, k, scale=None):
    """Mixed regimes: CLIP-like synthetic logits and raw Gaussian logits of random scales."""
    if rng.random() < 0.5:
        _, zs, tta = synthetic_logits(n, k, rng)
        return zs, tta
    s = scale if scale is not None else 10 ** rng.uniform(-1, 1.5)
    zs = (rng.normal(size=(n, k)) * s).astype(np.float32)
    tta = (zs * np.exp(rng.normal(0.3, 0.6, size=(n, 1))) + rng.normal(size=(n, k))).astype(np.float32)
    return zs, tta


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


@pytest.mark.parametrize("k", [2, 3, 10, 100])
def test_proposition_2_over_random_cases(rng, k):
    """Entropy floor reached exactly, T minimal, T = 1 outside the reduced subset, ranking and accuracy preserved."""
    for _ in range(15):
        zs, tta = random_pair(rng, 200, k)
        sol = solve_zaec(zs, tta)
        t = sol.temperature
        h_zs = np.array([slow_entropy(r) for r in zs])
        h_tta = np.array([slow_entropy(r) for r in tta])
        reduced = h_tta < h_zs
        assert np.all(t[~reduced] == 1.0)
        assert np.all(t >= 1.0)
        ok = reduced & ~sol.capped
        h_out = np.array([slow_entropy(r / ti) for r, ti in zip(tta.astype(np.float64), t)])
        # output entropy = max(H_tta, H_zs) within the solver tolerance
        assert np.all(np.abs(h_out[ok] - h_zs[ok]) <= ZAEC_TOL)
        assert np.allclose(h_out[~reduced], h_tta[~reduced], atol=1e-12)
        # minimality: the smallest T >= 1 at which H reaches target - 2 tol (exact brentq reference) lies below T,
        # so no smaller temperature reaches the target within the tolerance, and T is within the tolerance band
        for i in np.flatnonzero(ok)[:25]:
            z = tta[i].astype(np.float64)
            lo_t = root_or_one(z, h_zs[i] - 2 * ZAEC_TOL)
            hi_t = root_or_one(z, h_zs[i] + 2 * ZAEC_TOL)
            assert lo_t <= t[i] < hi_t and (lo_t < t[i] or lo_t == 1.0)
        # ranking (argsort) and top-1 preserved
        cal = tta.astype(np.float64) / t[:, None]
        assert np.array_equal(np.argmax(cal, 1), np.argmax(tta, 1))
        assert np.array_equal(np.argsort(cal, 1, kind="stable"), np.argsort(tta.astype(np.float64), 1, kind="stable"))
        assert sol.n_capped == 0


def test_against_brentq_reference(rng):
    zs, tta = random_pair(rng, 300, 20, scale=5)
    t = zaec_temperature(zs, tta)
    for i in range(300):
        hz, ht = slow_entropy(zs[i]), slow_entropy(tta[i])
        if ht >= hz:
            assert t[i] == 1.0
            continue
        z = tta[i].astype(np.float64)
        ref = brentq(lambda T: slow_entropy(z / T) - hz, 1.0, ZAEC_T_MAX, xtol=1e-14)
        assert t[i] == pytest.approx(ref, rel=1e-4)


def test_proposition_1_monotone(rng):
    z = rng.normal(size=(30, 8)) * 3
    temps = np.linspace(0.2, 20, 60)
    h = np.array([entropy_from_logits(z / T) for T in temps])
    conf = np.array([softmax_stats(z, T).confidence for T in temps])
    assert np.all(np.diff(h, axis=0) > 0)
    assert np.all(np.diff(conf, axis=0) < 0)


def test_strength_and_subsets(rng):
    zs, tta = random_pair(rng, 400, 15, scale=4)
    h_zs, h_tta = entropy_from_logits(zs), entropy_from_logits(tta)
    assert np.all(zaec_temperature(zs, tta, strength=0.0) == 1.0)  # lambda = 0 is the identity
    assert np.array_equal(zaec_temperature(zs, tta, strength=1.0), zaec_temperature(zs, tta))
    for lam in (0.25, 0.5, 0.75):
        t = zaec_temperature(zs, tta, strength=lam)
        h = entropy_from_logits(tta / t[:, None])
        red = h_tta < h_zs
        assert np.all(np.abs(h[red] - (h_tta + lam * (h_zs - h_tta))[red]) <= ZAEC_TOL)
        assert np.all(t[~red] == 1)
    # stronger restoration never needs a lower temperature
    t_half, t_full = zaec_temperature(zs, tta, strength=0.5), zaec_temperature(zs, tta)
    assert np.all(t_full >= t_half)
    t_all = solve_zaec(zs, tta, subset="all")
    h = entropy_from_logits(tta / t_all.temperature[:, None])
    ok = ~t_all.capped
    assert np.all(np.abs(h - h_zs)[ok] <= ZAEC_TOL)
    inc = h_tta > h_zs
    assert np.all(t_all.temperature[inc & ok] < 1) and np.all(t_all.temperature[~inc] >= 1)
    t_inc = zaec_temperature(zs, tta, subset="increased")
    assert np.all(t_inc[~inc] == 1) and np.allclose(t_inc[inc & ok], t_all.temperature[inc & ok])


def test_edge_cases_constant_uniform_target_and_huge_logits():
    k = 5
    # uniform zero-shot (H = log K) is reached only at T = infinity: moderate logits get within the tolerance at a
    # finite T; logits spread over 2e4 cannot within T_MAX and are capped there, and counted
    zs = np.zeros((2, k))
    tta = np.array([[3.0, 1.0, 0.0, 0.0, -1.0], [1e4, -1e4, 0.0, 0.0, 0.0]])
    sol = solve_zaec(zs, tta)
    h = entropy_from_logits(tta / sol.temperature[:, None])
    assert abs(h[0] - np.log(k)) <= ZAEC_TOL and 1 < sol.temperature[0] < ZAEC_T_MAX and not sol.capped[0]
    assert sol.capped[1] and sol.temperature[1] == pytest.approx(ZAEC_T_MAX) and sol.n_capped == 1
    assert np.log(k) - h[1] > ZAEC_TOL
    # constant adapted logits: nothing to correct (H_tta = log K is maximal)
    sol = solve_zaec(np.array([[2.0, 0.0, 0, 0, 0]]), np.full((1, k), 7.0))
    assert sol.temperature[0] == 1.0 and sol.n_capped == 0
    # logits of magnitude 1e4: H_tta underflows to 0; the solve still reaches the target
    zs = np.array([[1e4, 9990.0, 9985.0], [5.0, 4.0, 0.0]])
    tta = np.array([[1e4, -1e4, 0.0], [1e4, -1e4, 5e3]], dtype=np.float32)
    sol = solve_zaec(zs, tta)
    h = entropy_from_logits(tta.astype(np.float64) / sol.temperature[:, None])
    assert np.all(np.abs(h - entropy_from_logits(zs)) <= ZAEC_TOL) and sol.n_capped == 0
    # K = 2
    zs = np.array([[0.5, 0.0]])
    tta = np.array([[4.0, 0.0]])
    t = zaec_temperature(zs, tta)
    assert slow_entropy(tta[0] / t[0]) == pytest.approx(slow_entropy(zs[0]), abs=ZAEC_TOL)
    assert t[0] == pytest.approx(8.0, rel=1e-6)  # for K = 2 the entropy depends only on the gap: 4 / T = 0.5


def test_float32_input_solved_in_float64(rng):
    zs, tta = random_pair(rng, 100, 30)
    t32 = zaec_temperature(zs.astype(np.float32), tta.astype(np.float32))
    t64 = zaec_temperature(zs.astype(np.float32).astype(np.float64), tta.astype(np.float32).astype(np.float64))
    assert t32.dtype == np.float64 and np.array_equal(t32, t64)


def test_chunking_does_not_change_results(rng, monkeypatch):
    import calibrate.calibrators as C

    zs, tta = random_pair(rng, 500, 40)
    full = zaec_temperature(zs, tta)
    monkeypatch.setattr(C, "CHUNK_ELEMENTS", 7 * 40)
    assert np.array_equal(zaec_temperature(zs, tta), full)


def test_sals_is_range_ratio(rng):
    zs = rng.normal(size=(50, 6)) * 3
    tta = rng.normal(size=(50, 6)) * 7
    t = SaLS().temperatures(zs, tta)
    for i in range(50):
        scaled = (tta[i] - tta[i].min()) / np.ptp(tta[i]) * np.ptp(zs[i]) + zs[i].min()
        p_ref = np.exp(scaled - scaled.max()); p_ref /= p_ref.sum()
        z = tta[i] / t[i]
        p = np.exp(z - z.max()); p /= p.sum()
        assert np.allclose(p, p_ref, atol=1e-12)
    # zero range on either side: T = 1, no division by zero
    assert SaLS().temperatures(np.ones((1, 3)), np.array([[1.0, 2, 3]]))[0] == 1.0
    assert SaLS().temperatures(np.array([[1.0, 2, 3]]), np.ones((1, 3)))[0] == 1.0


def slow_nll(z, y, T):
    z = z / T
    m = z.max(1, keepdims=True)
    return float(np.mean(np.log(np.exp(z - m).sum(1)) + m[:, 0] - z[np.arange(len(y)), y]))


def test_temperature_scaling_minimises_nll(rng):
    for true_t in (0.5, 1.0, 2.5):
        y = rng.integers(0, 10, size=2000)
        z = rng.normal(size=(2000, 10)) * 2
        z[np.arange(2000), y] += 2.5
        z = z / true_t
        ts = TemperatureScaling().fit(z, y)
        t = ts.temperature_
        grid = t * np.array([0.98, 1.0, 1.02])
        nll = [slow_nll(z, y, g) for g in grid]
        assert nll[1] < nll[0] and nll[1] < nll[2]
        # streaming over two batches gives the same fit
        t2, _ = fit_temperature(lambda: [(z[:700], y[:700]), (z[700:], y[700:])])
        assert t2 == pytest.approx(t, rel=1e-9)
        assert np.all(ts.temperatures(z, z) == t)
    # separable data: the optimum is T -> 0; the fit stays finite and clamped
    z = np.eye(3)[[0, 1, 2]] * 10
    assert 0 < TemperatureScaling().fit(z, [0, 1, 2]).temperature_ <= 1.0
    with pytest.raises(ValueError, match="not fitted"):
        TemperatureScaling().temperatures(z, z)
    assert TemperatureScaling(T=1.3).temperature_ == 1.3


@pytest.mark.parametrize("name", sorted(CALIBRATORS))
def test_every_registered_calibrator_preserves_predictions(rng, name):
    zs, tta = random_pair(rng, 300, 12)
    cal = parse_calibrator(name)
    if cal.needs_fit:
        y = rng.integers(0, 12, size=300)
        assert cal.fit(tta, y) is cal
    else:
        assert cal.fit() is cal
    t = cal.temperatures(zs, tta)
    assert t.shape == (300,) and t.dtype == np.float64 and np.all(t > 0)
    out = cal.transform(zs, tta)
    assert np.array_equal(out.argmax(1), tta.argmax(1))


def test_parse_calibrator_specs():
    c = parse_calibrator("zaec:strength=0.5")
    assert c.strength == 0.5 and c.subset == "reduced" and c.spec == "zaec:strength=0.5"
    assert parse_calibrator("zaec:subset=all").subset == "all"
    assert parse_calibrator("temperature:T=1.2").temperature_ == 1.2
    cals = parse_calibrators("none,zaec:strength=0.5,subset=all,sals")
    assert [c.spec for c in cals] == ["none", "zaec:strength=0.5,subset=all", "sals"]
    assert cals[1].subset == "all"
    with pytest.raises(ValueError, match="unknown calibrator 'zeac'; available: none, temperature, sals, zaec"):
        parse_calibrator("zeac")
    with pytest.raises(ValueError, match="no option 'lambda'; valid options: strength, subset"):
        parse_calibrator("zaec:lambda=1")
    with pytest.raises(ValueError, match="unknown zaec subset 'some'; valid: reduced, all, increased"):
        parse_calibrator("zaec:subset=some")
    with pytest.raises(ValueError, match=r"strength must lie in \[0, 1\]"):
        parse_calibrator("zaec:strength=2")
    with pytest.raises(ValueError, match="expects a number"):
        parse_calibrator("zaec:strength=high")
    with pytest.raises(ValueError, match="given twice"):
        parse_calibrators("zaec,zaec")
    with pytest.raises(ValueError, match="no option 'x'; valid options: none"):
        parse_calibrator("sals:x=1")


def test_nan_and_bad_shapes_are_rejected():
    zs = np.zeros((3, 4))
    tta = np.ones((3, 4))
    tta[1, 2] = np.nan
    tta[2, 0] = np.inf
    with pytest.raises(ValueError, match="tta_logits has 2 row"):
        zaec_temperature(zs, tta)
    with pytest.raises(ValueError, match="logits has 2 row"):
        entropy_from_logits(tta)
    with pytest.raises(ValueError, match=r"same shape; got \(3, 4\) and \(3, 5\)"):
        zaec_temperature(zs, np.zeros((3, 5)))
    with pytest.raises(ValueError, match=r"shape \(N, K\)"):
        zaec_temperature(np.zeros(4), np.zeros(4))
    with pytest.raises(ValueError, match="unknown subset 'most'"):
        zaec_temperature(zs, zs, subset="most")
    assert zaec_temperature(np.zeros((0, 3)), np.zeros((0, 3))).shape == (0,)


def test_float32_steering_only_steers(rng, monkeypatch):
    """The float32 search steps change how the root is found, never what is accepted (float64, same tolerance)."""
    import calibrate.calibrators as C

    zs, tta = random_pair(rng, 400, 50)
    fast = solve_zaec(zs, tta)
    monkeypatch.setattr(C, "_FLOAT32_STEPS", 0)
    plain = solve_zaec(zs, tta)
    for sol in (fast, plain):
        h = np.array([slow_entropy(r / t) for r, t in zip(tta.astype(np.float64), sol.temperature)])
        assert np.all(np.abs(h - sol.target) <= ZAEC_TOL)
    assert np.allclose(fast.temperature, plain.temperature, rtol=1e-3)
    assert np.array_equal(fast.capped, plain.capped)
