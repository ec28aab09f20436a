"""Softmax kernels: entropy, prediction, confidence, NLL and Brier of softmax(logits / T), and the moments of the
logits under the softmax that the ZAEC solve and the temperature fit need. Pure functions over arrays.

All computations run in float64 on row chunks (bounded memory) and subtract the row maximum before `exp`, so they
are exact and stable for logits of any magnitude (1e4 included). Entropies are accurate to a few float64 eps
*relative* to their value, down to about 1e-300 nats (see `entropy_from_logits`), which is what lets ZAEC solve
confident samples exactly.

The helpers with a leading underscore are shared by the kernels of this package (`calibrate.functional.zaec`,
`calibrate.functional.temperature`) and by the estimator classes in `calibrate.calibrators`; they are not part of
the public interface.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator

import numpy as np

#: rows per chunk are chosen so that one (rows, K) float64 temporary holds about this many elements
CHUNK_ELEMENTS = 1 << 17


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


def adapted_stats(logits: Any, temperatures: Any, labels: Any, output_kind: str) -> SoftmaxStats:
    """`softmax_stats` of a run's adapted rows; for log-probability rows (`zaec:output_kind` "log_probs") at
    T = 1 everywhere, the confidence and entropy of the probabilities as stored (`stored_probability_stats`).

    Why: re-normalising stored float32 log-probabilities in float64 makes a row's top probability depend on the
    rounding of every other entry, so probabilities the method made equal (ZERO's vote fractions 17/19) split into
    distinct values and the tie-exact metrics (`calibrate.selective`) would average over rounding noise. At T ≠ 1
    the probabilities are new ones (softmax(log p / T)), computed as for logits.

    Args:
        logits: (N, K) stored rows; temperatures: scalar or (N,); labels: optional (N,);
        output_kind: "logits" or "log_probs" (`schemas.shard.OUTPUT_KINDS`).
    """
    s = softmax_stats(logits, temperatures, labels)
    if output_kind == "log_probs" and bool(np.all(np.asarray(temperatures) == 1.0)):
        s = stored_probability_stats(logits, s)
    return s


def stored_probability_stats(log_probs: Any, stats: SoftmaxStats) -> SoftmaxStats:
    """`stats` with the confidence and entropy of log-probability rows taken as stored, without re-normalising:
    confidence = exp(max_k lp_k), entropy = -Σ_k exp(lp_k)·lp_k summed over the row sorted ascending.

    Each is a function of the row's values alone (the entropy of its multiset of values), so two rows holding the
    same stored probabilities in any order get bit-identical confidences and entropies; a method that rounds equal
    probabilities to the same float32 log (ZERO: `extract.methods.zero.log_vote_fractions`) keeps its ties. The
    stored rows sum to 1 within float32 rounding (a few 1e-7 relative), which is how far these values can be
    from the re-normalised ones. Prediction, NLL and Brier stay those of `stats`.

    Args:
        log_probs: (N, K) log-probabilities (float32 or float64, finite).
        stats: `softmax_stats(log_probs, 1.0, ...)` of the same rows.

    Returns:
        SoftmaxStats with confidence in (0, 1] and entropy >= 0, float64.

    Example:
        >>> lp = np.log(np.array([[17, 1, 1], [17, 2, 0.5]], dtype=np.float64) / np.array([[19.0], [19.5]]))
        >>> s = stored_probability_stats(lp, softmax_stats(lp))
        >>> bool(s.confidence[0] == np.exp(lp[0, 0]))
        True
    """
    x = _as_2d(log_probs, "log_probs")
    n, k = x.shape
    conf = np.empty(n, dtype=np.float64)
    ent = np.empty(n, dtype=np.float64)
    for sl in _chunks(n, k):
        z = np.sort(x[sl].astype(np.float64), axis=1)
        conf[sl] = np.minimum(np.exp(z[:, -1]), 1.0)
        ent[sl] = np.maximum(-(np.exp(z) * z).sum(axis=1), 0.0)
    return replace(stats, confidence=conf, entropy=ent)


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
