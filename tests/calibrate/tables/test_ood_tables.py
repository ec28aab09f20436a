"""`calibrate.tables.ood_tables` and the OOD item of `make tables`: values against sklearn on the per-sample arrays,
averages over the OOD sets, paired intervals from the ECE bootstrap's resamples, missing values with a reason, OOD runs
kept out of the paper's items, and the item skipped with one line when there is no OOD run."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import average_precision_score, roc_auc_score

from calibrate.calibrators import parse_calibrator
from calibrate.ood import OOD_NAMES, ood_metrics, ood_replicates
from calibrate.selective import SCORES, confidence_score
from calibrate.tables import ood_tables as ot
from calibrate.tables import report
from calibrate.tables.bootstrap import BootstrapResult, dataset_seed, resample_counts
from calibrate.tables.data import load_summaries, summarise_arrays
from schemas.shard import RunKey

K = 4
EPS = np.finfo(np.float64).eps
CALS = {"temperature": lambda z, t: np.full(z.shape[0], 1.7),
        "sals": parse_calibrator("sals").temperatures, "zaec": parse_calibrator("zaec").temperatures}


def make_ood_run(ood, seed=1, n_id=100, n_ood=70, method="tda", only_id=False):
    """An OOD run `<ood>@dtd`: tied confidences (logits on a 0.5 grid), OOD rows flatter, label -1."""
    rng = np.random.default_rng([seed, sum(map(ord, ood + method))])
    n = n_id + (0 if only_id else n_ood)
    labels = rng.integers(0, K, n)
    zs = np.round(rng.normal(0, 1, (n, K)) * 2) / 2
    zs[np.arange(n_id), labels[:n_id]] += 1.5
    labels[n_id:] = -1
    tta = 2.0 * zs + np.round(rng.normal(0, 1, (n, K)) * 2) / 2
    key = RunKey("RN50", f"{ood}@dtd", method, seed)
    s = summarise_arrays(key, np.arange(n), labels, zs.astype(np.float32), tta.astype(np.float32), CALS)
    return replace(s, ood_for="dtd")


def test_values_equal_sklearn_and_averages_over_the_ood_sets():
    runs = [make_ood_run("noise"), make_ood_run("blobs")]
    cells = ot.ood_cells(runs)
    groups = ot.ood_groups(runs)
    assert groups == {"noise@dtd": ("dtd", "noise"), "blobs@dtd": ("dtd", "blobs")}
    t = ot.ood_table(cells, groups, "RN50")
    assert set(t["group"]) == {"dtd"} and set(t["metric"]) == set(OOD_NAMES)
    for s in runs:
        ind = s.label >= 0
        for row, conf, ent in (("zero-shot", s.zs_confidence, s.zs_entropy),
                               ("zaec", s.calibrated["zaec"].confidence, s.calibrated["zaec"].entropy)):
            block = "zero-shot" if row == "zero-shot" else "tda"
            got = t.filter((pl.col("dataset") == s.key.dataset) & (pl.col("block") == block) & (pl.col("row") == row))
            val = dict(zip(got["metric"], got["value"]))
            n = len(s)
            assert val["ood_auroc_msp"] == pytest.approx(100 * roc_auc_score(ind, conf), abs=800 * n * EPS)
            assert val["ood_aupr_negent"] == pytest.approx(100 * average_precision_score(ind, -ent), abs=800 * n * EPS)
            assert val["ood_fpr95_msp"] == pytest.approx(100 * ood_metrics(conf, ind)["fpr95"], abs=1e-12)
    avg = t.filter((pl.col("dataset") == "avg") & (pl.col("row") == "none") & (pl.col("metric") == "ood_aupr_msp"))
    each = t.filter((pl.col("dataset") != "avg") & (pl.col("row") == "none") & (pl.col("metric") == "ood_aupr_msp"))
    assert avg["value"][0] == pytest.approx(each["value"].mean(), abs=1e-12)
    assert avg["n_datasets"][0] == 2 and avg["group_size"][0] == 2
    assert t.filter(pl.col("dataset") != "avg")["column_label"].unique().sort().to_list() == ["blobs", "noise"]


def test_intervals_are_paired_on_the_ece_resamples():
    s = make_ood_run("noise")
    boot = BootstrapResult(n_resamples=40, seed=3, n_bins=20)
    cells = ot.run_ood(s, boot=boot)
    counts = resample_counts(len(s), 40, dataset_seed(3, "RN50", "noise@dtd", s.sample_id))
    conf = np.stack([s.calibrated[c].confidence for c in ("zaec", "none")])
    ent = np.stack([s.calibrated[c].entropy for c in ("zaec", "none")])
    ref = ood_replicates({sc: confidence_score(sc, conf, ent) for sc in SCORES}, s.label >= 0, counts)
    for col in OOD_NAMES:
        assert np.array_equal(cells["zaec"].reps[col], ref[col][0], equal_nan=True)
        assert np.array_equal(cells["none"].reps[col], ref[col][1], equal_nan=True)
    diffs = ot.ood_differences(ot.ood_cells([s], boot), ot.ood_groups([s]), "RN50")
    d = diffs.filter((pl.col("dataset") == "noise@dtd") & (pl.col("metric") == "ood_auroc_msp")
                     & (pl.col("comparison") == "ZAEC − None"))
    assert d.height == 1 and d["ci_low"][0] is not None
    est = 100 * (cells["zaec"].values["ood_auroc_msp"] - cells["none"].values["ood_auroc_msp"])
    assert d["estimate"][0] == pytest.approx(est, abs=1e-12)


def test_a_run_without_ood_rows_is_a_dash_with_its_reason():
    runs = [make_ood_run("noise", only_id=True), make_ood_run("blobs")]
    t = ot.ood_table(ot.ood_cells(runs), ot.ood_groups(runs), "RN50")
    miss = t.filter((pl.col("dataset") == "noise@dtd") & (pl.col("row") == "zaec"))
    assert miss["value"].is_null().all()
    assert all("no out-of-distribution row" in r for r in miss["missing_reason"])
    avg = t.filter((pl.col("dataset") == "avg") & (pl.col("row") == "zaec"))
    assert avg["n_datasets"].to_list() == [1] * len(OOD_NAMES)


# --------------------------------------------------------------------------------- the item, shards by pyarrow


def write_pa(path, dataset, sample_id, label, zs, tta, **extra):
    kv = {"zaec:schema": "1", "zaec:backbone": "RN50", "zaec:pretrained": "openai", "zaec:dataset": dataset,
          "zaec:method": "tda", "zaec:seed": "1", "zaec:num_classes": str(K),
          "zaec:class_names": json.dumps([f"c{i}" for i in range(K)]), "zaec:method_config": "{}",
          "zaec:zs_prompts": "{}", **extra}
    col = lambda x: pa.FixedSizeListArray.from_arrays(pa.array(x.astype(np.float32).ravel()), K)  # noqa: E731
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"sample_id": pa.array(sample_id, pa.int64()), "label": pa.array(label, pa.int32()),
                             "zs_logits": col(zs), "tta_logits": col(tta)}).replace_schema_metadata(kv), path)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("ood_shards")
    rng = np.random.default_rng(7)
    n_id, n_ood = 80, 50
    y = rng.integers(0, K, n_id)
    zs = rng.normal(0, 1, (n_id + n_ood, K))
    zs[np.arange(n_id), y] += 2.0
    tta = 1.5 * zs
    write_pa(root / "plain" / "p.parquet", "dtd", np.arange(n_id), y, zs[:n_id], tta[:n_id])
    lab = np.r_[y, np.full(n_ood, -1)]
    order = rng.permutation(n_id + n_ood)
    for i, idx in enumerate(np.array_split(order, 2)):
        write_pa(root / "ood" / f"part-{i:05d}.parquet", "noise@dtd", idx, lab[idx], zs[idx], tta[idx],
                 **{"zaec:ood_for": "dtd", "zaec:ood_dataset": "noise"})
    return root


def test_the_item_is_written_and_the_paper_items_never_see_ood_runs(shards, tmp_path):
    summaries = load_summaries([shards], report.ALL_SPECS, temperature=1.3)
    assert summaries.runs[RunKey("RN50", "noise@dtd", "tda", 1)].ood_for == "dtd"
    rep = report.write_report(summaries, tmp_path, None, report.ReportOptions(temperature_fixed=True))
    item = next(it for it in rep.items if it.name == report.OOD_NAME)
    assert item.skipped is None and item.beyond_paper and rep.items[-2] is item
    fig = rep.items[-1]  # issue 32 item 12: the OOD figure follows the OOD table
    assert fig.name == report.OOD_FIGURE_NAME and fig.skipped is None and fig.beyond_paper
    assert [p.name for p in fig.paths] == ["ood_roc.csv", "ood_roc_RN50.png"]
    roc = pl.read_csv(tmp_path / "ood_roc.csv")
    assert set(roc["panel"]) == {"zero-shot", "none", "zaec"} and set(roc["method"]) == {"tda"}
    assert "ood_roc_RN50.png" in (tmp_path / "README.md").read_text()
    table = pl.read_csv(tmp_path / "ood_RN50.csv")
    assert set(table["dataset"]) == {"noise@dtd", "avg"} and table["value"].null_count() == 0
    assert "noise@dtd" not in set(pl.read_csv(tmp_path / "per_run_metrics.csv")["dataset"])
    assert "noise@dtd" not in (tmp_path / "trust_RN50.csv").read_text()
    md = (tmp_path / "ood_RN50.md").read_text()
    assert "noise AUROC" in md and "(in-distribution) against" in md
    s = summaries.runs[RunKey("RN50", "noise@dtd", "tda", 1)]
    want = 100 * roc_auc_score(s.label >= 0, s.calibrated["none"].confidence)
    got = table.filter((pl.col("dataset") == "noise@dtd") & (pl.col("row") == "none")
                       & (pl.col("metric") == "ood_auroc_msp"))["value"][0]
    assert got == pytest.approx(want, abs=800 * len(s) * EPS)


def test_no_ood_runs_skips_the_item_with_one_line(shards, tmp_path):
    summaries = load_summaries([shards / "plain"], report.ALL_SPECS, temperature=1.3)
    rep = report.write_report(summaries, tmp_path, None, report.ReportOptions(temperature_fixed=True))
    item = next(it for it in rep.items if it.name == report.OOD_NAME)
    assert item.skipped is not None and "no OOD runs" in item.skipped and "\n" not in item.skipped
    assert report.OOD_FIGURE_NAME not in [it.name for it in rep.items]  # the table's line says it for both


def test_roc_points_are_sklearns_and_their_area_the_auroc():
    """Issue 32 item 12: the OOD figure's ROC points equal sklearn's roc_curve at every distinct threshold (ties as
    one step), and the trapezoid area under them is the table's AUROC, for every drawn prediction."""
    from sklearn.metrics import roc_curve

    runs = [make_ood_run("noise", seed=1), make_ood_run("noise", seed=2), make_ood_run("blobs", method="dpe")]
    curves = ot.ood_roc_curves(runs)
    assert curves.select("dataset", "method", "seed").unique().sort("dataset").rows() == [
        ("blobs@dtd", "dpe", 1), ("noise@dtd", "tda", 1)]  # the lowest seed per OOD run and method
    for s in (runs[0], runs[2]):
        ind = s.label >= 0
        for panel, conf in (("zero-shot", s.zs_confidence), ("none", s.calibrated["none"].confidence),
                            ("zaec", s.calibrated["zaec"].confidence)):
            p = curves.filter((pl.col("dataset") == s.key.dataset) & (pl.col("panel") == panel)).sort("point")
            fpr, tpr, thr = roc_curve(ind, conf, drop_intermediate=False)
            np.testing.assert_array_equal(p["fpr"].to_numpy(), fpr)
            np.testing.assert_array_equal(p["tpr"].to_numpy(), tpr)
            np.testing.assert_array_equal(p["threshold"].to_numpy()[1:], thr[1:])
            area = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))
            n = len(s)
            assert p["auroc"][0] == pytest.approx(area, abs=8 * n * EPS)
            assert p["auroc"][0] == pytest.approx(roc_auc_score(ind, conf), abs=8 * n * EPS)
    with pytest.raises(ValueError, match="needs in-distribution and out-of-distribution"):
        ot.roc_points([0.5, 0.4], [True, True])
