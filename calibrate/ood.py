"""In- vs out-of-distribution detection from the confidence of an OOD run: AUROC, FPR at 95% TPR, AUPR.

An OOD run (docs/contract.md, "Out-of-distribution runs") mixes in-distribution rows (labels in [0, K)) and
out-of-distribution rows (label -1), all classified with the in-distribution set's class names. A detector accepts a
row as in-distribution when its score is at least a threshold. Convention, as in MCM (Ming et al., 2022) and the
maximum-softmax baseline (Hendrycks and Gimpel, 2017): **in-distribution is the positive class**, the score is the
confidence (`msp`: max softmax probability; `negent`: negative entropy, `calibrate.selective.SCORES`), higher = more
in-distribution.

    AUROC = P(s_id > s_ood) + P(s_id = s_ood) / 2   (average ranks for ties, as sklearn's `roc_auc_score`)
    FPR95 = the fraction of OOD rows accepted at the highest threshold that accepts at least 95% of the
            in-distribution rows (20 * accepted_id >= 19 * N_id, in integers; no interpolation), lower is better
    AUPR  = average precision with in-distribution positive ("AUPR-In"): sum over the distinct thresholds t, in
            decreasing order, of (recall(t) - recall(t_prev)) * precision(t), as sklearn's
            `average_precision_score` (a tied group is accepted whole, its precision the one at its threshold)

AUROC and FPR95 are `calibrate.selective.selective_from_counts` with "correct" read as "in-distribution": the same
tie rule and the same streaming state (`ScoreCounts`: counts per distinct score, exact and mergeable). All three need
at least one row of each kind; otherwise they are NaN with a reason (`OODStats.reasons`), never a made-up number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from calibrate.selective import SCORES, ScoreCounts, confidence_score, count_replicates, selective_from_counts

OOD_METRICS: tuple[str, ...] = ("auroc", "fpr95", "aupr")
#: metrics.csv columns: ood_metric_score, e.g. `ood_auroc_msp`, `ood_aupr_negent`
OOD_NAMES: tuple[str, ...] = tuple(f"ood_{m}_{s}" for s in SCORES for m in OOD_METRICS)
#: why the OOD columns of a plain (not OOD) run are missing: one note for all such runs, not one per run
NOT_OOD = "not an OOD run (no 'zaec:ood_for' in its shards; docs/contract.md, \"Out-of-distribution runs\")"


def ood_from_counts(n_id: Any, n_ood: Any) -> dict[str, np.ndarray]:
    """AUROC, FPR95 and AUPR (in-distribution positive) from per-group counts in descending score order.

    Args:
        n_id, n_ood: (..., G) in-distribution / out-of-distribution counts of tied groups, highest score first;
            leading axes are independent problems (bootstrap multiplicity sums; groups may be empty).

    Returns:
        dict of (...) float64 arrays, keys `OOD_METRICS`; NaN where a kind of row is absent.

    Example:
        >>> # scores 0.9 (ID), 0.5 (ID and OOD tied), 0.1 (OOD); AUPR = 1/2 * 1 + 1/2 * 2/3
        >>> {k: round(float(v), 4) for k, v in ood_from_counts(np.array([1, 1, 0]), np.array([0, 1, 1])).items()}
        {'auroc': 0.875, 'fpr95': 0.5, 'aupr': 0.8333}
    """
    pos = np.asarray(n_id, dtype=np.float64)
    neg = np.asarray(n_ood, dtype=np.float64)
    sel = selective_from_counts(pos, neg)
    if pos.shape[-1] == 0:
        return {"auroc": sel["auroc"], "fpr95": sel["fpr95"], "aupr": np.full(pos.shape[:-1], np.nan)}
    cum_pos = np.cumsum(pos, axis=-1)
    cum_all = cum_pos + np.cumsum(neg, axis=-1)
    precision = np.divide(cum_pos, cum_all, out=np.zeros_like(cum_pos), where=cum_all > 0)
    p_tot, n_tot = cum_pos[..., -1], neg.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        # an empty group (pos = 0) adds no recall, so its undefined precision never counts
        aupr = np.where((p_tot > 0) & (n_tot > 0), (pos * precision).sum(axis=-1) / p_tot, np.nan)
    return {"auroc": sel["auroc"], "fpr95": sel["fpr95"], "aupr": aupr}


def ood_metrics(score: Any, in_distribution: Any) -> dict[str, float]:
    """AUROC, FPR95 and AUPR of one score over the rows of an OOD run (see the module docstring).

    Args:
        score: (N,) finite scores, higher = more in-distribution (`calibrate.selective.confidence_score`).
        in_distribution: (N,) bool, True for in-distribution rows (label >= 0).

    Example:
        >>> ood_metrics([0.9, 0.5, 0.5, 0.1], [True, True, False, False])["auroc"]
        0.875
    """
    sc = ScoreCounts.of(score, in_distribution)
    return {k: float(v) for k, v in ood_from_counts(sc.n_ok, sc.n_err).items()}


@dataclass
class OODStats:
    """Mergeable statistics of `OOD_NAMES` for one (OOD run, prediction): `update` per shard, `merge`, `compute`.

    State: `ScoreCounts` per score (in-distribution counted as `n_ok`, out-of-distribution as `n_err`), at most 3
    values per distinct score; shard-by-shard updates give exactly the one-pass result.
    """

    _parts: dict[str, list[ScoreCounts]] = field(default_factory=lambda: {s: [] for s in SCORES}, repr=False)

    def update(self, confidence: Any, entropy: Any, in_distribution: Any) -> "OODStats":
        """Add a chunk: (n,) top-label confidences, entropies (nats) and the in-distribution flags. Returns self."""
        for s in SCORES:
            self._parts[s].append(ScoreCounts.of(confidence_score(s, confidence, entropy), in_distribution))
        return self

    def merge(self, other: "OODStats") -> "OODStats":
        """Add another partial result. Returns self."""
        for s in SCORES:
            self._parts[s] += other._parts[s]
        return self

    def counts(self, score: str = "msp") -> ScoreCounts:
        """The merged per-distinct-score counts (compacts the stored chunks)."""
        merged = ScoreCounts.concat(self._parts[score])
        self._parts[score] = [merged]
        return merged

    def compute(self) -> dict[str, float]:
        """The metrics, keys `OOD_NAMES`; NaN where undefined (`reasons` says why)."""
        out: dict[str, float] = {}
        for s in SCORES:
            sc = self.counts(s)
            out.update({f"ood_{m}_{s}": float(v) for m, v in ood_from_counts(sc.n_ok, sc.n_err).items()})
        return out

    def reasons(self) -> dict[str, str]:
        """{column: reason} for every undefined column of `compute`; empty when all are defined."""
        sc = self.counts("msp")
        n_id, n_ood = int(sc.n_ok.sum()), int(sc.n_err.sum())
        if n_id and n_ood:
            return {}
        if not n_id and not n_ood:
            why = "no samples"
        elif not n_ood:
            why = "no out-of-distribution row (label -1) in the run: detection needs both kinds"
        else:
            why = "no in-distribution row in the run: detection needs both kinds"
        return {c: why for c in OOD_NAMES}


def missing_ood() -> dict[str, float]:
    """The OOD columns of a plain run: all NaN (explained once by `NOT_OOD`)."""
    return {c: float("nan") for c in OOD_NAMES}


def ood_replicates(
    scores: dict[str, Any], in_distribution: Any, counts: Iterable[np.ndarray]
) -> dict[str, np.ndarray]:
    """Paired bootstrap replicates of `OOD_NAMES` for C predictions of the same N rows.

    Args:
        scores: {score: (C, N) scores} for every score of `SCORES`, higher = more in-distribution.
        in_distribution: (N,) bool.
        counts: chunks of (b, N) multiplicities (`calibrate.tables.bootstrap.resample_counts`), consumed once, so
            one chunk is held at a time.

    Returns:
        {column: (C, B) float64}; NaN in a resample holding one kind of row only (`interval` leaves those out).
    """
    parts: dict[str, list[np.ndarray]] = {}
    for w in counts:
        for s in SCORES:
            for m, v in count_replicates(scores[s], in_distribution, [w], ood_from_counts).items():
                parts.setdefault(f"ood_{m}_{s}", []).append(v)
    c = np.atleast_2d(np.asarray(scores[SCORES[0]])).shape[0]
    return {col: np.concatenate(parts[col], axis=1) if col in parts else np.zeros((c, 0)) for col in OOD_NAMES}
