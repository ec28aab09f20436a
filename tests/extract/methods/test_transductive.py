"""The base of the transductive methods (extract.methods.transductive): the blocked nearest-neighbour search against
the whole similarity matrix, and how `adapt` serves the rows of a unit solved once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from extract.methods.stata import StatA, StatAOnline
from extract.methods.transductive import knn
from tests.support.transductive import make_set, make_text
from tests.support.transductive import solve as solve_with

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("skip_self", [False, True])
def test_knn_in_blocks_equals_the_whole_matrix(skip_self):
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(23, 8, generator=g, dtype=torch.float64), dim=1)
    full = x @ x.T
    if skip_self:
        full.fill_diagonal_(-torch.inf)
    want_s, want_i = full.topk(4, dim=1)
    for block in (8 * 23, 8 * 23 * 5, 1 << 20):  # one row, five rows, every row per block
        s, i = knn(x, x, 4, skip_self=skip_self, block_bytes=block)
        # a product of another shape may sum in another order: a few eps64 of width-8 dot products
        torch.testing.assert_close(s, want_s, rtol=0, atol=8 * torch.finfo(torch.float64).eps)
        assert torch.equal(i, want_i)
    if skip_self:
        assert not (i == torch.arange(23)[:, None]).any()


def _method(cls, x, text, unit=None, start=0):
    cfg = cls.default_config("dtd", "ViT-B-16")
    m = cls(cfg if unit is None else dataclasses.replace(cfg, unit=unit), text, 100.0, backbone="ViT-B-16",
            dataset="dtd")
    m.attach_set(lambda a, b: x[a:b], len(x), start)
    return m


def test_calls_of_any_width_return_the_rows_of_one_solve():
    """Calls of 7 over units of 8: a call may span two units; every row is that of its unit's single solve."""
    text = make_text(dtype=torch.float32)
    x = make_set(20, text)
    whole = _method(StatAOnline, x, text, unit=8).adapt(x)
    m = _method(StatAOnline, x, text, unit=8)
    parts = torch.cat([m.adapt(x[a:a + 7]) for a in range(0, 20, 7)])
    assert torch.equal(parts, whole) and m.units_solved == 3
    for a in (0, 8, 16):  # each unit alone is the same solve
        alone = solve_with(StatA, x[a:a + 8], text)[0].float()
        assert torch.equal(whole[a:a + 8], alone)


def test_a_run_resumed_at_a_unit_boundary_gives_the_same_rows():
    text = make_text(dtype=torch.float32)
    x = make_set(20, text)
    whole = _method(StatAOnline, x, text, unit=8).adapt(x)
    resumed = _method(StatAOnline, x, text, unit=8, start=8)
    assert torch.equal(resumed.adapt(x[8:]), whole[8:])


def test_features_of_other_positions_are_refused():
    text = make_text(dtype=torch.float32)
    x = make_set(12, text)
    m = _method(StatA, x, text)
    with pytest.raises(ValueError, match="not those of the attached run"):
        m.adapt(x.flip(0)[:4])
    with pytest.raises(ValueError, match="run past the attached 12"):
        _method(StatA, x, text, start=10).adapt(x[:4])
    bare = StatA(StatA.default_config("dtd", "x"), text, 100.0, backbone="x", dataset="dtd")
    with pytest.raises(ValueError, match="attach the run's features first"):
        bare.adapt(x[:2])


def test_every_unit_has_a_reason_not_to_serve_a_shorter_run():
    assert "whole run's features jointly" in StatA.prefix_dependence(StatA.default_config("dtd", "x"))
    assert "batches of 128" in StatAOnline.prefix_dependence(StatAOnline.default_config("dtd", "x"))
    assert StatA.transductive_unit(StatA.default_config("dtd", "x")) == 0
