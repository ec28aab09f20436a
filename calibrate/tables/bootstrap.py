"""Paired bootstrap of ECE over samples, vectorised.

ECE over M bins can be written without per-bin means:

    ECE = (1/N) * sum_m | sum_{i in B_m} (correct_i - conf_i) |

so one resample b with multiplicity counts w_b (N,) (sum N) gives ECE_b = (1/N) sum_m |sum_i w_bi r_im| with the
sparse per-sample residual matrix r (N, C*M): r[i, c*M + bin_c(i)] = correct_c(i) - conf_c(i) for calibrator c.
A chunk of resamples is one sparse matrix product counts (B, N) @ r (N, C*M). Zero-shot, raw and every calibrated
prediction of every run sharing a sample set are columns of r, so they are resampled together (paired): a difference
of two ECEs is computed per resample, and its interval accounts for the pairing.

The bin convention is `calibrate.metrics.bin_index` (lo < conf <= hi, conf = 0 in the first bin), the same as the
point estimates of every table.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import scipy.sparse as sp

from calibrate.metrics import bin_index
from calibrate.tables.data import RunSummary
from schemas.shard import RunKey

#: label of the zero-shot prediction among the calibrators of a run
ZERO_SHOT = "zero-shot"
#: resample multiplicities of one chunk hold about this many values (bounds memory at ~16 MB per array)
CHUNK_VALUES = 2_000_000


def residual_matrix(confidence: np.ndarray, correct: np.ndarray, n_bins: int) -> sp.csc_matrix:
    """Sparse (N, C*M) residuals r[i, c*M + bin] = correct - conf for C predictions of the same N samples.

    Args:
        confidence: (C, N) top-label confidences in [0, 1].
        correct: (C, N) or (N,) bool/0-1 correctness.
        n_bins: M equal-width bins.
    """
    conf = np.atleast_2d(np.asarray(confidence, dtype=np.float64))
    c, n = conf.shape
    corr = np.broadcast_to(np.asarray(correct, dtype=np.float64), (c, n))
    cols = np.stack([np.asarray(bin_index(conf[j], n_bins), dtype=np.int64) + j * n_bins for j in range(c)])
    rows = np.broadcast_to(np.arange(n), (c, n))
    return sp.csc_matrix(((corr - conf).ravel(), (rows.ravel(), cols.ravel())), shape=(n, c * n_bins))


def ece_from_bin_sums(sums: np.ndarray, n: int, n_bins: int) -> np.ndarray:
    """(B, C*M) per-bin residual sums -> (B, C) ECE."""
    b = sums.shape[0]
    return np.abs(sums).reshape(b, -1, n_bins).sum(axis=2) / n


def point_ece(residuals: sp.spmatrix, n_bins: int) -> np.ndarray:
    """(C,) ECE of the unresampled data (every count 1)."""
    n = residuals.shape[0]
    return ece_from_bin_sums(np.asarray(residuals.sum(axis=0)).reshape(1, -1), n, n_bins)[0]


def resample_counts(n: int, n_resamples: int, seed: np.random.SeedSequence | int) -> Iterator[np.ndarray]:
    """Multiplicities of `n_resamples` bootstrap resamples of n samples, in chunks of (b, n) float64 arrays.

    Resample j draws n indices uniformly with replacement; its row holds how often each sample was drawn
    (each row sums to n). Deterministic for a given seed and chunking-independent in distribution.
    """
    rng = np.random.default_rng(seed)
    chunk = max(1, min(n_resamples, CHUNK_VALUES // max(n, 1)))
    done = 0
    while done < n_resamples:
        b = min(chunk, n_resamples - done)
        idx = rng.integers(0, n, size=(b, n))
        idx += (np.arange(b) * n)[:, None]
        yield np.bincount(idx.ravel(), minlength=b * n).reshape(b, n).astype(np.float64)
        done += b


def ece_replicates(
    residuals: Sequence[sp.spmatrix], n_bins: int, n_resamples: int, seed: np.random.SeedSequence | int
) -> list[np.ndarray]:
    """Bootstrap ECE replicates of several residual matrices over the same N samples, with shared resamples.

    Args:
        residuals: matrices (N, C_j * M) from `residual_matrix`, all with the same N sample order.
        n_bins: M.
        n_resamples: B.
        seed: the resamples depend only on (seed, N, B).

    Returns:
        one (C_j, B) array of ECE replicates per input matrix.
    """
    if not residuals:
        return []
    n = residuals[0].shape[0]
    if any(r.shape[0] != n for r in residuals):
        raise ValueError("all residual matrices must have the same number of samples")
    widths = [r.shape[1] for r in residuals]
    # (C*M, N) CSR so each chunk is one sparse @ dense product
    rt = sp.hstack(list(residuals), format="csc").T.tocsr()
    out = np.empty((sum(widths) // n_bins, n_resamples))
    done = 0
    for counts in resample_counts(n, n_resamples, seed):
        sums = (rt @ counts.T).T  # (b, sum C*M)
        out[:, done:done + counts.shape[0]] = ece_from_bin_sums(sums, n, n_bins).T
        done += counts.shape[0]
    splits = np.cumsum([w // n_bins for w in widths])[:-1]
    return np.split(out, splits, axis=0)


def percentile_interval(replicates: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval over the last axis: ((1-level)/2, (1+level)/2) quantiles."""
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(replicates, [a, 1.0 - a], axis=-1)
    return lo, hi


