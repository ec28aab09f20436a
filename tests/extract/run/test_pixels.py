"""The pixels of a batch for a method that adapts the image encoder over batches (extract/run/pixels.py
`BatchPixels`): the original views the encoding pass encodes, by stream position, read ahead by loader processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from extract.datasets import DatasetError, load_testset, open_image
from extract.run.pixels import BatchPixels
from extract.run.stream import stream_permutation
from extract.views import ViewGenerator

from tests.support.extract import make_json_dataset

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def testset(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_json_dataset(root, "dtd", n_classes=3, per_class=4)  # 12 images of several sizes, grey and RGB
    return load_testset("dtd", root)


def want(model, testset, perm, start, stop):
    """View 0 of each position as the encoding pass makes it (`ViewGenerator.original`), one image at a time."""
    gen = ViewGenerator(model.preprocess, "single", seed=1)
    return torch.stack([gen.original(open_image(testset.paths[int(perm[p])])) for p in range(start, stop)])


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_the_encoding_pass_views_in_stream_order(tiny_model, testset, workers):
    perm = stream_permutation("dtd", 1, len(testset.paths))
    reader = BatchPixels(tiny_model, testset, perm, 1, stop=10, workers=workers)
    try:
        got = [reader.get(s, min(s + 4, 10)) for s in range(0, 10, 4)]  # the last batch holds 2
    finally:
        reader.close()
    assert [tuple(g.shape) for g in got] == [(4, 3, 32, 32), (4, 3, 32, 32), (2, 3, 32, 32)]
    assert torch.equal(torch.cat(got), want(tiny_model, testset, perm, 0, 10))


def test_a_call_that_does_not_continue_restarts_the_loader(tiny_model, testset):
    perm = stream_permutation("dtd", 1, len(testset.paths))
    reader = BatchPixels(tiny_model, testset, perm, 1, stop=12)
    assert torch.equal(reader.get(8, 12), want(tiny_model, testset, perm, 8, 12))  # a resumed run
    assert torch.equal(reader.get(0, 3), want(tiny_model, testset, perm, 0, 3))  # another width
    assert torch.equal(reader.get(3, 6), want(tiny_model, testset, perm, 3, 6))
    with pytest.raises(ValueError, match=r"positions 10\.\.12 asked for; the run has 0\.\.11"):
        reader.get(10, 13)


def test_an_unreadable_image_is_named(tiny_model, testset, tmp_path):
    import dataclasses

    perm = np.arange(len(testset.paths))
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    bad = dataclasses.replace(testset, paths=(str(broken),) + tuple(testset.paths[1:]))
    with pytest.raises(DatasetError, match="broken.png"):
        BatchPixels(tiny_model, bad, perm, 1, stop=4).get(0, 4)
