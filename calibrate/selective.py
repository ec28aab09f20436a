"""Selective prediction and misclassification detection: risk-coverage, AURC, E-AURC, AUROC, FPR at 95% TPR.

A selective classifier accepts the samples whose confidence score is at least a threshold and abstains on the rest.
Two scores are supported (`SCORES`): `msp`, the maximum softmax probability, and `negent`, the negative entropy
-H(p) in nats (higher = more confident for both).

Ties, one rule everywhere: a threshold accepts or rejects a whole group of tied scores, and every number below is
the exact expectation over a uniformly random order of tied samples. For AUROC this is the usual average-rank
(Mann-Whitney) value: a tied (correct, wrong) pair counts 1/2, as in sklearn's `roc_auc_score`.

    AURC   = (1/N) sum_{k=1..N} E_k / k,

the selective risk averaged over the N coverage levels k/N (Geifman et al.'s empirical AURC), where E_k is the
expected number of errors among the k most confident samples: within a tied group of n samples holding e errors,
after k0 samples and E0 errors in front of it, E_{k0+j} = E0 + j e / n (linear inside the group). So AURC is the
mean of the tie-free AURC over all orders of the tied samples; it never depends on the input order.
    E-AURC = AURC - AURC*, with AURC* = (1/N) sum_{k=C+1..N} (k - C) / k the AURC of a score that ranks all C
correct samples first (same N and accuracy).
    AUROC  = P(s_correct > s_wrong) + P(s_correct = s_wrong) / 2 (correct = positive).
    FPR95  = the fraction of wrong samples accepted at the highest threshold that accepts at least 95% of the
correct ones (TPR >= 0.95, compared in integers: 20 * accepted_correct >= 19 * C; no interpolation between
thresholds, as `sklearn.metrics.roc_curve` points at distinct thresholds).

Undefined values are NaN with a reason (`SelectiveStats.reasons`): AUROC and FPR95 need at least one correct and
one wrong sample; every metric needs N >= 1. AURC and E-AURC are defined (0) when nothing is wrong.

Exactness with ties needs the whole ranking, so the streaming state is not a fixed histogram: it is the count of
correct and wrong samples per DISTINCT score (`ScoreCounts`). Merging adds counts of equal scores, so streaming is
exact and order-free; memory is at most 3 values per distinct score, i.e. bounded by the run's N (saturated CLIP
confidences, many exactly 1.0, make it much smaller).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

import numpy as np

Score = Literal["msp", "negent"]
SCORES: tuple[str, ...] = ("msp", "negent")
SELECTIVE_METRICS: tuple[str, ...] = ("aurc", "eaurc", "auroc", "fpr95")
#: metrics.csv columns: metric_score, e.g. `aurc_msp`, `fpr95_negent`
SELECTIVE_NAMES: tuple[str, ...] = tuple(f"{m}_{s}" for s in SCORES for m in SELECTIVE_METRICS)
TPR_LEVEL = (19, 20)  # FPR at TPR >= 19/20 = 95%, compared in integers


def _check_score(score: str) -> str:
    if score not in SCORES:
        raise ValueError(f"unknown confidence score {score!r}; valid: {', '.join(SCORES)}")
    return score


def confidence_score(score: Score, confidence: Any, entropy: Any) -> np.ndarray:
    """The selection score of each sample: `msp` -> confidence, `negent` -> -entropy; float64, input's shape."""
    src = confidence if _check_score(score) == "msp" else entropy
    s = np.asarray(src, dtype=np.float64)
    return s if score == "msp" else -s


def _score_correct(score: Any, correct: Any) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(score, dtype=np.float64).reshape(-1)
    y = np.asarray(correct).reshape(-1).astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"score and correct must have the same length; got {s.shape[0]} and {y.shape[0]}")
    if not np.all(np.isfinite(s)):
        raise ValueError("confidence scores must be finite")
    return s, y


