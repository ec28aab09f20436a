"""The demo's Fashion-MNIST reader (tools/demo/fmnist.py): idx files round trip, byte order, bad inputs, and the
folder check (the shifts, images and summary are tested in test_shifts.py, test_images.py, test_run.py)."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from tools.demo import fmnist

from tests.support.demo import idx_bytes as _idx_bytes
from tests.support.demo import write_fake_fmnist as _write_fake_fmnist


@pytest.mark.parametrize("gz", [True, False])
def test_idx_reader_roundtrip(tmp_path, gz):
    data = _write_fake_fmnist(tmp_path, gz=gz)
    x, y = fmnist.load_split(tmp_path, "train")
    np.testing.assert_array_equal(x, data["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(y, data["train-labels-idx1-ubyte"].astype(np.int64))
    x, y = fmnist.load_split(tmp_path, "test")
    assert x.shape == (7, 28, 28) and y.dtype == np.int64


def test_idx_reader_multibyte_native_order(tmp_path):
    arr = np.arange(6, dtype=">i4").reshape(2, 3)
    (tmp_path / "a").write_bytes(_idx_bytes(arr))
    out = fmnist.read_idx(tmp_path / "a")
    assert out.dtype.byteorder in ("=", "|") or out.dtype.isnative
    np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3))


def test_idx_reader_bad_inputs(tmp_path):
    with pytest.raises(fmnist.FashionMNISTError, match="does not exist"):
        fmnist.load_split(tmp_path / "nope", "test")
    with pytest.raises(fmnist.FashionMNISTError, match="t10k-images-idx3-ubyte"):
        fmnist.load_split(tmp_path, "test")
    with pytest.raises(fmnist.FashionMNISTError, match="unknown Fashion-MNIST split 'val'"):
        fmnist.load_split(tmp_path, "val")  # type: ignore[arg-type]
    (tmp_path / "junk").write_bytes(b"hello world")
    with pytest.raises(fmnist.FashionMNISTError, match="not an idx file"):
        fmnist.read_idx(tmp_path / "junk")
    arr = np.zeros((3, 28, 28), np.uint8)
    (tmp_path / "short").write_bytes(_idx_bytes(arr)[:-5])
    with pytest.raises(fmnist.FashionMNISTError, match="data bytes"):
        fmnist.read_idx(tmp_path / "short")
    (tmp_path / "trunc.gz").write_bytes(gzip.compress(_idx_bytes(arr))[:20])
    with pytest.raises(fmnist.FashionMNISTError, match="cannot read"):
        fmnist.read_idx(tmp_path / "trunc.gz")


def test_check_dir_lists_expected_files(tmp_path):
    _write_fake_fmnist(tmp_path)
    assert fmnist.check_dir(tmp_path) == tmp_path
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(fmnist.FashionMNISTError, match="fetch_fmnist.sh"):
        fmnist.check_dir(tmp_path)
