"""Out-of-distribution runs end to end on the tiny model: the mixed stream, its shards against the contract
(docs/contract.md, "Out-of-distribution runs"), the pairing with the plain run, resume, bad input, and
`zaec-calibrate` on the result."""

from __future__ import annotations

import json
import zlib

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from extract.cli import app
from extract.datasets import DatasetError, load_ood_images, load_testset
from extract.run import writer as run_writer
from extract.runner import run_extraction
from schemas.shard import OOD_LABEL, read_shard, validate_shard

from tests.support.extract import interrupt_nth_write, make_json_dataset, write_image

SMALL = dict(part_size=8, adapt_batch=4, chunk_size=5, batch_size=3, progress=False)
N_ID, N_OOD = 18, 7
EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """dtd (3 classes x 6) and NINCO's layout with 7 images in nested folders (their names are no classes)."""
    root = tmp_path_factory.mktemp("ood-data")
    make_json_dataset(root, "dtd", n_classes=3, per_class=6)
    rng = np.random.default_rng(7)
    for i in range(N_OOD):
        write_image(root / "NINCO" / "NINCO_OOD_classes" / f"c{i % 2}" / ("deep" if i == 3 else "") / f"x{i}.png",
                    rng)
    return root


def _run(method, dataset, tmp_path, model, data_root, **kw):
    args = dict(SMALL, data_root=data_root, out=tmp_path / "out", cache_dir=tmp_path / "cache", model=model)
    return run_extraction(method, dataset, **{**args, **kw})


def _table(paths):
    shards = [read_shard(p) for p in paths]
    cols = {k: np.concatenate([getattr(s, k) for s in shards])
            for k in ("sample_id", "label", "zs_logits", "tta_logits", "stream_pos")}
    return shards, cols


def _reference_stream(key: str, seed: int, n: int) -> np.ndarray:
    """docs/extract.md, "Out-of-distribution runs": one permutation of the n_id + n_ood sample ids, seeded by the
    seed and the run's dataset key `<ood>@<id>` (written out here, not taken from `stream_permutation`)."""
    return np.random.default_rng([seed, zlib.crc32(key.encode())]).permutation(n)


def test_ood_images_listing(data_root):
    ts = load_ood_images("ninco", data_root)
    rel = [p.relative_to(ts.dataset_dir).as_posix() for p in ts.paths]
    assert rel == sorted(rel) and len(rel) == N_OOD and "c1/deep/x3.png" in rel
    assert ts.class_names == () and (ts.labels == OOD_LABEL).all()
    # a labelled set as OOD: its test list, labels dropped
    dtd = load_ood_images("dtd", data_root)
    assert dtd.paths == load_testset("dtd", data_root).paths and (dtd.labels == OOD_LABEL).all()


def test_mixed_run_shards_follow_the_contract(tmp_path, tiny_model, data_root, running_mean):
    plain = _run("zero-shot", "dtd", tmp_path, tiny_model, data_root)
    parts = _run("zero-shot", "ninco", tmp_path, tiny_model, data_root, ood_for="dtd")
    shards, t = _table(parts)
    for p in parts:
        validate_shard(p)
    meta = shards[0].meta
    assert meta.dataset == "ninco@dtd" and meta.ood_for == "dtd" and meta.ood_dataset == "ninco"
    assert meta.extra["zaec:ood_n_id"] == str(N_ID) and meta.extra["zaec:ood_n_ood"] == str(N_OOD)
    assert meta.extra["zaec:n_total"] == str(N_ID + N_OOD)
    ts = load_testset("dtd", data_root)
    assert tuple(meta.class_names) == ts.class_names
    # the documented stream, the documented sample ids and labels
    assert np.array_equal(t["stream_pos"], np.arange(N_ID + N_OOD))
    assert np.array_equal(t["sample_id"], _reference_stream("ninco@dtd", 1, N_ID + N_OOD))
    sid = t["sample_id"]
    want = np.where(sid < N_ID, ts.labels[np.minimum(sid, N_ID - 1)], OOD_LABEL)
    assert np.array_equal(t["label"], want)
    # the in-distribution rows pair up with the plain run's: same sample id, same image, same zero-shot logits up to
    # the encoder's batch composition (images share micro-batches with others in each run): a few float32 eps per
    # term of the longest reduction (the 3 x 8 x 8 patch convolution), times the logit scale
    _, p = _table(plain)
    order = np.argsort(sid)[:N_ID]
    tol = 4 * 192 * EPS32 * tiny_model.logit_scale
    assert np.allclose(t["zs_logits"][order], p["zs_logits"][np.argsort(p["sample_id"])], rtol=0, atol=tol)
    # the stream is the same for every method, and an online method sees the mixed stream (its ID rows differ)
    online = _run(running_mean, "ninco", tmp_path, tiny_model, data_root, ood_for="dtd")
    _, o = _table(online)
    assert np.array_equal(o["sample_id"], t["sample_id"])
    plain_rm = _table(_run(running_mean, "dtd", tmp_path, tiny_model, data_root))[1]
    mixed_id = o["tta_logits"][np.argsort(o["sample_id"])[:N_ID]]
    assert not np.allclose(mixed_id, plain_rm["tta_logits"][np.argsort(plain_rm["sample_id"])], atol=1e-3)


def test_mixed_run_has_its_own_cache_and_run_folder(tmp_path, tiny_model, data_root):
    _run("zero-shot", "dtd", tmp_path, tiny_model, data_root)
    _run("zero-shot", "ninco", tmp_path, tiny_model, data_root, ood_for="dtd")
    runs = sorted(p.name for p in (tmp_path / "out").glob("*/dataset=*"))
    assert runs == ["dataset=dtd", "dataset=ninco@dtd"]
    caches = {p.relative_to(tmp_path / "cache").as_posix().split("/")[1] for p in (tmp_path / "cache").rglob("*")
              if p.is_file() and "text" not in p.as_posix()}
    assert any("ninco@dtd" in c for c in caches) and any(c.startswith("dtd") for c in caches), caches


