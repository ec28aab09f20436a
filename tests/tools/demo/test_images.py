"""The demo's image conversion (tools/demo/images.py): upsampling and grey to RGB."""

from __future__ import annotations

import numpy as np

from tools.demo.images import IMAGE_SIZE, to_rgb_uint8, upsample

EPS32 = np.finfo(np.float32).eps  # float32 tolerances below are multiples of it


def test_upsample_and_rgb():
    img = np.full((2, 28, 28), 200, np.uint8)
    up = upsample(img)
    assert up.shape == (2, IMAGE_SIZE, IMAGE_SIZE) and up.dtype == np.float32
    np.testing.assert_allclose(up, 200 / 255, rtol=0, atol=8 * EPS32)  # a constant stays constant (4 taps)
    rgb = to_rgb_uint8(up)
    assert rgb.shape == (2, IMAGE_SIZE, IMAGE_SIZE, 3) and (rgb == 200).all()
