"""The ZAEC per-sample temperature solver (Zero-shot-Anchored Entropy Calibration): pure functions over arrays.

`zaec_temperature(zs, tta)` returns, per sample, the temperature T_i that brings the entropy of softmax(tta_i / T_i)
to the zero-shot entropy (or part way, `strength`); `solve_zaec` returns the same with diagnostics. The solve is a
vectorised, safeguarded Halley iteration in log T on log H; every accepted temperature is evaluated and certified in
float64 (see `zaec_temperature` for the precision guarantee). The estimator class is `calibrate.calibrators.ZAEC`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from calibrate.functional.softmax import _as_2d, _centred, _chunks, _cumulants, _entropy_chunk, _exp_rest

#: the largest ZAEC temperature. Restoring an entropy of exactly log K needs T = infinity; such samples (and any
#: whose target needs more than this) are capped here and counted (`ZaecSolution.capped`).
ZAEC_T_MAX = 1e6
#: the smallest ZAEC temperature (only the `all` / `increased` ablations sharpen, T < 1). Exact ties at the top make
#: low entropies unreachable; such samples are capped here and counted.
ZAEC_T_MIN = 1e-6
#: relative tolerance of the ZAEC solve. A row is accepted when |log H(T) - log target| <= ZAEC_RTOL and Newton's
#: estimate of the distance to the root, |log T - log T*|, is <= ZAEC_RTOL too; or when float64 evaluations bracket
#: the root in an interval of log T no wider than ZAEC_RTOL; or, where the entropy is too flat in T for the first
#: test (|d log H / d log T| < 1e-4), when log H is at the target to its own rounding (_LOG_H_NOISE).
#: Relative, not absolute: an absolute band of 1e-6 nats would accept T = 1 for every confident sample (H < 1e-6).
#: Attainable for any target in float64: log H is evaluated to ~1e-13 and moves by <= ~750 eps per ulp of log T.
ZAEC_RTOL = 1e-9
#: iteration limit of the safeguarded Halley solve (it needs about 4; bisection alone would need < 60)
ZAEC_MAX_ITER = 100

Subset = Literal["reduced", "all", "increased"]
SUBSETS: tuple[str, ...] = ("reduced", "all", "increased")


@dataclass(frozen=True)
class ZaecSolution:
    """The per-sample result of the ZAEC solve (all (N,) arrays).

    Attributes:
        temperature: float64 T_i (1 outside the corrected subset).
        target: float64 target entropy (= h_tta outside the corrected subset).
        h_zs: float64 zero-shot entropy.
        h_tta: float64 adapted entropy.
        corrected: bool, in the corrected subset and its target differs from h_tta (solved).
        capped: bool, target unreachable within [ZAEC_T_MIN, ZAEC_T_MAX]; T is set to the cap.
        iterations: the number of solver iterations of the slowest chunk.
    """

    temperature: np.ndarray
    target: np.ndarray
    h_zs: np.ndarray
    h_tta: np.ndarray
    corrected: np.ndarray
    capped: np.ndarray
    iterations: int = 0

    @property
    def n_capped(self) -> int:
        return int(self.capped.sum())


def _moments32(zc32: np.ndarray, top: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_moments` in float32 (cheaper, see _FLOAT32_STEPS): only to steer the search, never to accept."""
    e = zc32 * beta.astype(np.float32)[:, None]
    np.exp(e, out=e)
    e[np.arange(e.shape[0]), top] = 0.0
    eps = np.einsum("ij->i", e)
    s = eps + np.float32(1.0)
    e *= zc32
    m1 = np.einsum("ij->i", e) / s
    e *= zc32
    m2 = np.einsum("ij->i", e) / s
    m3 = np.einsum("ij,ij->i", e, zc32) / s
    m1, m2, m3 = m1.astype(np.float64), m2.astype(np.float64), m3.astype(np.float64)
    var = np.maximum(m2 - m1 * m1, 0.0)
    return np.log1p(eps.astype(np.float64)) - beta * m1, var, m3 - 3.0 * m1 * m2 + 2.0 * m1 * m1 * m1