@dataclass(frozen=True)
class ScoreCounts:
    """Correct and wrong counts per distinct score, scores in DESCENDING order (the selection order).

    Attributes:
        score: (G,) float64 distinct scores, strictly decreasing.
        n_ok: (G,) int64 correct samples with that score.
        n_err: (G,) int64 wrong samples with that score.
    """

    score: np.ndarray
    n_ok: np.ndarray
    n_err: np.ndarray

    @staticmethod
    def of(score: Any, correct: Any) -> "ScoreCounts":
        """Group (N,) scores and (N,) correctness by distinct score."""
        s, y = _score_correct(score, correct)
        uniq, inv = np.unique(-s, return_inverse=True)  # ascending in -s = descending in s
        g = uniq.size
        n_ok = np.bincount(inv, weights=y, minlength=g).astype(np.int64)
        n_all = np.bincount(inv, minlength=g).astype(np.int64)
        return ScoreCounts(-uniq, n_ok, n_all - n_ok)

    @staticmethod
    def concat(parts: Iterable["ScoreCounts"]) -> "ScoreCounts":
        """Merge partial counts: equal scores are added (exact)."""
        parts = list(parts)
        if not parts:
            return ScoreCounts(np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64))
        if len(parts) == 1:
            return parts[0]
        s = np.concatenate([p.score for p in parts])
        uniq, inv = np.unique(-s, return_inverse=True)
        g = uniq.size
        ok = np.bincount(inv, weights=np.concatenate([p.n_ok for p in parts]), minlength=g)
        err = np.bincount(inv, weights=np.concatenate([p.n_err for p in parts]), minlength=g)
        # counts are integers below 2**53, so the float64 sums are exact
        return ScoreCounts(-uniq, ok.astype(np.int64), err.astype(np.int64))


def _harmonic(n: int) -> np.ndarray:
    """(n + 1,) harmonic numbers H_0 = 0, H_k = sum_{j<=k} 1/j."""
    h = np.zeros(n + 1)
    if n:
        np.cumsum(1.0 / np.arange(1, n + 1), out=h[1:])
    return h


def selective_from_counts(n_ok: np.ndarray, n_err: np.ndarray) -> dict[str, np.ndarray]:
    """AURC, E-AURC, AUROC and FPR95 from per-group counts (the module docstring's formulas), vectorised.

    Args:
        n_ok, n_err: (..., G) correct / wrong counts of tied groups in descending score order; leading axes are
            independent problems (bootstrap resamples pass (B, G) multiplicity sums; groups may be empty).

    Returns:
        dict of (...) float64 arrays, keys `SELECTIVE_METRICS`; NaN where undefined (N = 0; AUROC/FPR95 without a
        correct or without a wrong sample).

    Example:
        >>> # groups: {ok}, then {ok, wrong} tied; AURC = (0 + (1/2)/2 + 1/3) / 3, AURC* = (1/3)/3
        >>> {k: round(float(v), 4) for k, v in selective_from_counts(np.array([1, 1]), np.array([0, 1])).items()}
        {'aurc': 0.1944, 'eaurc': 0.0833, 'auroc': 0.75, 'fpr95': 1.0}
    """
    ok = np.asarray(n_ok, dtype=np.float64)
    err = np.asarray(n_err, dtype=np.float64)
    if ok.shape[-1] == 0:  # no sample at all
        return {m: np.full(ok.shape[:-1], np.nan) for m in SELECTIVE_METRICS}
    n_g = ok + err
    cum_n = np.cumsum(n_g, axis=-1)
    cum_err = np.cumsum(err, axis=-1)
    n_tot, c_tot, e_tot = cum_n[..., -1], ok.sum(axis=-1), cum_err[..., -1]
    h = _harmonic(int(np.max(n_tot, initial=0)))
    k0 = (cum_n - n_g).astype(np.int64)
    e0 = cum_err - err
    dh = h[k0 + n_g.astype(np.int64)] - h[k0]  # sum_{j=1..n} 1 / (k0 + j)
    # sum_{j=1..n} (e0 + j e / n) / (k0 + j) = e0 dh + (e / n) (n - k0 dh); an empty group adds 0
    frac = np.divide(err, n_g, out=np.zeros_like(err), where=n_g > 0)
    terms = e0 * dh + frac * (n_g - k0 * dh)
    with np.errstate(invalid="ignore", divide="ignore"):
        aurc = np.where(n_tot > 0, terms.sum(axis=-1) / n_tot, np.nan)
        c_int = c_tot.astype(np.int64)
        opt = (e_tot - c_tot * (h[n_tot.astype(np.int64)] - h[c_int])) / n_tot  # (1/N) sum_{k>C} (k - C) / k
        eaurc = np.where(n_tot > 0, aurc - opt, np.nan)
        # AUROC: correct beats every wrong sample with a strictly lower score (later groups), ties count 1/2
        err_below = e_tot[..., None] - cum_err
        auc_num = (ok * (err_below + 0.5 * err)).sum(axis=-1)
        defined = (c_tot > 0) & (e_tot > 0)
        auroc = np.where(defined, auc_num / (c_tot * e_tot), np.nan)
        # FPR95: first group (highest threshold) where the accepted correct reach 95% of all correct
        cum_ok = np.cumsum(ok, axis=-1)
        reach = TPR_LEVEL[1] * cum_ok >= TPR_LEVEL[0] * c_tot[..., None]
        first = np.argmax(reach, axis=-1)
        fpr = np.take_along_axis(cum_err, first[..., None], axis=-1)[..., 0] / e_tot
        fpr95 = np.where(defined, fpr, np.nan)
    return {"aurc": aurc, "eaurc": eaurc, "auroc": auroc, "fpr95": fpr95}


