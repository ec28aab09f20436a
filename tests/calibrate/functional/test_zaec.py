"""The ZAEC solver (calibrate/functional/zaec.py): the paper's Propositions 1 and 2 as properties over many random
cases, against slow obvious references written here and in tests/support/calibrate.py (bisection in log T on log H,
per-sample scipy brentq, plain softmax loops), with confident samples (entropies down to 1e-300 nats) solved as
exactly as diffuse ones (the calibrator classes are tested in tests/calibrate/test_calibrators.py)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import brentq

from calibrate.functional.softmax import entropy_from_logits, softmax_stats
from calibrate.functional.zaec import ZAEC_RTOL, ZAEC_T_MAX, ZAEC_T_MIN, solve_zaec, zaec_temperature
from calibrate.functional.softmax import _centred
from calibrate.functional.zaec import _moments, _moments32

from tests.support.calibrate import random_pair, ref_entropies, slow_entropy

EPS32 = float(np.finfo(np.float32).eps)


#: log H as evaluated by `ref_entropies` is exact to ~1e-14 (sums of non-negative terms); so float64 fixes the
#: root in log T only to about 1e-13 / |d log H / d log T|: where the entropy is flat in T, T is undetermined
LOG_H_NOISE = 1e-13


def centred(z: np.ndarray) -> np.ndarray:
    """z - max z per row, in float64. Entropies of z / T are evaluated as entropies of centred(z) / T: dividing
    logits of size |z| by a tiny T first would round the gaps between them by |z| / T * eps (1e-8 nats at T = 1e-5)."""
    z = np.asarray(z, dtype=np.float64)
    return z - z.max(axis=1, keepdims=True)


def ref_solve(z: np.ndarray, target: np.ndarray, iters: int = 120) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slow reference: per row, bisection in u = log T on g(u) = log H(z / e^u) - log target (increasing in u),
    in lockstep over the rows, on [log T_MIN, log T_MAX]. Returns (T, capped, slope), slope = d log H / d log T at
    the root by a central difference. A target outside [H(T_MIN), H(T_MAX)] gives the cap it lies beyond."""
    z = centred(z)
    lt = np.log(target)
    g = lambda u: np.log(ref_entropies(z / np.exp(u)[:, None])) - lt  # noqa: E731
    lo, hi = np.full(len(z), np.log(ZAEC_T_MIN)), np.full(len(z), np.log(ZAEC_T_MAX))
    with np.errstate(divide="ignore"):
        over, under = g(lo) > 0, g(hi) < 0  # even the sharpest / the flattest T misses the target
        for _ in range(iters):
            mid = 0.5 * (lo + hi)
            up = g(mid) > 0
            hi, lo = np.where(up, mid, hi), np.where(up, lo, mid)
        u = np.where(over, lo, np.where(under, hi, 0.5 * (lo + hi)))
        du = 1e-4
        log_h = lambda v: np.log(ref_entropies(z / np.exp(v)[:, None]))  # noqa: E731
        slope = (log_h(u + du) - log_h(u - du)) / (2 * du)
    return np.where(over, ZAEC_T_MIN, np.where(under, ZAEC_T_MAX, np.exp(u))), over | under, slope


