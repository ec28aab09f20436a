"""Metrics against slow obvious loops written here and against netcal (the independent reference), named edge
cases of the binning convention, and streaming over random shard splits == one shot."""

from __future__ import annotations

import numpy as np
import pytest

from calibrate.functional.softmax import softmax_stats
from calibrate.metrics import CalibrationStats, bin_index, ece, mass_bin_index, mce, reliability


def slow_ece(conf, correct, n_bins, lo_closed=False):
    """Textbook loop: bins (lo, hi] with conf == 0 in the first bin (lo_closed=True: [lo, hi), last closed)."""
    n = len(conf)
    total, worst = 0.0, 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        members = []
        for c, y in zip(conf, correct):
            if lo_closed:
                inside = lo <= c < hi or (b == n_bins - 1 and c == 1.0)
            else:
                inside = lo < c <= hi or (b == 0 and c == 0.0)
            if inside:
                members.append((c, y))
        if members:
            gap = abs(sum(y for _, y in members) / len(members) - sum(c for c, _ in members) / len(members))
            total += len(members) / n * gap
            worst = max(worst, gap)
    return total, worst


def slow_mass_ece(conf, correct, n_bins):
    """Equal-count bins by sorted position; ties go to the bin of their first occurrence."""
    order = sorted(range(len(conf)), key=lambda i: conf[i])
    n = len(conf)
    bins = {}
    first_pos = {}
    for pos, i in enumerate(order):
        first_pos.setdefault(conf[i], pos)
    for i in range(n):
        bins.setdefault(first_pos[conf[i]] * n_bins // n, []).append(i)
    return sum(abs(sum(correct[i] for i in m) - sum(conf[i] for i in m)) for m in bins.values()) / n


def random_conf(rng, n):
    c = rng.beta(5, 1.5, size=n)
    return c, rng.random(n) < c * rng.uniform(0.6, 1.0)


def test_ece_mce_against_slow_loop(rng):
    for n_bins in (1, 10, 15, 20):
        for _ in range(10):
            c, y = random_conf(rng, int(rng.integers(1, 400)))
            e, m = slow_ece(c.tolist(), y.tolist(), n_bins)
            assert ece(c, y, n_bins) == pytest.approx(e, abs=1e-12)
            assert mce(c, y, n_bins) == pytest.approx(m, abs=1e-12)
            assert ece(c, y, n_bins, "mass") == pytest.approx(slow_mass_ece(c.tolist(), y.tolist(), n_bins), abs=1e-12)


def test_ece_against_netcal_on_non_edge_data(rng):
    netcal = pytest.importorskip("netcal.metrics")
    for n_bins in (10, 15, 20):
        for _ in range(5):
            z = rng.normal(size=(800, 10)) * rng.uniform(1, 5)
            labels = rng.integers(0, 10, size=800)
            s = softmax_stats(z, 1.0, labels)
            edges = np.linspace(0, 1, n_bins + 1)
            assert np.abs(s.confidence[:, None] - edges[None]).min() > 1e-9  # no confidence on an edge
            correct = s.prediction == labels
            p = np.exp(z - z.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            ref = netcal.ECE(bins=n_bins).measure(p, labels)
            # netcal sums in its own float64 order: 1e-9 >> 800 eps64, yet << one sample's weight 1/800
            assert ece(s.confidence, correct, n_bins) == pytest.approx(ref, abs=1e-9)
            ref_m = netcal.MCE(bins=n_bins).measure(s.confidence, correct.astype(int))
            assert mce(s.confidence, correct, n_bins) == pytest.approx(ref_m, abs=1e-9)
            # equal-mass: netcal's quantile edges agree on distinct confidences
            ref_mass = netcal.ECE(bins=n_bins, equal_intervals=False).measure(s.confidence, correct.astype(int))
            assert ece(s.confidence, correct, n_bins, "mass") == pytest.approx(ref_mass, abs=1e-9)


def test_bin_edges_convention():
    n = 20
    edges = np.linspace(0, 1, n + 1)
    # exactly on an inner edge: the LOWER bin (lo < conf <= hi)
    assert bin_index(edges[1:-1], n).tolist() == list(range(n - 1))
    assert bin_index([0.0], n)[0] == 0  # conf == 0 in the first bin
    assert bin_index([1.0], n)[0] == n - 1  # exactly 1.0: last bin, no hidden extra bin
    assert bin_index(np.nextafter(edges[1:-1], 2), n).tolist() == list(range(1, n))
    # literal 0.3 sits below linspace's 0.30000000000000004, so it is inside bin 5, not on the edge
    assert bin_index([0.3], 20)[0] == 5 and bin_index([0.30000000000000004], 20)[0] == 5
    assert bin_index([0.15], 20)[0] == 2


def test_named_edge_cases_from_the_library_survey():
    # [0.95, 1.0] / [1, 0], 10 bins: 0.475 (torchmetrics' hidden {1.0} bin would give 0.525)
    assert ece([0.95, 1.0], [1, 0], 10) == pytest.approx(0.475)
    # conf 0 is kept in bin 0 (Guo's code drops it and gives 0.4)
    assert ece([1, 1, 1, 1, 0], [0, 0, 1, 1, 1], 10) == pytest.approx(0.6)
    # (lo, hi] membership: 0.5 joins 0.45, 0.55 stands alone -> 1/6, unlike [lo, hi) libraries (0.2)
    assert ece([0.45, 0.5, 0.55], [1, 0, 1], 10) == pytest.approx(slow_ece([0.45, 0.5, 0.55], [1, 0, 1], 10)[0])
    assert ece([0.45, 0.5, 0.55], [1, 0, 1], 10) == pytest.approx(0.1666666666666667)
    assert ece([0.05, 0.1, 0.15, 0.2], [0, 1, 1, 0], 10) == pytest.approx(0.375)
    assert np.isnan(ece([], [], 20))
    # ties are never split across equal-mass bins
    b = mass_bin_index([0.5] * 5 + [0.9] * 5 + [0.7], 4)
    assert len(set(b[:5])) == 1 and len(set(b[5:10])) == 1
    with pytest.raises(ValueError, match="unknown binning 'wide'; valid: width, mass"):
        ece([0.5], [1], 10, "wide")
    with pytest.raises(ValueError, match=r"confidence must lie in \[0, 1\]"):
        ece([1.5], [1], 10)
    with pytest.raises(ValueError, match="positive integer"):
        ece([0.5], [1], 0)


def test_k2_constant_and_huge_logits_metrics():
    # K = 2 and constant logits: confidence 0.5 / 1/K exactly; huge logits: confidence exactly 1.0, finite NLL
    s = softmax_stats(np.array([[0.0, 0.0], [3.0, 3.0], [1e4, -1e4]]), 1.0, [0, 1, 1])
    assert s.confidence.tolist() == [0.5, 0.5, 1.0]
    assert s.nll[2] == pytest.approx(2e4) and np.isfinite(s.nll).all()
    assert s.brier[2] == pytest.approx(2.0)
    assert ece(s.confidence, s.prediction == np.array([0, 1, 1])) == pytest.approx(slow_ece(s.confidence, s.prediction == np.array([0, 1, 1]), 20)[0])


def test_reliability_arrays():
    r = reliability([0.1, 0.12, 0.9, 1.0], [1, 0, 1, 1], 10)
    # 0.1 and 0.9 lie exactly on edges: lower bins
    assert r.count.tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 1, 1]
    assert r.confidence[1] == pytest.approx(0.12) and r.accuracy[1] == 0.0 and r.accuracy[0] == 1.0
    assert np.isnan(r.accuracy[2]) and r.edges.shape == (11,)
    # the diagram and the metric are computed from the same bins
    gaps = np.nan_to_num(np.abs(r.accuracy - r.confidence)) * r.count / r.count.sum()
    assert gaps.sum() == pytest.approx(ece([0.1, 0.12, 0.9, 1.0], [1, 0, 1, 1], 10))


@pytest.mark.parametrize("binning", ["width", "mass"])
def test_streaming_random_splits_equal_one_shot(rng, binning):
    for _ in range(10):
        n = int(rng.integers(5, 600))
        z = rng.normal(size=(n, 7)) * 4
        labels = rng.integers(0, 7, size=n)
        s = softmax_stats(z, 1.0, labels)
        correct = s.prediction == labels
        one = CalibrationStats(20, binning).update(s.confidence, correct, s.nll, s.brier, s.entropy).compute()
        perm = rng.permutation(n)
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(4, n - 1), replace=False))
        parts = []
        for idx in np.split(perm, cuts):
            st = CalibrationStats(20, binning)
            st.update(s.confidence[idx], correct[idx], s.nll[idx], s.brier[idx], s.entropy[idx])
            parts.append(st)
        merged = parts[0]
        for p in parts[1:]:
            merged.merge(p)
        got = merged.compute()
        for k, v in one.items():
            assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-14), k
        # and against the plain functions
        assert one["ece"] == pytest.approx(ece(s.confidence, correct, 20, binning), abs=1e-14)
        assert one["ece_mass"] == pytest.approx(ece(s.confidence, correct, 20, "mass"), abs=1e-14)
        assert one["accuracy"] == pytest.approx(correct.mean()) and one["nll"] == pytest.approx(s.nll.mean())


def test_stats_merge_rejects_mismatched_bins():
    with pytest.raises(ValueError, match="cannot merge"):
        CalibrationStats(10).merge(CalibrationStats(20))
    assert np.isnan(CalibrationStats(10).compute()["ece"])
