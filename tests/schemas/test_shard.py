"""The shard contract (schemas/): round trip, atomic writes, and one test per validation error."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import schemas.shard as shard_mod
from schemas.shard import (
    META_KEYS,
    REQUIRED_COLUMNS,
    RunKey,
    ShardError,
    build_table,
    find_shards,
    group_shards,
    iter_run,
    read_meta,
    read_shard,
    shard_path,
    validate_shard,
    write_shard,
)


def sample(k=4, n=6, seed=0):
    rng = np.random.default_rng(seed)
    return np.arange(n), rng.integers(0, k, n), rng.normal(size=(n, k)), rng.normal(size=(n, k))


def test_round_trip_and_layout(tmp_path, make_meta):
    meta = make_meta(k=4, extra={"zaec:note": "x"})
    ids, y, zs, tta = sample()
    p = write_shard(shard_path(tmp_path, meta.key, 3), meta, ids, y, zs, tta, stream_pos=ids[::-1])
    assert p == tmp_path / "backbone=ViT-B-16" / "dataset=dtd" / "method=tda" / "seed=1" / "part-00003.parquet"
    s = read_shard(p)
    assert s.meta == meta and s.meta.extra == {"zaec:note": "x"}
    assert np.array_equal(s.sample_id, ids) and s.sample_id.dtype == np.int64 and s.label.dtype == np.int32
    assert s.zs_logits.dtype == np.float32 and np.array_equal(s.zs_logits, zs.astype(np.float32))
    assert np.array_equal(s.tta_logits, tta.astype(np.float32)) and np.array_equal(s.stream_pos, ids[::-1])
    schema = pq.read_schema(p)
    assert schema.field("zs_logits").type == pa.list_(pa.float32(), 4)
    assert all(v for k, v in schema.metadata.items() if k.decode() in META_KEYS)
    assert set(k.decode() for k in schema.metadata) >= set(META_KEYS)
    assert validate_shard(p) == []
    # an empty shard is valid
    e = write_shard(tmp_path / "e.parquet", meta, [], [], np.zeros((0, 4)), np.zeros((0, 4)))
    assert len(read_shard(e)) == 0


def test_atomic_write_keeps_old_file_and_leaves_no_temp(tmp_path, make_meta, monkeypatch):
    meta = make_meta()
    ids, y, zs, tta = sample(k=5)
    p = write_shard(tmp_path / "s.parquet", meta, ids, y, zs, tta)
    before = p.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(shard_mod.pq, "write_table", boom)
    with pytest.raises(OSError, match="disk full"):
        write_shard(tmp_path / "s.parquet", meta, ids, y, zs + 1, tta)
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["s.parquet"]  # no temporary left behind
    # hidden temporaries are never picked up as shards
    (tmp_path / ".s.parquet.abc.tmp").write_text("partial")
    (tmp_path / ".hidden.parquet").write_text("partial")
    assert find_shards([tmp_path]) == [p.resolve()]


def test_atomic_write_gives_the_usual_permissions(tmp_path, make_meta):
    # mkstemp creates 0600 files; a shard must be as readable as a plainly opened file (shared clusters)
    mask = os.umask(0o022)
    try:
        ids, y, zs, tta = sample(k=5)
        p = write_shard(tmp_path / "s.parquet", make_meta(), ids, y, zs, tta)
    finally:
        os.umask(mask)
    assert p.stat().st_mode & 0o777 == 0o644


def _write(path: Path, table: pa.Table) -> Path:
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda kv: kv.pop(b"zaec:schema"), "not a zaec shard"),
        (lambda kv: kv.update({b"zaec:schema": b"0"}), "schema version '0' is not supported; expected '1'"),
        (lambda kv: kv.pop(b"zaec:backbone"), "missing key(s) zaec:backbone"),
        (lambda kv: kv.update({b"zaec:class_names": b"[oops"}), "'zaec:class_names' is not valid JSON"),
        (lambda kv: kv.update({b"zaec:class_names": b'{"a": 1}'}), "must be a JSON list"),
        (lambda kv: kv.update({b"zaec:method_config": b"[1]"}), "'zaec:method_config' must be a JSON dict"),
        (lambda kv: kv.update({b"zaec:seed": b"one"}), "'zaec:seed' must be an integer"),
        (lambda kv: kv.update({b"zaec:num_classes": b"3"}), "has 5 names but 'zaec:num_classes' is 3"),
    ],
)
def test_metadata_errors(tmp_path, make_meta, mutate, fragment):
    ids, y, zs, tta = sample(k=5)
    table = build_table(make_meta(k=5), ids, y, zs, tta)
    kv = dict(table.schema.metadata)
    mutate(kv)
    p = _write(tmp_path / "bad.parquet", table.replace_schema_metadata(kv))
    with pytest.raises(ShardError) as e:
        read_shard(p)
    assert fragment in str(e.value) and str(p) in str(e.value)
    assert validate_shard(p) == [str(e.value)]


def _replace(table, name, array):
    i = table.schema.get_field_index(name)
    return table.set_column(i, name, array).replace_schema_metadata(table.schema.metadata)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda t: t.drop(["label"]).replace_schema_metadata(t.schema.metadata), "missing required column 'label'"),
        (lambda t: _replace(t, "label", pa.array(["a"] * 6)), "column 'label' must be int32"),
        (lambda t: _replace(t, "sample_id", pa.array([0.5] * 6)), "column 'sample_id' must be int64"),
        (lambda t: _replace(t, "zs_logits", pa.array([[1.0] * 5] * 6)), "column 'zs_logits' must be fixed_size_list"),
        (lambda t: _replace(t, "zs_logits", pa.FixedSizeListArray.from_arrays(pa.array(["x"] * 30), 5)),
         "column 'zs_logits' must be fixed_size_list"),
        (lambda t: _replace(t, "tta_logits", pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(36, np.float32)), 6)),
         "column 'tta_logits' has 6 logits per row but 'zaec:num_classes' is 5"),
        (lambda t: _replace(t, "label", pa.array([0, 1, 2, 3, 4, 5], pa.int32())), "1 value(s) outside [0, 5)"),
        (lambda t: _replace(t, "label", pa.array([0, None, 2, 3, 4, 1], pa.int32())), "column 'label' has 1 null"),
        (lambda t: _replace(t, "sample_id", pa.array([0, 0, 1, 1, 2, 3], pa.int64())), "2 duplicate value(s)"),
    ],
)
def test_column_errors(tmp_path, make_meta, make, fragment):
    ids, y, zs, tta = sample(k=5)
    table = build_table(make_meta(k=5), ids, y, zs, tta)
    p = _write(tmp_path / "bad.parquet", make(table))
    with pytest.raises(ShardError) as e:
        read_shard(p)
    assert fragment in str(e.value) and str(p) in str(e.value)


def test_file_errors(tmp_path):
    with pytest.raises(ShardError, match="no such file"):
        read_meta(tmp_path / "x.parquet")
    (tmp_path / "t.parquet").write_text("not parquet")
    with pytest.raises(ShardError, match="not a readable Parquet file"):
        read_shard(tmp_path / "t.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardError, match="no shards"):
        find_shards([tmp_path / "empty"])
    with pytest.raises(ShardError, match="no such file or directory"):
        find_shards([tmp_path / "missing"])


def test_nonfinite_rows_are_reported_not_rejected(tmp_path, make_meta):
    ids, y, zs, tta = sample(k=5)
    tta[2, 1] = np.nan
    p = write_shard(tmp_path / "n.parquet", make_meta(k=5), ids, y, zs, tta)
    s = read_shard(p)
    assert s.nonfinite_rows().tolist() == [False, False, True, False, False, False]
    assert "1 row(s) have NaN or inf" in validate_shard(p)[0]
    assert len(s.select(~s.nonfinite_rows())) == 5


def test_build_table_argument_errors(make_meta):
    meta = make_meta(k=3)
    with pytest.raises(ValueError, match=r"zs_logits must have shape \(2, 3\)"):
        build_table(meta, [0, 1], [0, 1], np.zeros((2, 4)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"label values must lie in \[0, 3\)"):
        build_table(meta, [0, 1], [0, 3], np.zeros((2, 3)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="collides with a contract key"):
        make_meta(extra={"dataset": "x"}).to_kv()
    with pytest.raises(ValueError, match="collides with a contract column"):
        build_table(meta, [0], [0], np.zeros((1, 3)), np.zeros((1, 3)), extra_columns={"label": [1]})


def test_grouping_and_disagreement(tmp_path, make_meta):
    ids, y, zs, tta = sample(k=5)
    a = write_shard(tmp_path / "a.parquet", make_meta(k=5), ids, y, zs, tta)
    b = write_shard(tmp_path / "b.parquet", make_meta(k=5), ids + 6, y, zs, tta)
    c = write_shard(tmp_path / "c.parquet", make_meta(k=5, seed=2), ids, y, zs, tta)
    groups = group_shards(find_shards([tmp_path]))
    assert {k: len(v) for k, v in groups.items()} == {
        RunKey("ViT-B-16", "dtd", "tda", 1): 2, RunKey("ViT-B-16", "dtd", "tda", 2): 1
    }
    assert [len(s) for s in iter_run(groups[RunKey("ViT-B-16", "dtd", "tda", 1)])] == [6, 6]
    write_shard(tmp_path / "d.parquet", make_meta(k=5, pretrained="laion"), ids + 12, y, zs, tta)
    with pytest.raises(ShardError, match="metadata 'pretrained' disagrees with"):
        group_shards(find_shards([tmp_path]))
    assert REQUIRED_COLUMNS == ("sample_id", "label", "zs_logits", "tta_logits")
    del a, b, c


def test_output_kind_key(tmp_path):
    """`zaec:output_kind`: absent means logits; "log_probs" round-trips; any other value is a ShardError."""
    from schemas.shard import OUTPUT_KINDS, ShardMeta

    assert OUTPUT_KINDS == ("logits", "log_probs")
    base = ShardMeta("RN50", "openai", "dtd", "zero", 1, ("a", "b"))
    p = write_shard(tmp_path / "a.parquet", base, [0], [1], [[1.0, 2.0]], [[0.0, -1e3]])
    assert read_shard(p).meta.output_kind == "logits"
    meta = ShardMeta("RN50", "openai", "dtd", "zero", 1, ("a", "b"), extra={"zaec:output_kind": "log_probs"})
    p = write_shard(tmp_path / "b.parquet", meta, [0], [1], [[1.0, 2.0]], [[0.0, -1e3]])
    assert read_shard(p).meta.output_kind == "log_probs" and validate_shard(p) == []
    bad = ShardMeta("RN50", "openai", "dtd", "zero", 1, ("a", "b"), extra={"zaec:output_kind": "votes"})
    p = write_shard(tmp_path / "c.parquet", bad, [0], [1], [[1.0, 2.0]], [[0.0, -1e3]])
    with pytest.raises(ShardError, match="output_kind' must be one of logits, log_probs, got 'votes'"):
        read_shard(p)
