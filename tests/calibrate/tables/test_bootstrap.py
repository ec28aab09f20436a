"""Paired bootstrap of ECE: exactness against the metric, resample bookkeeping, and coverage on a simulated case."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from calibrate.metrics import ece
from calibrate.tables import bootstrap as bs
from calibrate.tables import builders
from calibrate.tables.data import summarise_arrays
from schemas.shard import RunKey


def test_point_ece_equals_metric_including_edges(rng):
    conf = np.r_[rng.uniform(0, 1, 300), [0.0, 0.05, 0.3, 0.5, 1.0, 1.0]]
    correct = rng.uniform(size=conf.size) < conf
    conf2 = conf ** 2
    r = bs.residual_matrix(np.stack([conf, conf2]), correct, 20)
    got = bs.point_ece(r, 20)
    assert got[0] == pytest.approx(ece(conf, correct, 20), abs=1e-14)
    assert got[1] == pytest.approx(ece(conf2, correct, 20), abs=1e-14)


def test_each_replicate_is_the_ece_of_its_resample(rng):
    n = 50
    conf = rng.uniform(0.2, 1.0, n)
    correct = rng.uniform(size=n) < 0.6
    seed = np.random.SeedSequence(7)
    counts = np.concatenate(list(bs.resample_counts(n, 30, seed)))
    assert counts.shape == (30, n) and np.all(counts.sum(axis=1) == n)
    reps = bs.ece_replicates([bs.residual_matrix(conf[None], correct, 10)], 10, 30, seed)[0]
    for b in range(30):
        idx = np.repeat(np.arange(n), counts[b].astype(int))
        assert reps[0, b] == pytest.approx(ece(conf[idx], correct[idx], 10), abs=1e-12)


def test_replicates_are_seeded_and_chunking_safe(rng, monkeypatch):
    conf = rng.uniform(0, 1, 200)
    correct = rng.uniform(size=200) < conf
    r = [bs.residual_matrix(conf[None], correct, 20)]
    a = bs.ece_replicates(r, 20, 100, 3)[0]
    b = bs.ece_replicates(r, 20, 100, 3)[0]
    c = bs.ece_replicates(r, 20, 100, 4)[0]
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    monkeypatch.setattr(bs, "CHUNK_VALUES", 200 * 7)  # chunks of 7 resamples, a ragged last chunk
    d = bs.ece_replicates(r, 20, 100, 3)[0]
    assert d.shape == (1, 100)
    assert abs(d.mean() - a.mean()) < 0.01  # same distribution (different stream)


def test_bootstrap_intervals_cover_at_the_nominal_rate():
    """Population: conf ~ U(0.5, 1), correct ~ Bernoulli(conf - 0.25): every bin's gap is 0.25, so the true ECE is
    0.25. A second prediction conf2 = conf - u, u ~ U(0, 0.2), has true ECE 0.15 and a true difference of -0.1.
    Bins hold ~100 samples and gaps sit 5 standard errors from zero, so |.| is linear and the intervals the tables
    use (basic bootstrap) should cover at about 95%."""
    rng = np.random.default_rng(2024)
    reps, n, b = 200, 1000, 300
    hit_ece = hit_diff = 0
    width_ece = width_diff = 0.0
    for r in range(reps):
        conf = rng.uniform(0.5, 1.0, n)
        correct = rng.uniform(size=n) < conf - 0.25
        conf2 = conf - rng.uniform(0.0, 0.2, n)
        res = bs.residual_matrix(np.stack([conf, conf2]), correct, 20)
        est = bs.point_ece(res, 20)
        rep = bs.ece_replicates([res], 20, b, r)[0]
        lo, hi = bs.basic_interval(est[0], rep[0])
        hit_ece += lo <= 0.25 <= hi
        width_ece += hi - lo
        lo, hi = bs.basic_interval(est[1] - est[0], rep[1] - rep[0])
        hit_diff += lo <= -0.1 <= hi
        width_diff += hi - lo
    assert 0.88 <= hit_ece / reps <= 0.99
    assert 0.88 <= hit_diff / reps <= 0.99
    # pairing: the difference is far better determined than either ECE
    assert width_diff < 0.5 * width_ece  # unpaired it would be about sqrt(2) times wider than one ECE


def test_basic_interval_covers_a_small_true_ece_where_the_percentile_interval_fails():
    """True ECE 0.02 (every bin's gap): binned ECE is biased upwards, its resamples once more. The percentile interval
    sits above the truth; the basic interval reflects the bias back."""
    rng = np.random.default_rng(7)
    reps, n, gap = 100, 2000, 0.02
    basic = perc = 0
    for r in range(reps):
        conf = rng.uniform(0.5, 1.0, n)
        correct = rng.uniform(size=n) < conf - gap
        res = bs.residual_matrix(conf[None], correct, 20)
        rep = bs.ece_replicates([res], 20, 300, r)[0][0]
        lo, hi = bs.basic_interval(bs.point_ece(res, 20)[0], rep)
        basic += lo <= gap <= hi
        lo, hi = bs.percentile_interval(rep)
        perc += lo <= gap <= hi
    assert basic / reps >= 0.8 and perc / reps <= 0.5


def _run(method, zs, tta, labels, dataset="imagenet_a", seed=1):
    return summarise_arrays(RunKey("ViT-B-16", dataset, method, seed), np.arange(len(labels)), labels, zs, tta,
                            {"sals": lambda z, t: np.full(len(t), 2.0)})


def test_bootstrap_runs_pairs_runs_of_a_dataset(rng):
    n, k = 150, 4
    zs = rng.normal(size=(n, k)) * 2
    labels = rng.integers(0, k, n)
    tta = zs * 3
    a, b = _run("tda", zs, tta, labels), _run("dpe", zs, tta, labels)
    c = _run("tda", zs, tta, labels, dataset="dtd")
    res = bs.bootstrap_runs({s.key: s for s in (a, b, c)}, ["none", "sals", "zaec"], n_bins=20, n_resamples=64,
                            seed=5)
    # same samples, same data: identical replicates; another dataset: other resamples
    assert np.array_equal(res.get(a.key, "none"), res.get(b.key, "none"))
    assert not np.array_equal(res.get(a.key, "none"), res.get(c.key, "none"))
    assert res.get(a.key, "zaec") is None  # calibrators a run lacks are skipped
    assert res.get(a.key, "zero-shot").shape == (64,)
    metrics = builders.run_metrics([a], 20)
    for cal in ("zero-shot", "none", "sals"):
        want = metrics.filter(pl.col("calibrator") == cal)["ece"][0]
        assert res.points[(a.key, cal)] == pytest.approx(want, abs=1e-12)


def _cells(rows):
    return pl.DataFrame(
        [dict(backbone="ViT-B-16", dataset=d, method=m, calibrator=c, accuracy=0.5, ece=e, nll=1.0,
              mean_confidence=0.5, mean_entropy=1.0, range_deviation=0.0, mean_delta_entropy=0.0, n=10.0, n_seeds=1)
         for d, m, c, e in rows])


def test_differences_mark_intervals_containing_zero():
    rng = np.random.default_rng(0)
    B = 400
    boot = bs.BootstrapResult(n_resamples=B, seed=0, n_bins=20)
    rows = []
    for d in ("imagenet_a", "imagenet_r"):
        key = RunKey("ViT-B-16", d, "tda", 1)
        z = 0.05 + rng.normal(0, 0.002, B)
        reps = {"zero-shot": 0.04 + rng.normal(0, 0.002, B), "none": 0.20 + rng.normal(0, 0.002, B), "zaec": z,
                "sals": z + rng.normal(0, 0.002, B)}  # SaLS indistinguishable from ZAEC
        for cal, r in reps.items():
            boot.replicates[(key, cal)] = r
            rows.append((d, "tda", cal, float(r.mean())))
    cells = _cells(rows)
    reps = builders.CellReplicates(boot)
    diffs = builders.main_differences(cells, "ViT-B-16", reps)
    flags = {(r["comparison"], r["dataset"]): r["contains_zero"] for r in diffs.iter_rows(named=True)}
    assert flags[("ZAEC - None", "imagenet_a")] is False and flags[("ZAEC - None", "avg")] is False
    assert flags[("ZAEC - SaLS", "imagenet_a")] is True and flags[("ZAEC - SaLS", "avg")] is True
    assert not any(c.endswith("Temp. Scal.") for c, _ in flags)  # no temperature rows: no such comparison
    est = diffs.filter((pl.col("comparison") == "ZAEC - None") & (pl.col("dataset") == "avg"))["estimate"][0]
    assert est == pytest.approx(100 * np.mean([(boot.replicates[(RunKey("ViT-B-16", d, "tda", 1), "zaec")]
                                               - boot.replicates[(RunKey("ViT-B-16", d, "tda", 1), "none")]).mean()
                                               for d in ("imagenet_a", "imagenet_r")]))
    # the main table carries each ECE's interval in percent, the average's from averaged replicates
    main = builders.main_table(cells, "ViT-B-16", reps)
    r = main.filter((pl.col("row") == "none") & (pl.col("dataset") == "avg")).row(0, named=True)
    avg = (boot.replicates[(RunKey("ViT-B-16", "imagenet_a", "tda", 1), "none")]
           + boot.replicates[(RunKey("ViT-B-16", "imagenet_r", "tda", 1), "none")]) / 2 * 100
    q_lo, q_hi = np.quantile(avg, [0.025, 0.975])
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((2 * r["value"] - q_hi, 2 * r["value"] - q_lo))
    assert r["ci_low"] < r["value"] < r["ci_high"]


#: a data set of the test below whose basic interval lies below its estimate (about a quarter of such data sets do;
#: the first seed that does: the test asserts it from the interval's definition, so a change would fail loudly)
SEED_BELOW = 1


def test_an_interval_below_its_estimate_is_marked_explained_and_centred():
    """Issue 32 item 10: a perfectly calibrated prediction of 400 samples (true ECE 0) has a binned ECE biased
    upwards; the basic interval then lies wholly below the estimate (as `18.64 [11.89, 18.29]` in the issue). The
    interval stays basic (docs: percentile/BCa miss small true ECEs), and the table says so where it is read: the
    flag, the bias-corrected centre inside the interval, the ↓ mark and its legend."""
    from calibrate.tables import render

    rng = np.random.default_rng(SEED_BELOW)
    n, k = 400, 4
    logits = rng.normal(0, 1.5, (n, k))
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    pred, conf = p.argmax(1), p.max(1)
    # label = prediction with probability conf (calibrated), else another class
    wrong = (pred + rng.integers(1, k, n)) % k
    labels = np.where(rng.random(n) < conf, pred, wrong)
    key = RunKey("ViT-B-16", "dtd", "tda", 1)
    s = summarise_arrays(key, np.arange(n), labels, logits.astype(np.float32), logits.astype(np.float32), {})
    boot = bs.bootstrap_runs({key: s}, ["none"], n_bins=20, n_resamples=400, seed=0)
    cells = builders.cell_metrics(builders.run_metrics([s], 20))
    reps = builders.CellReplicates(boot)
    iv = builders.main_intervals(cells, "ViT-B-16", reps)
    row = iv.filter((pl.col("block") == "tda") & (pl.col("row") == "none") & (pl.col("dataset") == "dtd")).row(
        0, named=True)
    est, r = row["value"], 100.0 * boot.get(key, "none")
    # today's interval, from its definition: wholly below the estimate
    lo, hi = max(2 * est - np.quantile(r, 0.975), 0.0), 2 * est - np.quantile(r, 0.025)
    assert hi < est and (row["ci_low"], row["ci_high"]) == pytest.approx((lo, hi), abs=1e-12)
    assert row["ci_excludes_estimate"] is True
    assert row["bias_corrected"] == pytest.approx(max(2 * est - np.median(r), 0.0), abs=1e-12)
    assert lo <= row["bias_corrected"] <= hi
    # a cell whose interval contains its estimate is not flagged
    assert iv.filter(pl.col("ci_low").is_not_null() & (pl.col("ci_low") <= pl.col("value"))
                     & (pl.col("value") <= pl.col("ci_high")))["ci_excludes_estimate"].to_list() == [False] * \
        iv.filter(pl.col("ci_low").is_not_null() & (pl.col("ci_low") <= pl.col("value"))
                  & (pl.col("value") <= pl.col("ci_high"))).height
    md = render.intervals_markdown(iv, builders.main_differences(cells, "ViT-B-16", reps), "t", 400, 0.95)
    assert f"[{render.fmt(row['ci_low'])}, {render.fmt(row['ci_high'])}]{render.BELOW_MARK}" in md
    assert render.BELOW_LEGEND in md