def assert_exact_temperatures(zs, tta, sol, *, strength=1.0, subset="reduced"):
    """Per sample: T = 1 exactly outside the subset, the cap where the reference says the target is unreachable,
    else T within a relative ZAEC_RTOL of the reference root (plus what float64 leaves undetermined, see
    LOG_H_NOISE), and H(tta / T) equal to the target to a relative ZAEC_RTOL."""
    h_zs, h_tta = ref_entropies(zs), ref_entropies(tta)
    target = (1 - strength) * h_tta + strength * h_zs  # no cancellation: H_zs = 1e-90 stays 1e-90 next to H_tta = 0.7
    in_subset = {"reduced": h_tta < h_zs, "increased": h_tta > h_zs, "all": np.ones(len(zs), bool)}[subset]
    sel = in_subset & (target != h_tta)
    t = sol.temperature
    assert np.all(t[~sel] == 1.0) and not sol.capped[~sel].any()
    const = sel & (np.ptp(np.asarray(tta, np.float64), axis=1) == 0)  # H = log K at every T: T = 1, capped
    assert np.all(t[const] == 1.0) and sol.capped[const].all()
    idx = np.flatnonzero(sel & ~const)
    if not idx.size:
        return
    t_ref, cap_ref, slope = ref_solve(tta[idx], target[idx])
    np.testing.assert_array_equal(sol.capped[idx], cap_ref)
    np.testing.assert_array_equal(t[idx][cap_ref], t_ref[cap_ref])  # exactly the cap
    ok = ~cap_ref
    # both solves are exact to Newton's estimate (<= ZAEC_RTOL) or to the rounding of log H over the slope
    tol = 2 * ZAEC_RTOL + 10 * LOG_H_NOISE / np.abs(slope[ok])
    err = np.abs(np.log(t[idx][ok] / t_ref[ok]))
    assert np.all(err <= tol), (idx[ok][err > tol], t[idx][ok][err > tol], t_ref[ok][err > tol])
    h_out = ref_entropies(centred(tta)[idx][ok] / t[idx][ok][:, None])
    assert np.all(np.abs(np.log(h_out / target[idx][ok])) <= ZAEC_RTOL + 10 * LOG_H_NOISE)


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
        h_out = ref_entropies(tta.astype(np.float64) / t[:, None])
        # output entropy = max(H_tta, H_zs), to a relative ZAEC_RTOL (plus the rounding of log H)
        assert np.all(np.abs(np.log(h_out[ok] / h_zs[ok])) <= ZAEC_RTOL + LOG_H_NOISE)
        np.testing.assert_array_equal(h_out[~reduced], h_tta[~reduced])  # T = 1: the very same computation
        # minimal and exact: T is the reference root, per sample
        assert_exact_temperatures(zs, tta, sol)
        # ranking (argsort) and top-1 preserved
        cal = tta.astype(np.float64) / t[:, None]
        assert np.array_equal(np.argmax(cal, 1), np.argmax(tta, 1))
        assert np.array_equal(np.argsort(cal, 1, kind="stable"), np.argsort(tta.astype(np.float64), 1, kind="stable"))
        assert sol.n_capped == 0


def test_against_brentq_reference(rng):
    """An outside root finder (scipy's brentq, per sample) on log H in log T agrees to the solver's precision."""
    zs, tta = random_pair(rng, 300, 20, scale=5)
    zs[:100] *= 30  # confident zero-shot rows too: targets far below 1e-6 nats
    tta[:100] *= 60
    t = zaec_temperature(zs, tta)
    h_zs = ref_entropies(zs)
    for i in range(300):
        hz, ht = h_zs[i], slow_entropy(tta[i])
        if ht >= hz:
            assert t[i] == 1.0
            continue
        z = tta[i].astype(np.float64)
        g = lambda u: np.log(slow_entropy(z / np.exp(u))) - np.log(hz)  # noqa: E731
        with np.errstate(divide="ignore"):  # H underflows to 0 near T = 1 for the most confident rows
            ref = brentq(g, 0.0, np.log(ZAEC_T_MAX), xtol=1e-15, rtol=4 * np.finfo(float).eps)
            slope = (g(ref + 1e-4) - g(ref - 1e-4)) / 2e-4
        assert abs(np.log(t[i]) - ref) <= 2 * ZAEC_RTOL + 10 * LOG_H_NOISE / slope, (i, t[i], np.exp(ref))


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
        assert np.all(np.abs(np.log(h[red] / ((1 - lam) * h_tta + lam * h_zs)[red])) <= ZAEC_RTOL + LOG_H_NOISE)
        assert np.all(t[~red] == 1)
    # stronger restoration never needs a lower temperature
    t_half, t_full = zaec_temperature(zs, tta, strength=0.5), zaec_temperature(zs, tta)
    assert np.all(t_full >= t_half)
    t_all = solve_zaec(zs, tta, subset="all")
    h = entropy_from_logits(tta / t_all.temperature[:, None])
    ok = ~t_all.capped
    assert np.all(np.abs(np.log(h / h_zs))[ok] <= ZAEC_RTOL + LOG_H_NOISE)
    inc = h_tta > h_zs
    assert np.all(t_all.temperature[inc & ok] < 1) and np.all(t_all.temperature[~inc] >= 1)
    t_inc = zaec_temperature(zs, tta, subset="increased")
    assert np.all(t_inc[~inc] == 1) and np.allclose(t_inc[inc & ok], t_all.temperature[inc & ok])


