"""`tools.bench_launches`: the kernel launches per sample the sweep's work entries take (docs/sweep.md, "The cost
model"), counted through the runner: per call and per sample fitted through calls of two widths, a method's own
batch, a transductive method's solve; the classes left as found."""

from __future__ import annotations

from tools import bench_launches
from extract.methods import REGISTRY


def test_launches_are_fitted_per_call_and_per_sample(tmp_path, tiny_model_dir):
    before = {k: dict(vars(c)).get("adapt") for k, c in REGISTRY.items()}
    counts = {c.key: c for c in bench_launches.count_methods(["tda", "tent", "stata"], 4, tmp_path,
                                                             model_dir=tiny_model_dir, positions=8,
                                                             multi_positions=4)}
    assert not any(c.skipped for c in counts.values()), counts
    tda = counts["tda"]
    assert [b for b, _ in tda.calls] == [1, 2] and tda.per_sample > 0 and tda.own_width is None
    for b, launches in tda.calls:  # two points, two unknowns: the fit goes through both
        assert tda.per_call + tda.per_sample * b == launches
    assert tda.at(64) == tda.per_sample + tda.per_call / 64
    tent = counts["tent"]  # its own batch (64), counted at batches of 2 and 4
    assert tent.own_width == 64 and [b for b, _ in tent.calls] == [2, 4] and tent.at(1) == tent.at(64)
    stata = counts["stata"]  # one call holds the solve of the run's 8 samples
    assert stata.solve and stata.per_call == stata.calls[0][1] > 0
    assert "launches a solve of the run" in bench_launches.line(stata, 64)
    assert {k: dict(vars(c)).get("adapt") for k, c in REGISTRY.items()} == before