def test_mixed_run_marker_accuracy_counts_in_distribution_rows(tmp_path, tiny_model, data_root):
    parts = _run("zero-shot", "ninco", tmp_path, tiny_model, data_root, ood_for="dtd")
    _, t = _table(parts)
    marker = json.loads((parts[0].parent / "_zaec_complete.json").read_text())
    ind = t["label"] >= 0
    want = float((t["zs_logits"][ind].argmax(1) == t["label"][ind]).mean())
    assert marker["zero_shot_accuracy"] == pytest.approx(want, abs=1e-12)


def test_mixed_run_resumes_equal_to_uninterrupted(tmp_path, tiny_model, data_root, running_mean, monkeypatch):
    whole = _table(_run(running_mean, "ninco", tmp_path / "a", tiny_model, data_root, ood_for="dtd"))[1]
    real = interrupt_nth_write(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        _run(running_mean, "ninco", tmp_path / "b", tiny_model, data_root, ood_for="dtd")
    monkeypatch.setattr(run_writer, "write_shard", real)
    resumed = _table(_run(running_mean, "ninco", tmp_path / "b", tiny_model, data_root, ood_for="dtd"))[1]
    for k in whole:
        assert np.array_equal(whole[k], resumed[k]), k


@pytest.mark.parametrize("dataset, ood_for, needle", [
    ("ninco", "dtdd", "--ood-for: unknown dataset 'dtdd'; available: "),
    ("dtd", "dtd", "--dataset 'dtd' is the in-distribution set itself (--ood-for 'dtd')"),
    ("dtd", "ninco", "--ood-for 'ninco' is an out-of-distribution set (no classes)"),
    ("ninco", None, "dataset 'ninco' is an out-of-distribution set (images without classes); run it against"),
    ("ninco", "caltech101", "dataset 'caltech101' not found under data root"),
    ("inaturalist", "dtd", "ImageNet_OOD_dataset/iNaturalist/<any sub-folders>/<image>"),
])
def test_bad_ood_input_one_line_before_the_model(tmp_path, data_root, tiny_model_dir, monkeypatch, dataset, ood_for,
                                                 needle):
    import extract.runner

    def no_model(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(extract.runner, "load_model", no_model)
    args = ["--method", "tda", "--dataset", dataset, "--data-root", str(data_root), "--out", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache"), "--pretrained", f"local-dir:{tiny_model_dir}", "--quiet"]
    r = CliRunner().invoke(app, args + (["--ood-for", ood_for] if ood_for else []), catch_exceptions=False)
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_file_in_both_sets_refused(data_root):
    """A `folder:` OOD set that is dtd's own image folder: every image would be in both sets."""
    from extract.datasets import resolve_dataset
    from extract.run.ood import load_mixed_data
    from extract.run.options import RunOptions, plan

    name = resolve_dataset(f"folder:{data_root / 'dtd' / 'images'}", name="dtd-copy")
    with pytest.raises(DatasetError, match=r"'dtd-copy' and --ood-for 'dtd' share their images: 18 of the 18 "):
        load_mixed_data(plan(RunOptions("zero-shot", name, data_root=str(data_root), ood_for="dtd")))


def test_textures_against_dtd_says_the_two_sets_share_their_images(tmp_path, tiny_model_dir, data_root):
    """Issue 35 item 9: `--dataset textures --ood-for dtd` was refused with "18 image file(s) ... listed more than
    once", right but not what the user needs to know: that the two sets share their images (textures is DTD)."""
    args = ["--method", "zero-shot", "--dataset", "textures", "--ood-for", "dtd", "--data-root", str(data_root),
            "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--pretrained",
            f"local-dir:{tiny_model_dir}", "--device", "cpu", "--quiet"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    (line,) = r.stderr.strip().splitlines()
    assert "--dataset 'textures' and --ood-for 'dtd' share their images: 18 of the 18 out-of-distribution images " \
        "are test images of 'dtd'" in line
    assert "textures: Textures: all 5,640 DTD images" in line and "listed more than once" not in line


def test_calibrate_reports_ood_metrics(tmp_path, tiny_model, data_root):
    from calibrate.cli import main

    parts = _run("zero-shot", "ninco", tmp_path, tiny_model, data_root, ood_for="dtd")
    with pytest.raises(SystemExit) as done:
        main([str(parts[0].parent), "--out", str(tmp_path / "cal")])
    assert done.value.code == 0
    m = pl.read_csv(tmp_path / "cal" / "metrics.csv")
    row = m.filter(pl.col("calibrator") == "zero-shot").row(0, named=True)
    _, t = _table(parts)
    z = t["zs_logits"].astype(np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    conf = (p / p.sum(1, keepdims=True)).max(1)
    ind, ood = conf[t["label"] >= 0], conf[t["label"] < 0]
    # slow AUROC: in-distribution positive, ties count half
    slow = np.mean([(a > b) + 0.5 * (a == b) for a in ind for b in ood])
    assert row["ood_auroc_msp"] == pytest.approx(slow, abs=8 * len(conf) * EPS32)
    assert all(np.isfinite(row[c]) for c in ("ood_fpr95_msp", "ood_aupr_msp", "ood_auroc_negent"))
    assert row["n"] == N_ID  # accuracy and ECE on the in-distribution rows only
