"""Calibration metrics as pure functions over arrays, plus mergeable streaming statistics.

Binning convention (the TTABC benchmark's, also Guo et al.'s): `n_bins` equal-width bins on the top-label
confidence, bin b covers (b/n, (b+1)/n], i.e. membership lo < conf <= hi, and conf == 0 goes to bin 0. So a
confidence exactly on an inner edge belongs to the LOWER bin, and conf == 1.0 belongs to the last bin (no hidden
extra bin as in torchmetrics). Edges are `np.linspace(0, 1, n_bins + 1)` in float64, compared exactly (no `floor(n*c)`
rounding), so 0.3 with 20 bins sits on the edge linspace(0,1,21)[6] = 0.30000000000000004 and falls in bin 5.
netcal and torchmetrics use lo <= conf < hi instead; results agree except for confidences exactly on an edge.

Equal-mass ("adaptive") ECE sorts the confidences and splits them into `n_bins` groups of (nearly) equal count,
never splitting tied confidences: a sample goes to bin floor(r * n_bins / N), where r is the rank of the first
sample with the same confidence. It needs every confidence, so its streaming state keeps the (N,) confidence and
correctness arrays (never logits).

ECE = sum_b (n_b / N) |acc_b - conf_b|; MCE = max over non-empty bins of |acc_b - conf_b|.
All metrics are fractions (multiply by 100 for the paper's percent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Binning = Literal["width", "mass"]
BINNINGS: tuple[str, ...] = ("width", "mass")
DEFAULT_BINS = 20  # TTABC: 20 equal-width bins


def _check_bins(n_bins: int) -> int:
    if int(n_bins) != n_bins or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
    return int(n_bins)


def _check_binning(binning: str) -> str:
    if binning not in BINNINGS:
        raise ValueError(f"unknown binning {binning!r}; valid: {', '.join(BINNINGS)}")
    return binning


def _conf_correct(confidence: Any, correct: Any) -> tuple[np.ndarray, np.ndarray]:
    c = np.asarray(confidence, dtype=np.float64).reshape(-1)
    y = np.asarray(correct).reshape(-1).astype(bool)
    if c.shape != y.shape:
        raise ValueError(f"confidence and correct must have the same length; got {c.shape[0]} and {y.shape[0]}")
    if c.size and (not np.all(np.isfinite(c)) or c.min() < 0 or c.max() > 1):
        raise ValueError("confidence must lie in [0, 1] (finite)")
    return c, y


def bin_index(confidence: Any, n_bins: int = DEFAULT_BINS) -> np.ndarray:
    """Equal-width bin of each confidence: bin b holds lo < conf <= hi, conf == 0 in bin 0 (TTABC convention).

    Args:
        confidence: (N,) float confidences in [0, 1].
        n_bins: number of bins.

    Returns:
        (N,) int64 bin indices in [0, n_bins).

    Example:
        >>> bin_index([0.0, 0.05, 0.0500001, 1.0], 20).tolist()
        [0, 0, 1, 19]
    """
    n_bins = _check_bins(n_bins)
    c = np.asarray(confidence, dtype=np.float64)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    # searchsorted(side="left") counts edges strictly below c: c in (e_b, e_{b+1}] -> b + 1
    return np.clip(np.searchsorted(edges, c, side="left") - 1, 0, n_bins - 1).astype(np.int64)


def mass_bin_index(confidence: Any, n_bins: int = DEFAULT_BINS) -> np.ndarray:
    """Equal-mass bin of each confidence: floor(rank_of_first_tie * n_bins / N); ties never split.

    Example:
        >>> mass_bin_index([0.9, 0.1, 0.5, 0.5], 2).tolist()
        [1, 0, 0, 0]
    """
    n_bins = _check_bins(n_bins)
    c = np.asarray(confidence, dtype=np.float64).reshape(-1)
    if c.size == 0:
        return np.zeros(0, dtype=np.int64)
    first_rank = np.searchsorted(np.sort(c), c, side="left")
    return (first_rank * n_bins // c.size).astype(np.int64)


@dataclass(frozen=True)
class Reliability:
    """Per-bin arrays of a reliability diagram, all (n_bins,): count, mean confidence, accuracy (NaN if empty)."""

    edges: np.ndarray
    count: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray


def _bin_sums(b: np.ndarray, c: np.ndarray, y: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    count = np.bincount(b, minlength=n_bins).astype(np.int64)
    conf = np.bincount(b, weights=c, minlength=n_bins)
    acc = np.bincount(b, weights=y.astype(np.float64), minlength=n_bins)
    return count, conf, acc


def _ece_from_sums(count: np.ndarray, conf: np.ndarray, acc: np.ndarray) -> tuple[float, float]:
    n = count.sum()
    if n == 0:
        return float("nan"), float("nan")
    gap = np.abs(acc - conf)  # = count * |acc_b - conf_b|
    nz = count > 0
    return float(gap.sum() / n), float((gap[nz] / count[nz]).max())


def _sums(confidence: Any, correct: Any, n_bins: int, binning: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n_bins, binning = _check_bins(n_bins), _check_binning(binning)
    c, y = _conf_correct(confidence, correct)
    b = bin_index(c, n_bins) if binning == "width" else mass_bin_index(c, n_bins)
    return _bin_sums(b, c, y, n_bins)


def ece(confidence: Any, correct: Any, n_bins: int = DEFAULT_BINS, binning: Binning = "width") -> float:
    """Expected calibration error: sum_b (n_b / N) |acc_b - conf_b| (a fraction; NaN for N = 0).

    Args:
        confidence: (N,) top-label confidences in [0, 1].
        correct: (N,) bool, prediction == label.
        n_bins: number of bins (default 20, TTABC).
        binning: "width" (lo < conf <= hi, conf = 0 in bin 0) or "mass" (equal count, ties kept together).

    Example:
        >>> ece([0.95, 1.0], [1, 0], n_bins=10)
        0.475
    """
    return _ece_from_sums(*_sums(confidence, correct, n_bins, binning))[0]


def mce(confidence: Any, correct: Any, n_bins: int = DEFAULT_BINS, binning: Binning = "width") -> float:
    """Maximum calibration error: max over non-empty bins of |acc_b - conf_b| (same binning as `ece`)."""
    return _ece_from_sums(*_sums(confidence, correct, n_bins, binning))[1]


def reliability(confidence: Any, correct: Any, n_bins: int = DEFAULT_BINS) -> Reliability:
    """Per-bin count, mean confidence and accuracy (equal-width bins, the `bin_index` convention) for plots.

    Empty bins have count 0 and NaN confidence/accuracy (a plot shows them as empty, not as zero bars).
    """
    count, conf, acc = _sums(confidence, correct, n_bins, "width")
    with np.errstate(invalid="ignore", divide="ignore"):
        return Reliability(np.linspace(0.0, 1.0, n_bins + 1), count, conf / count, acc / count)


# ---------------------------------------------------------------------------------------------------------------
# Streaming statistics
# ---------------------------------------------------------------------------------------------------------------

METRIC_NAMES: tuple[str, ...] = (
    "n", "accuracy", "ece", "mce", "ece_mass", "nll", "brier", "mean_confidence", "mean_entropy",
)


@dataclass
class CalibrationStats:
    """Mergeable sufficient statistics of one (group, calibrator): `update` per chunk, `merge`, `compute`.

    Holds per-bin counts and sums (equal-width ECE/MCE), sums of correctness, NLL, Brier, confidence and entropy,
    and, for equal-mass ECE (which needs every confidence), the (N,) confidence and correctness chunks.
    Shard-by-shard updates give the same numbers as one update on everything (sums in float64; the equal-mass part
    is computed on the concatenated arrays).
    """

    n_bins: int = DEFAULT_BINS
    #: binning of the `ece` and `mce` outputs ("mass" needs keep_confidences); `ece_mass` is always equal-mass
    binning: str = "width"
    keep_confidences: bool = True
    count: np.ndarray = field(init=False)
    conf_sum: np.ndarray = field(init=False)
    acc_sum: np.ndarray = field(init=False)
    n: int = field(default=0, init=False)
    sums: dict[str, float] = field(init=False)
    _conf: list[np.ndarray] = field(default_factory=list, init=False, repr=False)
    _correct: list[np.ndarray] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.n_bins = _check_bins(self.n_bins)
        _check_binning(self.binning)
        if self.binning == "mass" and not self.keep_confidences:
            raise ValueError("equal-mass binning needs keep_confidences=True")
        self.count = np.zeros(self.n_bins, dtype=np.int64)
        self.conf_sum = np.zeros(self.n_bins)
        self.acc_sum = np.zeros(self.n_bins)
        self.sums = {"correct": 0.0, "nll": 0.0, "brier": 0.0, "confidence": 0.0, "entropy": 0.0}

    def update(
        self, confidence: Any, correct: Any, nll: Any, brier: Any, entropy: Any
    ) -> "CalibrationStats":
        """Add a chunk of per-sample values ((n,) arrays each). Returns self."""
        c, y = _conf_correct(confidence, correct)
        parts = {"nll": nll, "brier": brier, "entropy": entropy}
        arrs = {k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in parts.items()}
        for k, v in arrs.items():
            if v.shape != c.shape:
                raise ValueError(f"{k} must have length {c.shape[0]}, got {v.shape[0]}")
        count, conf, acc = _bin_sums(bin_index(c, self.n_bins), c, y, self.n_bins)
        self.count += count
        self.conf_sum += conf
        self.acc_sum += acc
        self.n += int(c.size)
        self.sums["correct"] += float(y.sum())
        self.sums["confidence"] += float(c.sum())
        for k, v in arrs.items():
            self.sums[k] += float(v.sum())
        if self.keep_confidences:
            self._conf.append(c)
            self._correct.append(y)
        return self

    def merge(self, other: "CalibrationStats") -> "CalibrationStats":
        """Add another partial result (same n_bins). Returns self."""
        if (other.n_bins, other.binning) != (self.n_bins, self.binning):
            raise ValueError(
                f"cannot merge statistics with {other.n_bins} {other.binning} bins into {self.n_bins} {self.binning} bins"
            )
        self.count += other.count
        self.conf_sum += other.conf_sum
        self.acc_sum += other.acc_sum
        self.n += other.n
        for k, v in other.sums.items():
            self.sums[k] += v
        self._conf += other._conf
        self._correct += other._correct
        self.keep_confidences = self.keep_confidences and other.keep_confidences
        return self

    def compute(self) -> dict[str, float]:
        """The metrics (fractions; NaN when n = 0): keys `METRIC_NAMES`."""
        n = self.n
        e, m = _ece_from_sums(self.count, self.conf_sum, self.acc_sum)
        em = float("nan")
        if self.keep_confidences and n:
            c_all, y_all = np.concatenate(self._conf), np.concatenate(self._correct)
            em, mm = _ece_from_sums(*_sums(c_all, y_all, self.n_bins, "mass"))
            if self.binning == "mass":
                e, m = em, mm
        div = (lambda k: self.sums[k] / n) if n else (lambda k: float("nan"))
        return {
            "n": n,
            "accuracy": div("correct"),
            "ece": e,
            "mce": m,
            "ece_mass": em,
            "nll": div("nll"),
            "brier": div("brier"),
            "mean_confidence": div("confidence"),
            "mean_entropy": div("entropy"),
        }