def test_edge_cases_constant_uniform_target_and_huge_logits():
    k = 5
    # uniform zero-shot (H = log K) is reached only at T = infinity: capped at T_MAX, and counted, however close
    # T_MAX gets (moderate logits come within 1e-11 nats there, 2e4-wide ones do not)
    zs = np.zeros((2, k))
    tta = np.array([[3.0, 1.0, 0.0, 0.0, -1.0], [1e4, -1e4, 0.0, 0.0, 0.0]])
    sol = solve_zaec(zs, tta)
    assert sol.capped.all() and np.all(sol.temperature == ZAEC_T_MAX) and sol.n_capped == 2
    h = entropy_from_logits(tta / sol.temperature[:, None])
    assert np.all(h < np.log(k)) and np.log(k) - h[0] < 1e-10
    # constant adapted logits: nothing to correct (H_tta = log K is maximal)
    sol = solve_zaec(np.array([[2.0, 0.0, 0, 0, 0]]), np.full((1, k), 7.0))
    assert sol.temperature[0] == 1.0 and sol.n_capped == 0
    # logits of magnitude 1e4: H_tta underflows to 0; the solve still reaches the target
    zs = np.array([[1e4, 9990.0, 9985.0], [5.0, 4.0, 0.0]])
    tta = np.array([[1e4, -1e4, 0.0], [1e4, -1e4, 5e3]], dtype=np.float32)
    sol = solve_zaec(zs, tta)
    h = entropy_from_logits(tta.astype(np.float64) / sol.temperature[:, None])
    assert np.all(np.abs(np.log(h / entropy_from_logits(zs))) <= ZAEC_RTOL + LOG_H_NOISE) and sol.n_capped == 0
    assert_exact_temperatures(zs, tta, sol)


def test_float32_input_solved_in_float64(rng):
    zs, tta = random_pair(rng, 100, 30)
    t32 = zaec_temperature(zs.astype(np.float32), tta.astype(np.float32))
    t64 = zaec_temperature(zs.astype(np.float32).astype(np.float64), tta.astype(np.float32).astype(np.float64))
    assert t32.dtype == np.float64 and np.array_equal(t32, t64)


def test_chunking_does_not_change_results(rng, monkeypatch):
    import calibrate.functional.softmax as C  # the chunk size lives with the kernels that chunk

    zs, tta = random_pair(rng, 500, 40)
    full = zaec_temperature(zs, tta)
    monkeypatch.setattr(C, "CHUNK_ELEMENTS", 7 * 40)
    assert np.array_equal(zaec_temperature(zs, tta), full)


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
    import calibrate.functional.zaec as C

    zs, tta = random_pair(rng, 400, 50)
    fast = solve_zaec(zs, tta)
    monkeypatch.setattr(C, "_FLOAT32_STEPS", 0)
    plain = solve_zaec(zs, tta)
    for sol in (fast, plain):
        assert_exact_temperatures(zs, tta, sol)
    assert np.array_equal(fast.capped, plain.capped)


# ------------------------------------------------------------------------------------- exact for every sample

def spanning_logits(rng, n: int, k: int, dtype=np.float64) -> np.ndarray:
    """(n, k) logits whose entropies span ~1e-300 .. log K, ranges up to 1e4: Gaussian rows of scale 1e-3 .. 2e3
    (range capped at 1e4) and confident rows (top class 0, the rest a gap g in [0, 680] nats below it, spread)."""
    z = np.empty((n, k))
    for i in range(n):
        if rng.random() < 0.5:
            row = rng.normal(size=k) * 10 ** rng.uniform(-3, 3.3)
            span = np.ptp(row)
            if span > 1e4:
                row *= 1e4 / span
        else:
            g = rng.uniform(0, 680)
            row = -(g + np.abs(rng.normal(size=k)) * 10 ** rng.uniform(-2, 3))
            row[rng.integers(k)] = 0.0
            row = np.maximum(row, -1e4)
        z[i] = row + rng.normal() * 10 ** rng.uniform(0, 3)  # an offset: entropies ignore it, roundings do not
    return z.astype(dtype)


