"""Shards written by other tools, without zaec's code: pyarrow (schema metadata) and polars (file key-value metadata).

docs/contract.md names the Parquet file's key-value metadata as the home of the `zaec:` keys; pyarrow also copies a
table's schema metadata there, polars writes only there. The reader must accept both.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.shard import ShardError, read_shard
from schemas.shard import read_meta

K, N = 4, 6


def _kv() -> dict[str, str]:
    return {
        "zaec:schema": "1", "zaec:backbone": "ViT-B-16", "zaec:pretrained": "openai", "zaec:dataset": "dtd",
        "zaec:method": "tda", "zaec:seed": "1", "zaec:num_classes": str(K),
        "zaec:class_names": json.dumps([f"c{i}" for i in range(K)]), "zaec:method_config": "{}",
        "zaec:zs_prompts": json.dumps({"t": ["a {}"]}),
    }


def _columns(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "sample_id": np.arange(N, dtype=np.int64), "label": rng.integers(0, K, N).astype(np.int32),
        "zs_logits": rng.normal(size=(N, K)).astype(np.float32), "tta_logits": rng.normal(size=(N, K)).astype(np.float32),
    }


def test_pyarrow_written_shard_is_read(tmp_path, rng):
    cols = _columns(rng)
    table = pa.table({
        "sample_id": cols["sample_id"], "label": cols["label"],
        "zs_logits": pa.FixedSizeListArray.from_arrays(cols["zs_logits"].ravel(), K),
        "tta_logits": pa.FixedSizeListArray.from_arrays(cols["tta_logits"].ravel(), K),
    }).replace_schema_metadata(_kv())
    pq.write_table(table, tmp_path / "a.parquet")
    shard = read_shard(tmp_path / "a.parquet")
    np.testing.assert_array_equal(shard.tta_logits, cols["tta_logits"])
    assert shard.meta.method == "tda" and shard.meta.num_classes == K


def test_polars_written_shard_is_read(tmp_path, rng):
    cols = _columns(rng)
    df = pl.DataFrame({
        "sample_id": cols["sample_id"], "label": cols["label"],
        "zs_logits": pl.Series(cols["zs_logits"]).cast(pl.Array(pl.Float32, K)),
        "tta_logits": pl.Series(cols["tta_logits"]).cast(pl.Array(pl.Float32, K)),
    })
    df.write_parquet(tmp_path / "b.parquet", metadata=_kv())
    assert pq.read_schema(tmp_path / "b.parquet").metadata is None  # polars leaves the Arrow schema's metadata empty
    shard = read_shard(tmp_path / "b.parquet")
    np.testing.assert_array_equal(shard.zs_logits, cols["zs_logits"])
    np.testing.assert_array_equal(shard.label, cols["label"])
    assert read_meta(tmp_path / "b.parquet").dataset == "dtd"


def test_disagreeing_copies_of_a_key_are_refused(tmp_path, rng):
    cols = _columns(rng)
    table = pa.table({
        "sample_id": cols["sample_id"], "label": cols["label"],
        "zs_logits": pa.FixedSizeListArray.from_arrays(cols["zs_logits"].ravel(), K),
        "tta_logits": pa.FixedSizeListArray.from_arrays(cols["tta_logits"].ravel(), K),
    }).replace_schema_metadata(_kv())
    kv = {**_kv(), "zaec:method": "dpe"}  # the schema says tda, the file's key-value metadata says dpe
    writer = pq.ParquetWriter(tmp_path / "d.parquet", table.schema)
    writer.write_table(table)
    writer.add_key_value_metadata(kv)
    writer.close()
    with pytest.raises(ShardError, match="zaec:method"):
        read_shard(tmp_path / "d.parquet")


def test_polars_list_float64_refusal_names_the_cast_that_fixes_it(tmp_path, rng):
    """Issue 32 item 13: polars writes (N, K) numpy rows as `List(Float64)`; the refusal names the fix, and the cast it
    names gives a shard the reader accepts."""
    cols = _columns(rng)
    df = pl.DataFrame({"sample_id": cols["sample_id"], "label": cols["label"],
                       "zs_logits": cols["zs_logits"].astype(np.float64).tolist(),
                       "tta_logits": cols["tta_logits"].astype(np.float64).tolist()})
    assert df.schema["zs_logits"] == pl.List(pl.Float64)
    df.write_parquet(tmp_path / "list.parquet", metadata=_kv())
    with pytest.raises(ShardError) as e:
        read_shard(tmp_path / "list.parquet")
    msg = str(e.value)
    assert "column 'zs_logits' must be fixed_size_list<float32>[4]" in msg
    fix = f"pl.col('zs_logits').cast(pl.Array(pl.Float32, {K}))"
    assert fix in msg
    fixed = df.with_columns(pl.col(c).cast(pl.Array(pl.Float32, K)) for c in ("zs_logits", "tta_logits"))
    fixed.write_parquet(tmp_path / "fixed.parquet", metadata=_kv())
    np.testing.assert_array_equal(read_shard(tmp_path / "fixed.parquet").zs_logits, cols["zs_logits"])