def _halley_log(x: np.ndarray, h: np.ndarray, v: np.ndarray, k3: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, ...]:
    """Halley and Newton steps (each limited to _MAX_STEP) for f(x) = log H - log t, x = log beta."""
    b = np.exp(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        f = np.log(h / t)
        g = b * b * v / h  # -f'
        f1 = -g
        f2 = (-2.0 * b * b * v - b * b * b * k3) / h - g * g
        halley = x + np.clip(-2.0 * f * f1 / (2.0 * f1 * f1 - f * f2), -_MAX_STEP, _MAX_STEP)
        newton = x + np.clip(-f / f1, -_MAX_STEP, _MAX_STEP)
    return halley, newton


def _moments(zc: np.ndarray, top: np.ndarray, beta: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """H, Var and third central moment of z under p = softmax(beta * zc), for centred rows zc <= 0 (max 0 at `top`).

    With mu(beta) = E_p[z]: H = log sum exp(beta zc) - beta mu, dH/dbeta = -beta Var, dVar/dbeta = kappa3.
    """
    log_s, m1, var, k3 = _cumulants(zc, top, beta)
    return (log_s - m1 if beta is None else log_s - beta * m1), var, k3


def _entropy_at(zc: np.ndarray, top: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """H alone (no Var, kappa3) of softmax(beta * zc): the cheaper float64 evaluation that certifies a last step."""
    e, eps = _exp_rest(zc, top, beta)
    return np.log1p(eps) - beta * (np.einsum("ij,ij->i", e, zc) / (1.0 + eps))


_X_LO = float(np.log(1.0 / ZAEC_T_MAX))  # log beta at the largest temperature
_X_HI = float(np.log(1.0 / ZAEC_T_MIN))  # log beta at the smallest temperature
#: the largest Halley step in log beta (a factor e^2 in T): near-tied top classes give H(log beta) an inflection
#: that can throw an undamped step decades away
_MAX_STEP = 2.0
#: Halley steps evaluated in float32 before the float64 iteration takes over (0 disables them). float32 `exp` is
#: cheaper (4x on AVX2 CPUs, 1.5x with AVX-512), and the steps only steer: every accepted temperature is evaluated
#: and certified in float64.
_FLOAT32_STEPS = 1
#: a row whose Newton distance is below this takes a last step: its new point is evaluated for H alone (Var and
#: kappa3 kept from a point at most this far away in log T, so they still steer and estimate the slope correctly)
_LAST_STEP = 1e-4


#: the rounding error of log H as evaluated here (sums of non-negative terms: a few eps, 1e-13 with a wide margin).
#: Where the entropy is so flat in T that |f| cannot get below rtol * |f'|, a row with |f| below this is at the
#: root as far as float64 can tell.
_LOG_H_NOISE = 1e-13


def _take(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """a[rows] for sorted unique row indices, without the copy when they are all the rows."""
    return a if rows.size == a.shape[0] else a[rows]


def _unsolved(x: np.ndarray, h: np.ndarray, v: np.ndarray, target: np.ndarray, rtol: float) -> np.ndarray:
    """Rows not yet accepted. With f(x) = log H - log target and f'(x) = -beta^2 Var / H in x = log beta = -log T,
    accepted means |f| <= rtol and either |f / f'| <= rtol (Newton's estimate of the distance to the root, so T is
    within a relative rtol) or |f| <= _LOG_H_NOISE (the entropy is flat in T and already exact to its rounding)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        f = np.abs(np.log(h / target))
        slope = np.exp(2.0 * x) * v / h
        near = (f == 0.0) | (f <= rtol * slope) | (f <= _LOG_H_NOISE)
    return ~((f <= rtol) & near)


def _steer_float32(
    zc: np.ndarray, top: np.ndarray, target: np.ndarray, a: np.ndarray, x: np.ndarray, h: np.ndarray,
    v: np.ndarray, k3: np.ndarray, rtol: float,
) -> np.ndarray:
    """The first _FLOAT32_STEPS Halley steps of `_solve_beta` for rows `a`, evaluated in float32 (cheap): they only
    move x. The point they reach is evaluated in float64 and written into x, h, v, k3 at rows `a` (in place), so
    only a float64 evaluation can accept a row; the bracket is built from float64 evaluations only. Returns the
    rows of `a` still unsolved."""
    zc32, top32 = _take(zc, a).astype(np.float32), top[a]
    xs, hs, vs, ks, ts = x[a], h[a], v[a], k3[a], target[a]
    for _ in range(_FLOAT32_STEPS):
        halley, newton = _halley_log(xs, hs, vs, ks, ts)
        step = np.where(np.isfinite(halley), halley, newton)
        ok = np.isfinite(step)
        xs = np.where(ok, np.clip(step, _X_LO, _X_HI), xs)
        hs, vs, ks = _moments32(zc32, top32, np.exp(xs))
        if not (np.isfinite(hs).all() and np.isfinite(vs).all()):
            break
    halley, newton = _halley_log(xs, hs, vs, ks, ts)
    step = np.where(np.isfinite(halley), halley, newton)
    xs = np.where(np.isfinite(step), np.clip(step, _X_LO, _X_HI), xs)
    x[a] = xs
    h[a], v[a], k3[a] = _moments(_take(zc, a), top32, np.exp(xs))
    return a[_unsolved(x[a], h[a], v[a], target[a], rtol)]


def _solve_beta(
    zc: np.ndarray, top: np.ndarray, target: np.ndarray, h1: np.ndarray, v1: np.ndarray, k1: np.ndarray, rtol: float
) -> tuple[np.ndarray, np.ndarray, int]:
    """Solve H(softmax(beta * zc)) = target for beta in [1/T_MAX, 1/T_MIN], per row, vectorised.

    H is strictly decreasing in beta for non-constant rows (Proposition 1), so the root is unique. The iteration is
    Halley's method on f(x) = log H - log target in x = log beta (nearly linear in both the sharp and the diffuse
    regime, so it needs about 3 steps), with Newton as the second choice, steps limited to _MAX_STEP, and a bracket
    [x_lo, x_hi] that every evaluation shrinks. Without a usable step (outside the bracket, or not finite, e.g. H
    underflowed to 0) it bisects the bracket, or moves towards a never-evaluated end (the T caps) by _MAX_STEP;
    reaching a cap evaluates it and marks the row capped when the target is still missed. The first _FLOAT32_STEPS
    steps are evaluated in float32 and only move x; the bracket, the tolerance test and the caps use float64 only.
    A row is accepted by `_unsolved`'s relative test, or when float64 evaluations on both sides bracket the root
    within rtol in x (= log T up to sign), so T is exact to a relative rtol whatever the size of the target.
    Starts at beta = 1, where (H, Var, kappa3) = (h1, v1, k1) are already known. Returns (beta, capped, iterations).
    """
    n = zc.shape[0]
    x = np.zeros(n)
    h, v, k3 = h1.copy(), v1.copy(), k1.copy()
    lo = np.full(n, _X_LO)
    hi = np.full(n, _X_HI)
    lo_seen = np.zeros(n, dtype=bool)  # H(lo) evaluated (and >= target)
    hi_seen = np.zeros(n, dtype=bool)
    capped = np.zeros(n, dtype=bool)
    active = np.flatnonzero(_unsolved(x, h, v, target, rtol))
    it = 0
    if _FLOAT32_STEPS and active.size:
        active = _steer_float32(zc, top, target, active, x, h, v, k3, rtol)
        it = _FLOAT32_STEPS + 1
    while active.size and it < ZAEC_MAX_ITER:
        it += 1
        xa, ha, va, ka, ta = x[active], h[active], v[active], k3[active], target[active]
        below = ha < ta  # entropy too low: the root is at smaller beta
        lo_a = np.where(below, lo[active], xa)
        hi_a = np.where(below, xa, hi[active])
        lo_s = lo_seen[active] | ~below
        hi_s = hi_seen[active] | below
        # unreachable: the extreme temperature itself misses the target
        cap = (below & (xa <= _X_LO)) | (~below & (xa >= _X_HI))
        halley, newton = _halley_log(xa, ha, va, ka, ta)
        inside_h = np.isfinite(halley) & (halley > lo_a) & (halley < hi_a)
        inside_n = np.isfinite(newton) & (newton > lo_a) & (newton < hi_a)
        nxt = np.where(inside_h, halley, newton)
        ok = inside_h | inside_n
        # no usable step: bisect a verified bracket; towards an unverified end move by at most _MAX_STEP (reaching
        # the end itself evaluates it, which decides whether the row is capped)
        nxt = np.where(ok, nxt, 0.5 * (lo_a + hi_a))
        nxt = np.where(~ok & below & ~lo_s, np.maximum(xa - _MAX_STEP, lo_a), nxt)
        nxt = np.where(~ok & ~below & ~hi_s, np.minimum(xa + _MAX_STEP, hi_a), nxt)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            slope = np.exp(2.0 * xa) * va / ha  # |d log H / dx|: a bracket this narrow pins H to rtol as well
        narrow = (hi_a - lo_a) * np.where(np.isfinite(slope), np.maximum(slope, 1.0), 1.0) <= rtol
        collapsed = narrow & lo_s & hi_s  # the root is bracketed by float64 evaluations within rtol: accept x
        # a narrow interval against a never-evaluated cap: evaluate the cap itself, which decides `capped`
        nxt = np.where(narrow & below & ~lo_s, lo_a, nxt)
        nxt = np.where(narrow & ~below & ~hi_s, hi_a, nxt)
        lo[active], hi[active] = lo_a, hi_a
        lo_seen[active], hi_seen[active] = lo_s | (nxt <= _X_LO), hi_s | (nxt >= _X_HI)
        done = cap | collapsed
        capped[active[cap]] = True
        go = active[~done]
        if go.size == 0:
            break
        x[go] = nxt[~done]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            last = (np.abs(np.log(ha / ta)) <= _LAST_STEP * slope)[~done]
        full, light = go[~last], go[last]
        if full.size:
            h[full], v[full], k3[full] = _moments(_take(zc, full), top[full], np.exp(x[full]))
        if light.size:
            h[light] = _entropy_at(_take(zc, light), top[light], np.exp(x[light]))
        active = go[_unsolved(x[go], h[go], v[go], target[go], rtol)]
    return np.exp(x), capped, it


def solve_zaec(
    zs_logits: Any,
    tta_logits: Any,
    *,
    strength: float = 1.0,
    subset: Subset = "reduced",
    rtol: float = ZAEC_RTOL,
) -> ZaecSolution:
    """Solve ZAEC's per-sample temperatures, with diagnostics. See `zaec_temperature` for the definition and the
    precision guarantee (`rtol`, relative in H and in T)."""
    zs = _as_2d(zs_logits, "zs_logits")
    tta = _as_2d(tta_logits, "tta_logits")
    if zs.shape != tta.shape:
        raise ValueError(f"zs_logits and tta_logits must have the same shape; got {zs.shape} and {tta.shape}")
    strength = float(strength)
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"strength must lie in [0, 1], got {strength}")
    if subset not in SUBSETS:
        raise ValueError(f"unknown subset {subset!r}; valid: {', '.join(SUBSETS)}")
    n, k = tta.shape
    temp = np.ones(n)
    target = np.empty(n)
    h_zs = np.empty(n)
    h_tta = np.empty(n)
    corrected = np.zeros(n, dtype=bool)
    capped = np.zeros(n, dtype=bool)
    iters = 0
    for sl in _chunks(n, k):
        hz = _entropy_chunk(zs[sl])
        zc, top = _centred(tta[sl])
        ht, vt, kt = _moments(zc, top, None)
        # a convex combination of two non-negative numbers: relatively exact (ht + strength * (hz - ht) would
        # cancel to 0 for hz ~ 1e-90 next to ht ~ 0.7), and exactly hz at strength 1, exactly ht at strength 0
        tg = (1.0 - strength) * ht + strength * hz
        if subset == "reduced":
            sel = ht < hz
        elif subset == "increased":
            sel = ht > hz
        else:
            sel = np.ones_like(ht, dtype=bool)
        sel &= tg != ht  # only an exact tie is "already there": T = 1 exactly (lambda = 0 is the identity)
        h_zs[sl], h_tta[sl] = hz, ht
        target[sl] = np.where(sel, tg, ht)
        corrected[sl] = sel
        # constant logits have entropy log K at every T: nothing to solve (T = 1, capped if the target differs)
        const = sel & (zc.min(axis=1) == 0)
        capped[sl] = const
        idx = np.flatnonzero(sel & ~const)
        if idx.size:
            beta, cap, it = _solve_beta(zc[idx], top[idx], tg[idx], ht[idx], vt[idx], kt[idx], rtol)
            t_sl, cap_sl = temp[sl], capped[sl]
            t_sl[idx] = np.where(cap, np.where(beta < 1.0, ZAEC_T_MAX, ZAEC_T_MIN), 1.0 / beta)  # a cap exactly
            cap_sl[idx] = cap
            iters = max(iters, it)
    return ZaecSolution(temp, target, h_zs, h_tta, corrected, capped, iters)


def zaec_temperature(
    zs_logits: Any,
    tta_logits: Any,
    *,
    strength: float = 1.0,
    subset: Subset = "reduced",
) -> np.ndarray:
    """ZAEC per-sample temperatures (Zero-shot-Anchored Entropy Calibration).

    With H_zs = H(softmax(zs)), H_tta = H(softmax(tta)) and target = H_tta + strength * (H_zs - H_tta):
    for samples in the corrected subset, T is the unique T with H(softmax(tta / T)) = target; T = 1 elsewhere.
    Subsets: `reduced` (the paper's ZAEC: H_tta < H_zs, so T >= 1 is the smallest temperature reaching the
    target), `all` (every sample, T < 1 where H_tta > H_zs), `increased` (H_tta > H_zs only).

    Precision, for every sample whose target float64 can represent (entropies down to about 1e-300 nats) and that
    lies within the caps: H(softmax(tta / T)) equals the target to a relative 1e-9 (ZAEC_RTOL) and T is the exact
    root to a relative 1e-9 (Newton's estimate at a converged point, or a bracket of float64 evaluations). Where
    the entropy is nearly flat in T (|d log H / d log T| < 1e-4: nearly uniform predictions at a large T) float64
    cannot pin T that finely; there T is exact to the rounding of H, 1e-13 / |d log H / d log T| relative.
    Entropies are evaluated as those of (tta - max) * (1 / T), and all are computed with a small relative error (see
    `entropy_from_logits`), so confident samples (H ~ 1e-30) are solved as exactly as diffuse ones, not left at
    T = 1. Only an exact tie H_tta = target keeps T = 1. Targets unreachable within [ZAEC_T_MIN, ZAEC_T_MAX] (e.g.
    H_zs = log K, reached only at T = infinity) get the cap; count them with `solve_zaec(...).n_capped`.

    Args:
        zs_logits: (N, K) float zero-shot logits (logit scale included).
        tta_logits: (N, K) float adapted logits of the same samples.
        strength: lambda in [0, 1]; 0 is the identity, 1 is ZAEC.
        subset: "reduced" | "all" | "increased".

    Returns:
        (N,) float64 temperatures; calibrated logits are tta_logits / T[:, None].

    Example:
        >>> from calibrate.functional.softmax import entropy_from_logits
        >>> zs, tta = np.array([[1.0, 0.0, 0.0]]), np.array([[4.0, 0.0, 0.0]])
        >>> t = zaec_temperature(zs, tta)
        >>> h, h_zs = entropy_from_logits(tta / t[:, None])[0], entropy_from_logits(zs)[0]
        >>> bool(abs(np.log(h / h_zs)) <= 1e-9)
        True
    """
    return solve_zaec(zs_logits, tta_logits, strength=strength, subset=subset).temperature
