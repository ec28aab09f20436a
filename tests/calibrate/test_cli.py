"""`zaec-calibrate` end to end on small shard sets: outputs, streaming == one shot, temperature-scaling sources,
per-sample output, and every bad input of the issue (one clear line on stderr, exit code 2, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from calibrate.calibrators import TemperatureScaling
from calibrate.functional.softmax import softmax_stats
from calibrate.functional.zaec import zaec_temperature
from calibrate.cli import main
from calibrate.metrics import ece, mce
from calibrate.ood import OOD_NAMES
from calibrate.run import COUNT_COLUMNS, METRIC_COLUMNS, SAMPLE_COLUMNS, calibrate_paths
from calibrate.synthetic import synthetic_logits, write_synthetic_run
from schemas.shard import RunKey, build_table, shard_path, write_shard


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def write_run(root, make_meta, rng, dataset="dtd", n=120, k=6, parts=3, method="tda", seed=1, **meta_kw):
    meta = make_meta(dataset=dataset, k=k, method=method, seed=seed, **meta_kw)
    y, zs, tta = synthetic_logits(n, k, rng)
    ids = rng.permutation(n)
    paths = []
    for i, idx in enumerate(np.array_split(np.arange(n), parts)):
        paths.append(write_shard(shard_path(root, meta.key, i), meta, ids[idx], y[idx], zs[idx], tta[idx]))
    return meta, ids, y, zs, tta, paths


def expected_metrics(logits, t, y, n_bins=20):
    s = softmax_stats(logits, t, y)
    correct = s.prediction == y
    return {
        "n": len(y), "accuracy": correct.mean(), "ece": ece(s.confidence, correct, n_bins),
        "mce": mce(s.confidence, correct, n_bins), "ece_mass": ece(s.confidence, correct, n_bins, "mass"),
        "nll": s.nll.mean(), "brier": s.brier.mean(), "mean_confidence": s.confidence.mean(),
        "mean_entropy": s.entropy.mean(),
    }


def test_end_to_end_outputs_match_one_shot_reference(tmp_path, make_meta, rng, capsys):
    _, ids, y, zs, tta, _ = write_run(tmp_path / "shards", make_meta, rng, dataset="dtd", parts=4)
    _, _, ys, _, ttas, _ = write_run(tmp_path / "shards", make_meta, rng, dataset="imagenet", n=300, k=6, parts=2)
    code, out, err = run_cli([tmp_path / "shards", "--out", tmp_path / "out", "--samples"], capsys)
    assert code in (0, None), err
    df = pl.read_parquet(tmp_path / "out" / "metrics.parquet")
    assert tuple(df.columns) == METRIC_COLUMNS
    csv = pl.read_csv(tmp_path / "out" / "metrics.csv")
    assert csv.shape == df.shape
    dtd = df.filter(pl.col("dataset") == "dtd")
    assert dtd["calibrator"].to_list() == ["zero-shot", "none", "temperature", "sals", "zaec"]
    t_fit = TemperatureScaling().fit(ttas, ys).temperature_
    notes = json.loads((tmp_path / "out" / "notes.json").read_text())
    assert list(notes["temperatures"].values()) == [pytest.approx(t_fit, rel=1e-9)]
    refs = {
        "zero-shot": expected_metrics(zs, 1.0, y),
        "none": expected_metrics(tta, 1.0, y),
        "temperature": expected_metrics(tta, t_fit, y),
        "sals": expected_metrics(tta, np.ptp(tta.astype(np.float64), 1) / np.ptp(zs.astype(np.float64), 1), y),
        "zaec": expected_metrics(tta, zaec_temperature(zs, tta), y),
    }
    for row in dtd.iter_rows(named=True):
        for k, v in refs[row["calibrator"]].items():
            assert row[k] == pytest.approx(v, rel=1e-9, abs=1e-12), (row["calibrator"], k)
    # accuracy never changes under a temperature
    assert dtd.filter(pl.col("calibrator") != "zero-shot")["accuracy"].n_unique() == 1
    assert "ECE %" in out and "temperature scaling fitted" in out
    # per-sample output
    s = pl.read_parquet(next((tmp_path / "out" / "samples").rglob("*.parquet")))
    assert set(SAMPLE_COLUMNS) <= set(s.columns)
    z = s.filter((pl.col("dataset") == "dtd") & (pl.col("calibrator") == "zaec")).sort("sample_id")
    order = np.argsort(ids)
    assert np.array_equal(z["sample_id"].to_numpy(), np.sort(ids))
    assert np.allclose(z["temperature"].to_numpy(), zaec_temperature(zs, tta)[order])
    t = s.filter((pl.col("dataset") == "dtd") & (pl.col("calibrator") == "temperature"))["temperature"]
    assert np.allclose(t.to_numpy(), t_fit)


def test_in_sample_temperature_scaling_is_noted(tmp_path, make_meta, rng):
    """Temperature scaling scored on the runs it was fitted on (the --ts-source dataset itself) is said to be."""
    write_run(tmp_path, make_meta, rng, dataset="dtd", n=60)
    src, *_ = write_run(tmp_path, make_meta, rng, dataset="imagenet", n=60)
    notes = [n for n in calibrate_paths([tmp_path], calibrators="temperature").notes if "in-sample" in n]
    assert notes == [f"{src.key}: 'temperature' is scored on the labelled logits its T was fitted on "
                     "(in-sample: --ts-source imagenet)"]
    assert not any("in-sample" in n for n in calibrate_paths([tmp_path], calibrators="temperature",
                                                            temperature=1.5).notes)  # fixed: fitted nowhere


def test_shard_splits_do_not_change_metrics(tmp_path, make_meta, rng):
    meta = make_meta(k=9)
    y, zs, tta = synthetic_logits(500, 9, rng)
    write_shard(shard_path(tmp_path / "one", meta.key, 0), meta, np.arange(500), y, zs, tta)
    perm = rng.permutation(500)
    for i, idx in enumerate(np.array_split(perm, [3, 90, 91, 400])):
        write_shard(shard_path(tmp_path / "many", meta.key, i), meta, idx, y[idx], zs[idx], tta[idx])
    kw = dict(calibrators="none,sals,zaec,zaec:strength=0.5,subset=all", binning="mass")
    a = calibrate_paths([tmp_path / "one"], **kw).metrics
    b = calibrate_paths([tmp_path / "many"], **kw).metrics
    assert a.select("calibrator", "n").equals(b.select("calibrator", "n"))
    for col in (c for c in METRIC_COLUMNS[5:] if c not in ("n", *COUNT_COLUMNS)):
        # the ood_* columns of a plain run are NaN in both
        assert np.allclose(a[col].to_numpy(), b[col].to_numpy(), rtol=1e-12, atol=1e-14,
                           equal_nan=col in OOD_NAMES), col


def test_temperature_sources(tmp_path, make_meta, rng, capsys, monkeypatch):
    write_run(tmp_path / "s", make_meta, rng, dataset="dtd")
    # no source shards: a clear note, the calibrator is skipped, the rest runs
    rep = calibrate_paths([tmp_path / "s"])
    assert "temperature" not in rep.metrics["calibrator"].to_list()
    assert any("skipped 'temperature'" in n and "--ts-source" in n for n in rep.notes)
    # another source dataset (the demo uses its clean set `fmnist`)
    write_run(tmp_path / "s", make_meta, rng, dataset="fmnist", n=200)
    rep = calibrate_paths([tmp_path / "s"], ts_source="fmnist")
    assert rep.metrics.filter(pl.col("calibrator") == "temperature").height == 2
    # a source larger than the in-memory budget is streamed again on every pass: same fit
    import calibrate.run as run_mod

    monkeypatch.setattr(run_mod, "TS_CACHE_BYTES", 100)
    streamed = calibrate_paths([tmp_path / "s"], ts_source="fmnist")
    assert streamed.temperatures == pytest.approx(rep.temperatures, rel=1e-12)
    # fixed temperature
    rep = calibrate_paths([tmp_path / "s"], temperature=1.7, calibrators="temperature")
    assert any("T = 1.7" in n for n in rep.notes)
    code, out, err = run_cli([tmp_path / "s", "--out", tmp_path / "o", "--temperature", "-1"], capsys)
    assert code == 2 and "--temperature must be finite and > 0" in err


def write_table(path, table):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def good_table(make_meta, k=4, n=5, **kw):
    meta = make_meta(k=k, **kw)
    rng = np.random.default_rng(0)
    return meta, build_table(meta, np.arange(n), rng.integers(0, k, n), rng.normal(size=(n, k)), rng.normal(size=(n, k)))


def bad_case(name, tmp_path, make_meta):
    """Write one bad shard set; returns (path to pass, expected message fragment)."""
    root = tmp_path / name
    meta, table = good_table(make_meta)
    f = root / "part-00000.parquet"
    if name == "empty_dir":
        root.mkdir()
        return root, "no shards (*.parquet) found"
    if name == "missing_path":
        return root / "nope", "no such file or directory"
    if name == "not_parquet":
        root.mkdir()
        f.write_text("hello")
        return root, "not a readable Parquet file"
    if name == "truncated":
        write_table(f, table)
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
        return root, "not a readable Parquet file"
    if name == "schema_version":
        kv = dict(table.schema.metadata)
        kv[b"zaec:schema"] = b"2"
        write_table(f, table.replace_schema_metadata(kv))
        return root, "schema version '2' is not supported"
    if name == "missing_column":
        write_table(f, table.drop(["tta_logits"]).replace_schema_metadata(table.schema.metadata))
        return root, "missing required column 'tta_logits'"
    if name == "k_mismatch_zs_tta":
        rng = np.random.default_rng(0)
        other = pa.FixedSizeListArray.from_arrays(pa.array(rng.normal(size=15).astype(np.float32)), 3)
        t = table.set_column(table.schema.get_field_index("tta_logits"), "tta_logits", other)
        write_table(f, t.replace_schema_metadata(table.schema.metadata))
        return root, "column 'tta_logits' has 3 logits per row but 'zaec:num_classes' is 4"
    if name == "k_vs_num_classes":
        kv = dict(table.schema.metadata)
        kv[b"zaec:num_classes"] = b"5"
        kv[b"zaec:class_names"] = json.dumps([f"c{i}" for i in range(5)]).encode()
        write_table(f, table.replace_schema_metadata(kv))
        return root, "has 4 logits per row but 'zaec:num_classes' is 5"
    if name == "label_range":
        t = table.set_column(1, "label", pa.array(np.array([0, 1, 4, 2, -1], dtype=np.int32)))
        write_table(f, t.replace_schema_metadata(table.schema.metadata))
        return root, "column 'label' has 2 value(s) outside [0, 4)"
    if name == "nonfinite":
        zs = np.zeros((5, 4), dtype=np.float32)
        zs[1, 2], zs[3, 0] = np.nan, np.inf
        write_shard(f, meta, np.arange(5), np.zeros(5), zs, np.ones((5, 4)))
        return root, "2 row(s) have NaN or inf"
    if name == "duplicate_across_shards":
        write_table(f, table)
        write_table(root / "part-00001.parquet", table.slice(2, 2))
        return root, "already appear in another shard of run"
    if name == "duplicate_within_shard":
        t = table.set_column(0, "sample_id", pa.array(np.array([0, 1, 1, 2, 3], dtype=np.int64)))
        write_table(f, t.replace_schema_metadata(table.schema.metadata))
        return root, "column 'sample_id' has 1 duplicate value(s)"
    if name == "metadata_disagreement":
        write_table(f, table)
        _, t2 = good_table(make_meta, method_config={"alpha": 2})
        write_table(root / "part-00001.parquet", t2)
        return root, "metadata 'method_config' disagrees"
    if name == "zero_rows":
        write_table(f, table.slice(0, 0))  # a valid shard with no row: NaN metrics if it were let through
        return root, "holds no samples"
    raise AssertionError(name)


BAD = ["empty_dir", "missing_path", "not_parquet", "truncated", "schema_version", "missing_column",
       "k_mismatch_zs_tta", "k_vs_num_classes", "label_range", "nonfinite", "duplicate_across_shards",
       "duplicate_within_shard", "metadata_disagreement", "zero_rows"]


@pytest.mark.parametrize("name", BAD)
def test_bad_input_one_line_exit_2(name, tmp_path, make_meta, capsys):
    path, fragment = bad_case(name, tmp_path, make_meta)
    code, out, err = run_cli([path, "--out", tmp_path / "out", "--quiet"], capsys)
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("zaec-calibrate: error: "), err
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err
    if name not in ("empty_dir", "missing_path"):
        assert str(tmp_path / name) in lines[0]  # the message names the file
    assert not (tmp_path / "out" / "metrics.parquet").exists()  # nothing half-written


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--calibrators", "none,zeac"], "unknown calibrator 'zeac'; available: none, temperature, sals, zaec"),
        (["--calibrators", "zaec:lambda=1"], "no option 'lambda'; valid options: strength, subset"),
        (["--calibrators", "zaec:subset=most"], "valid: reduced, all, increased"),
        (["--binning", "quantile"], "unknown binning 'quantile'; valid: width, mass"),
        (["--bins", "0"], "n_bins must be a positive integer"),
        (["--bins", "x"], "Invalid value for '--bins'"),
        (["--frobnicate"], "No such option: --frobnicate"),
    ],
)
def test_bad_options(args, fragment, tmp_path, make_meta, rng, capsys):
    write_run(tmp_path / "s", make_meta, rng)
    code, out, err = run_cli([tmp_path / "s", "--out", tmp_path / "o", "--quiet", *args], capsys)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1


def test_drop_nonfinite_reports_count(tmp_path, make_meta, capsys):
    path, _ = bad_case("nonfinite", tmp_path, make_meta)
    code, out, err = run_cli([path, "--out", tmp_path / "out", "--drop-nonfinite", "--calibrators", "none,zaec"], capsys)
    assert code in (0, None), err
    assert "dropped 2 row(s) with NaN or inf" in out
    df = pl.read_parquet(tmp_path / "out" / "metrics.parquet")
    assert df["n"].to_list() == [3, 3, 3]


def test_console_script_never_prints_a_traceback(tmp_path):
    exe = Path(sys.executable).with_name("zaec-calibrate")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "calibrate.cli"]
    r = subprocess.run([*cmd, str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"zaec-calibrate: error: {tmp_path / 'missing'}: no such file or directory"


def test_tables_subcommand_dispatch(monkeypatch):
    import types

    seen = {}
    fake = types.ModuleType("calibrate.tables.cli")

    def fake_main(argv):
        seen.update(args=argv)
        raise SystemExit(0)

    fake.main = fake_main
    monkeypatch.setitem(sys.modules, "calibrate.tables.cli", fake)
    with pytest.raises(SystemExit):
        main(["tables", "shards", "--out", "x"])
    assert seen == {"args": ["shards", "--out", "x"]}


def test_synthetic_generator_writes_valid_shards(tmp_path):
    from schemas.shard import find_shards, group_shards, validate_shard

    paths = write_synthetic_run(tmp_path, "eurosat", 250, 10, rows_per_shard=100)
    assert len(paths) == 3 and all(validate_shard(p) == [] for p in paths)
    groups = group_shards(find_shards([tmp_path]))
    assert list(groups) == [RunKey("ViT-B-16", "eurosat", "synthetic-tta", 1)]
    rep = calibrate_paths([tmp_path], calibrators="none,zaec")
    none, zaec = rep.metrics.filter(pl.col("calibrator") != "zero-shot").iter_rows(named=True)
    # synthetic TTA is sharper than zero-shot; ZAEC raises the entropy, never the accuracy
    assert zaec["mean_entropy"] > none["mean_entropy"] and zaec["accuracy"] == none["accuracy"]


def test_missing_argument_is_one_line(capsys):
    code, out, err = run_cli([], capsys)
    assert code == 2 and err.strip() == "zaec-calibrate: error: Missing argument 'paths'. (see zaec-calibrate --help)"


def test_synthetic_entry_point(tmp_path, capsys):
    from calibrate import synthetic

    assert synthetic.main([str(tmp_path / "a"), "--scale", "0.001", "--datasets", "dtd,eurosat"]) == 0
    assert len(list((tmp_path / "a").rglob("*.parquet"))) == 2
    assert synthetic.main([str(tmp_path / "b"), "--datasets", "dtdd"]) == 2
    assert "unknown dataset(s) dtdd; available: imagenet" in capsys.readouterr().err


def test_cpu_stage_never_imports_the_gpu_stack(tmp_path):
    """calibrate/ and schemas/ run without torch, open_clip or extract/ (they sit behind the `extract` extra).

    Checked in a fresh interpreter: after a whole zaec-calibrate run and a whole tables run on synthetic shards,
    none of them has been imported.
    """
    import subprocess
    import textwrap

    code = textwrap.dedent(f"""
        import sys
        from calibrate.synthetic import write_synthetic_benchmark
        from calibrate.cli import main
        write_synthetic_benchmark({str(tmp_path / "s")!r}, scale=0.01, datasets=["imagenet", "dtd"], methods=["tda"])
        for argv in (["{tmp_path / 's'}", "--out", "{tmp_path / 'm'}", "--quiet"],
                     ["tables", "{tmp_path / 's'}", "--out", "{tmp_path / 't'}", "--bootstrap", "20", "--quiet"]):
            try:
                main(argv)
            except SystemExit as e:
                assert not e.code, e.code
        loaded = sorted({{m.split(".")[0] for m in sys.modules}} & {{"torch", "torchvision", "open_clip", "extract"}})
        print("loaded:", loaded)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("loaded: []"), r.stdout[-500:]
    assert (tmp_path / "m" / "metrics.parquet").is_file() and (tmp_path / "t" / "README.md").is_file()
