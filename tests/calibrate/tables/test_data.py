"""`calibrate.tables.data`: what the tables read. Runs of one dataset key must hold one test set (the same K and N):
the tables average them into one column, so runs of different test sets are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from calibrate.run import run_counts
from calibrate.synthetic import synthetic_logits
from calibrate.tables.cli import main as tables_main
from calibrate.tables.data import check_same_test_sets, load_summaries
from schemas.shard import ShardError, find_shards, group_shards, shard_path, write_shard


def _write(root, make_meta, rng, *, dataset="dtd", method="tda", seed=1, n=40, k=5, n_total=None, limit=None):
    """One run of `n` rows in one part; `n_total` / `limit` announced only when given (else a third-party shard)."""
    extra = {} if n_total is None else {"zaec:n_total": str(n_total),
                                        "zaec:limit": "none" if limit is None else str(limit)}
    meta = make_meta(dataset=dataset, method=method, seed=seed, k=k, extra=extra)
    y, zs, tta = synthetic_logits(n, k, rng)
    write_shard(shard_path(root, meta.key, 0), meta, np.arange(n), y, zs, tta)
    return meta.key


def _check(root):
    groups = group_shards(find_shards([root]))
    check_same_test_sets(groups, run_counts(groups))


def test_runs_of_one_dataset_with_other_counts_are_refused(tmp_path, make_meta, rng):
    a = _write(tmp_path / "n", make_meta, rng, method="tda", n=40)
    b = _write(tmp_path / "n", make_meta, rng, method="tpt", n=30)  # a third party's shard of another test set
    with pytest.raises(ShardError) as e:
        _check(tmp_path / "n")
    msg = str(e.value)
    assert "\n" not in msg and "dataset 'dtd' has runs of different test sets" in msg
    assert f"K=5, N=30: {b}" in msg and f"K=5, N=40: {a}" in msg
    # another class count with the same sample count; seeds of one method count as runs too
    _write(tmp_path / "k", make_meta, rng, seed=1, k=5)
    _write(tmp_path / "k", make_meta, rng, seed=2, k=5)
    c = _write(tmp_path / "k", make_meta, rng, seed=3, k=7)
    with pytest.raises(ShardError, match=rf"K=5, N=40: {a} and 1 more run\(s\); K=7, N=40: {c}"):
        _check(tmp_path / "k")


def test_runs_of_one_test_set_pass(tmp_path, make_meta, rng):
    # other datasets may differ; a partial or --limit run announces its test set's size, so it is the same set
    _write(tmp_path, make_meta, rng, method="tda", n=24, n_total=24)
    _write(tmp_path, make_meta, rng, method="tpt", n=24)  # third party, all 24 rows
    _write(tmp_path, make_meta, rng, method="dpe", n=5, n_total=24, limit=5)
    _write(tmp_path, make_meta, rng, dataset="imagenet", k=9, n=50)
    _check(tmp_path)
    s = load_summaries([tmp_path], ["none"], ts_source=None, allow_partial=True)
    assert {k.method: len(v) for k, v in s.runs.items() if k.dataset == "dtd"} == {"tda": 24, "tpt": 24, "dpe": 5}


def test_tables_refuse_them_in_one_line_before_writing(tmp_path, make_meta, rng, capsys):
    _write(tmp_path / "s", make_meta, rng, method="tda", n=40)
    _write(tmp_path / "s", make_meta, rng, method="zero-shot", n=30)
    with pytest.raises(SystemExit) as e:
        tables_main([str(tmp_path / "s"), "--out", str(tmp_path / "o"), "--bootstrap", "0", "--quiet"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "dataset 'dtd' has runs of different test sets" in err
    assert not (tmp_path / "o").exists()
