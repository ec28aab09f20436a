"""Metrics beyond ECE for one (run, calibrator): selective prediction and classwise calibration, streamed and
bootstrapped together.

`TrustStats` is what `zaec-calibrate` folds over the shards of a run (columns `TRUST_NAMES`, documented in
docs/calibrate.md "Selective prediction and classwise calibration"); `paired_replicates` is the paired bootstrap of
the same columns for the tables, drawn from the multiplicities the tables' ECE bootstrap uses, so every difference
(between calibrators, with zero-shot, with ECE) is computed per resample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from calibrate.classwise import (
    CLASSWISE_BINS,
    CLASSWISE_NAMES,
    ClasswiseStats,
    classwise_residuals,
    ece_replicates,
    top_label_ece,
    top_label_residuals,
)
from calibrate.selective import SCORES, SELECTIVE_NAMES, SelectiveStats, confidence_score, selective_replicates

TRUST_NAMES: tuple[str, ...] = (*SELECTIVE_NAMES, *CLASSWISE_NAMES)


@dataclass
class TrustStats:
    """Mergeable statistics of `TRUST_NAMES` for one (run, calibrator): update per shard, merge, compute."""

    selective: SelectiveStats = field(default_factory=SelectiveStats)
    classwise: ClasswiseStats = field(default_factory=ClasswiseStats)

    def update(self, logits: Any, temperatures: Any, labels: Any, prediction: Any, confidence: Any,
               entropy: Any) -> "TrustStats":
        """Add a shard: (n, K) logits, scalar or (n,) temperatures, (n,) labels, and the (n,) prediction, confidence
        and entropy of softmax(logits / T) (`calibrate.calibrators.softmax_stats`). Returns self."""
        y = np.asarray(labels, dtype=np.int64)
        self.selective.update(confidence, entropy, np.asarray(prediction) == y)
        self.classwise.update_logits(logits, temperatures, y)
        return self

    def merge(self, other: "TrustStats") -> "TrustStats":
        """Add another partial result. Returns self."""
        self.selective.merge(other.selective)
        self.classwise.merge(other.classwise)
        return self

    def compute(self) -> dict[str, float]:
        """The metrics, keys `TRUST_NAMES`; NaN where undefined (`reasons` says why)."""
        return {**self.selective.compute(), **self.classwise.compute()}

    def reasons(self) -> dict[str, str]:
        """{column: reason} for every undefined column."""
        return {**self.selective.reasons(), **self.classwise.reasons()}


def point_metrics(
    prediction: Any, confidence: Any, entropy: Any, labels: Any, num_classes: int, probs: Any = None
) -> dict[str, float]:
    """`TRUST_NAMES` of one prediction from per-sample arrays (what the tables hold), equal to `TrustStats`.

    Args:
        prediction, confidence, entropy, labels: (N,) arrays of one run and calibrator.
        num_classes: K.
        probs: optional (N, K) probabilities; without them `cw_ece_15w` is NaN (it needs every class's
            probability: fold `ClasswiseStats.update_logits` over the shards instead).
    """
    pred = np.asarray(prediction, dtype=np.int64).reshape(-1)
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    sel = SelectiveStats().update(confidence, entropy, pred == y).compute()
    cw = ClasswiseStats()
    if probs is not None:
        cw.update_probs(probs, y, pred)
        out = cw.compute()
    else:
        out = {CLASSWISE_NAMES[0]: float("nan"),
               CLASSWISE_NAMES[1]: top_label_ece(pred, confidence, pred == y, num_classes) if y.size else float("nan")}
    return {**sel, **out}


def describe_missing(reasons: dict[str, str]) -> str:
    """One line for notes.json: the missing columns grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for col, why in reasons.items():
        by_reason.setdefault(why, []).append(col)
    return "; ".join(f"{', '.join(cols)} missing: {why}" for why, cols in by_reason.items())


def paired_replicates(
    prediction: Any,
    confidence: Any,
    entropy: Any,
    labels: Any,
    num_classes: int,
    counts: Iterable[np.ndarray],
    probs: Sequence[np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Paired bootstrap replicates of `TRUST_NAMES` for C predictions of the same N samples.

    Args:
        prediction, confidence, entropy: (C, N) per prediction (zero-shot, raw, every calibrator).
        labels: (N,) int labels (correct = prediction == labels).
        num_classes: K.
        counts: chunks of (b, N) resample multiplicities, consumed once. Pass the tables' own
            `resample_counts(N, B, dataset_seed(seed, backbone, dataset, sample_id))` so these replicates are paired
            with the ECE replicates of the same runs.
        probs: optional C (N, K) probability arrays for `cw_ece_15w` (N * K values each; see
            `calibrate.classwise.classwise_residuals`); without them that column is absent from the result.

    Returns:
        {column: (C, B) float64}; NaN where a resample leaves a metric undefined (`calibrate.selective.interval`
        leaves those out and counts them).
    """
    pred = np.atleast_2d(np.asarray(prediction))
    conf = np.atleast_2d(np.asarray(confidence, dtype=np.float64))
    ent = np.atleast_2d(np.asarray(entropy, dtype=np.float64))
    c, n = conf.shape
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    corr = pred == y[None, :]
    tl = [top_label_residuals(pred[j], conf[j], corr[j], num_classes) for j in range(c)]
    cw = [classwise_residuals(p, y, CLASSWISE_BINS) for p in probs] if probs is not None else []
    parts: dict[str, list[np.ndarray]] = {}
    for w in counts:
        for s in SCORES:
            for m, v in selective_replicates(confidence_score(s, conf, ent), corr, [w]).items():
                parts.setdefault(f"{m}_{s}", []).append(v)
        parts.setdefault(CLASSWISE_NAMES[1], []).append(ece_replicates(tl, [w]))
        if cw:
            parts.setdefault(CLASSWISE_NAMES[0], []).append(ece_replicates(cw, [w], [float(num_classes)] * c))
    return {k: np.concatenate(v, axis=1) for k, v in parts.items()}
