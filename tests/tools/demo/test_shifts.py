"""The demo's distribution shifts (tools/demo/shifts.py): deterministic, in range, as defined, and their on-disk
layout read back through the dataset loader."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tools.demo import shifts
from tools.demo.images import IMAGE_SIZE, upsample

from tests.support.demo import write_fake_fmnist as _write_fake_fmnist

EPS32 = np.finfo(np.float32).eps  # float32 tolerances below are multiples of it


@pytest.mark.parametrize("name", list(shifts.SHIFTS))
def test_shift_deterministic_and_in_range(name):
    rng = np.random.default_rng(3)
    x = upsample(rng.integers(0, 256, (20, 28, 28), dtype=np.uint8))
    a, b = shifts.apply_shift(name, x), shifts.apply_shift(name, x)
    np.testing.assert_array_equal(a, b)
    assert a.shape == x.shape and a.dtype == np.float32
    assert a.min() >= 0.0 and a.max() <= 1.0
    if name == "clean":
        np.testing.assert_array_equal(a, x)
    else:
        assert not np.allclose(a, x)
    assert shifts.describe(name)


def test_shift_definitions():
    x = np.linspace(0, 1, 20 * 32 * 32, dtype=np.float32).reshape(20, 32, 32)
    cfg = shifts.ShiftConfig()
    c = shifts.apply_shift("contrast", x, cfg)
    # float32 std, a reduction over 32 x 32 pixels
    np.testing.assert_allclose(c.std(axis=(1, 2)), cfg.contrast_factor * x.std(axis=(1, 2)), rtol=32 * 32 * EPS32)
    inv = shifts.apply_shift("invert", x, cfg)
    flipped = [not np.allclose(inv[i], x[i]) for i in range(len(x))]
    assert sum(flipped) == round(cfg.invert_fraction * len(x))
    for i in np.flatnonzero(flipped):
        np.testing.assert_array_equal(inv[i], 1 - x[i])  # the same float32 subtraction: exact
    # blur keeps a constant image constant (reflect padding) and smooths an edge
    const = np.full((1, 32, 32), 0.3, np.float32)
    # two 13-tap float32 passes (radius 6) with a kernel normalised in float32: a few eps per tap
    np.testing.assert_allclose(shifts.apply_shift("blur", const, cfg), const, rtol=0, atol=4 * 13 * EPS32)
    with pytest.raises(ValueError, match="unknown shift 'fog'; available: clean, noise"):
        shifts.apply_shift("fog", x)


def test_write_set_layout_and_loader(tmp_path):
    from extract.datasets import FASHION_MNIST_CLASSES, load_testset

    src = tmp_path / "fm"
    src.mkdir()
    data = _write_fake_fmnist(src, n_test=9)
    root = tmp_path / "datasets"
    d = shifts.write_set("blur", src, root, limit=6)
    assert d == root / "fashion-mnist" / "blur" and shifts.is_written(root, "blur", n=6)
    assert not shifts.is_written(root, "blur", n=None)
    split = json.loads((d / shifts.SPLIT_FILE).read_text())
    assert split["train"] == [] and split["val"] == [] and len(split["test"]) == 6
    labels = data["t10k-labels-idx1-ubyte"][:6]
    for i, (rel, label, cname) in enumerate(split["test"]):
        assert rel == f"{label:02d}/{i:05d}.png" and label == labels[i] and cname == FASHION_MNIST_CLASSES[label]
    ts = load_testset("fmnist_blur", root)
    assert len(ts) == 6 and list(ts.labels) == list(labels)
    from PIL import Image

    img = Image.open(d / "images" / split["test"][0][0])
    assert img.mode == "RGB" and img.size == (IMAGE_SIZE, IMAGE_SIZE)
    # skipped when present; no temporary folders left behind
    mtime = (d / shifts.SPLIT_FILE).stat().st_mtime_ns
    shifts.write_set("blur", src, root, limit=6)
    assert (d / shifts.SPLIT_FILE).stat().st_mtime_ns == mtime
    assert [p.name for p in (root / "fashion-mnist").iterdir()] == ["blur"]
    # rewriting gives identical pixels (seeded)
    before = np.asarray(Image.open(d / "images" / split["test"][3][0]))
    shifts.write_set("blur", src, root, limit=6, force=True)
    np.testing.assert_array_equal(before, np.asarray(Image.open(d / "images" / split["test"][3][0])))


def test_the_demo_split_file_loads_as_a_user_split(tmp_path):
    """Issue 32 item 13: the demo writes CoOp's layout (paths relative to `images/` beside the split file), which
    `split:FILE.json` reads as CoOp's own split files, giving the registered set's samples."""
    from extract.datasets import DatasetError, load_testset, resolve_dataset

    src = tmp_path / "fm"
    src.mkdir()
    data = _write_fake_fmnist(src, n_test=80)
    assert len(set(data["t10k-labels-idx1-ubyte"].tolist())) == 10  # a user split's labels have no gaps
    root = tmp_path / "datasets"
    d = shifts.write_set("blur", src, root)
    registered = load_testset("fmnist_blur", root)
    key = resolve_dataset(f"split:{d / shifts.SPLIT_FILE}", name="my_blur")
    mine = load_testset(key)
    assert mine.paths == registered.paths and all(p.is_file() for p in mine.paths)
    np.testing.assert_array_equal(mine.labels, registered.labels)
    assert mine.class_names == registered.class_names and mine.notes["split_image_dir"] == "images"
    # the same images under a second sub-folder: which one the paths start at cannot be told
    (d / "images").rename(d / "jpg")
    import shutil

    shutil.copytree(d / "jpg", d / "images")
    with pytest.raises(DatasetError, match=r"lies under several sub-folders \(images, jpg\)"):
        load_testset(key)
