"""Calibrators for test-time-adapted logits: none, temperature scaling, SaLS and ZAEC.

Every calibrator here is a per-sample temperature: the calibrated prediction of sample i is
softmax(tta_logits[i] / T_i). A temperature never changes the class ranking, so no calibrator in this module changes
a prediction or the accuracy. Calibrators look like scikit-learn estimators: `fit(...)` returns self, fitted state
ends in `_`, and `temperatures(zs_logits, tta_logits)` returns the (N,) float64 effective temperatures. Label-free
calibrators (SaLS, ZAEC) take the paired zero-shot logits as their input, never labels.

All computations run in float64 on row chunks (bounded memory) and subtract the row maximum before `exp`, so they
are exact and stable for logits of any magnitude (1e4 included). Entropies are accurate to a few float64 eps
*relative* to their value, down to about 1e-300 nats (see `entropy_from_logits`), which is what lets ZAEC solve
confident samples exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Iterable, Iterator, Literal

import numpy as np

#: rows per chunk are chosen so that one (rows, K) float64 temporary holds about this many elements
CHUNK_ELEMENTS = 1 << 17

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


def _as_2d(logits: Any, name: str = "logits") -> np.ndarray:
    """(N, K) real array, finite (a NaN would otherwise pass silently as T = 1 or a NaN metric)."""
    x = np.asarray(logits)
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape (N, K), got {x.shape}")
    if x.shape[1] < 1:
        raise ValueError(f"{name} must have at least one class, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
        raise ValueError(f"{name} must be real numbers, got dtype {x.dtype}")
    if not np.isfinite(x).all():
        bad = int((~np.isfinite(x)).any(axis=1).sum())
        raise ValueError(f"{name} has {bad} row(s) with NaN or inf")
    return x


def _chunks(n: int, k: int) -> Iterator[slice]:
    rows = max(1, CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n, rows):
        yield slice(start, min(n, start + rows))


def _centred(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float64 copy of (n, K) rows minus their maximum (<= 0, max exactly 0): exp never overflows; and the (n,)
    index of each row's (first) maximum."""
    z = x.astype(np.float64)  # always a copy, so the in-place subtraction never touches the input
    top = z.argmax(axis=1)
    z -= z[np.arange(z.shape[0]), top][:, None]
    return z, top


