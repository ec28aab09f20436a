"""`make bench` (tools.bench_calibrate): the solver line of the CPU-stage benchmark on a tiny size."""

from __future__ import annotations

from tools.bench_calibrate import bench_solver


def test_bench_solver_smoke():
    (row,) = bench_solver(60, [7], naive_repeat=1)
    # both solve T >= 1 to about 1e-9 relative (the bench's brentq: xtol 1e-10 absolute)
    assert row["max_rel_diff_vs_brentq"] < 1e-8
    assert row["speedup_vs_brentq"] > 0 and row["capped"] == 0
