"""In- vs out-of-distribution detection (calibrate.ood) and OOD runs through `zaec-calibrate` (calibrate.run).

References: sklearn's `roc_auc_score` / `average_precision_score` (in-distribution positive), a slow threshold loop
for FPR95, hand-computed tied cases. OOD shards are written with pyarrow directly (no extractor, no schemas writer),
so the fixture is what any outside writer could produce from docs/contract.md.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import average_precision_score, roc_auc_score

from calibrate.cli import main
from calibrate.functional.softmax import softmax_stats
from calibrate.ood import OOD_NAMES, OODStats, ood_from_counts, ood_metrics, ood_replicates
from calibrate.run import COUNT_COLUMNS, METRIC_COLUMNS, calibrate_paths, write_metrics
from calibrate.selective import SCORES, confidence_score
from calibrate.synthetic import synthetic_logits

EPS = np.finfo(np.float64).eps


def slow_fpr95(score, is_id) -> float:
    """Every distinct threshold from the top: the first that accepts >= 95% of the ID rows; its OOD acceptance."""
    score, is_id = np.asarray(score), np.asarray(is_id, bool)
    for t in sorted(set(score.tolist()), reverse=True):
        acc = score >= t
        if (acc & is_id).sum() >= 0.95 * is_id.sum():
            return float((acc & ~is_id).sum() / (~is_id).sum())
    raise AssertionError("unreachable: the lowest threshold accepts everything")


def tied(rng, n, levels):
    score = rng.integers(0, levels, n) / levels
    is_id = rng.random(n) < 0.2 + 0.6 * score
    return score, is_id


def test_auroc_aupr_match_sklearn_and_fpr95_the_slow_loop_with_ties(rng):
    done = 0
    for trial in range(80):
        n = int(rng.integers(2, 300))
        score, is_id = tied(rng, n, int(rng.integers(1, 25)))
        if is_id.all() or not is_id.any():
            continue
        m = ood_metrics(score, is_id)
        # sums of n terms of size <= 1: a few eps times n
        assert abs(m["auroc"] - roc_auc_score(is_id, score)) <= 8 * n * EPS, trial
        assert abs(m["aupr"] - average_precision_score(is_id, score)) <= 8 * n * EPS, trial
        assert m["fpr95"] == slow_fpr95(score, is_id), trial
        done += 1
    assert done > 50


def test_hand_computed_ties():
    # ID {1.0, 0.5, 0.5}, OOD {0.5, 0.2}: pairs ID>OOD: 1.0 beats both (2), each 0.5 ties one and beats one (1.5 x 2)
    m = ood_metrics([1.0, 0.5, 0.5, 0.5, 0.2], [1, 1, 1, 0, 0])
    assert m["auroc"] == 5 / 6
    # thresholds 1.0: P = 1, R = 1/3; 0.5: P = 3/4, R = 1 -> AP = 1/3 + 2/3 * 3/4
    assert m["aupr"] == pytest.approx(1 / 3 + 0.5, abs=4 * EPS)
    assert m["fpr95"] == 0.5  # all three ID need threshold 0.5, which accepts one of two OOD
    # every score tied: AUROC 1/2, AP = the ID share, FPR95 = 1
    m = ood_metrics([0.3] * 4, [1, 0, 0, 0])
    assert (m["auroc"], m["aupr"], m["fpr95"]) == (0.5, 0.25, 1.0)
    # perfect separation
    assert ood_metrics([0.9, 0.8, 0.1], [1, 1, 0]) == {"auroc": 1.0, "fpr95": 0.0, "aupr": 1.0}


def test_one_kind_of_row_is_missing_with_a_reason():
    for is_id, word in (([1, 1, 1], "no out-of-distribution row"), ([0, 0], "no in-distribution row")):
        st = OODStats().update(np.full(len(is_id), 0.5), np.ones(len(is_id)), np.array(is_id, bool))
        assert all(np.isnan(v) for v in st.compute().values())
        why = st.reasons()
        assert set(why) == set(OOD_NAMES) and all(word in r for r in why.values())
    assert set(OODStats().reasons().values()) == {"no samples"}
    assert all(np.isnan(v) for v in ood_from_counts(np.zeros(0), np.zeros(0)).values())


def test_shard_by_shard_equals_one_pass(rng):
    for trial in range(20):
        n = int(rng.integers(5, 400))
        conf = rng.integers(1, 12, n) / 12  # ties across chunks
        ent = rng.integers(0, 7, n) / 3.0
        is_id = rng.random(n) < 0.6
        one = OODStats().update(conf, ent, is_id).compute()
        perm = rng.permutation(n)
        cuts = np.sort(rng.integers(0, n, 3))
        parts = [OODStats().update(conf[i], ent[i], is_id[i]) for i in np.split(perm, cuts)]
        merged = parts[0]
        for p in parts[1:]:
            merged.merge(p)
        got = merged.compute()
        for c in OOD_NAMES:
            assert got[c] == one[c] or (np.isnan(got[c]) and np.isnan(one[c])), (trial, c)
        want = ood_metrics(-ent, is_id)["auroc"]
        assert np.isnan(want) or got["ood_auroc_negent"] == want


def test_replicates_equal_the_metric_of_the_resampled_rows(rng):
    n = 60
    conf = rng.integers(1, 9, (2, n)) / 9
    ent = rng.random((2, n))
    is_id = rng.random(n) < 0.5
    w = rng.multinomial(n, np.full(n, 1 / n), size=5)
    reps = ood_replicates({s: confidence_score(s, conf, ent) for s in SCORES}, is_id, [w[:2], w[2:]])
    for b in range(5):
        idx = np.repeat(np.arange(n), w[b])
        for j in range(2):
            ref = ood_metrics(conf[j][idx], is_id[idx])
            for m in ("auroc", "fpr95", "aupr"):
                r = reps[f"ood_{m}_msp"][j, b]
                assert (np.isnan(r) and np.isnan(ref[m])) or abs(r - ref[m]) <= 8 * n * EPS, (b, j, m)


# ----------------------------------------------------------------------------------------------------------------
# OOD runs through zaec-calibrate, the fixture written by pyarrow directly
# ----------------------------------------------------------------------------------------------------------------


def _kv(dataset, k, names=None, **extra):
    kv = {"zaec:schema": "1", "zaec:backbone": "RN50", "zaec:pretrained": "openai", "zaec:dataset": dataset,
          "zaec:method": "tda", "zaec:seed": "1", "zaec:num_classes": str(k),
          "zaec:class_names": json.dumps(names or [f"c{i}" for i in range(k)]), "zaec:method_config": "{}",
          "zaec:zs_prompts": "{}"}
    kv.update(extra)
    return kv


def write_pa(path, kv, sample_id, label, zs, tta):
    k = zs.shape[1]
    arr = lambda x: pa.FixedSizeListArray.from_arrays(pa.array(x.astype(np.float32).ravel()), k)  # noqa: E731
    t = pa.table({"sample_id": pa.array(sample_id, pa.int64()), "label": pa.array(label, pa.int32()),
                  "zs_logits": arr(zs), "tta_logits": arr(tta)}).replace_schema_metadata(kv)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(t, path)
    return path


OOD_KV = {"zaec:ood_for": "dtd", "zaec:ood_dataset": "noise"}


def ood_run(root, rng, n_id=90, n_ood=60, k=5, parts=1, **extra):
    """An OOD run noise@dtd: ID rows (sample_id < n_id) and OOD rows (label -1, flatter logits), mixed order."""
    y, zs, tta = synthetic_logits(n_id + n_ood, k, rng)
    y = y.astype(np.int64)
    y[n_id:] = -1
    zs[n_id:] *= 0.3
    tta[n_id:] *= 0.3
    kv = _kv("noise@dtd", k, **{**OOD_KV, "zaec:ood_n_id": str(n_id), "zaec:ood_n_ood": str(n_ood), **extra})
    order = rng.permutation(n_id + n_ood)
    for i, idx in enumerate(np.array_split(order, parts)):
        write_pa(root / f"part-{i:05d}.parquet", kv, idx, y[idx], zs[idx], tta[idx])
    return y, zs, tta


def test_ood_run_metrics(tmp_path, rng):
    y, zs, tta = ood_run(tmp_path / "ood", rng)
    ind = y >= 0
    # the same in-distribution rows as a plain run: accuracy, ECE, ... of the OOD run must equal it
    write_pa(tmp_path / "plain" / "p.parquet", _kv("dtd", 5), np.arange(ind.sum()), y[ind], zs[ind], tta[ind])
    kw = dict(calibrators="none,temperature,sals,zaec", temperature=1.5)
    ood = calibrate_paths([tmp_path / "ood"], **kw)
    plain = calibrate_paths([tmp_path / "plain"], **kw)
    a, b = ood.metrics, plain.metrics
    assert a["dataset"].unique().to_list() == ["noise@dtd"] and a["n"].to_list() == [90] * 5
    assert a["n_ood"].to_list() == [60] * 5 and b["n_ood"].null_count() == 5  # the OOD rows, apart from n
    for col in METRIC_COLUMNS[6:]:
        if col not in (*OOD_NAMES, *COUNT_COLUMNS):
            assert np.allclose(a[col].to_numpy(), b[col].to_numpy(), rtol=1e-12, atol=1e-14, equal_nan=True), col
    assert b.select(OOD_NAMES).to_numpy().size and np.isnan(b.select(OOD_NAMES).to_numpy()).all()
    assert sum("ood_* columns missing" in n for n in plain.notes) == 1
    assert not any("ood_" in n for n in ood.notes)
    zs_s = softmax_stats(zs, 1.0)
    row = a.filter(a["calibrator"] == "zero-shot").row(0, named=True)
    assert row["ood_auroc_msp"] == pytest.approx(roc_auc_score(ind, zs_s.confidence), abs=8 * len(y) * EPS)
    assert row["ood_aupr_negent"] == pytest.approx(average_precision_score(ind, -zs_s.entropy), abs=8 * len(y) * EPS)
    ts = softmax_stats(tta, 1.5)
    row = a.filter(a["calibrator"] == "temperature").row(0, named=True)
    assert row["ood_fpr95_msp"] == slow_fpr95(ts.confidence, ind)
    # shard by shard equals one shard
    ood_run(tmp_path / "split", np.random.default_rng(12345), parts=4)
    one = ood.metrics
    many = calibrate_paths([tmp_path / "split"], **kw).metrics
    for col in OOD_NAMES:
        assert np.array_equal(one[col].to_numpy(), many[col].to_numpy()), col


def test_ood_run_without_ood_rows_is_missing_with_reason(tmp_path, rng):
    k = 4
    y, zs, tta = synthetic_logits(30, k, rng)
    write_pa(tmp_path / "p.parquet", _kv("noise@dtd", k, **OOD_KV), np.arange(30), y, zs, tta)
    rep = calibrate_paths([tmp_path], calibrators="none,zaec")
    assert np.isnan(rep.metrics.select(OOD_NAMES).to_numpy()).all()
    assert np.isfinite(rep.metrics["accuracy"].to_numpy()).all()
    for name in ("zero-shot", "none", "zaec"):
        why = rep.missing[f"RN50/noise@dtd/tda/seed=1|{name}"]
        assert all("no out-of-distribution row" in why[c] for c in OOD_NAMES)
    write_metrics(rep, tmp_path / "out")
    notes = json.loads((tmp_path / "out" / "notes.json").read_text())
    assert "no out-of-distribution row" in json.dumps(notes["missing"])


def test_ood_run_of_ood_rows_only(tmp_path, rng):
    k = 4
    _, zs, tta = synthetic_logits(20, k, rng)
    write_pa(tmp_path / "p.parquet", _kv("noise@dtd", k, **OOD_KV), np.arange(20), np.full(20, -1), zs, tta)
    rep = calibrate_paths([tmp_path], calibrators="none")
    assert rep.metrics["n"].to_list() == [0, 0]
    assert np.isnan(rep.metrics.select("accuracy", "ece", *OOD_NAMES).to_numpy()).all()
    why = rep.missing["RN50/noise@dtd/tda/seed=1|none"]
    assert "no in-distribution row" in why["ood_auroc_msp"] and why["auroc_msp"] == "no samples"


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def bad_ood_case(name, root, rng):
    k = 4
    y, zs, tta = synthetic_logits(12, k, rng)
    y = y.astype(np.int64)
    y[8:] = -1
    if name == "ood_labels_without_ood_for":  # a run mixing labelled and OOD rows without the ID set
        f = write_pa(root / "a.parquet", _kv("noise", k), np.arange(12), y, zs, tta)
        return f, "value(s) of -1 (out-of-distribution"
    if name == "class_names_differ":
        write_pa(root / "id" / "a.parquet", _kv("dtd", k), np.arange(8), y[:8], zs[:8], tta[:8])
        names = ["c0", "c1", "other", "c3"]
        f = write_pa(root / "ood" / "a.parquet", _kv("noise@dtd", k, names, **OOD_KV), np.arange(12), y, zs, tta)
        return f, "must use the class names of its in-distribution set 'dtd'"
    if name == "dataset_key":
        f = write_pa(root / "a.parquet", _kv("noise", k, **OOD_KV), np.arange(12), y, zs, tta)
        return f, "must be 'noise@dtd'"
    if name == "ood_for_without_ood_dataset":
        f = write_pa(root / "a.parquet", _kv("noise@dtd", k, **{"zaec:ood_for": "dtd"}), np.arange(12), y, zs, tta)
        return f, "needs a non-empty 'zaec:ood_dataset'"
    if name == "sample_id_kind":
        f = write_pa(root / "a.parquet", _kv("noise@dtd", k, **OOD_KV, **{"zaec:ood_n_id": "8", "zaec:ood_n_ood": "4"}),
                     np.r_[np.arange(7), 9, 8, 10, 11, 7], y, zs, tta)
        return f, "column 'sample_id' has 2 value(s) outside their kind's range"
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["ood_labels_without_ood_for", "class_names_differ", "dataset_key",
                                  "ood_for_without_ood_dataset", "sample_id_kind"])
def test_bad_ood_input_one_line_exit_2(name, tmp_path, rng, capsys):
    path, fragment = bad_ood_case(name, tmp_path, rng)
    code, out, err = run_cli([tmp_path, "--out", tmp_path / "out", "--quiet"], capsys)
    assert code == 2
    lines = [x for x in err.strip().splitlines() if x]
    assert len(lines) == 1 and fragment in lines[0] and str(path) in lines[0], err
    assert "Traceback" not in err


def test_console_shows_trust_and_ood_columns_and_words_ood_counts_apart(tmp_path, rng, capsys):
    """Issue 32 item 6: the console's views hold the selective and OOD columns (percent of metrics.csv), an OOD
    run's count reads `90 ID + 60 OOD` (not `90 of 150`, a partial run's wording), and the last line names
    notes.json too."""
    from calibrate.cli import main
    from calibrate.console import console_views, count_text

    ood_run(tmp_path / "s" / "ood", rng)
    y, zs, tta = synthetic_logits(40, 5, rng)
    write_pa(tmp_path / "s" / "plain" / "p.parquet", _kv("dtd", 5, **{"zaec:n_total": "40", "zaec:limit": "none"}),
             np.arange(40), y, zs, tta)
    rep = calibrate_paths([tmp_path / "s"], calibrators="none,zaec", temperature=1.5)
    m = rep.metrics
    for score in SCORES:
        views = console_views(m, score)
        assert set(views) == {"calibration", "selective", "ood"}
        sel, ood = views["selective"], views["ood"]
        for head, col in (("AURC", f"aurc_{score}"), ("E-AURC", f"eaurc_{score}"), ("AUROC", f"auroc_{score}"),
                          ("FPR95", f"fpr95_{score}"), ("cw-ECE", "cw_ece_15w"), ("tl-ECE", "tl_ece_15w")):
            np.testing.assert_array_equal(sel[head].to_numpy(), 100.0 * m[col].to_numpy())
        is_ood = m["dataset"] == "noise@dtd"
        assert ood.height == int(is_ood.sum()) == 3  # the OOD run's rows only
        for head in ("AUROC", "FPR95", "AUPR"):
            np.testing.assert_array_equal(ood[f"OOD {head}"].to_numpy(),
                                          100.0 * m.filter(is_ood)[f"ood_{head.lower()}_{score}"].to_numpy())
    n = dict(zip(views["calibration"]["run"], views["calibration"]["n"]))
    assert n == {"RN50/noise@dtd/tda/seed=1": "90 ID + 60 OOD", "RN50/dtd/tda/seed=1": "40"}
    assert count_text({"n": 5, "n_ood": None, "n_total": 24, "partial": True}) == "5 of 24, partial"
    assert count_text({"n": 80, "n_ood": 50, "n_total": 150, "partial": True}) == "80 ID + 50 OOD of 150, partial"
    assert "ood" not in console_views(m.filter(~is_ood))  # no OOD run: no OOD view
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "s"), "--out", str(tmp_path / "o"), "--temperature", "1.5", "--score", "negent"])
    out, err = capsys.readouterr()
    assert e.value.code in (0, None), err
    assert "90 ID + 60 OOD" in out and "90 of 150" not in out
    assert "out-of-distribution detection" in out and "negative entropy" in out and "E-AURC" in out
    last = " ".join(out.split()).rsplit("wrote ", 1)[1]  # the last line, however the console wrapped it
    assert last == " ".join(f"{tmp_path / 'o' / f}," for f in ("metrics.parquet", "metrics.csv"))[:-1] + \
        f" and {tmp_path / 'o' / 'notes.json'}"
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "s"), "--out", str(tmp_path / "o2"), "--score", "auroc"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "msp, negent" in err
    assert not (tmp_path / "o2").exists()