def selective_metrics(score: Any, correct: Any) -> dict[str, float]:
    """AURC, E-AURC, misclassification AUROC and FPR95 of one run (see the module docstring; ties by expectation).

    Args:
        score: (N,) finite confidence scores, higher = more confident (`confidence_score`).
        correct: (N,) bool, prediction == label.

    Example:
        >>> selective_metrics([0.9, 0.9, 0.4], [1, 0, 1])["aurc"]  # k=1: 1/2 expected error, k=2: 1/2, k=3: 1/3
        0.4444444444444444
    """
    return {k: float(v) for k, v in selective_from_counts(*_counts_of(ScoreCounts.of(score, correct))).items()}


def _counts_of(sc: ScoreCounts) -> tuple[np.ndarray, np.ndarray]:
    return sc.n_ok, sc.n_err


@dataclass(frozen=True)
class RiskCoverage:
    """Risk-coverage curve at the distinct thresholds (a tied group is accepted or rejected as a whole).

    Attributes:
        threshold: (G,) float64 scores, decreasing; point g accepts every sample with score >= threshold[g].
        coverage: (G,) float64 accepted fraction, increasing to 1.
        risk: (G,) float64 error rate among the accepted samples.
        oracle_risk: (G,) float64 the lowest risk any score reaches at that coverage: max(0, cov - acc) / cov.
        aurc: float, the module's AURC (mean risk over the N coverage levels k/N, ties by expectation).
    """

    threshold: np.ndarray
    coverage: np.ndarray
    risk: np.ndarray
    oracle_risk: np.ndarray
    aurc: float


def risk_coverage(score: Any, correct: Any) -> RiskCoverage:
    """Risk-coverage curve of one run and calibrator, for figures (pure arrays, nothing drawn).

    Args:
        score: (N,) confidence scores, higher = more confident (`confidence_score`), N >= 1.
        correct: (N,) bool.

    Example:
        >>> rc = risk_coverage([0.9, 0.9, 0.4], [1, 0, 1])
        >>> rc.coverage.tolist(), rc.risk.tolist()
        ([0.6666666666666666, 1.0], [0.5, 0.3333333333333333])
    """
    sc = ScoreCounts.of(score, correct)
    if sc.score.size == 0:
        raise ValueError("risk_coverage needs at least one sample")
    cum_n = np.cumsum(sc.n_ok + sc.n_err)
    n, acc = cum_n[-1], sc.n_ok.sum() / cum_n[-1]
    cov = cum_n / n
    return RiskCoverage(
        threshold=sc.score,
        coverage=cov,
        risk=np.cumsum(sc.n_err) / cum_n,
        oracle_risk=np.maximum(0.0, cov - acc) / cov,
        aurc=float(selective_from_counts(sc.n_ok, sc.n_err)["aurc"]),
    )


