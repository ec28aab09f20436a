"""Shards of log-probability rows (`zaec:output_kind = log_probs`): calibrated as logits (docs/calibrate.md)."""

from __future__ import annotations

import numpy as np
import polars as pl

from calibrate.run import calibrate_paths
from calibrate.synthetic import synthetic_logits
from schemas.shard import write_shard


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))


def test_log_probs_rows_calibrate_like_their_logits(tmp_path, make_meta, rng):
    n, k = 300, 6
    y, zs, tta = synthetic_logits(n, k, rng)
    tta[:3] = 0.0
    tta[:3, 0] = 800.0  # three rows one-hot in float64 (exp(-800) underflows): entropy 0 at T = 1
    ids = np.arange(n)
    write_shard(tmp_path / "a" / "part-00000.parquet", make_meta(method="tda", k=k), ids, y, zs, tta)
    meta = make_meta(method="zero", k=k, extra={"zaec:output_kind": "log_probs"})
    write_shard(tmp_path / "b" / "part-00000.parquet", meta, ids, y, zs, _log_softmax(tta))
    ra = calibrate_paths([tmp_path / "a"], calibrators="none,sals,zaec", temperature=1.5)
    rb = calibrate_paths([tmp_path / "b"], calibrators="none,sals,zaec", temperature=1.5)
    cols = [c for c in ra.metrics.columns if ra.metrics[c].dtype == pl.Float64]
    a, b = ra.metrics.sort("calibrator"), rb.metrics.sort("calibrator")
    assert a["calibrator"].to_list() == b["calibrator"].to_list()
    # the stored rows differ by a per-row constant, rounded to float32 once: |z| <= 800 here, so each logit moves
    # by at most a few eps32 * 800 ~ 2e-4, which moves a probability-based metric by far less than 1e-3
    for c in cols:
        np.testing.assert_allclose(b[c].to_numpy(), a[c].to_numpy(), atol=1e-3, rtol=0, err_msg=c)
    note = [x for x in rb.notes if "log-probabilities" in x]
    assert len(note) == 1 and "3 row(s) one-hot at T = 1" in note[0]
    assert not [x for x in ra.notes if "log-probabilities" in x]