def basic_interval(estimate, replicates: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Basic (reverse-percentile) bootstrap interval over the last axis: [2 t - q_hi, 2 t - q_lo].

    Chosen over the percentile and BCa intervals because binned ECE is biased upwards and its resamples are biased
    once more (the interval Kumar, Liang and Ma, "Verified Uncertainty Calibration", NeurIPS 2019, use for
    calibration errors: `bootstrap_uncertainty` of their `calibration` library). The percentile and BCa intervals
    are quantiles of the replicates, so they never reach below the smallest replicate: where every resample's ECE
    exceeds the estimate they miss every smaller true ECE, and BCa's bias correction z0 = Phi^-1(share of
    replicates below t) is then infinite. Simulated (20 bins, confidences Beta(5, 2), 300 data sets, 500 resamples
    each; coverage of the true binned ECE at 95%): N = 400, true ECE 2%: basic 0.79, percentile 0.00, BCa 0.00;
    N = 2000, true ECE 2%: basic 0.89, percentile 0.00, BCa 0.24; N = 400, true ECE 18%: 0.92 / 0.94 / 0.92.

    The price: where the bias exceeds the sampling spread (small ECE, few samples per bin; a fifth of the N = 400
    data sets above), the basic interval lies entirely below its estimate (`2 t - q_lo < t`). That is its statement
    (the true ECE is likely lower than the plug-in estimate), not an error; the tables mark it and give the
    bias-corrected value `bias_corrected` (2 t - median of the replicates, the interval's centre, Kumar et al.'s
    "debiased" estimate). For differences of paired ECEs the two intervals agree.
    """
    q_lo, q_hi = percentile_interval(replicates, level)
    return 2 * np.asarray(estimate) - q_hi, 2 * np.asarray(estimate) - q_lo


def bias_corrected(estimate, replicates: np.ndarray) -> np.ndarray:
    """2 t - median(replicates) over the last axis: the estimate minus the bootstrap's median bias, the centre of
    `basic_interval` (inside it for any level)."""
    return 2 * np.asarray(estimate) - np.median(replicates, axis=-1)


def dataset_seed(seed: int, backbone: str, dataset: str, sample_id: np.ndarray) -> np.random.SeedSequence:
    """Seed of the resamples of one (backbone, dataset, sample set): runs over the same samples share resamples."""
    digest = zlib.crc32(np.ascontiguousarray(sample_id, dtype=np.int64).tobytes())
    return np.random.SeedSequence([seed, zlib.crc32(backbone.encode()), zlib.crc32(dataset.encode()), digest])


@dataclass
class BootstrapResult:
    """ECE replicates (B,) per (run, calibrator); calibrator `zero-shot` is the paired zero-shot prediction.
    Intervals are `basic_interval`s at `level`."""

    n_resamples: int
    seed: int
    n_bins: int
    level: float = 0.95
    replicates: dict[tuple[RunKey, str], np.ndarray] = field(default_factory=dict)
    #: point estimates from the same residuals (equal to the metrics' ECE)
    points: dict[tuple[RunKey, str], float] = field(default_factory=dict)

    def get(self, key: RunKey, calibrator: str) -> np.ndarray | None:
        return self.replicates.get((key, calibrator))


def bootstrap_runs(
    runs: Mapping[RunKey, RunSummary],
    calibrators: Sequence[str],
    *,
    n_bins: int = 20,
    n_resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    on_group: Callable[[str, str, int, int], None] | None = None,
) -> BootstrapResult:
    """Paired bootstrap of ECE for every run and calibrator (those a run has), plus its zero-shot prediction.

    Runs of one (backbone, dataset) over the same sample ids share one set of resamples (so differences between
    methods are paired too); within a run, zero-shot and every calibrator are always paired.
    """
    result = BootstrapResult(n_resamples=n_resamples, seed=seed, n_bins=n_bins, level=level)
    by_set: dict[tuple[str, str, bytes], list[RunSummary]] = {}
    for key in sorted(runs, key=lambda k: (k.backbone, k.dataset, k.method, k.seed)):
        s = runs[key]
        by_set.setdefault((key.backbone, key.dataset, s.sample_id.tobytes()), []).append(s)
    for gi, ((backbone, dataset, _), members) in enumerate(by_set.items()):
        mats, names = [], []
        for s in members:
            cals = [c for c in calibrators if c in s.calibrated]
            conf = np.stack([s.zs_confidence] + [s.calibrated[c].confidence for c in cals])
            corr = np.stack([s.zs_correct] + [s.tta_correct] * len(cals))
            mats.append(residual_matrix(conf, corr, n_bins))
            names.append([ZERO_SHOT] + cals)
        if len(members[0]) == 0:
            continue
        reps = ece_replicates(mats, n_bins, n_resamples, dataset_seed(seed, backbone, dataset, members[0].sample_id))
        for s, mat, cal_names, rep in zip(members, mats, names, reps):
            pts = point_ece(mat, n_bins)
            for j, c in enumerate(cal_names):
                result.replicates[(s.key, c)] = rep[j]
                result.points[(s.key, c)] = float(pts[j])
        if on_group is not None:
            on_group(backbone, dataset, gi + 1, len(by_set))
    return result
