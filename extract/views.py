"""Test-time views: the original view plus the TPT-style augmented views (spec §1.2), reimplemented.

View 0 ("original"): resize the short side to the model's size (its interpolation, bicubic for CLIP), centre crop,
to tensor, normalise with the model's mean/std.

Views 1..63: a random resized crop of the raw image (area fraction U(0.08, 1), log-uniform aspect ratio in
[3/4, 4/3], bilinear; ten tries, then a centre crop) and a horizontal flip with probability 1/2. Policy
"crop_flip" stops there. Policy "augmix" then mixes, in normalised-tensor space,
    out = m * P(x) + (1 - m) * sum_i w_i * P(chain_i(x)),   w ~ Dirichlet(1, 1, 1), m ~ Beta(1, 1),
with three chains of 1-3 operations each, drawn uniformly from autocontrast, equalize, posterize, rotate, solarize,
shear_x, shear_y, translate_x, translate_y at severity 1 (AugMix's operation set without the colour, contrast,
brightness and sharpness operations).

Seeding: all randomness of a sample comes from one numpy Generator seeded with (seed, sample_id), so every method,
every batch size and every stream order sees exactly the same views of a sample.

Example:
    >>> gen = ViewGenerator(Preprocess((32, 32), (0.5,) * 3, (0.5,) * 3), policy="augmix", seed=1)  # doctest: +SKIP
    >>> gen(img, sample_id=7).shape  # doctest: +SKIP
    torch.Size([64, 3, 32, 32])
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
import torchvision.transforms.functional as TF
from PIL import Image, ImageOps
from torchvision.transforms import InterpolationMode

from extract.models import Preprocess

ViewPolicy = Literal["single", "crop_flip", "augmix"]
VIEW_POLICIES: tuple[str, ...] = ("single", "crop_flip", "augmix")
#: augmented views per sample in the multi-view policies (TPT's batch of 64 = 1 original + 63)
N_AUG_VIEWS = 63

_INTERP = {"bicubic": InterpolationMode.BICUBIC, "bilinear": InterpolationMode.BILINEAR,
           "nearest": InterpolationMode.NEAREST}


def view_policy(n_views: int, augmix: bool) -> ViewPolicy:
    """The view policy of a method config: 1 view = "single"; 64 views = "augmix" or "crop_flip"."""
    if n_views == 1:
        return "single"
    if n_views != 1 + N_AUG_VIEWS:
        raise ValueError(f"n_views must be 1 or {1 + N_AUG_VIEWS}, got {n_views}")
    return "augmix" if augmix else "crop_flip"


# --- AugMix operations at severity 1. `level` = U(0.1, severity) as in AugMix; ints scale maxval * level / 10. ---

def _level(rng: np.random.Generator, severity: float = 1.0) -> float:
    return float(rng.uniform(0.1, severity))


def _signed(rng: np.random.Generator, value: float) -> float:
    return -value if rng.uniform() > 0.5 else value


def _autocontrast(img: Image.Image, rng: np.random.Generator, size: int) -> Image.Image:
    return ImageOps.autocontrast(img)


def _equalize(img: Image.Image, rng: np.random.Generator, size: int) -> Image.Image:
    return ImageOps.equalize(img)


def _posterize(img: Image.Image, rng: np.random.Generator, size: int) -> Image.Image:
    return ImageOps.posterize(img, 4 - int(_level(rng) * 4 / 10))


def _rotate(img: Image.Image, rng: np.random.Generator, size: int) -> Image.Image:
    degrees = _signed(rng, int(_level(rng) * 30 / 10))
    return img.rotate(degrees, resample=Image.BILINEAR)


def _solarize(img: Image.Image, rng: np.random.Generator, size: int) -> Image.Image:
    return ImageOps.solarize(img, 256 - int(_level(rng) * 256 / 10))


def _affine(img: Image.Image, size: int, coeffs: tuple[float, ...]) -> Image.Image:
    return img.transform((size, size), Image.AFFINE, coeffs, resample=Image.BILINEAR)


def _shear_x(img: Image.Image, rng: np.random.Generator, size: int) -> Image.Image:
    return _affine(img, size, (1, _signed(rng, _level(rng) * 0.3 / 10), 0, 0, 1, 0))


def _shear_y(img: Image.Image, rng: np.random.Generator, size: int) -> Image.Image:
    return _affine(img, size, (1, 0, 0, _signed(rng, _level(rng) * 0.3 / 10), 1, 0))


def _translate_x(img: Image.Image, rng: np.random.Generator, size: int) -> Image.Image:
    return _affine(img, size, (1, 0, _signed(rng, int(_level(rng) * (size / 3) / 10)), 0, 1, 0))


def _translate_y(img: Image.Image, rng: np.random.Generator, size: int) -> Image.Image:
    return _affine(img, size, (1, 0, 0, 0, 1, _signed(rng, int(_level(rng) * (size / 3) / 10))))


AUGMIX_OPS = (_autocontrast, _equalize, _posterize, _rotate, _solarize, _shear_x, _shear_y, _translate_x,
              _translate_y)
AUGMIX_CHAINS = 3
AUGMIX_MAX_DEPTH = 3


def random_resized_crop_box(rng: np.random.Generator, width: int, height: int,
                            scale: tuple[float, float] = (0.08, 1.0),
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """(left, top, w, h) of a random resized crop (torchvision's sampling rule, driven by `rng`)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class ViewGenerator:
    """Views of one image: (V, 3, H, W) float32, view 0 the original.

    Args:
        preprocess: the model's preprocessing (size, mean/std, interpolation).
        policy: "single" (1 view), "crop_flip" or "augmix" (1 + 63 views).
        seed: the run seed; views of sample i depend only on (seed, i, image).
    """

    def __init__(self, preprocess: Preprocess, policy: ViewPolicy = "single", seed: int = 0):
        if policy not in VIEW_POLICIES:
            raise ValueError(f"unknown view policy {policy!r}; available: {', '.join(VIEW_POLICIES)}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if preprocess.size[0] != preprocess.size[1]:
            raise ValueError(f"only square model inputs are supported, got {preprocess.size}")
        if preprocess.resize_mode not in ("shortest", "squash"):
            raise ValueError(f"resize_mode {preprocess.resize_mode!r} is not supported (shortest, squash)")
        self.pre = preprocess
        self.size = int(preprocess.size[0])
        self.policy = policy
        self.seed = int(seed)
        self.interp = _INTERP.get(preprocess.interpolation, InterpolationMode.BICUBIC)
        self._mean = torch.tensor(preprocess.mean, dtype=torch.float32)[:, None, None]
        self._std = torch.tensor(preprocess.std, dtype=torch.float32)[:, None, None]

    @property
    def n_views(self) -> int:
        return 1 if self.policy == "single" else 1 + N_AUG_VIEWS

    def _to_tensor(self, img: Image.Image) -> torch.Tensor:
        return TF.normalize(TF.to_tensor(img), self.pre.mean, self.pre.std)

    def _finish(self, x: np.ndarray) -> torch.Tensor:
        """(S, S, 3) float32 in [0, 1] -> normalised (3, S, S) tensor."""
        t = torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))
        return (t - self._mean) / self._std

    def original(self, img: Image.Image) -> torch.Tensor:
        """View 0: (3, S, S)."""
        if self.pre.resize_mode == "squash":
            img = TF.resize(img, [self.size, self.size], interpolation=self.interp)
        else:
            img = TF.resize(img, self.size, interpolation=self.interp)
        return self._to_tensor(TF.center_crop(img, [self.size, self.size]))

    def _augmented_one(self, img: Image.Image, rng: np.random.Generator) -> torch.Tensor:
        left, top, w, h = random_resized_crop_box(rng, img.width, img.height)
        # crop, then resize (torchvision's resized_crop on PIL images)
        crop = img.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.BILINEAR)
        if rng.uniform() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        base = np.asarray(crop, dtype=np.float32) / 255.0
        if self.policy != "augmix":
            return self._finish(base)
        w_mix = rng.dirichlet([1.0] * AUGMIX_CHAINS).astype(np.float32)
        m = np.float32(rng.beta(1.0, 1.0))
        mix = np.zeros_like(base)
        for i in range(AUGMIX_CHAINS):
            x = crop.copy()
            for _ in range(int(rng.integers(1, AUGMIX_MAX_DEPTH + 1))):
                op = AUGMIX_OPS[int(rng.integers(0, len(AUGMIX_OPS)))]
                x = op(x, rng, self.size)
            mix += w_mix[i] * (np.asarray(x, dtype=np.float32) / 255.0)
        # the weights m + (1 - m) * sum(w) are 1, so mixing before the (affine) normalisation equals mixing
        # normalised tensors, as the original does, up to float rounding
        return self._finish(m * base + (1.0 - m) * mix)

    def augmented(self, img: Image.Image, sample_id: int) -> torch.Tensor:
        """Views 1..63 of sample `sample_id`: (63, 3, S, S)."""
        rng = np.random.default_rng([self.seed, int(sample_id)])
        return torch.stack([self._augmented_one(img, rng) for _ in range(N_AUG_VIEWS)])

    def __call__(self, img: Image.Image, sample_id: int) -> torch.Tensor:
        """All views of one sample: (V, 3, S, S), V = 1 or 64."""
        first = self.original(img).unsqueeze(0)
        if self.policy == "single":
            return first
        return torch.cat([first, self.augmented(img, sample_id)])
