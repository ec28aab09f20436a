"""The temperature-scaling fit: one temperature by NLL over labelled logits, streaming. Pure functions over
arrays; the estimator class is `calibrate.calibrators.TemperatureScaling`."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from calibrate.functional.softmax import _as_2d, _centred, _chunks, _cumulants

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