def _exp_rest(zc: np.ndarray, top: np.ndarray, beta: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """e = exp(beta * zc) with the top entry (exactly exp(0) = 1) set to 0, and eps = sum(e) = s - 1.

    Keeping the top class out of the sum gives eps to full relative precision even when it is below 1e-16, so
    log s = log1p(eps) is exact where log(1 + eps) would round to 0. The top entry has zc = 0, so sums of e * zc^j
    are unchanged.
    """
    if beta is None:
        e = np.exp(zc)
    else:
        e = np.multiply(zc, beta[:, None])
        np.exp(e, out=e)
    e[np.arange(zc.shape[0]), top] = 0.0
    return e, np.einsum("ij->i", e)  # row sums: einsum is several times faster than ndarray.sum(axis=1) here


def _entropy_chunk(z: np.ndarray) -> np.ndarray:
    """(n, K) float -> (n,) entropy. H = log1p(eps) + sum_k e_k (m - z_k) / (1 + eps), m = max z, e_k = exp(z_k - m)
    off the top class and eps = sum_k e_k: two sums of non-negative terms, so H is accurate relative to its size."""
    zc, top = _centred(z)  # 0 * (-huge) stays 0 below
    e, eps = _exp_rest(zc, top)
    return np.log1p(eps) - np.einsum("ij,ij->i", e, zc) / (1.0 + eps)


def entropy_from_logits(logits: Any) -> np.ndarray:
    """Entropy of softmax(logits) per row, in nats, computed in float64.

    H(softmax(z)) = log sum_k exp(z_k - m) - sum_k p_k (z_k - m), m = max_k z_k; exact for |z| ~ 1e4 and beyond.
    Both terms are non-negative and each is computed from sums of non-negative terms (the first as log1p of the sum
    over the non-top classes), so H has a small *relative* error (a few eps times max |z - m| at worst, ~1e-13) for
    every entropy float64 can represent, down to about 1e-300 nats; below that it underflows to 0.

    Args:
        logits: (N, K) float logits (float32 or float64).

    Returns:
        (N,) float64 entropies in [0, log K].

    Example:
        >>> bool(entropy_from_logits(np.zeros((1, 4)))[0] == np.log(4))
        True
    """
    x = _as_2d(logits)
    out = np.empty(x.shape[0], dtype=np.float64)
    for sl in _chunks(x.shape[0], x.shape[1]):
        out[sl] = _entropy_chunk(x[sl])
    return out


@dataclass(frozen=True)
class SoftmaxStats:
    """Per-sample results of softmax(logits / T): all (N,) arrays.

    Attributes:
        prediction: int64 argmax (the first index on ties, like numpy).
        confidence: float64 top-label probability.
        entropy: float64 entropy in nats.
        nll: float64 -log p[label] (None without labels).
        brier: float64 sum_k (p_k - 1[k = label])^2 (None without labels).
    """

    prediction: np.ndarray
    confidence: np.ndarray
    entropy: np.ndarray
    nll: np.ndarray | None = None
    brier: np.ndarray | None = None


def softmax_stats(logits: Any, temperatures: Any = 1.0, labels: Any = None) -> SoftmaxStats:
    """Prediction, confidence and entropy (plus NLL and Brier with labels) of softmax(logits / T) per sample.

    Args:
        logits: (N, K) float logits.
        temperatures: scalar or (N,) positive per-sample temperatures.
        labels: optional (N,) int class indices in [0, K).

    Returns:
        SoftmaxStats of (N,) arrays, float64.

    Example:
        >>> s = softmax_stats(np.array([[0.0, np.log(3.0)]]), 1.0, [1])
        >>> round(float(s.confidence[0]), 6), round(float(s.nll[0]), 6)
        (0.75, 0.287682)
    """
    x = _as_2d(logits)
    n, k = x.shape
    t = np.broadcast_to(np.asarray(temperatures, dtype=np.float64), (n,))
    if n and not (np.all(np.isfinite(t)) and np.all(t > 0)):
        raise ValueError("temperatures must be finite and > 0")
    y = None if labels is None else np.asarray(labels, dtype=np.int64)
    if y is not None and y.shape != (n,):
        raise ValueError(f"labels must have shape ({n},), got {y.shape}")
    pred = np.empty(n, dtype=np.int64)
    conf = np.empty(n, dtype=np.float64)
    ent = np.empty(n, dtype=np.float64)
    nll = None if y is None else np.empty(n, dtype=np.float64)
    brier = None if y is None else np.empty(n, dtype=np.float64)
    for sl in _chunks(n, k):
        z = x[sl].astype(np.float64)
        am = z.argmax(axis=1)
        rows = np.arange(z.shape[0])
        zc = (z - z[rows, am][:, None]) / t[sl][:, None]  # <= 0, max exactly 0
        e, eps = _exp_rest(zc, am)  # the top class (e = 1) is left out, see _exp_rest
        s = 1.0 + eps
        log_s = np.log1p(eps)
        pred[sl] = am
        conf[sl] = 1.0 / s
        ent[sl] = log_s - np.einsum("ij,ij->i", e, zc) / s
        if y is not None:
            yl = y[sl]
            nll[sl] = log_s - zc[rows, yl]
            p_y = np.exp(zc[rows, yl]) / s
            brier[sl] = (np.einsum("ij,ij->i", e, e) + 1.0) / (s * s) - 2.0 * p_y + 1.0
    return SoftmaxStats(pred, conf, ent, nll, brier)


# ---------------------------------------------------------------------------------------------------------------
# ZAEC
# ---------------------------------------------------------------------------------------------------------------


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


def _cumulants(zc: np.ndarray, top: np.ndarray, beta: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """log sum exp(beta zc), and the mean, variance and third central moment of zc under p = softmax(beta * zc).

    Rows are centred (zc <= 0, max 0 at index `top`), so exp never overflows; one exp pass, in place. The log-sum
    is log1p of the non-top sum (exact for tiny sums) and the mean is a sum of non-positive terms, so
    H = log_s - beta * mean keeps full relative precision however small it is.
    """
    e, eps = _exp_rest(zc, top, beta)
    s = 1.0 + eps
    e *= zc
    m1 = np.einsum("ij->i", e) / s  # E_p[zc] <= 0
    e *= zc
    m2 = np.einsum("ij->i", e) / s
    m3 = np.einsum("ij,ij->i", e, zc) / s
    var = np.maximum(m2 - m1 * m1, 0.0)
    k3 = m3 - 3.0 * m1 * m2 + 2.0 * m1 * m1 * m1
    return np.log1p(eps), m1, var, k3


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
        # steer: a few Halley steps evaluated in float32 (cheap), then every step below is evaluated in float64 and
        # only a float64 evaluation can accept a row; the bracket is built from float64 evaluations only
        a = active
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
        it = _FLOAT32_STEPS + 1
        active = a[_unsolved(x[a], h[a], v[a], target[a], rtol)]
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
        >>> zs, tta = np.array([[1.0, 0.0, 0.0]]), np.array([[4.0, 0.0, 0.0]])
        >>> t = zaec_temperature(zs, tta)
        >>> h, h_zs = entropy_from_logits(tta / t[:, None])[0], entropy_from_logits(zs)[0]
        >>> bool(abs(np.log(h / h_zs)) <= 1e-9)
        True
    """
    return solve_zaec(zs_logits, tta_logits, strength=strength, subset=subset).temperature


# ---------------------------------------------------------------------------------------------------------------
# Temperature scaling: NLL is convex in the inverse temperature beta = 1/T
# ---------------------------------------------------------------------------------------------------------------

#: the fitted temperature is searched in [1/TS_BETA_MAX, 1/TS_BETA_MIN]
TS_BETA_MIN = 1e-3
TS_BETA_MAX = 1e3


def nll_derivatives(logits: Any, labels: Any, beta: float) -> tuple[float, float, float, float, int]:
    """Sums over samples of NLL(beta) and its first three derivatives for softmax(beta * logits); and the count.

    NLL_i(beta) = logsumexp(beta z_i) - beta z_{i,y}; its derivatives are E_p[z] - z_y, Var_p(z) >= 0 and the third
    central moment of z under p, so the mean NLL is convex in beta. Sums make the statistics mergeable across shards.
    """
    x = _as_2d(logits)
    y = np.asarray(labels, dtype=np.int64)
    f = g = h = t = 0.0
    for sl in _chunks(x.shape[0], x.shape[1]):
        z = x[sl].astype(np.float64)
        zc, top = _centred(z)
        rows = np.arange(z.shape[0])
        log_s, m1, var, k3 = _cumulants(zc, top, np.full(z.shape[0], float(beta)))
        zy = zc[rows, y[sl]]
        f += float((log_s - beta * zy).sum())
        g += float((m1 - zy).sum())
        h += float(var.sum())
        t += float(k3.sum())
    return f, g, h, t, int(x.shape[0])


def fit_temperature(
    batches: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]],
    *,
    tol: float = 1e-10,
    max_iter: int = 100,
) -> tuple[float, int]:
    """Fit one temperature by NLL over labelled logits, streaming: Halley on beta = 1/T inside a bisection bracket.

    The mean NLL is convex in beta, so dNLL/dbeta has one root; Halley's method (using the second and third
    derivatives, both available from one pass) needs about 3 passes from beta = 1; a step leaving the bracket is
    replaced by geometric bisection.

    Args:
        batches: a callable returning a fresh iterable of ((n, K) logits, (n,) labels) per pass (one pass per step),
            so the data never need to fit in memory.
        tol: stop when |mean dNLL/dbeta| * beta <= tol or the bracket collapses.

    Returns:
        (T, passes). T is clamped to [1/TS_BETA_MAX, 1/TS_BETA_MIN] when the optimum lies outside (e.g. separable data).

    Raises:
        ValueError: no labelled samples.
    """

    def stats(beta: float) -> tuple[float, float, float]:
        g = h = t = 0.0
        n = 0
        for z, y in batches():
            _, gi, hi, ti, ni = nll_derivatives(z, y, beta)
            g, h, t, n = g + gi, h + hi, t + ti, n + ni
        if n == 0:
            raise ValueError("temperature scaling needs at least one labelled source sample")
        return g / n, h / n, t / n

    lo, hi = TS_BETA_MIN, TS_BETA_MAX
    beta = 1.0
    for it in range(1, max_iter + 1):
        g, h, t = stats(beta)
        if abs(g) * beta <= tol:
            return 1.0 / beta, it
        if g > 0:  # NLL increasing: optimum at smaller beta
            hi = beta
        else:
            lo = beta
        if hi - lo <= 1e-12 * hi:
            return 1.0 / beta, it
        step = np.nan
        if h > 0:
            step = beta - 2.0 * g * h / (2.0 * h * h - g * t)  # Halley
            if not (np.isfinite(step) and lo < step < hi):
                step = beta - g / h  # Newton
        beta = step if np.isfinite(step) and lo < step < hi else float(np.sqrt(lo * hi))
    return 1.0 / beta, max_iter


# ---------------------------------------------------------------------------------------------------------------
# Calibrator classes and their registry
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Calibrator:
    """Base class. Subclasses are dataclasses whose fields are the spec options (`name:field=value`)."""

    name: ClassVar[str] = ""
    #: needs labelled source logits (`fit`) before `temperatures`
    needs_fit: ClassVar[bool] = False
    spec: str = field(default="", repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.spec:
            self.spec = self.name

    def fit(self, *args: Any, **kwargs: Any) -> "Calibrator":
        """Label-free calibrators have nothing to fit; returns self."""
        return self

    def temperatures(self, zs_logits: Any, tta_logits: Any) -> np.ndarray:
        """(N,) float64 effective per-sample temperatures for `tta_logits`."""
        raise NotImplementedError

    def transform(self, zs_logits: Any, tta_logits: Any) -> np.ndarray:
        """Calibrated logits tta_logits / T[:, None], float64."""
        t = self.temperatures(zs_logits, tta_logits)
        return np.asarray(tta_logits, dtype=np.float64) / t[:, None]


@dataclass
class NoCalibration(Calibrator):
    """`none`: the raw adapted logits (T = 1)."""

    name: ClassVar[str] = "none"

    def temperatures(self, zs_logits: Any, tta_logits: Any) -> np.ndarray:
        return np.ones(_as_2d(tta_logits, "tta_logits").shape[0])


@dataclass
class TemperatureScaling(Calibrator):
    """`temperature`: one temperature fitted by NLL on labelled source logits (or fixed with `T`).

    Fit once, e.g. on the ImageNet shards of the same backbone and method, then apply to every target set.
    `T` (spec `temperature:T=1.2`) fixes the temperature and skips the fit.
    """

    name: ClassVar[str] = "temperature"
    needs_fit: ClassVar[bool] = True
    T: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.T is not None:
            self.T = float(self.T)
            if not (np.isfinite(self.T) and self.T > 0):
                raise ValueError(f"temperature T must be finite and > 0, got {self.T}")
            self.temperature_ = self.T
            self.n_iter_ = 0

    @property
    def is_fitted(self) -> bool:
        return hasattr(self, "temperature_")

    def fit(self, logits: Any = None, labels: Any = None, *, batches: Callable[[], Iterable] | None = None) -> "TemperatureScaling":
        """Fit by NLL on labelled logits: in-memory `(logits, labels)` or a streaming `batches` callable."""
        if self.T is not None:
            return self
        if batches is None:
            z, y = _as_2d(logits), np.asarray(labels)
            batches = lambda: [(z, y)]  # noqa: E731
        self.temperature_, self.n_iter_ = fit_temperature(batches)
        return self

    @property
    def at_bound_(self) -> bool:
        """Whether the fitted T sits at a bound of its search range [1/TS_BETA_MAX, 1/TS_BETA_MIN]: the NLL optimum
        lies outside (e.g. source logits that are all wrong), so T is a cap, not a fitted value."""
        t = float(self.temperature_)
        return self.T is None and (t >= (1.0 - 1e-6) / TS_BETA_MIN or t <= (1.0 + 1e-6) / TS_BETA_MAX)

    def describe_fit(self, source: str) -> str:
        """One line for the notes: the fitted T, or that it was capped."""
        t = float(self.temperature_)
        if self.at_bound_:
            return (f"temperature scaling on {source}: T = {t:g} is the bound of its search range "
                    f"[{1 / TS_BETA_MAX:g}, {1 / TS_BETA_MIN:g}], not a fitted optimum (the NLL keeps falling "
                    "beyond it, e.g. all source predictions wrong)")
        return f"temperature scaling fitted on {source}: T = {t:.4f}"

    def temperatures(self, zs_logits: Any, tta_logits: Any) -> np.ndarray:
        if not self.is_fitted:
            raise ValueError("temperature scaling is not fitted: call fit(...) or give T")
        return np.full(_as_2d(tta_logits, "tta_logits").shape[0], float(self.temperature_))


#: SaLS guard: a zero-range row (constant logits) gets T = 1 (its softmax is uniform at every temperature)
SALS_MIN_RANGE = 1e-12


@dataclass
class SaLS(Calibrator):
    """`sals`: per-sample min-max rescaling of the adapted logits onto the zero-shot logit range.

    z' = (z_tta - min z_tta) / range(z_tta) * range(z_zs) + min z_zs, which under softmax equals a per-sample
    temperature T_i = range(z_tta) / range(z_zs). A zero range on either side (constant logits) gives T = 1.
    """

    name: ClassVar[str] = "sals"

    def temperatures(self, zs_logits: Any, tta_logits: Any) -> np.ndarray:
        zs, tta = _as_2d(zs_logits, "zs_logits"), _as_2d(tta_logits, "tta_logits")
        if zs.shape != tta.shape:
            raise ValueError(f"zs_logits and tta_logits must have the same shape; got {zs.shape} and {tta.shape}")
        r_zs = zs.max(axis=1).astype(np.float64) - zs.min(axis=1)
        r_tta = tta.max(axis=1).astype(np.float64) - tta.min(axis=1)
        ok = (r_zs > SALS_MIN_RANGE) & (r_tta > SALS_MIN_RANGE)
        return np.where(ok, r_tta / np.where(ok, r_zs, 1.0), 1.0)


@dataclass
class ZAEC(Calibrator):
    """`zaec`: the paper's Zero-shot-Anchored Entropy Calibration (see `zaec_temperature`).

    Options: `strength` (lambda, default 1.0: full restoration, paper §5 ablation) and `subset` (default
    `reduced`: the paper's method; `all` and `increased` are the corrected-subset ablations).
    After `temperatures(...)`, `capped_` holds the (N,) bool mask of capped samples of that call.
    """

    name: ClassVar[str] = "zaec"
    strength: float = 1.0
    subset: str = "reduced"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.strength = float(self.strength)
        if not 0.0 <= self.strength <= 1.0:
            raise ValueError(f"zaec strength must lie in [0, 1], got {self.strength}")
        if self.subset not in SUBSETS:
            raise ValueError(f"unknown zaec subset {self.subset!r}; valid: {', '.join(SUBSETS)}")

    def temperatures(self, zs_logits: Any, tta_logits: Any) -> np.ndarray:
        sol = solve_zaec(zs_logits, tta_logits, strength=self.strength, subset=self.subset)  # type: ignore[arg-type]
        self.capped_ = sol.capped
        return sol.temperature


#: name -> calibrator class. Adding a calibrator is one class plus one entry here.
CALIBRATORS: dict[str, type[Calibrator]] = {
    c.name: c for c in (NoCalibration, TemperatureScaling, SaLS, ZAEC)
}


def _number(value: str, cls_name: str, key: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"calibrator {cls_name!r}: option {key!r} expects a number, got {value!r}") from None


def parse_calibrator(spec: str) -> Calibrator:
    """Build a calibrator from a spec string `name[:key=value[,key=value...]]`.

    Examples: `none`, `temperature`, `temperature:T=1.2`, `sals`, `zaec`, `zaec:strength=0.5`, `zaec:subset=all`,
    `zaec:strength=0.5,subset=all`. The spec string is the calibrator's name in every output.

    Raises:
        ValueError: unknown name or option (the message lists the valid ones), or a bad value.
    """
    text = spec.strip()
    name, _, opts = text.partition(":")
    name = name.strip()
    if name not in CALIBRATORS:
        raise ValueError(f"unknown calibrator {name!r}; available: {', '.join(CALIBRATORS)}")
    cls = CALIBRATORS[name]
    valid = {f.name: f for f in fields(cls) if f.name != "spec"}
    kwargs: dict[str, Any] = {}
    for item in filter(None, (o.strip() for o in opts.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key not in valid:
            choices = ", ".join(valid) or "none"
            raise ValueError(f"calibrator {name!r} has no option {key!r}; valid options: {choices}")
        if not eq or not value:
            raise ValueError(f"calibrator option {key!r} of {name!r} needs a value ({name}:{key}=VALUE)")
        if key in kwargs:
            raise ValueError(f"calibrator option {key!r} given twice in {spec!r}")
        kwargs[key] = value if isinstance(valid[key].default, str) else _number(value, name, key)
    cal = cls(**kwargs)
    cal.spec = text
    return cal


def parse_calibrators(specs: str | Iterable[str]) -> list[Calibrator]:
    """Parse a comma-free list of specs or one string `a;b` / `a,b` where commas between specs are allowed.

    In a single string, specs are split at commas that start a new known calibrator name, so
    `none,zaec:strength=0.5,subset=all,sals` gives three calibrators. Duplicate specs raise.
    """
    if isinstance(specs, str):
        parts: list[str] = []
        for piece in specs.split(","):
            piece = piece.strip()
            if not piece:
                continue
            head = piece.partition(":")[0].strip()
            if parts and "=" in piece and head not in CALIBRATORS and ":" not in piece:
                parts[-1] += "," + piece  # an option of the previous spec
            else:
                parts.append(piece)
        specs = parts
    cals = [parse_calibrator(s) for s in specs]
    if not cals:
        raise ValueError(f"no calibrator given; available: {', '.join(CALIBRATORS)}")
    seen: set[str] = set()
    for c in cals:
        if c.spec in seen:
            raise ValueError(f"calibrator {c.spec!r} given twice")
        seen.add(c.spec)
    return cals