#: the oracle curve of a figure is drawn through at most about this many coverage levels (every level k/N below it)
ORACLE_POINTS = 512


def oracle_curve(n: int, n_correct: int, max_points: int = ORACLE_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """The oracle's risk-coverage curve over the WHOLE coverage range: (coverage, risk), float64.

    The oracle accepts every correct sample first, so at coverage k/N its risk is max(0, k - C) / k (C correct of N).
    It is defined at every level k = 1..N whatever the scores are, unlike a run's curve (`risk_coverage`), which
    has points only at its distinct thresholds (ECALP's rows with top probability exactly 1.0 are one tied group,
    so its curve starts at their share). Levels: every k when N <= `max_points`, else an even grid of k in [1, N]
    plus k = C, where the curve bends.

    Example:
        >>> cov, risk = oracle_curve(4, 2)
        >>> cov.tolist(), risk.tolist()
        ([0.25, 0.5, 0.75, 1.0], [0.0, 0.0, 0.3333333333333333, 0.5])
    """
    if n < 1 or not 0 <= n_correct <= n:
        raise ValueError(f"oracle_curve needs N >= 1 and 0 <= C <= N, got N = {n}, C = {n_correct}")
    if n <= max_points:
        k = np.arange(1, n + 1)
    else:
        k = np.unique(np.r_[np.linspace(1, n, max_points).round().astype(np.int64), max(n_correct, 1)])
    k = k.astype(np.float64)
    return k / n, np.maximum(0.0, k - n_correct) / k


@dataclass
class SelectiveStats:
    """Mergeable statistics of one (run, calibrator) for both scores: `update` per chunk, `merge`, `compute`.

    State: `ScoreCounts` per score and chunk (at most 3 values per distinct score; see the module docstring for
    why the exact tie handling cannot use a fixed histogram). Shard-by-shard updates give exactly the one-shot
    result.
    """

    _parts: dict[str, list[ScoreCounts]] = field(default_factory=lambda: {s: [] for s in SCORES}, repr=False)

    def update(self, confidence: Any, entropy: Any, correct: Any) -> "SelectiveStats":
        """Add a chunk: (n,) top-label confidences, entropies (nats) and correctness. Returns self."""
        for s in SCORES:
            self._parts[s].append(ScoreCounts.of(confidence_score(s, confidence, entropy), correct))
        return self

    def merge(self, other: "SelectiveStats") -> "SelectiveStats":
        """Add another partial result. Returns self."""
        for s in SCORES:
            self._parts[s] += other._parts[s]
        return self

    def counts(self, score: Score = "msp") -> ScoreCounts:
        """The merged per-distinct-score counts (compacts the stored chunks)."""
        merged = ScoreCounts.concat(self._parts[_check_score(score)])
        self._parts[score] = [merged]
        return merged

    def compute(self) -> dict[str, float]:
        """The metrics, keys `SELECTIVE_NAMES` (`aurc_msp`, ..., `fpr95_negent`); NaN where undefined."""
        out: dict[str, float] = {}
        for s in SCORES:
            vals = selective_from_counts(*_counts_of(self.counts(s)))
            out.update({f"{m}_{s}": float(vals[m]) for m in SELECTIVE_METRICS})
        return out

    def reasons(self) -> dict[str, str]:
        """Why each undefined (NaN) column of `compute` is missing: {column: reason}; empty when all are defined."""
        sc = self.counts("msp")
        n_ok, n_err = int(sc.n_ok.sum()), int(sc.n_err.sum())
        if n_ok + n_err == 0:
            return {c: "no samples" for c in SELECTIVE_NAMES}
        if n_err == 0 or n_ok == 0:
            why = ("no misclassified sample" if n_err == 0 else "no correctly classified sample") + (
                " (misclassification AUROC/FPR95 need both)")
            return {f"{m}_{s}": why for s in SCORES for m in ("auroc", "fpr95")}
        return {}


def selective_replicates(
    scores: Any, correct: Any, counts: Iterable[np.ndarray]
) -> dict[str, np.ndarray]:
    """Bootstrap replicates of the selective metrics of C predictions of the same N samples, paired.

    Every resample is given as multiplicities (how often each sample was drawn), so passing the same `counts`
    as another bootstrap (for example `calibrate.tables.bootstrap.resample_counts(n, B, dataset_seed(...))`)
    pairs these replicates with that bootstrap's: differences between calibrators, or with ECE, are per resample.
    A sample drawn m times is m tied copies (same score), so ties follow the module's rule.

    Args:
        scores: (C, N) confidence scores (higher = more confident), e.g. zero-shot and every calibrator.
        correct: (C, N) or (N,) bool.
        counts: chunks of (b, N) multiplicities, summing to B resamples.

    Returns:
        {metric: (C, B) float64} for `SELECTIVE_METRICS`; NaN in a resample where the metric is undefined (no wrong
        or no correct sample drawn), which `interval` leaves out.
    """
    return count_replicates(scores, correct, counts, selective_from_counts)


def count_replicates(
    scores: Any, positive: Any, counts: Iterable[np.ndarray],
    from_counts: Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """Bootstrap replicates of any metric of per-group (positive, negative) counts, for C scores of N samples.

    Each resample's tied groups are the distinct scores of the run (a sample drawn m times is m tied copies), their
    counts the multiplicity sums, so `from_counts` (e.g. `selective_from_counts`, `calibrate.ood.ood_from_counts`)
    sees exactly what it would see for the resampled run.

    Args:
        scores: (C, N) scores, higher = more confident.
        positive: (C, N) or (N,) bool (correct, or in-distribution).
        counts: chunks of (b, N) multiplicities, summing to B resamples.
        from_counts: (b, G) positive and negative counts in descending score order -> {metric: (b,) float64}.

    Returns:
        {metric: (C, B) float64}.
    """
    s = np.atleast_2d(np.asarray(scores, dtype=np.float64))
    c, n = s.shape
    y = np.broadcast_to(np.asarray(positive).astype(bool), (c, n))
    # per prediction: descending order and the start of each tied group in it
    plans = []
    for j in range(c):
        _score_correct(s[j], y[j])
        order = np.argsort(-s[j], kind="stable")
        ss = s[j][order]
        starts = np.flatnonzero(np.r_[True, ss[1:] != ss[:-1]]) if n else np.zeros(0, np.int64)
        plans.append((order, starts, y[j][order].astype(np.float64)))
    if n == 0:
        raise ValueError("bootstrap replicates need at least one sample")
    chunks: dict[str, list[np.ndarray]] = {}
    for w in counts:
        w = np.asarray(w, dtype=np.float64)
        per_c: dict[str, list[np.ndarray]] = {}
        for order, starts, ys in plans:
            ws = w[:, order]  # (b, N) in selection order
            ok = np.add.reduceat(ws * ys, starts, axis=1)
            err = np.add.reduceat(ws, starts, axis=1) - ok
            for m, v in from_counts(ok, err).items():
                per_c.setdefault(m, []).append(v)
        for m, v in per_c.items():
            chunks.setdefault(m, []).append(np.stack(v))
    if not chunks:  # no resample: the metric names from an empty problem
        return {m: np.zeros((c, 0)) for m in from_counts(np.zeros((1, 1)), np.zeros((1, 1)))}
    return {m: np.concatenate(v, axis=1) for m, v in chunks.items()}


def interval(estimate: Any, replicates: Any, level: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Basic bootstrap interval [2 t - q_hi, 2 t - q_lo] over the last axis, leaving out NaN replicates.

    The same interval as the tables' ECE (`calibrate.tables.bootstrap.basic_interval`); for a paired difference
    pass `estimate_a - estimate_b` and `replicates_a - replicates_b`.

    Returns:
        (low, high, n_undefined): NaN bounds where every replicate is NaN; n_undefined counts the NaN replicates
        (resamples without a wrong or without a correct sample), to be reported next to the interval.
    """
    r = np.asarray(replicates, dtype=np.float64)
    a = (1.0 - level) / 2.0
    undefined = np.isnan(r).sum(axis=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices give NaN bounds, as documented
        q_lo, q_hi = np.nanquantile(r, [a, 1.0 - a], axis=-1)
    t = np.asarray(estimate, dtype=np.float64)
    return 2 * t - q_hi, 2 * t - q_lo, undefined
