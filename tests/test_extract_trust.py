"""Extraction you can trust with real data: stale data is never served, partial runs and bad input are named."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from extract_fixtures import (  # noqa: F401  (pytest fixtures)
    make_json_dataset,
    tiny_model,
    tiny_model_dir,
)

from extract.datasets import load_testset
from extract.fingerprint import fingerprint
from extract.runner import RunError, run_extraction
from schemas import read_shard

SMALL = dict(part_size=8, adapt_batch=4, chunk_size=5, batch_size=3, progress=False)


def _run(root, out, cache, model, method="zero-shot", **kw):
    return run_extraction(method, "dtd", data_root=root, out=out, cache_dir=cache, model=model,
                          **{**SMALL, **kw})


def _logits(paths):
    return np.concatenate([read_shard(p).zs_logits for p in paths])


def _ids(paths):
    return np.concatenate([read_shard(p).sample_id for p in paths])


@pytest.fixture
def two_roots(tmp_path):
    """Two copies of one dataset with the same split file; the second copy's images differ."""
    a, b = tmp_path / "a", tmp_path / "b"
    make_json_dataset(a, "dtd", n_classes=3, per_class=2, seed=0)
    split = (a / "dtd" / "split_zhou_DescribableTextures.json").read_text()
    make_json_dataset(b, "dtd", n_classes=3, per_class=2, seed=5)  # other pixels, same names and labels
    assert (b / "dtd" / "split_zhou_DescribableTextures.json").read_text() != split  # other shuffle...
    (b / "dtd" / "split_zhou_DescribableTextures.json").write_text(split)  # ...made identical
    return a, b


def test_fingerprint_modes_notice_changes(two_roots):
    a, b = two_roots
    ta, tb = load_testset("dtd", a), load_testset("dtd", b)
    assert ta.fingerprint() == tb.fingerprint()  # the sample list cannot tell the copies apart
    assert fingerprint(ta) != fingerprint(tb)
    assert fingerprint(ta).startswith("stat:") and fingerprint(ta, "content").startswith("content:")
    before = {m: fingerprint(ta, m) for m in ("stat", "content")}
    p = ta.paths[0]
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: same bytes, new time
    assert fingerprint(ta, "stat") != before["stat"] and fingerprint(ta, "content") == before["content"]
    shutil.copyfile(ta.paths[1], p)  # replaced bytes
    assert fingerprint(ta, "content") != before["content"]
    with pytest.raises(Exception, match="available: stat, content"):
        fingerprint(ta, "mtime")


def test_other_root_same_split_recomputes_or_refuses(tmp_path, two_roots, tiny_model):  # noqa: F811
    a, b = two_roots
    out, cache = tmp_path / "out", tmp_path / "cache"
    pa_ = _run(a, out, cache, tiny_model)
    meta = read_shard(pa_[0]).meta.extra
    assert meta["zaec:data_root"] == str(a.resolve())
    assert meta["zaec:data_fingerprint"] == fingerprint(load_testset("dtd", a))
    # same --out: the finished run is not served for the other copy; the refusal says why
    with pytest.raises(RunError, match=r"data_fingerprint \(the image files changed.*data_root \(another data root"):
        _run(b, out, cache, tiny_model)
    # a new --out, the same cache: recomputed from the other copy's images
    pb = _run(b, tmp_path / "out_b", cache, tiny_model)
    la, lb = _logits(pa_), _logits(pb)
    np.testing.assert_array_equal(_ids(pa_), _ids(pb))
    assert not np.allclose(la, lb)
    ref = _run(b, tmp_path / "ref", tmp_path / "fresh_cache", tiny_model)
    np.testing.assert_array_equal(lb, _logits(ref))  # equals a run that never saw the first copy


def test_changed_image_in_place_recomputes(tmp_path, two_roots, tiny_model):  # noqa: F811
    a, b = two_roots
    out, cache = tmp_path / "out", tmp_path / "cache"
    first = _logits(_run(a, out, cache, tiny_model))
    ts = load_testset("dtd", a)
    sid = int(_ids(_run(a, out, cache, tiny_model))[0])  # the finished run is reused while nothing changed
    shutil.copyfile(load_testset("dtd", b).paths[sid], ts.paths[sid])  # the image is fixed in place
    with pytest.raises(RunError, match="data_fingerprint"):
        _run(a, out, cache, tiny_model)
    again = _logits(_run(a, out, cache, tiny_model, force=True))
    assert not np.array_equal(again[0], first[0])  # the fixed image was re-encoded, not served from the cache
    np.testing.assert_array_equal(again[1:], first[1:])  # the others are the same images
    ref = _logits(_run(a, tmp_path / "ref", tmp_path / "fresh_cache", tiny_model))
    np.testing.assert_array_equal(again, ref)


def test_writer_announces_counts_and_resumed_parts_agree(tmp_path, tiny_model):  # noqa: F811
    from calibrate.run import check_complete
    from schemas import PartialRunError, find_shards, group_shards

    root = tmp_path / "data"
    make_json_dataset(root, "dtd", n_classes=3, per_class=6)  # 18 samples; parts of 8 rows
    out, cache = tmp_path / "out", tmp_path / "cache"
    limited = _run(root, out, cache, tiny_model, limit=8)
    assert read_shard(limited[0]).meta.extra["zaec:limit"] == "8"
    assert read_shard(limited[0]).meta.extra["zaec:n_total"] == "18"
    full = _run(root, out, cache, tiny_model)  # keeps part 0, restamps it with this run's limit
    assert [read_shard(p).meta.extra["zaec:limit"] for p in full] == ["none"] * 3
    assert check_complete(group_shards(find_shards([out]))) == []
    full[-1].unlink()  # a crash before the last part: 16 of 18 rows
    (full[0].parent / "_zaec_complete.json").unlink()
    with pytest.raises(PartialRunError, match="16 of 18 samples in 2 shard"):
        check_complete(group_shards(find_shards([out])))
