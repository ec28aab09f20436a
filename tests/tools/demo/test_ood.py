"""The demo's OOD pair: the synthetic shapes and the sentence computed from the OOD metrics."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from extract.datasets import DatasetError, load_ood_images
from tools.demo.ood import OOD_KEY, ood_sentence, shapes, write_shapes


def _metrics(pairs):
    """pairs: (backbone, method, auroc none, auroc zaec, fpr none, fpr zaec) -> a zaec-calibrate-like table, with a
    plain run's rows (NaN OOD columns) that the sentence must ignore."""
    rows = []
    for b, m, a0, a1, f0, f1 in pairs:
        for cal, a, f in (("none", a0, f0), ("zaec", a1, f1), ("temperature", 0.0, 1.0)):
            rows.append({"backbone": b, "dataset": "demo_shapes@fmnist", "method": m, "calibrator": cal,
                         "ood_auroc_msp": a, "ood_fpr95_msp": f})
            rows.append({"backbone": b, "dataset": "fmnist", "method": m, "calibrator": cal,
                         "ood_auroc_msp": float("nan"), "ood_fpr95_msp": float("nan")})
    return pl.DataFrame(rows)


def test_sentence_helps_hurts_neither_and_undecided():
    helps = ood_sentence(_metrics([("V", "tda", 0.6, 0.7, 0.8, 0.5), ("R", "tda", 0.5, 0.9, 0.9, 0.4),
                                   ("V", "dpe", 0.7, 0.6, 0.5, 0.6),
                                   ("V", "zero-shot", 0.1, 0.9, 0.9, 0.1)]))  # zero-shot: left out of the verdict
    # means: AUROC (0.6 + 0.5 + 0.7) / 3 = 60.0% -> (0.7 + 0.9 + 0.6) / 3 = 73.3%; FPR95 73.3% -> 50.0%
    assert "ZAEC helps OOD detection here (dpe, tda; 3 backbone-method pairs)" in helps
    assert "AUROC 60.0% raw -> 73.3% with ZAEC" in helps and "higher in 2 of 3" in helps
    assert "FPR at 95% TPR 73.3% -> 50.0%" in helps and "lower in 2 of 3" in helps
    # the demo's own case: zero-shot ties (ZAEC leaves it unchanged) must not turn TDA's loss into "neither"
    tied = ood_sentence(_metrics([("V", "tda", 0.6, 0.55, 0.9, 0.92), ("R", "tda", 0.6, 0.57, 0.9, 0.93),
                                  ("V", "zero-shot", 0.6, 0.6, 0.9, 0.9), ("R", "zero-shot", 0.6, 0.6, 0.9, 0.9)]))
    assert "ZAEC hurts OOD detection here (tda; 2 backbone-method pairs)" in tied
    hurts = ood_sentence(_metrics([("V", "tda", 0.7, 0.6, 0.5, 0.6), ("R", "tda", 0.8, 0.7, 0.4, 0.5)]))
    assert "ZAEC hurts OOD detection" in hurts and "higher in 0 of 2" in hurts
    # AUROC up but FPR95 up too: mixed
    mixed = ood_sentence(_metrics([("V", "tda", 0.6, 0.7, 0.5, 0.6)]))
    assert "ZAEC's effect on OOD detection is mixed" in mixed
    # nothing changes: no clear verdict
    assert "neither clearly helps nor hurts" in ood_sentence(_metrics([("V", "tda", 0.6, 0.6, 0.5, 0.5)]))
    # a pair with an undefined metric is left out; none left: undecided
    nan = float("nan")
    assert "1 backbone-method pairs" in ood_sentence(_metrics([("V", "tda", 0.6, 0.7, 0.8, 0.5),
                                                               ("R", "tda", nan, 0.7, 0.8, 0.5)]))
    assert "undecided" in ood_sentence(_metrics([("V", "tda", nan, nan, nan, nan)]))
    assert "undecided" in ood_sentence(pl.DataFrame({"dataset": ["fmnist"], "calibrator": ["none"]}))


def test_shapes_seeded_and_registered(tmp_path):
    a, b = shapes(6, seed=3), shapes(6, seed=3)
    assert np.array_equal(a, b) and not np.array_equal(a, shapes(6, seed=4))
    assert a.shape == (6, 32, 32) and a.min() >= 0 and a.max() <= 1
    assert all((img > 0).any() for img in a)  # every canvas holds a shape
    folder = write_shapes(tmp_path, 5)
    stamp = (folder / "images" / "00000.png").stat().st_mtime_ns
    assert write_shapes(tmp_path, 5) == folder and (folder / "images" / "00000.png").stat().st_mtime_ns == stamp
    ts = load_ood_images(OOD_KEY, tmp_path)
    assert [p.name for p in ts.paths] == [f"{i:05d}.png" for i in range(5)] and (ts.labels == -1).all()
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(DatasetError, match=r"demo-ood/shapes/images/<any sub-folders>/<image>"):
        load_ood_images(OOD_KEY, tmp_path / "elsewhere")
