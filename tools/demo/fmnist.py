"""Reading Fashion-MNIST from the four standard idx files.

The demo accepts any directory that holds ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte``, each either plain or gzip-compressed (``.gz``), as Debian's
``dataset-fashion-mnist`` package and the original distribution ship them.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Literal

import numpy as np

Split = Literal["train", "test"]
SPLITS: tuple[str, ...] = ("train", "test")

# idx file stems per split: (images, labels). "t10k" is the test split's name in the original distribution.
_STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# The idx format's type codes (third byte of the magic number) and the numpy dtypes they denote (big-endian).
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}

EXPECTED_FILES: tuple[str, ...] = tuple(stem for pair in _STEMS.values() for stem in pair)


class FashionMNISTError(ValueError):
    """A Fashion-MNIST directory or idx file is missing or malformed (the message says which and what was expected)."""


def _find(directory: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        path = directory / name
        if path.is_file():
            return path
    raise FashionMNISTError(
        f"Fashion-MNIST file '{stem}' (or '{stem}.gz') not found in {directory}; expected the four idx files "
        f"{', '.join(EXPECTED_FILES)} (plain or .gz). Get them with `bash data/fetch_fmnist.sh {directory}` "
        "or pass --fmnist-dir DIR"
    )


def read_idx(path: str | Path) -> np.ndarray:
    """Read one idx file (plain or gzip) into a numpy array.

    The idx format: a 4-byte magic number ``0x00 0x00 <type> <ndim>``, then ``ndim`` big-endian uint32 dimensions,
    then the data in C order.

    Args:
        path: the file; a name ending in ``.gz`` is decompressed.

    Returns:
        An array of the stored shape, e.g. ``(60000, 28, 28) uint8`` for training images, ``(60000,) uint8``
        for labels. Multi-byte types are converted to native byte order.

    Example:
        >>> read_idx("data/fashion-mnist/t10k-labels-idx1-ubyte.gz").shape  # doctest: +SKIP
        (10000,)
    """
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as exc:  # gzip raises BadGzipFile (an OSError) or EOFError when truncated
        raise FashionMNISTError(f"cannot read idx file {path}: {exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise FashionMNISTError(f"{path} is not an idx file (bad magic number {raw[:4].hex() or 'empty'})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise FashionMNISTError(
            f"{path}: header says shape {shape} ({expected} data bytes) but the file holds {len(raw) - header}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=True)


def load_split(directory: str | Path, split: Split) -> tuple[np.ndarray, np.ndarray]:
    """Load one split of Fashion-MNIST.

    Args:
        directory: a folder with the four idx files (plain or ``.gz``).
        split: ``"train"`` (60,000 images) or ``"test"`` (10,000 images).

    Returns:
        ``(images, labels)``: ``(N, 28, 28) uint8`` grey images (0 = black) and ``(N,) int64`` class indices
        in ``[0, 10)``, in the file's order (which is the canonical order used by the demo's sets).
    """
    if split not in _STEMS:
        raise FashionMNISTError(f"unknown Fashion-MNIST split '{split}'; available: {', '.join(SPLITS)}")
    directory = Path(directory)
    if not directory.is_dir():
        raise FashionMNISTError(
            f"Fashion-MNIST directory {directory} does not exist; "
            f"create it with `bash data/fetch_fmnist.sh {directory}`"
        )
    images_path, labels_path = (_find(directory, stem) for stem in _STEMS[split])
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise FashionMNISTError(f"{images_path}: expected (N, H, W) uint8 images, got {images.shape} {images.dtype}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise FashionMNISTError(
            f"{labels_path}: expected {len(images)} labels to match {images_path.name}, got shape {labels.shape}"
        )
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise FashionMNISTError(f"{labels_path}: labels must lie in [0, 10), found [{labels.min()}, {labels.max()}]")
    return images, labels.astype(np.int64)


def check_dir(directory: str | Path) -> Path:
    """Fail fast (before any training) unless all four idx files are present; returns the directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FashionMNISTError(
            f"Fashion-MNIST directory {directory} does not exist; "
            f"create it with `bash data/fetch_fmnist.sh {directory}`"
        )
    for stem in EXPECTED_FILES:
        _find(directory, stem)
    return directory
