"""The demo's image format: Fashion-MNIST's 28x28 grey images upsampled to 32x32 and stored as RGB.

32 is the smallest size both towers accept (open_clip's ModifiedResNet downsamples by 32; the ViT uses 4-pixel
patches). Training and the written test sets go through the same two functions, so a model sees at test time exactly
the pixel statistics it was trained on.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

IMAGE_SIZE = 32


def upsample(images: np.ndarray, size: int = IMAGE_SIZE) -> np.ndarray:
    """(N, h, w) uint8 grey -> (N, size, size) float32 in [0, 1], bilinear (half-pixel centres, no antialiasing)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)[:, None]
    y = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return y[:, 0].clamp_(0.0, 1.0).numpy()


def to_rgb_uint8(images: np.ndarray) -> np.ndarray:
    """(N, H, W) float grey in [0, 1] -> (N, H, W, 3) uint8 RGB (R = G = B), rounded to nearest."""
    grey = np.clip(np.rint(np.asarray(images, dtype=np.float32) * 255.0), 0, 255).astype(np.uint8)
    return np.repeat(grey[..., None], 3, axis=-1)
