"""The calibrators (calibrate/calibrators.py): SaLS, temperature scaling against a slow NLL, every registered
calibrator preserves predictions, the spec parser, and the temperature-scaling bound in `zaec-calibrate`'s notes
(the ZAEC solver's own properties are in tests/calibrate/functional/test_zaec.py)."""

from __future__ import annotations

import numpy as np
import pytest

from calibrate.calibrators import CALIBRATORS, SaLS, TemperatureScaling, parse_calibrator, parse_calibrators
from calibrate.functional.temperature import fit_temperature

from tests.support.calibrate import random_pair



def test_sals_is_range_ratio(rng):
    zs = rng.normal(size=(50, 6)) * 3
    tta = rng.normal(size=(50, 6)) * 7
    t = SaLS().temperatures(zs, tta)
    for i in range(50):
        scaled = (tta[i] - tta[i].min()) / np.ptp(tta[i]) * np.ptp(zs[i]) + zs[i].min()
        p_ref = np.exp(scaled - scaled.max()); p_ref /= p_ref.sum()
        z = tta[i] / t[i]
        p = np.exp(z - z.max()); p /= p.sum()
        assert np.allclose(p, p_ref, atol=1e-12)
    # zero range on either side: T = 1, no division by zero
    assert SaLS().temperatures(np.ones((1, 3)), np.array([[1.0, 2, 3]]))[0] == 1.0
    assert SaLS().temperatures(np.array([[1.0, 2, 3]]), np.ones((1, 3)))[0] == 1.0


def slow_nll(z, y, T):
    z = z / T
    m = z.max(1, keepdims=True)
    return float(np.mean(np.log(np.exp(z - m).sum(1)) + m[:, 0] - z[np.arange(len(y)), y]))


def test_temperature_scaling_minimises_nll(rng):
    for true_t in (0.5, 1.0, 2.5):
        y = rng.integers(0, 10, size=2000)
        z = rng.normal(size=(2000, 10)) * 2
        z[np.arange(2000), y] += 2.5
        z = z / true_t
        ts = TemperatureScaling().fit(z, y)
        t = ts.temperature_
        grid = t * np.array([0.98, 1.0, 1.02])
        nll = [slow_nll(z, y, g) for g in grid]
        assert nll[1] < nll[0] and nll[1] < nll[2]
        # streaming over two batches gives the same fit
        t2, _ = fit_temperature(lambda: [(z[:700], y[:700]), (z[700:], y[700:])])
        assert t2 == pytest.approx(t, rel=1e-9)
        assert np.all(ts.temperatures(z, z) == t)
    # separable data: the optimum is T -> 0; the fit stays finite and clamped
    z = np.eye(3)[[0, 1, 2]] * 10
    assert 0 < TemperatureScaling().fit(z, [0, 1, 2]).temperature_ <= 1.0
    with pytest.raises(ValueError, match="not fitted"):
        TemperatureScaling().temperatures(z, z)
    assert TemperatureScaling(T=1.3).temperature_ == 1.3


@pytest.mark.parametrize("name", sorted(CALIBRATORS))
def test_every_registered_calibrator_preserves_predictions(rng, name):
    zs, tta = random_pair(rng, 300, 12)
    cal = parse_calibrator(name)
    if cal.needs_fit:
        y = rng.integers(0, 12, size=300)
        assert cal.fit(tta, y) is cal
    else:
        assert cal.fit() is cal
    t = cal.temperatures(zs, tta)
    assert t.shape == (300,) and t.dtype == np.float64 and np.all(t > 0)
    out = cal.transform(zs, tta)
    assert np.array_equal(out.argmax(1), tta.argmax(1))


def test_parse_calibrator_specs():
    c = parse_calibrator("zaec:strength=0.5")
    assert c.strength == 0.5 and c.subset == "reduced" and c.spec == "zaec:strength=0.5"
    assert parse_calibrator("zaec:subset=all").subset == "all"
    assert parse_calibrator("temperature:T=1.2").temperature_ == 1.2
    cals = parse_calibrators("none,zaec:strength=0.5,subset=all,sals")
    assert [c.spec for c in cals] == ["none", "zaec:strength=0.5,subset=all", "sals"]
    assert cals[1].subset == "all"
    with pytest.raises(ValueError, match="unknown calibrator 'zeac'; available: none, temperature, sals, zaec"):
        parse_calibrator("zeac")
    with pytest.raises(ValueError, match="no option 'lambda'; valid options: strength, subset"):
        parse_calibrator("zaec:lambda=1")
    with pytest.raises(ValueError, match="unknown zaec subset 'some'; valid: reduced, all, increased"):
        parse_calibrator("zaec:subset=some")
    with pytest.raises(ValueError, match=r"strength must lie in \[0, 1\]"):
        parse_calibrator("zaec:strength=2")
    with pytest.raises(ValueError, match="expects a number"):
        parse_calibrator("zaec:strength=high")
    with pytest.raises(ValueError, match="given twice"):
        parse_calibrators("zaec,zaec")
    with pytest.raises(ValueError, match="no option 'x'; valid options: none"):
        parse_calibrator("sals:x=1")


def test_temperature_at_its_bound_is_not_reported_as_fitted(tmp_path, make_meta):
    from calibrate.calibrators import TemperatureScaling
    from calibrate.functional.temperature import TS_BETA_MIN
    from calibrate.run import calibrate_paths
    from schemas.shard import shard_path, write_shard

    z = np.array([[5.0, 0.0], [0.0, 5.0], [4.0, 1.0]])
    wrong = TemperatureScaling().fit(z, np.array([1, 0, 1]))  # every prediction wrong: NLL falls as T grows
    # within a relative 1e-6 of the bound is how `at_bound_` defines "at the bound" (a solver tolerance, not rounding)
    assert wrong.at_bound_ and wrong.temperature_ == pytest.approx(1 / TS_BETA_MIN, rel=1e-6)
    assert "is the bound of its search range" in wrong.describe_fit("src")
    mixed = TemperatureScaling().fit(np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 0.5]]), np.array([0, 0, 0]))
    assert not mixed.at_bound_ and mixed.describe_fit("src").startswith("temperature scaling fitted on src: T = ")
    meta = make_meta(dataset="imagenet", k=2)
    write_shard(shard_path(tmp_path, meta.key, 0), meta, [0, 1, 2], [1, 0, 1], z, z)
    notes = calibrate_paths([tmp_path], calibrators="temperature").notes
    assert any("is the bound of its search range" in n for n in notes)
    assert not any(n.startswith("temperature scaling fitted on") for n in notes)
