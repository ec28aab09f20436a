"""Shared slow references and random cases of the calibration tests (tests/calibrate/): entropies from plain sums,
softmax cumulants from `math.fsum`, and zero-shot / adapted logit pairs in mixed regimes."""

from __future__ import annotations

import math

import numpy as np

from calibrate.synthetic import synthetic_logits


def ref_entropies(z: np.ndarray) -> np.ndarray:
    """(n, K) -> (n,) float64 entropies from log-probabilities: log p_j = z_j - logsumexp(z), with the log-sum-exp
    written as m + log1p(sum over the non-top classes of exp(z_j - m)) so that it keeps sums far below eps, and
    H = sum_j p_j * (-log p_j), a sum of non-negative terms: accurate relative to H down to ~1e-300 nats."""
    z = np.atleast_2d(np.asarray(z, dtype=np.float64))
    rows = np.arange(z.shape[0])
    top = z.argmax(axis=1)
    d = z - z[rows, top][:, None]
    rest = np.exp(d)
    rest[rows, top] = 0.0
    log_p = d - np.log1p(rest.sum(axis=1))[:, None]
    return np.sum(np.exp(log_p) * -log_p, axis=1)


def slow_entropy(z: np.ndarray) -> float:
    return float(ref_entropies(z)[0])


def random_pair(rng, n, k, scale=None):
    """Mixed regimes: CLIP-like synthetic logits and raw Gaussian logits of random scales."""
    if rng.random() < 0.5:
        _, zs, tta = synthetic_logits(n, k, rng)
        return zs, tta
    s = scale if scale is not None else 10 ** rng.uniform(-1, 1.5)
    zs = (rng.normal(size=(n, k)) * s).astype(np.float32)
    tta = (zs * np.exp(rng.normal(0.3, 0.6, size=(n, 1))) + rng.normal(size=(n, k))).astype(np.float32)
    return zs, tta


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
