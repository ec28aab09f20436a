"""`python -m tools.demo_synthetic`: the CPU stage end to end on synthetic shards, with the printed summary."""

from __future__ import annotations

import polars as pl
import pytest

from tools import demo_synthetic


def test_demo_synthetic_runs_every_calibrator(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        demo_synthetic.main([str(tmp_path / "demo"), "--scale", "0.005"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "SYNTHETIC" in out and "zaec" in out
    df = pl.read_parquet(tmp_path / "demo" / "results" / "metrics.parquet")
    assert set(df["calibrator"]) == {"zero-shot", "none", "temperature", "sals", "zaec"}
