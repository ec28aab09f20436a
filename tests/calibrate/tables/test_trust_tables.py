"""`calibrate.tables.trust_tables`: the trust table's values against slow references computed from the per-sample
arrays (sklearn for the AUROC), its intervals against a bootstrap rebuilt from the ECE bootstrap's own resamples
(paired), missing metrics, and the risk-coverage figure's arrays."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from sklearn.metrics import roc_auc_score

from calibrate.calibrators import parse_calibrator
from calibrate.metrics import ece
from calibrate.selective import confidence_score, risk_coverage
from calibrate.tables import trust_tables as tt
from calibrate.tables.bootstrap import bootstrap_runs, dataset_seed, resample_counts
from calibrate.tables.data import summarise_arrays
from schemas.shard import RunKey

K = 4
M = 15  # the classwise / top-label binning of the column names


def make_arrays(dataset, seed, n=160, method="tda", perfect=False):
    """(labels, zs, tta) with tied confidences (logits on a 0.5 grid); `perfect`: the adapted prediction is always
    right. The same samples for every method and seed of a dataset."""
    rng = np.random.default_rng([0, sum(map(ord, dataset))])
    labels = rng.integers(0, K, n)
    zs = np.round(rng.normal(0, 1, (n, K)) * 2) / 2
    zs[np.arange(n), labels] += 1.0
    noise = np.round(np.random.default_rng([seed, *method.encode()]).normal(0, 1, (n, K)) * 2) / 2
    tta = 2.0 * zs + noise
    if perfect:
        tta = np.zeros((n, K))
        tta[np.arange(n), labels] = 8.0
    return labels, zs.astype(np.float32), tta.astype(np.float32)


def make_run(dataset, seed, n=160, method="tda", perfect=False):
    labels, zs, tta = make_arrays(dataset, seed, n, method, perfect)
    cals = {"temperature": lambda z, t: np.full(z.shape[0], 1.7),
            "sals": parse_calibrator("sals").temperatures, "zaec": parse_calibrator("zaec").temperatures}
    key = RunKey("ViT-B-16", dataset, method, seed)
    return summarise_arrays(key, np.arange(n) * 3 + 1, labels, zs, tta, cals)


# ------------------------------------------------------------------------------------------ slow references


def slow_selective(score, correct):
    """AURC (tied samples in random order: each position's error probability is its tie group's error rate),
    E-AURC, AUROC (sklearn), FPR95 (scan of the distinct thresholds)."""
    score, correct = np.asarray(score, float), np.asarray(correct, bool)
    n = score.size
    s = np.sort(score)[::-1]
    p_err = np.array([(~correct[score == v]).mean() for v in s])
    k = np.arange(1, n + 1)
    aurc = np.mean(np.cumsum(p_err) / k)
    best = np.mean(np.cumsum(np.sort(~correct)) / k)  # every correct sample first
    c, e = int(correct.sum()), int((~correct).sum())
    auroc = fpr = np.nan
    if c and e:
        auroc = roc_auc_score(correct, score)
        for t in np.unique(score)[::-1]:
            acc = score >= t
            if 20 * (acc & correct).sum() >= 19 * c:
                fpr = (acc & ~correct).sum() / e
                break
    return {"aurc": aurc, "eaurc": aurc - best, "auroc": auroc, "fpr95": fpr}


def _bin(p, m=M):
    edges = np.linspace(0, 1, m + 1)
    return np.array([0 if v <= edges[1] else next(b for b in range(m) if edges[b] < v <= edges[b + 1]) for v in p])


def slow_tl_ece(pred, conf, correct):
    bins, total = _bin(conf), 0.0
    for k in range(K):
        for b in range(M):
            sel = (pred == k) & (bins == b)
            total += abs((correct[sel] - conf[sel]).sum())
    return total / conf.size


def slow_cw_ece(logits, t, labels):
    z = logits / np.asarray(t, float).reshape(-1, 1)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    total = 0.0
    for k in range(K):
        bins = _bin(p[:, k])
        for b in range(M):
            sel = bins == b
            total += abs(((labels[sel] == k) - p[sel, k]).sum())
    return total / (labels.size * K)


def slow_metrics(pred, conf, ent, labels):
    correct = pred == labels
    out = {f"{m}_msp": v for m, v in slow_selective(conf, correct).items()}
    out |= {f"{m}_negent": v for m, v in slow_selective(-ent, correct).items()}
    out["tl_ece_15w"] = slow_tl_ece(pred, conf, correct)
    return out


def predictions(s):
    """name -> (pred, conf, ent) of the zero-shot prediction and every calibrator."""
    out = {"zero-shot": (s.zs_pred, s.zs_confidence, s.zs_entropy)}
    out |= {c: (s.tta_pred, s.calibrated[c].confidence, s.calibrated[c].entropy) for c in tt.TRUST_CALIBRATORS}
    return out


def value(table, block, row, dataset, metric):
    r = table.filter((pl.col("block") == block) & (pl.col("row") == row) & (pl.col("dataset") == dataset)
                     & (pl.col("metric") == metric))
    assert r.height == 1
    return r.row(0, named=True)


# ------------------------------------------------------------------------------------------ tests


def test_table_values_equal_slow_metrics_seed_and_dataset_means():
    runs = [make_run("dtd", 1), make_run("dtd", 2), make_run("eurosat", 1)]
    cells = tt.trust_cells(runs)
    table = tt.trust_table(cells, "ViT-B-16")
    # float64 sums over N = 160 samples and a few reductions: a few hundred eps, in percent
    tol = 1e-10
    per_ds = {}
    for ds in ("dtd", "eurosat"):
        mine = [s for s in runs if s.key.dataset == ds]
        for name in ("zero-shot", *tt.TRUST_CALIBRATORS):
            ref = [slow_metrics(*predictions(s)[name], s.label) for s in mine]
            block = "zero-shot" if name == "zero-shot" else "tda"
            for metric, v in ref[0].items():
                expect = 100.0 * np.mean([r[metric] for r in ref])
                got = value(table, block, name, ds, metric)["value"]
                assert got == pytest.approx(expect, abs=tol), (ds, name, metric)
                per_ds[(block, name, metric, ds)] = expect
    for (block, name, metric, ds), v in per_ds.items():
        if ds == "dtd":  # the group average: unweighted over the group's datasets, as the main table
            avg = value(table, block, name, "avg", metric)
            assert avg["value"] == pytest.approx((v + per_ds[(block, name, metric, "eurosat")]) / 2, abs=tol)
            assert avg["n_datasets"] == 2 and avg["group_size"] == 11 and avg["ci_low"] is None


def test_classwise_ece_from_the_streamed_logits():
    s = make_run("dtd", 1, n=90)
    labels, zs, tta = (a.astype(float) for a in make_arrays("dtd", 1, n=90))
    table = tt.trust_table(tt.trust_cells([s]), "ViT-B-16")
    got = value(table, "zero-shot", "zero-shot", "dtd", "cw_ece_15w")["value"]
    assert got == pytest.approx(100 * slow_cw_ece(zs, 1.0, labels), abs=1e-10)
    for c in tt.TRUST_CALIBRATORS:
        got = value(table, "tda", c, "dtd", "cw_ece_15w")["value"]
        assert got == pytest.approx(100 * slow_cw_ece(tta, s.calibrated[c].temperature, labels), abs=1e-10), c


def _slow_replicates(s, counts, name):
    pred, conf, ent = predictions(s)[name]
    out = []
    for w in counts:
        idx = np.repeat(np.arange(len(s)), w.astype(int))
        out.append(slow_metrics(pred[idx], conf[idx], ent[idx], s.label[idx]))
    return {m: np.array([r[m] for r in out]) for m in out[0]}


def _basic(est, reps):
    q_lo, q_hi = np.quantile(reps, [0.025, 0.975])
    return 2 * est - q_hi, 2 * est - q_lo


def test_intervals_are_paired_with_the_ece_bootstrap():
    s = make_run("dtd", 1, n=120)
    b, seed = 40, 7
    boot = bootstrap_runs({s.key: s}, ["none", "zaec", "temperature"], n_bins=20, n_resamples=b, seed=seed)
    counts = np.concatenate(list(resample_counts(len(s), b, dataset_seed(seed, "ViT-B-16", "dtd", s.sample_id))))
    # the same resamples as the ECE intervals: the ECE of each rebuilt resample is the ECE bootstrap's replicate
    for j, w in enumerate(counts):
        idx = np.repeat(np.arange(len(s)), w.astype(int))
        assert ece(s.tta_confidence[idx], s.tta_correct[idx], 20) == pytest.approx(
            boot.get(s.key, "none")[j], abs=1e-12)
    cells = tt.trust_cells([s], boot)
    table, diffs = tt.trust_table(cells, "ViT-B-16"), tt.trust_differences(cells, "ViT-B-16")
    reps = {c: _slow_replicates(s, counts, c) for c in ("none", "zaec", "temperature")}
    for metric in ("aurc_msp", "eaurc_msp", "auroc_msp", "fpr95_negent", "tl_ece_15w"):
        for c in ("none", "zaec"):
            r = value(table, "tda", c, "dtd", metric)
            lo, hi = _basic(r["value"], 100 * reps[c][metric])
            assert (r["ci_low"], r["ci_high"]) == pytest.approx((max(lo, 0), min(hi, 100)), abs=1e-9), metric
            if metric != "tl_ece_15w":  # binned ECE is biased: its basic interval may lie below the estimate
                assert r["ci_low"] <= r["value"] <= r["ci_high"], (metric, c)
        for other, label in (("none", "ZAEC − None"), ("temperature", "ZAEC − Temp. Scal.")):
            d = diffs.filter((pl.col("dataset") == "dtd") & (pl.col("metric") == metric)
                             & (pl.col("comparison") == label)).row(0, named=True)
            est = value(table, "tda", "zaec", "dtd", metric)["value"] - value(table, "tda", other, "dtd",
                                                                                metric)["value"]
            # paired: the interval of the per-resample difference, not of two independent bootstraps
            lo, hi = _basic(est, 100 * (reps["zaec"][metric] - reps[other][metric]))
            assert d["estimate"] == pytest.approx(est, abs=1e-9)
            assert (d["ci_low"], d["ci_high"]) == pytest.approx((lo, hi), abs=1e-9), (metric, label)
            assert d["contains_zero"] == (lo <= 0 <= hi)


def test_undefined_auroc_is_missing_with_its_reason():
    runs = [make_run("dtd", 1, perfect=True), make_run("eurosat", 1)]
    cells = tt.trust_cells(runs)
    table, diffs = tt.trust_table(cells, "ViT-B-16"), tt.trust_differences(cells, "ViT-B-16")
    for c in tt.TRUST_CALIBRATORS:
        for metric in ("auroc_msp", "fpr95_msp", "auroc_negent", "fpr95_negent"):
            r = value(table, "tda", c, "dtd", metric)
            assert r["value"] is None and "no misclassified sample" in r["missing_reason"]
            avg = value(table, "tda", c, "avg", metric)  # the average is over the dataset where it is defined
            assert avg["n_datasets"] == 1 and avg["value"] == value(table, "tda", c, "eurosat", metric)["value"]
        assert value(table, "tda", c, "dtd", "aurc_msp")["value"] == 0.0  # nothing wrong: defined, 0
    assert diffs.filter((pl.col("dataset") == "dtd") & pl.col("metric").str.starts_with("auroc")).height == 0
    notes = tt.missing_notes(table)
    assert any("TDA + ZAEC" in n and "auroc_msp" in n and "dtd" in n and "no misclassified" in n for n in notes)
    assert not any("eurosat" in n for n in notes)


def test_risk_coverage_curves_are_the_runs_curves():
    runs = {"tda": make_run("imagenet_a", 1), "dpe": make_run("imagenet_a", 1, method="dpe")}
    curves = tt.risk_coverage_curves(runs)
    assert curves["method"].unique(maintain_order=True).to_list() == ["tda", "dpe"]  # the paper's order
    for m, s in runs.items():
        for name, (pred, conf, ent) in predictions(s).items():
            p = curves.filter((pl.col("method") == m) & (pl.col("panel") == name)).sort("point")
            rc = risk_coverage(confidence_score("msp", conf, ent), pred == s.label)
            for col in ("threshold", "coverage", "risk", "oracle_risk"):
                assert np.array_equal(p[col].to_numpy(), getattr(rc, col)), (m, name, col)
            assert p["aurc"].unique().to_list() == [rc.aurc]
            assert p["aurc"][0] == pytest.approx(slow_selective(conf, pred == s.label)["aurc"], abs=1e-12)


def test_metric_labels_state_the_score():
    assert [tt.metric_label(m) for m in ("aurc_msp", "eaurc_negent", "cw_ece_15w")] == [
        "AURC (MSP)", "E-AURC (−H)", "cw-ECE (15 bins)"]


def test_classwise_statistics_merge_across_shards():
    from calibrate.tables.data import merge_summaries

    labels, zs, tta = make_arrays("dtd", 1, n=100)
    cals = {"zaec": parse_calibrator("zaec").temperatures}
    key = RunKey("ViT-B-16", "dtd", "tda", 1)
    ids = np.arange(100)
    whole = summarise_arrays(key, ids, labels, zs, tta, cals)
    order = np.random.default_rng(3).permutation(100)  # shards in any order
    parts = [summarise_arrays(key, ids[p], labels[p], zs[p], tta[p], cals) for p in np.array_split(order, 3)]
    merged = merge_summaries(parts)
    assert set(merged.classwise) == {"zero-shot", "none", "zaec"}
    for spec, stats in whole.classwise.items():
        got, want = merged.classwise[spec].compute(), stats.compute()
        for col in want:  # sums of 100 float64 values in another order
            assert got[col] == pytest.approx(want[col], abs=1e-13), (spec, col)


def test_oracle_spans_the_whole_coverage_range_when_top_probabilities_tie_at_one():
    """Issue 32 item 9: ECALP-like rows whose top probability is exactly 1.0 form one tied group, so the raw curve
    starts at their share; the oracle panel still covers every level k/N, with risk max(0, k - C) / k."""
    labels, zs, tta = make_arrays("imagenet", 1, n=200)
    tta = (tta.astype(np.float64) * 400.0).astype(np.float32)  # most rows one-hot in float64
    s = summarise_arrays(RunKey("ViT-B-16", "imagenet", "ecalp", 1), np.arange(200), labels, zs, tta,
                         {"temperature": lambda z, t: np.full(z.shape[0], 300.0)})
    assert (s.tta_confidence == 1.0).mean() > 0.5
    curves = tt.risk_coverage_curves({"ecalp": s}, ts_in_sample="imagenet")
    raw = curves.filter(pl.col("panel") == "none")
    assert raw["coverage"].min() > 0.5  # the run's own curve: no point below the tied group's share
    oracle = curves.filter(pl.col("panel") == tt.ORACLE).sort("point")
    k = np.arange(1, 201)
    c = int(s.tta_correct.sum())
    assert np.array_equal(oracle["coverage"].to_numpy(), k / 200)
    assert np.array_equal(oracle["risk"].to_numpy(), np.maximum(0, k - c) / k)
    # in-sample temperature scaling (the reference run is the --ts-source set): flagged for its ‡, nothing else
    flagged = curves.filter(pl.col("in_sample"))["panel"].unique().to_list()
    assert flagged == ["temperature"]
    assert not tt.risk_coverage_curves({"ecalp": s}, ts_in_sample="dtd")["in_sample"].any()


def test_oracle_curve_on_a_grid_keeps_the_bend():
    from calibrate.selective import oracle_curve

    cov, risk = oracle_curve(10_000, 3_333, max_points=100)
    k = np.round(cov * 10_000)
    assert cov[0] == 1e-4 and cov[-1] == 1.0 and 3_333 in k and np.all(np.diff(cov) > 0)
    np.testing.assert_array_equal(risk, np.maximum(0, k - 3_333) / k)
