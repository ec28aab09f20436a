"""`schemas.shard`: out-of-distribution runs in the contract (label -1 only with `zaec:ood_for`, the `<ood>@<id>`
dataset key, counts, class names against the in-distribution runs) and old shards unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.shard import (
    ShardError,
    find_shards,
    group_shards,
    ood_run_dataset,
    read_meta,
    read_shard,
    shard_path,
    validate_shard,
    write_shard,
)

OOD = {"zaec:ood_for": "dtd", "zaec:ood_dataset": "noise"}


def logits(n, k=5):
    return np.arange(n * k, dtype=np.float32).reshape(n, k) % 7


def test_ood_run_round_trip(tmp_path, make_meta):
    meta = make_meta(dataset=ood_run_dataset("noise", "dtd"),
                     extra={**OOD, "zaec:ood_n_id": "3", "zaec:ood_n_ood": "2", "zaec:n_total": "5"})
    p = write_shard(shard_path(tmp_path, meta.key, 0), meta, [4, 0, 3, 2, 1], [-1, 1, -1, 0, 4], logits(5), logits(5))
    shard = read_shard(p)
    assert shard.label.tolist() == [-1, 1, -1, 0, 4]
    assert (shard.meta.ood_for, shard.meta.ood_dataset, shard.meta.min_label) == ("dtd", "noise", -1)
    assert shard.meta.key.dataset == "noise@dtd" and validate_shard(p) == []
    assert read_meta(p).ood_for == "dtd"


def test_plain_shards_unchanged(tmp_path, make_meta):
    # an old shard (no OOD key) reads as before, even with '@' in its dataset name
    meta = make_meta(dataset="odd@name")
    p = write_shard(tmp_path / "a.parquet", meta, [0, 1], [0, 4], logits(2), logits(2))
    assert read_meta(p).ood_for is None and read_shard(p).meta.min_label == 0


def test_label_minus_one_needs_ood_for(tmp_path, make_meta):
    with pytest.raises(ValueError, match=r"1 value\(s\) of -1 \(out-of-distribution.*no 'zaec:ood_for'"):
        write_shard(tmp_path / "a.parquet", make_meta(), [0, 1], [0, -1], logits(2), logits(2))
    meta = make_meta(dataset="noise@dtd", extra=OOD)
    with pytest.raises(ValueError, match=r"outside \[0, 5\) or -1"):
        write_shard(tmp_path / "b.parquet", meta, [0, 1], [-2, 0], logits(2), logits(2))


@pytest.mark.parametrize("extra, dataset, fragment", [
    ({"zaec:ood_for": "dtd"}, "noise@dtd", "needs a non-empty 'zaec:ood_dataset'"),
    ({"zaec:ood_dataset": "noise"}, "noise@dtd", "needs a non-empty 'zaec:ood_for'"),
    (OOD, "noise", "must be 'noise@dtd'"),
    ({"zaec:ood_for": "dtd", "zaec:ood_dataset": "dtd"}, "dtd@dtd", "two different dataset names"),
    ({**OOD, "zaec:ood_n_id": "x"}, "noise@dtd", "'zaec:ood_n_id' must be a non-negative integer"),
    ({**OOD, "zaec:ood_n_id": "3", "zaec:ood_n_ood": "3", "zaec:n_total": "5"}, "noise@dtd", "= 6 but"),
    ({"zaec:ood_n_id": "3"}, "dtd", "is set but 'zaec:ood_for' is not"),
])
def test_bad_ood_metadata_is_one_line(tmp_path, make_meta, extra, dataset, fragment):
    from schemas.shard import build_table, write_atomic_table

    meta = make_meta(dataset=dataset, extra=extra)
    p = tmp_path / "a.parquet"
    write_atomic_table(build_table(make_meta(), [0], [0], logits(1), logits(1)).replace_schema_metadata(
        meta.to_kv()), p)
    with pytest.raises(ShardError) as e:
        read_meta(p)
    assert fragment in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)


def test_sample_id_ranges_of_each_kind(tmp_path, make_meta):
    meta = make_meta(dataset="noise@dtd", extra={**OOD, "zaec:ood_n_id": "2", "zaec:ood_n_ood": "2"})
    write_shard(tmp_path / "ok.parquet", meta, [0, 1, 2, 3], [0, 1, -1, -1], logits(4), logits(4))
    with pytest.raises(ValueError, match=r"2 value\(s\) outside their kind's range"):
        write_shard(tmp_path / "bad.parquet", meta, [0, 2, 1, 3], [0, 1, -1, -1], logits(4), logits(4))


def test_class_names_checked_against_the_in_distribution_runs(tmp_path, make_meta):
    plain = make_meta(dataset="dtd", method="zero-shot")
    write_shard(shard_path(tmp_path, plain.key, 0), plain, [0], [0], logits(1), logits(1))
    ok = make_meta(dataset="noise@dtd", extra=OOD)
    write_shard(shard_path(tmp_path, ok.key, 0), ok, [0, 1], [0, -1], logits(2), logits(2))
    assert len(group_shards(find_shards([tmp_path]))) == 2
    bad = make_meta(dataset="blobs@dtd", class_names=("c0", "c1", "x", "c3", "c4"),
                    extra={"zaec:ood_for": "dtd", "zaec:ood_dataset": "blobs"})
    bp = write_shard(shard_path(tmp_path, bad.key, 0), bad, [0, 1], [0, -1], logits(2), logits(2))
    with pytest.raises(ShardError, match=r"class names of its in-distribution set 'dtd'.*first difference at "
                                         r"index 2") as e:
        group_shards(find_shards([tmp_path]))
    assert str(e.value).startswith(str(bp))
    # the names themselves, so the user sees which list is which (issue 32 item 2)
    assert f"index 2: 'x' here, {plain.class_names[2]!r} there)" in str(e.value)
    # without the in-distribution runs among the inputs there is nothing to compare with
    assert len(group_shards([bp])) == 1


def test_shards_of_one_run_agree_on_the_ood_keys(tmp_path, make_meta):
    a = make_meta(dataset="noise@dtd", extra=OOD)
    b = make_meta(dataset="noise@dtd")  # same run key, no OOD keys
    write_shard(tmp_path / "a.parquet", a, [0], [-1], logits(1), logits(1))
    write_shard(tmp_path / "b.parquet", b, [1], [0], logits(1), logits(1))
    with pytest.raises(ShardError, match="metadata 'ood_for' disagrees"):
        group_shards(find_shards([tmp_path]))
