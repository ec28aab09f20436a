"""Selective prediction metrics (calibrate.selective): AUROC and FPR95 against sklearn, AURC against a slow loop
averaged over every order of the tied samples, hand-computed cases with ties, streaming == one shot, the bootstrap
against explicitly resampled data, and the `zaec-calibrate` columns against the per-sample output."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import polars as pl
import pytest
from sklearn.metrics import roc_auc_score, roc_curve

from calibrate.run import calibrate_paths, write_metrics
from calibrate.selective import (
    SELECTIVE_NAMES,
    SelectiveStats,
    ScoreCounts,
    confidence_score,
    interval,
    risk_coverage,
    selective_metrics,
    selective_replicates,
)
from calibrate.synthetic import synthetic_logits
from calibrate.tables.bootstrap import resample_counts
from schemas.shard import shard_path, write_shard

EPS = np.finfo(np.float64).eps


def tol(n: int) -> float:
    """Sums of n terms <= 1 and harmonic-number differences (k0 * (H_b - H_a), k0 <= n): a few n log n eps."""
    return 8 * EPS * max(n, 1) * (1 + math.log(max(n, 1)))


def slow_aurc_fixed_order(correct_in_order) -> float:
    """Mean over k = 1..N of (errors among the first k) / k: the tie-free AURC, written as a loop."""
    total, errors = 0.0, 0
    for k, c in enumerate(correct_in_order, start=1):
        errors += 0 if c else 1
        total += errors / k
    return total / len(correct_in_order)


def slow_aurc_all_orders(score, correct) -> float:
    """Average of the tie-free AURC over every order of the samples that keeps the scores descending."""
    vals = []
    for perm in itertools.permutations(range(len(score))):
        order = sorted(perm, key=lambda i: -score[i])  # stable: ties keep the permutation's order
        vals.append(slow_aurc_fixed_order([correct[i] for i in order]))
    return float(np.mean(vals))


def slow_optimal_aurc(n: int, n_correct: int) -> float:
    return slow_aurc_fixed_order([True] * n_correct + [False] * (n - n_correct))


def sklearn_fpr95(correct, score) -> float:
    fpr, tpr, _ = roc_curve(correct, score, drop_intermediate=False)
    return float(fpr[np.searchsorted(tpr, 0.95, side="left")])


def tied_case(rng, n, levels):
    score = rng.integers(0, levels, n) / levels  # few distinct values: many ties
    correct = rng.random(n) < 0.3 + 0.6 * score  # more confident -> more often right
    return score, correct


def test_auroc_and_fpr95_match_sklearn_with_ties(rng):
    for trial in range(60):
        n = int(rng.integers(2, 400))
        score, correct = tied_case(rng, n, int(rng.integers(1, 30)))
        if correct.all() or not correct.any():
            continue
        m = selective_metrics(score, correct)
        assert abs(m["auroc"] - roc_auc_score(correct, score)) <= 4 * EPS, trial
        assert m["fpr95"] == sklearn_fpr95(correct, score), trial


def test_aurc_is_the_average_over_tie_orders(rng):
    cases = [([0.9, 0.9, 0.4], [1, 0, 1]), ([0.5] * 4, [1, 0, 1, 1]), ([1.0, 1.0, 0.2, 0.2, 0.2], [0, 1, 1, 0, 1])]
    for _ in range(6):
        s, c = tied_case(rng, 7, 3)
        cases.append((s.tolist(), c.tolist()))
    for s, c in cases:
        m = selective_metrics(s, c)
        ref = slow_aurc_all_orders(s, c)
        assert abs(m["aurc"] - ref) <= tol(len(s)), (s, c)
        assert abs(m["eaurc"] - (ref - slow_optimal_aurc(len(c), int(sum(c))))) <= tol(len(s))


def test_aurc_without_ties_matches_loop(rng):
    for _ in range(20):
        n = int(rng.integers(1, 3000))
        score = rng.random(n)
        correct = rng.random(n) < score
        order = np.argsort(-score)
        m = selective_metrics(score, correct)
        assert abs(m["aurc"] - slow_aurc_fixed_order(correct[order])) <= tol(n)
        opt = slow_optimal_aurc(n, int(correct.sum()))
        assert abs(m["eaurc"] - (m["aurc"] - opt)) <= tol(n)


def test_hand_computed_cases():
    # all tied, 1 error in 4: E_k = k/4 -> risk 1/4 everywhere; AURC* = (1/4)(4-3)/4; a coin-flip AUROC
    m = selective_metrics([0.7] * 4, [1, 1, 0, 1])
    assert m["aurc"] == pytest.approx(0.25, abs=4 * EPS)
    assert m["eaurc"] == pytest.approx(0.25 - 1 / 16, abs=4 * EPS)
    assert m["auroc"] == 0.5 and m["fpr95"] == 1.0
    # perfect ranking: AURC = AURC*, AUROC 1, no error accepted at 95% TPR
    m = selective_metrics([0.9, 0.8, 0.7, 0.1], [1, 1, 1, 0])
    assert m["aurc"] == pytest.approx(1 / 16, abs=4 * EPS) and abs(m["eaurc"]) <= 4 * EPS
    assert m["auroc"] == 1.0 and m["fpr95"] == 0.0
    # worst ranking: the error first: risks 1, 1/2, 1/3, 1/4
    m = selective_metrics([0.9, 0.8, 0.7, 0.6], [0, 1, 1, 1])
    assert m["aurc"] == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4, abs=4 * EPS)
    assert m["auroc"] == 0.0 and m["fpr95"] == 1.0
    # a tie between one correct and one wrong sample counts 1/2: pairs (c1>w), (c1=w tie), ... = (1 + 0.5) / 2
    m = selective_metrics([0.9, 0.5, 0.5], [1, 1, 0])
    assert m["auroc"] == 0.75
    # 20 correct: TPR 95% = 19 accepted; the 19th correct sample comes after one error -> FPR 1/2
    score = np.r_[np.linspace(1, 0.6, 18), 0.55, np.linspace(0.5, 0.4, 2), 0.3]
    correct = np.r_[np.ones(18, bool), False, True, True, False]
    assert selective_metrics(score, correct)["fpr95"] == 0.5 == sklearn_fpr95(correct, score)


def test_undefined_cases_are_nan_with_reasons():
    st = SelectiveStats().update([0.9, 0.6], [0.1, 0.5], [True, True])
    m = st.compute()
    assert m["aurc_msp"] == 0.0 and m["eaurc_msp"] == 0.0
    assert all(math.isnan(m[c]) for c in ("auroc_msp", "fpr95_msp", "auroc_negent", "fpr95_negent"))
    assert set(st.reasons()) == {"auroc_msp", "fpr95_msp", "auroc_negent", "fpr95_negent"}
    assert "no misclassified sample" in st.reasons()["auroc_msp"]
    wrong = SelectiveStats().update([0.9, 0.6], [0.1, 0.5], [False, False])
    assert wrong.compute()["aurc_msp"] == 1.0 and wrong.compute()["eaurc_msp"] == 0.0
    assert "no correctly classified" in wrong.reasons()["fpr95_negent"]
    empty = SelectiveStats()
    assert all(math.isnan(v) for v in empty.compute().values())
    assert empty.reasons() == {c: "no samples" for c in SELECTIVE_NAMES}


def test_streaming_equals_one_shot_and_is_order_free(rng):
    for _ in range(10):
        n = int(rng.integers(1, 600))
        conf, correct = tied_case(rng, n, int(rng.integers(1, 50)))
        ent = rng.integers(0, 5, n) / 7.0
        one = SelectiveStats().update(conf, ent, correct).compute()
        perm = rng.permutation(n)
        cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 6))))
        parts = [SelectiveStats().update(conf[i], ent[i], correct[i]) for i in np.split(perm, cuts)]
        merged = parts[0]
        for p in parts[1:]:
            merged.merge(p)
        assert merged.compute() == one  # the per-score counts are identical, so bit-identical results


def test_negative_entropy_score_matches_sklearn(rng):
    n = 500
    ent = rng.integers(0, 20, n) * 0.1
    correct = rng.random(n) < np.exp(-ent)
    m = SelectiveStats().update(rng.random(n), ent, correct).compute()
    assert abs(m["auroc_negent"] - roc_auc_score(correct, -ent)) <= 4 * EPS
    assert m["fpr95_negent"] == sklearn_fpr95(correct, -ent)
    assert np.array_equal(confidence_score("negent", [0.2], [1.5]), [-1.5])
    with pytest.raises(ValueError, match="valid: msp, negent"):
        confidence_score("energy", [0.2], [1.5])


def test_risk_coverage_curve(rng):
    score, correct = tied_case(rng, 300, 12)
    rc = risk_coverage(score, correct)
    for t, cov, risk in zip(rc.threshold, rc.coverage, rc.risk):
        acc = score >= t  # the selector at this threshold, as a loop would apply it
        assert cov == acc.mean() and risk == pytest.approx((~correct[acc]).mean(), abs=4 * EPS)
    assert rc.coverage[-1] == 1.0 and np.all(np.diff(rc.threshold) < 0)
    assert np.all(rc.oracle_risk <= rc.risk + 4 * EPS)
    assert rc.aurc == selective_metrics(score, correct)["aurc"]


def test_bootstrap_replicates_equal_metrics_of_resampled_data(rng):
    n = 150
    score = np.stack([tied_case(rng, n, 10)[0], rng.random(n)])
    correct = rng.random(n) < 0.7
    counts = list(resample_counts(n, 40, seed=3))
    reps = selective_replicates(score, correct, counts)
    w = np.concatenate(counts).astype(np.int64)
    for b in range(0, 40, 7):
        idx = np.repeat(np.arange(n), w[b])  # the resample written out: a sample drawn m times is m copies
        for j in range(2):
            ref = selective_metrics(score[j][idx], correct[idx])
            for m, v in ref.items():
                assert reps[m][j, b] == pytest.approx(v, abs=tol(n)) or (math.isnan(v) and math.isnan(reps[m][j, b]))
    # all-ones multiplicities reproduce the point estimate; the same counts give the same (paired) replicates
    ones = selective_replicates(score, correct, [np.ones((1, n))])
    for m, v in selective_metrics(score[0], correct).items():
        assert ones[m][0, 0] == pytest.approx(v, abs=tol(n))
    again = selective_replicates(score[1:], correct, resample_counts(n, 40, seed=3))
    assert all(np.array_equal(again[m][0], reps[m][1]) for m in again)


def test_interval_leaves_out_undefined_replicates():
    reps = np.array([[0.1, np.nan, 0.3, 0.2, np.nan], [np.nan] * 5])
    lo, hi, undefined = interval(np.array([0.2, 0.5]), reps, level=0.5)
    q = np.quantile([0.1, 0.3, 0.2], [0.25, 0.75])
    assert lo[0] == pytest.approx(0.4 - q[1]) and hi[0] == pytest.approx(0.4 - q[0])
    assert np.isnan(lo[1]) and undefined.tolist() == [2, 5]


def test_score_counts_merge_exact():
    a = ScoreCounts.of([0.5, 0.2, 0.5], [1, 0, 0])
    b = ScoreCounts.of([0.2, 0.9], [1, 1])
    m = ScoreCounts.concat([a, b])
    assert m.score.tolist() == [0.9, 0.5, 0.2] and m.n_ok.tolist() == [1, 1, 1] and m.n_err.tolist() == [0, 1, 1]


def test_calibrate_writes_columns_matching_samples_and_notes_missing(tmp_path, make_meta, rng):
    meta = make_meta(dataset="dtd", k=7)
    y, zs, tta = synthetic_logits(240, 7, rng)
    for i, idx in enumerate(np.array_split(rng.permutation(240), 3)):
        write_shard(shard_path(tmp_path / "s", meta.key, i), meta, idx, y[idx], zs[idx], tta[idx])
    # a run the adapted model gets all right: its AUROC/FPR95 are missing, with the reason noted
    perfect = make_meta(dataset="eurosat", k=7)
    yp = np.arange(40) % 7
    tta_p = np.eye(7)[yp] * 5.0 + rng.normal(0, 0.1, (40, 7))
    zs_p = rng.normal(0, 1, (40, 7))
    write_shard(shard_path(tmp_path / "s", perfect.key, 0), perfect, np.arange(40), yp, zs_p, tta_p)
    rep = calibrate_paths([tmp_path / "s"], calibrators="none,sals,zaec", samples_dir=tmp_path / "samples")
    write_metrics(rep, tmp_path / "out")
    samples = pl.read_parquet(tmp_path / "samples" / "**" / "*.parquet")
    for row in rep.metrics.iter_rows(named=True):
        s = samples.filter((pl.col("dataset") == row["dataset"]) & (pl.col("calibrator") == row["calibrator"]))
        correct = (s["prediction"] == s["label"]).to_numpy()
        for score in ("msp", "negent"):
            ref = selective_metrics(confidence_score(score, s["confidence"].to_numpy(), s["entropy"].to_numpy()),
                                    correct)
            for m, v in ref.items():
                got = row[f"{m}_{score}"]
                assert (math.isnan(v) and math.isnan(got)) or got == pytest.approx(v, abs=tol(len(s))), (row, m)
    notes = json.loads((tmp_path / "out" / "notes.json").read_text())
    miss = notes["missing"]
    none_key = next(k for k in miss if "eurosat" in k and k.endswith("|none"))
    assert set(miss[none_key]) == {"auroc_msp", "fpr95_msp", "auroc_negent", "fpr95_negent"}
    assert any("eurosat" in n and "no misclassified sample" in n for n in notes["notes"])
    assert not any("dtd" in k for k in miss)
    # written as missing (NaN in Parquet and CSV), never as a made-up number
    csv = pl.read_csv(tmp_path / "out" / "metrics.csv").filter(
        (pl.col("dataset") == "eurosat") & (pl.col("calibrator") == "none"))
    assert csv["auroc_msp"].is_nan().all() and csv["fpr95_negent"].is_nan().all()
    assert csv["aurc_msp"].to_list() == [0.0]


def test_paired_difference_of_rank_preserving_scores_is_zero(rng):
    # a monotone transform keeps the ranking and the ties: paired replicates agree resample by resample
    n = 200
    conf, correct = tied_case(rng, n, 15)
    reps = selective_replicates(np.stack([conf, conf**3]), correct, resample_counts(n, 50, seed=2))
    est = selective_metrics(conf, correct)
    for m in ("aurc", "auroc", "fpr95"):
        d = reps[m][0] - reps[m][1]
        assert np.all((d == 0) | np.isnan(d)), m
        lo, hi, _ = interval(0.0, d)
        assert lo == 0 and hi == 0
        lo, hi, _ = interval(est[m], reps[m][0])
        assert lo <= hi