@pytest.mark.parametrize("k", [2, 3, 10, 100, 1000])
def test_exact_temperature_for_every_sample(rng, k):
    """Random pairs whose entropies span 1e-300 .. log K (K = 2 .. 1000, logit ranges up to 1e4): every sample gets
    the reference root, for the paper's ZAEC, a partial strength and the `all` / `increased` ablations (T < 1)."""
    n = {2: 300, 3: 300, 10: 300, 100: 150, 1000: 40}[k]
    zs, tta = spanning_logits(rng, n, k), spanning_logits(rng, n, k, np.float32 if k == 10 else np.float64)
    while (under := ref_entropies(zs) < 1e-300).any():  # targets float64 can represent (the guarantee's range)
        zs[under] -= zs[under].mean(axis=1, keepdims=True)
        zs[under] *= 0.5
    tta[: n // 3] = zs[: n // 3] * rng.uniform(1.0, 3.0, size=(n // 3, 1))  # adapted = sharpened zero-shot
    h = ref_entropies(zs)
    assert h.min() < 1e-200 and h.max() > 0.5 * np.log(k)  # the draw does span the range
    for strength, subset in ((1.0, "reduced"), (0.5, "reduced"), (1.0, "all"), (0.3, "increased")):
        sol = solve_zaec(zs, tta, strength=strength, subset=subset)
        assert_exact_temperatures(zs, tta, sol, strength=strength, subset=subset)
        assert sol.iterations < 60


def test_k2_closed_form_down_to_1e_300():
    """For K = 2 the entropy depends only on the gap, so ZAEC's T is exactly gap_tta / gap_zs; the issue's example
    (H_zs = 2.4e-12, H_tta = 1.6e-27 -> T = 2.18) and gaps up to 680 nats (H ~ 1e-293) included."""
    gaps_zs = np.array([0.5, 3.0, 30.0, 100.0, 300.0, 680.0])
    ratio = np.array([8.0, 1.5, 2.1823, 5.0, 1.0 + 1e-6, 14.7])
    zs = np.stack([gaps_zs, np.zeros_like(gaps_zs)], 1)
    tta = np.stack([np.zeros_like(gaps_zs), -gaps_zs * ratio], 1)  # the other class on top: a shift changes nothing
    h_zs = ref_entropies(zs)
    assert h_zs[-1] < 1e-290 and 1e-12 < h_zs[2] < 1e-11 and ref_entropies(tta)[2] < 1e-26
    sol = solve_zaec(zs, tta)
    assert sol.corrected.all() and sol.n_capped == 0
    # d log H / d log T is about the gap (>= 0.2 here), so T is exact to about ZAEC_RTOL
    np.testing.assert_allclose(sol.temperature, ratio, rtol=2 * ZAEC_RTOL)
    assert_exact_temperatures(zs, tta, sol)


def test_named_extreme_cases():
    k = 6
    big = -1e4
    zs = np.array([
        [0.0, -600, -600, -610, -700, -650],  # one-hot-like zero-shot, H ~ 1e-258
        [0.0, -40, -45, -50, -55, -60],       # confident
        [1.0, 1.0, -30, -30, -30, -30],       # a tie at the top: H >= log 2
        [2.0, 1.0, 0.5, 0.0, 0.0, 0.0],       # diffuse
        [5.0, 0.0, 0.0, 0.0, 0.0, 0.0],       # correct class, moderately sure
        [3.0, 3.0, 3.0, 3.0, 3.0, 3.0],       # equal logits: H = log K, reachable only at T = infinity
    ])
    tta = np.array([
        [0.0, big, big, big, big, big],       # one-hot-like adapted: H underflows to exactly 0
        [0.0, -400, -420, -450, -500, -1e4],  # far sharper, H ~ 1e-172
        [1.0, 1.0, -500, -500, -500, -500],   # the tie kept, the rest pushed away: H -> log 2 from above
        [7.0, 7.0, 7.0, 7.0, 7.0, 7.0],       # equal logits: H = log K, never reduced
        [0.0, 300.0, 0.0, 0.0, 0.0, 0.0],     # a single dominant wrong class
        [9.0, 1.0, 0.0, 0.0, 0.0, 0.0],
    ])
    sol = solve_zaec(zs, tta)
    assert_exact_temperatures(zs, tta, sol)
    t = sol.temperature
    assert 10 < t[0] < 30 and t[1] > 5 and t[3] == 1.0 and not sol.corrected[3]
    assert sol.capped[5] and t[5] == ZAEC_T_MAX and sol.n_capped == 1
    # the dominant wrong class: log p(label) = -300 / T + ..., so the exact T matters for NLL
    nll = softmax_stats(tta[4:5], t[4:5], [0]).nll[0]
    assert nll < 300 / t[4] + np.log(k) and t[4] > 50
    # the ablation that sharpens: targets below log 2 cannot be reached through a tie (capped at T_MIN)
    tie_low = solve_zaec(np.array([[0.0, -50, -50, -50]]), np.array([[1.0, 1.0, 0.0, 0.0]]), subset="all")
    assert tie_low.capped[0] and tie_low.temperature[0] == ZAEC_T_MIN
    # an exact tie of the two entropies keeps T = 1 exactly; the smallest relative margin is corrected
    same = np.array([[2.0, 0.0, -1.0]])
    assert solve_zaec(same, same[:, ::-1].copy()).temperature[0] == 1.0
    nudged = solve_zaec(same * (1 - 1e-7), same)
    assert nudged.corrected[0] and nudged.temperature[0] > 1.0
    assert_exact_temperatures(same * (1 - 1e-7), same, nudged)


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
