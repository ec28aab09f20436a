"""Classwise and top-label ECE (calibrate.classwise) against netcal and slow loops, their bin edges, streaming ==
one shot, the paired bootstrap against explicitly resampled data (calibrate.trust), and the zaec-calibrate columns."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import softmax

from calibrate.classwise import (
    CLASSWISE_NAMES,
    ClasswiseStats,
    classwise_ece,
    classwise_residuals,
    ece_replicates,
    softmax_probs,
    top_label_ece,
    top_label_residuals,
)
from calibrate.metrics import ece
from calibrate.run import calibrate_paths
from calibrate.selective import selective_replicates
from calibrate.synthetic import synthetic_logits
from calibrate.tables.bootstrap import resample_counts
from calibrate.trust import TRUST_NAMES, TrustStats, paired_replicates, point_metrics
from schemas.shard import shard_path, write_shard

EPS = np.finfo(np.float64).eps
M = 15


def tol(n_values: int) -> float:
    """float64 sums of n_values terms of magnitude <= 1 (bincount order differs between chunkings)."""
    return 8 * EPS * max(n_values, 1)


def slow_bin(p: float, m: int = M) -> int:
    """Bin b holds b/m < p <= (b+1)/m (edges from linspace, as documented), p = 0 in bin 0."""
    edges = np.linspace(0.0, 1.0, m + 1)
    for b in range(m):
        if edges[b] < p <= edges[b + 1]:
            return b
    return 0


def slow_classwise(probs, labels, m=M) -> float:
    n, k = probs.shape
    total = 0.0
    for cls in range(k):
        sums: dict[int, list[float]] = {}
        for i in range(n):
            s = sums.setdefault(slow_bin(probs[i, cls], m), [0, 0.0, 0.0])
            s[0] += 1
            s[1] += probs[i, cls]
            s[2] += float(labels[i] == cls)
        total += sum(c / n * abs(lab / c - pr / c) for c, pr, lab in sums.values())
    return total / k


def slow_top_label(pred, conf, correct, m=M) -> float:
    n = len(pred)
    sums: dict[tuple[int, int], list[float]] = {}
    for i in range(n):
        s = sums.setdefault((int(pred[i]), slow_bin(conf[i], m)), [0, 0.0, 0.0])
        s[0] += 1
        s[1] += conf[i]
        s[2] += float(correct[i])
    return sum(c / n * abs(a / c - f / c) for c, f, a in sums.values())


def random_probs(rng, n, k, scale=3.0):
    logits = rng.normal(0, scale, (n, k))
    labels = np.where(rng.random(n) < 0.6, logits.argmax(1), rng.integers(0, k, n))
    return logits, softmax(logits, axis=1), labels


def test_classwise_matches_netcal_and_slow_loop(rng):
    from netcal.metrics import ECE  # netcal: binary ECE of the positive-class probability, bins [lo, hi)

    for k in (2, 3, 10):
        logits, p, y = random_probs(rng, 300, k)
        got = classwise_ece(p, y)
        ref = np.mean([ECE(bins=M).measure(p[:, c], (y == c).astype(int)) for c in range(k)])
        # netcal's bins differ from ours only for probabilities exactly on an edge: none here (continuous floats)
        assert got == pytest.approx(ref, abs=1e-12)
        assert got == pytest.approx(slow_classwise(p, y), abs=tol(300))


def test_top_label_matches_slow_loop_and_bounds_ece(rng):
    for k in (2, 5, 30):
        logits, p, y = random_probs(rng, 400, k)
        pred, conf = p.argmax(1), p.max(1)
        correct = pred == y
        st = ClasswiseStats().update_probs(p, y).compute()
        assert st["tl_ece_15w"] == pytest.approx(slow_top_label(pred, conf, correct), abs=tol(400))
        assert top_label_ece(pred, conf, correct, k) == pytest.approx(st["tl_ece_15w"], abs=tol(400))
        assert st["tl_ece_15w"] >= ece(conf, correct, M) - tol(400)  # finer bins never lower the binned ECE


def test_bin_edges_zero_and_one():
    # p exactly 1/15 sits on an inner edge -> lower bin (b = 0), like calibrate.metrics.bin_index; 1.0 -> last bin
    edge = np.linspace(0, 1, M + 1)[1]
    p = np.array([[1.0, 0.0], [edge, 1 - edge], [0.0, 1.0]])
    y = np.array([0, 0, 1])
    st = ClasswiseStats().update_probs(p, y)
    assert st.cw_count[0].tolist()[0] == 2 and st.cw_count[0, M - 1] == 1  # class 0: {edge, 0.0} in bin 0, 1.0 last
    assert st.compute()["cw_ece_15w"] == pytest.approx(slow_classwise(p, y), abs=tol(6))
    perfect = ClasswiseStats().update_probs(np.eye(3), [0, 1, 2]).compute()
    assert perfect == {"cw_ece_15w": 0.0, "tl_ece_15w": 0.0}


def test_streaming_logits_equals_one_shot(rng, monkeypatch):
    logits, p, y = random_probs(rng, 500, 7, scale=20.0)  # CLIP-like saturated softmax
    t = rng.uniform(0.5, 3.0, 500)
    one = ClasswiseStats().update_probs(softmax(logits / t[:, None], axis=1), y, logits.argmax(1)).compute()
    monkeypatch.setattr("calibrate.classwise.CHUNK_VALUES", 50)  # force several probability chunks per update
    for _ in range(5):
        perm = rng.permutation(500)
        parts = np.split(perm, np.sort(rng.integers(0, 501, 3)))
        merged = ClasswiseStats()
        for idx in parts:
            merged.merge(ClasswiseStats().update_logits(logits[idx], t[idx], y[idx]))
        got = merged.compute()
        for name in CLASSWISE_NAMES:
            assert got[name] == pytest.approx(one[name], abs=tol(500 * 7))


def test_bad_input():
    st = ClasswiseStats().update_probs(np.full((2, 3), 1 / 3), [0, 1])
    with pytest.raises(ValueError, match="expected 3 classes, got 4"):
        st.update_probs(np.full((2, 4), 1 / 4), [0, 1])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        ClasswiseStats().update_probs(np.full((1, 3), 1 / 3), [3])
    empty = ClasswiseStats()
    assert all(math.isnan(v) for v in empty.compute().values()) and empty.reasons()["cw_ece_15w"] == "no samples"


def test_bootstrap_replicates_equal_resampled_metrics(rng):
    n, k = 120, 4
    logits, p, y = random_probs(rng, n, k)
    pred, conf = p.argmax(1), p.max(1)
    counts = list(resample_counts(n, 30, seed=11))
    w = np.concatenate(counts).astype(np.int64)
    tl = ece_replicates([top_label_residuals(pred, conf, pred == y, k)], counts)[0]
    cw = ece_replicates([classwise_residuals(p, y)], counts, [k])[0]
    for b in range(0, 30, 6):
        idx = np.repeat(np.arange(n), w[b])
        assert tl[b] == pytest.approx(slow_top_label(pred[idx], conf[idx], pred[idx] == y[idx]), abs=tol(n))
        assert cw[b] == pytest.approx(slow_classwise(p[idx], y[idx]), abs=tol(n * k))


def test_paired_replicates_share_resamples(rng):
    n, k = 90, 5
    logits, p, y = random_probs(rng, n, k)
    p2 = softmax(logits / 2.0, axis=1)  # a temperature-scaled second prediction: same arg-max
    pred = np.stack([p.argmax(1), p2.argmax(1)])
    conf = np.stack([p.max(1), p2.max(1)])
    ent = np.stack([-(q * np.log(q)).sum(1) for q in (p, p2)])
    reps = paired_replicates(pred, conf, ent, y, k, resample_counts(n, 25, seed=5), probs=[p, p2])
    assert set(reps) == set(TRUST_NAMES) and all(v.shape == (2, 25) for v in reps.values())
    alone = selective_replicates(conf, pred == y, resample_counts(n, 25, seed=5))
    assert np.array_equal(alone["aurc"], reps["aurc_msp"])
    tl = ece_replicates([top_label_residuals(pred[1], conf[1], pred[1] == y, k)], resample_counts(n, 25, seed=5))
    assert np.allclose(tl[0], reps["tl_ece_15w"][1], rtol=0, atol=tol(n))
    no_probs = paired_replicates(pred, conf, ent, y, k, resample_counts(n, 3, seed=5))
    assert "cw_ece_15w" not in no_probs


def test_calibrate_columns_match_one_shot(tmp_path, make_meta, rng):
    meta = make_meta(dataset="dtd", k=6)
    y, zs, tta = synthetic_logits(200, 6, rng)
    for i, idx in enumerate(np.array_split(rng.permutation(200), 4)):
        write_shard(shard_path(tmp_path / "s", meta.key, i), meta, idx, y[idx], zs[idx], tta[idx])
    df = calibrate_paths([tmp_path / "s"], calibrators="none").metrics
    for cal, logits in (("zero-shot", zs), ("none", tta)):
        row = df.row(df["calibrator"].to_list().index(cal), named=True)
        p = softmax_probs(logits)
        assert row["cw_ece_15w"] == pytest.approx(slow_classwise(p, y), abs=tol(200 * 6))
        pred = logits.argmax(1)
        assert row["tl_ece_15w"] == pytest.approx(slow_top_label(pred, p.max(1), pred == y), abs=tol(200))


def test_point_metrics_equal_streamed_stats(rng):
    n, k = 200, 6
    logits, p, y = random_probs(rng, n, k, scale=5.0)
    t = rng.uniform(0.5, 2.0, n)
    q = softmax(logits / t[:, None], axis=1)
    pred, conf = logits.argmax(1), q[np.arange(n), logits.argmax(1)]
    ent = -(q * np.log(q)).sum(1)
    streamed = TrustStats().update(logits, t, y, pred, conf, ent).compute()
    full = point_metrics(pred, conf, ent, y, k, probs=q)
    no_probs = point_metrics(pred, conf, ent, y, k)
    for name in TRUST_NAMES:
        assert full[name] == pytest.approx(streamed[name], abs=tol(n * k)), name
        if name != "cw_ece_15w":
            assert no_probs[name] == pytest.approx(streamed[name], abs=tol(n * k)), name
    assert math.isnan(no_probs["cw_ece_15w"])
