"""Shared helpers of the demo tests (tests/tools/demo/): Fashion-MNIST idx files written by hand."""

from __future__ import annotations

import gzip
import struct

import numpy as np


def idx_bytes(arr: np.ndarray) -> bytes:
    code = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}[arr.dtype]
    header = bytes([0, 0, code, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    return header + arr.tobytes()


def write_fake_fmnist(d, n_train=12, n_test=7, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    data = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test).astype(np.uint8),
    }
    for stem, arr in data.items():
        raw = idx_bytes(arr)
        if gz:
            (d / f"{stem}.gz").write_bytes(gzip.compress(raw))
        else:
            (d / stem).write_bytes(raw)
    return data
