"""Classwise and top-label ECE, streamed as per-(class, bin) sums; sparse residuals for their paired bootstrap.

Both use the literature's 15 equal-width bins (Kull et al. 2019 and Nixon et al. 2019 report 15; the column names
carry it: `cw_ece_15w`, `tl_ece_15w`) and the top-label ECE's bin convention, `calibrate.metrics.bin_index`:
bin b holds b/15 < p <= (b+1)/15, p = 0 in bin 0, p = 1 in the last bin.

Classwise ECE (Kull et al.'s classwise-ECE; equal to Nixon et al.'s static calibration error, SCE): every class k is
a binary problem, probability p_ik against 1[y_i = k], binned on p_ik:

    cw_ece = (1/K) sum_k sum_b (n_kb / N) |freq_kb - conf_kb|
           = (1/(K N)) sum_{k,b} |sum_{i: p_ik in b} (1[y_i = k] - p_ik)|

Top-label ECE (Gupta & Ramdas 2021): the top-label confidence binned separately within each predicted class,

    tl_ece = sum_k sum_b (n_kb / N) |acc_kb - conf_kb|,  (k = predicted class, b = bin of the confidence)

i.e. the usual ECE with K * 15 bins. It is never below the usual 15-bin ECE (triangle inequality). Equal-mass
variants (Nixon's ACE/TACE) are not computed: they sort all N * K probabilities of a run, which for ImageNet
(50,000 x 1,000) is 400 MB per calibrator.

State per (run, calibrator): three (K, 15) arrays per metric, exact to float64 summation order, so shard-by-shard
equals one-shot and merging adds arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import scipy.sparse as sp

from calibrate.metrics import bin_index

CLASSWISE_BINS = 15  # Kull et al. 2019, Nixon et al. 2019: 15 equal-width bins
CLASSWISE_NAMES: tuple[str, ...] = (f"cw_ece_{CLASSWISE_BINS}w", f"tl_ece_{CLASSWISE_BINS}w")
#: probabilities are formed this many values at a time (bounds the float64 (n, K) temporaries at 16 MB)
CHUNK_VALUES = 2**21


def _row_chunks(n: int, k: int) -> Iterable[slice]:
    step = max(1, CHUNK_VALUES // max(k, 1))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def softmax_probs(logits: Any, temperatures: Any = 1.0) -> np.ndarray:
    """softmax(logits / T) in float64, rows summing to 1: (N, K) logits, scalar or (N,) T > 0."""
    z = np.array(logits, dtype=np.float64)  # a fresh array: the steps below work in place (the same operations)
    t = np.broadcast_to(np.asarray(temperatures, dtype=np.float64), (z.shape[0],))
    z -= z.max(axis=1, keepdims=True)
    z /= t[:, None]
    np.exp(z, out=z)
    z /= z.sum(axis=1, keepdims=True)
    return z


@dataclass
class ClasswiseStats:
    """Per-(class, bin) sums for classwise and top-label ECE of one (run, calibrator): update, merge, compute.

    The number of classes K is fixed by the first update; `n_bins` defaults to 15 (the column names' binning).
    """

    n_bins: int = CLASSWISE_BINS
    num_classes: int | None = None
    n: int = 0
    #: classwise: (K, M) count, sum of p_ik, sum of 1[y_i = k] over samples whose p_ik falls in bin b
    cw_count: np.ndarray | None = field(default=None, repr=False)
    cw_prob: np.ndarray | None = field(default=None, repr=False)
    cw_label: np.ndarray | None = field(default=None, repr=False)
    #: top-label: (K, M) sum of confidence and of correctness, by predicted class and confidence bin
    tl_conf: np.ndarray | None = field(default=None, repr=False)
    tl_acc: np.ndarray | None = field(default=None, repr=False)

    def _init(self, k: int) -> None:
        if self.num_classes is None or self.cw_count is None:
            self.num_classes = int(k)
            shape = (self.num_classes, self.n_bins)
            self.cw_count = np.zeros(shape, dtype=np.int64)
            self.cw_prob, self.cw_label, self.tl_conf, self.tl_acc = (np.zeros(shape) for _ in range(4))
        elif k != self.num_classes:
            raise ValueError(f"expected {self.num_classes} classes, got {k}")

    def update_probs(self, probs: Any, labels: Any, prediction: Any = None) -> "ClasswiseStats":
        """Add a chunk of (n, K) probabilities and (n,) int labels; `prediction` defaults to the row arg-max.

        Pass the logits' arg-max as `prediction` when it is known, so that the top-label ECE uses exactly the
        predictions of the other metrics. Returns self.
        """
        p = np.asarray(probs, dtype=np.float64)
        if p.ndim != 2:
            raise ValueError(f"probs must be (n, K), got shape {p.shape}")
        n, k = p.shape
        y = np.asarray(labels, dtype=np.int64).reshape(-1)
        pred = p.argmax(axis=1) if prediction is None else np.asarray(prediction, dtype=np.int64).reshape(-1)
        if y.shape != (n,) or pred.shape != (n,):
            raise ValueError(f"labels and prediction must have shape ({n},)")
        if n and (y.min() < 0 or y.max() >= k):
            raise ValueError(f"labels must lie in [0, {k})")
        self._init(k)
        m, size = self.n_bins, k * self.n_bins
        rows = np.arange(n)
        first_edge = np.linspace(0.0, 1.0, m + 1)[1]
        for sl in _row_chunks(n, k):
            pc = p[sl]
            # bin 0 (p <= 1/M) holds almost every probability when K is large: bin only the others (at most M - 1
            # per row) and give bin 0 the rest of each class's count and probability sum
            r, cls = np.nonzero(pc > first_edge)
            vals = pc[r, cls]
            idx = cls * m + bin_index(vals, m)
            count = np.bincount(idx, minlength=size).reshape(k, m)
            prob = np.bincount(idx, weights=vals, minlength=size).reshape(k, m)
            count[:, 0] = pc.shape[0] - count[:, 1:].sum(axis=1)
            prob[:, 0] = pc.sum(axis=0) - prob[:, 1:].sum(axis=1)
            self.cw_count += count
            self.cw_prob += prob
            yl = y[sl]
            hit = yl * m + bin_index(pc[rows[: pc.shape[0]], yl], m)
            self.cw_label += np.bincount(hit, minlength=size).reshape(k, m)
        conf = p[rows, pred]
        self._update_top_label(pred, conf, pred == y)
        self.n += n
        return self

    def update_logits(self, logits: Any, temperatures: Any, labels: Any) -> "ClasswiseStats":
        """Add a chunk of (n, K) logits divided by scalar or (n,) temperatures (prediction = logits' arg-max)."""
        z = np.asarray(logits)
        n, k = z.shape
        t = np.broadcast_to(np.asarray(temperatures, dtype=np.float64), (n,))
        y = np.asarray(labels, dtype=np.int64).reshape(-1)
        for sl in _row_chunks(n, k):
            self.update_probs(softmax_probs(z[sl], t[sl]), y[sl], z[sl].argmax(axis=1))
        return self

    def _update_top_label(self, pred: np.ndarray, conf: np.ndarray, correct: np.ndarray) -> None:
        size = self.tl_conf.size
        idx = pred * self.n_bins + bin_index(conf, self.n_bins)
        self.tl_conf += np.bincount(idx, weights=conf, minlength=size).reshape(self.tl_conf.shape)
        self.tl_acc += np.bincount(idx, weights=correct.astype(np.float64), minlength=size).reshape(self.tl_acc.shape)

    def merge(self, other: "ClasswiseStats") -> "ClasswiseStats":
        """Add another partial result (same bins and classes). Returns self."""
        if other.n_bins != self.n_bins:
            raise ValueError(f"cannot merge {other.n_bins}-bin statistics into {self.n_bins}-bin statistics")
        if other.cw_count is None:
            return self
        self._init(other.num_classes)
        self.n += other.n
        for name in ("cw_count", "cw_prob", "cw_label", "tl_conf", "tl_acc"):
            getattr(self, name).__iadd__(getattr(other, name))
        return self

    def compute(self) -> dict[str, float]:
        """`cw_ece_15w` and `tl_ece_15w` (fractions; NaN for N = 0)."""
        if not self.n:
            return {c: float("nan") for c in CLASSWISE_NAMES}
        cw = float(np.abs(self.cw_label - self.cw_prob).sum() / (self.n * self.num_classes))
        tl = float(np.abs(self.tl_acc - self.tl_conf).sum() / self.n)
        return dict(zip(CLASSWISE_NAMES, (cw, tl)))

    def reasons(self) -> dict[str, str]:
        """Why an undefined column is missing: {column: reason} (only N = 0)."""
        return {c: "no samples" for c in CLASSWISE_NAMES} if not self.n else {}


def classwise_ece(probs: Any, labels: Any, n_bins: int = CLASSWISE_BINS) -> float:
    """Classwise ECE of (N, K) probabilities and (N,) labels (module docstring formula).

    Example:
        >>> # class 0: residuals 1 - 0.75 and 1 - 0.35 in two bins; class 1: -0.25 and -0.65; (0.9 + 0.9) / (N K)
        >>> round(classwise_ece([[0.75, 0.25], [0.35, 0.65]], [0, 0], n_bins=10), 12)
        0.45
    """
    return ClasswiseStats(n_bins).update_probs(probs, labels).compute()[CLASSWISE_NAMES[0]]


def top_label_ece(
    prediction: Any, confidence: Any, correct: Any, num_classes: int, n_bins: int = CLASSWISE_BINS
) -> float:
    """Top-label ECE of (N,) predictions, top-label confidences and correctness (module docstring formula)."""
    r = top_label_residuals(prediction, confidence, correct, num_classes, n_bins)
    n = r.shape[0]
    return float(np.abs(np.asarray(r.sum(axis=0))).sum() / n) if n else float("nan")


def top_label_residuals(
    prediction: Any, confidence: Any, correct: Any, num_classes: int, n_bins: int = CLASSWISE_BINS
) -> sp.csr_matrix:
    """Sparse (N, K * M) residuals: r[i, pred_i * M + bin(conf_i)] = correct_i - conf_i (N nonzeros).

    Top-label ECE = sum over columns of |column sum| / N, so a resample with multiplicities w gives
    |w @ r| summed / N (`ece_replicates`).
    """
    pred = np.asarray(prediction, dtype=np.int64).reshape(-1)
    conf = np.asarray(confidence, dtype=np.float64).reshape(-1)
    corr = np.asarray(correct, dtype=np.float64).reshape(-1)
    if not (pred.shape == conf.shape == corr.shape):
        raise ValueError("prediction, confidence and correct must have the same length")
    if pred.size and (pred.min() < 0 or pred.max() >= num_classes):
        raise ValueError(f"predictions must lie in [0, {num_classes})")
    cols = pred * n_bins + bin_index(conf, n_bins)
    n = pred.size
    return sp.csr_matrix((corr - conf, (np.arange(n), cols)), shape=(n, num_classes * n_bins))


def classwise_residuals(probs: Any, labels: Any, n_bins: int = CLASSWISE_BINS) -> sp.csr_matrix:
    """Sparse (N, K * M) residuals r[i, k * M + bin(p_ik)] = 1[y_i = k] - p_ik (N * K nonzeros).

    Classwise ECE = sum over columns of |column sum| / (N K). Memory is N * K values (ImageNet: 50 M, 600 MB),
    so the bootstrap of classwise ECE is meant for runs with few classes or a subset of runs.
    """
    p = np.asarray(probs, dtype=np.float64)
    n, k = p.shape
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    res = -p.copy()
    res[np.arange(n), y] += 1.0
    cols = (np.arange(k) * n_bins)[None, :] + bin_index(p, n_bins)
    rows = np.broadcast_to(np.arange(n)[:, None], (n, k))
    return sp.csr_matrix((res.ravel(), (rows.ravel(), cols.ravel())), shape=(n, k * n_bins))


def ece_replicates(
    residuals: Sequence[sp.spmatrix], counts: Iterable[np.ndarray], scales: Sequence[float] | None = None
) -> np.ndarray:
    """Bootstrap replicates sum_cols |w @ r| / (N * scale) of C residual matrices over the same N samples, paired.

    Args:
        residuals: C sparse (N, *) matrices (`top_label_residuals`: scale 1; `classwise_residuals`: scale K).
        counts: chunks of (b, N) multiplicities (e.g. `calibrate.tables.bootstrap.resample_counts` with the tables'
            seed, so that these replicates are paired with every other bootstrap drawn from the same counts).
        scales: per-matrix divisor besides N (default 1).

    Returns:
        (C, B) float64 replicates.
    """
    n = residuals[0].shape[0] if residuals else 0
    if any(r.shape[0] != n for r in residuals):
        raise ValueError("all residual matrices must have the same number of samples")
    scales = [1.0] * len(residuals) if scales is None else list(scales)
    rts = [sp.csr_matrix(r.T) for r in residuals]  # (cols, N): one sparse @ dense product per chunk
    out: list[np.ndarray] = []
    for w in counts:
        w = np.asarray(w, dtype=np.float64)
        out.append(np.stack([np.abs(rt @ w.T).sum(axis=0) / (n * s) for rt, s in zip(rts, scales)]))
    return np.concatenate(out, axis=1) if out else np.zeros((len(residuals), 0))
