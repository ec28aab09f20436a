"""Test-time views: the original view plus the TPT-style augmented views, reimplemented
(docs/methods.md, "Test-time views").

View 0 ("original"): resize the short side to the model's size (its interpolation, bicubic for CLIP), centre crop,
to tensor, normalise with the model's mean/std.

Views 1..63: a random resized crop of the raw image (area fraction U(0.08, 1), U(0.5, 1) for "crop_flip_05";
log-uniform aspect ratio in [3/4, 4/3], bilinear; ten tries, then a centre crop) and a horizontal flip with
probability 1/2. Policies "crop_flip" and "crop_flip_05" stop there. Policy "augmix" then mixes, in normalised-tensor space,
    out = m * P(x) + (1 - m) * sum_i w_i * P(chain_i(x)),   w ~ Dirichlet(1, 1, 1), m ~ Beta(1, 1),
with three chains of 1-3 operations each, drawn uniformly from autocontrast, equalize, posterize, rotate, solarize,
shear_x, shear_y, translate_x, translate_y at severity 1 (AugMix's operation set without the colour, contrast,
brightness and sharpness operations).

Seeding: all randomness of a sample comes from one numpy Generator seeded with (seed, sample_id), so every method,
every batch size and every stream order sees exactly the same views of a sample.

Two halves: the PIL work (`original_raw`, `augmented_raw`: uint8 images and the AugMix weights), done by the loader
processes, and the float work (`finish_views`: to [0, 1], the AugMix mix, the normalisation), done on the model's
device; `original` and `augmented` chain both. The split changes no float (see `finish_views`).

Example:
    >>> gen = ViewGenerator(Preprocess((32, 32), (0.5,) * 3, (0.5,) * 3), policy="augmix", seed=1)  # doctest: +SKIP
    >>> gen(img, sample_id=7).shape  # doctest: +SKIP
    torch.Size([64, 3, 32, 32])
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
import torchvision.transforms.functional as TF
from PIL import Image, ImageOps
from torchvision.transforms import InterpolationMode

from extract.models import Preprocess

ViewPolicy = Literal["single", "crop_flip", "augmix", "crop_flip_05"]
VIEW_POLICIES: tuple[str, ...] = ("single", "crop_flip", "augmix", "crop_flip_05")
#: the random-resized-crop area range of each multi-view policy: torchvision's default (0.08, 1) as TPT; DMN's
#: official `get_preaugment` crops at (0.5, 1) (`data/datautils.py`), its crop + flip views on the ImageNet family
CROP_SCALE: dict[str, tuple[float, float]] = {"crop_flip": (0.08, 1.0), "augmix": (0.08, 1.0),
                                              "crop_flip_05": (0.5, 1.0)}
#: augmented views per sample in the multi-view policies (TPT's batch of 64 = 1 original + 63)
N_AUG_VIEWS = 63

_INTERP = {"bicubic": InterpolationMode.BICUBIC, "bilinear": InterpolationMode.BILINEAR,
           "nearest": InterpolationMode.NEAREST}


def view_policy(n_views: int, augmix: bool, crop_scale: tuple[float, float] = (0.08, 1.0)) -> ViewPolicy:
    """The view policy of a method config: 1 view = "single"; 64 views = "augmix" or the crop + flip policy whose
    crops cover `crop_scale` of the image (`CROP_SCALE`)."""
    if n_views == 1:
        return "single"
    if n_views != 1 + N_AUG_VIEWS:
        raise ValueError(f"n_views must be 1 or {1 + N_AUG_VIEWS}, got {n_views}")
    kind = "augmix" if augmix else "crop_flip"
    for policy, scale in CROP_SCALE.items():
        if policy.startswith(kind) and scale == tuple(crop_scale):
            return policy  # type: ignore[return-value]
    have = ", ".join(f"{p} {s}" for p, s in CROP_SCALE.items() if p.startswith(kind))
    raise ValueError(f"no {kind} view policy crops at scale {tuple(crop_scale)}; available: {have}")


# --- AugMix operations at severity 1. `level` = U(0.1, severity) as in AugMix; ints scale maxval * level / 10. ---

def _level(rng: np.random.Generator, severity: float = 1.0) -> float:
    return float(rng.uniform(0.1, severity))


def _signed(rng: np.random.Generator, value: float) -> float:
    return -value if rng.uniform() > 0.5 else value


# Each operation draws its parameter from the sample's Generator (`_DRAWS`, AugMix's draws in AugMix's order), then
# applies it; the device half of the loader (`extract.augmix_device`) receives the same parameters, drawn by the same
# functions, and applies them to the same pixels with the same arithmetic.

def _no_draw(rng: np.random.Generator, size: int) -> float:
    return 0.0


def _draw_posterize(rng: np.random.Generator, size: int) -> int:
    return 4 - int(_level(rng) * 4 / 10)  # bits


def _draw_rotate(rng: np.random.Generator, size: int) -> int:
    return _signed(rng, int(_level(rng) * 30 / 10))  # whole degrees  # type: ignore[return-value]


def _draw_solarize(rng: np.random.Generator, size: int) -> int:
    return 256 - int(_level(rng) * 256 / 10)  # threshold


def _draw_shear(rng: np.random.Generator, size: int) -> float:
    return _signed(rng, _level(rng) * 0.3 / 10)


def _shift(rng: np.random.Generator, size: int) -> int:
    return int(_signed(rng, int(_level(rng) * (size / 3) / 10)))


#: the parameter draw of each operation, in AugMix's order (`_APPLY`, `AUGMIX_OPS`)
_DRAWS = (_no_draw, _no_draw, _draw_posterize, _draw_rotate, _draw_solarize, _draw_shear, _draw_shear, _shift, _shift)


# Pillow's application of each operation with its drawn parameter (posterize: bits, rotate: degrees, solarize:
# threshold, shears: the shear, translations: the shift in pixels)

def _autocontrast(img: Image.Image, param: float, size: int) -> Image.Image:
    return ImageOps.autocontrast(img)


def _equalize(img: Image.Image, param: float, size: int) -> Image.Image:
    return ImageOps.equalize(img)


def _posterize(img: Image.Image, bits: int, size: int) -> Image.Image:
    return ImageOps.posterize(img, bits)


def _rotate(img: Image.Image, degrees: int, size: int) -> Image.Image:
    return img.rotate(degrees, resample=Image.BILINEAR)


def _solarize(img: Image.Image, threshold: int, size: int) -> Image.Image:
    return ImageOps.solarize(img, threshold)


def _affine(img: Image.Image, size: int, coeffs: tuple[float, ...]) -> Image.Image:
    return img.transform((size, size), Image.AFFINE, coeffs, resample=Image.BILINEAR)


def _shear_x(img: Image.Image, shear: float, size: int) -> Image.Image:
    return _affine(img, size, (1, shear, 0, 0, 1, 0))


def _shear_y(img: Image.Image, shear: float, size: int) -> Image.Image:
    return _affine(img, size, (1, 0, 0, shear, 1, 0))


# A translation by a whole number of pixels t is an affine map whose bilinear weights are all exactly 0, so PIL's
# bilinear `transform` returns input pixel x + t, or 0 outside the image: exactly what `crop` with a box reaching past
# the border returns, at a fraction of the cost (tests/extract/test_views.py checks every shift against `transform`).

def _translate_x(img: Image.Image, t: int, size: int) -> Image.Image:
    return img.crop((t, 0, t + size, size))


def _translate_y(img: Image.Image, t: int, size: int) -> Image.Image:
    return img.crop((0, t, size, t + size))


def _translate_x_affine(img: Image.Image, t: int, size: int) -> Image.Image:
    return _affine(img, size, (1, 0, t, 0, 1, 0))


def _translate_y_affine(img: Image.Image, t: int, size: int) -> Image.Image:
    return _affine(img, size, (1, 0, 0, 0, 1, t))


#: the operations in AugMix's order, applied with a drawn parameter (the views' path)
_APPLY = (_autocontrast, _equalize, _posterize, _rotate, _solarize, _shear_x, _shear_y, _translate_x, _translate_y)


def _drawing(k: int, apply: Any) -> Any:
    """Operation k as AugMix's code writes it, (img, rng, size) -> img: draw its parameter, then apply it."""
    def op(img: Image.Image, rng: np.random.Generator, size: int) -> Image.Image:
        return apply(img, _DRAWS[k](rng, size), size)
    op.__name__ = apply.__name__
    return op


AUGMIX_OPS = tuple(_drawing(k, f) for k, f in enumerate(_APPLY))
#: the same operations as AugMix's code writes them (translations through PIL's affine transform): the reference
_REFERENCE_OPS = tuple(_drawing(k, f) for k, f in enumerate(_APPLY[:-2] + (_translate_x_affine, _translate_y_affine)))
AUGMIX_CHAINS = 3
AUGMIX_MAX_DEPTH = 3


#: images (a view holds J) finished per step on the CPU (`finish_views`), so that the temporaries fit in cache
_CPU_FINISH_IMAGES = 8
#: columns of an AugMix view's coefficient row (`ViewGenerator.augmented_raw`): m, 1 - m (float32), w_0, w_1, w_2
N_COEF = 2 + AUGMIX_CHAINS


def finish_views(raw: torch.Tensor, coef: torch.Tensor | None, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Raw views -> (N, 3, S, S) float32 normalised views, computed on `raw`'s device.

    Args:
        raw: (N, J, S, S, 3) uint8 images as PIL returns them: J = 1 (the view itself), or J = 4 for AugMix (the
            crop, then its three chains).
        coef: None for J = 1; for J = 4, (N, 5) float32 rows [m, 1 - m, w_0, w_1, w_2] on the same device.
        mean, std: (3, 1, 1) float32 on the same device.

    Every float is the one `to_tensor` + `normalize` (and, for AugMix, the obvious mixing code,
    `reference_augmented(..., mix_space="unit")`) computes: x = float32(level) / 255, then for AugMix
    m * x_0 + (1 - m) * ((x_1 * w_0 + x_2 * w_1) + x_3 * w_2), then (x - mean) / std, one IEEE float32 operation
    at a time in that order. Divisions are by tensors on the device, never by a host scalar (CUDA turns a division
    by a host scalar into a multiplication by its reciprocal, which can differ in the last bit), so the CPU and a
    GPU give the same bits, and the loader sends uint8 (a quarter of float32's bytes) with the float work done on
    the GPU.
    """
    n, j = raw.shape[:2]
    if j != 1 and (coef is None or coef.shape != (n, N_COEF)):
        raise ValueError(f"AugMix views need (N, {N_COEF}) coefficients, got "
                         f"{None if coef is None else tuple(coef.shape)}")
    # on the CPU a few views at a time, so that the temporaries stay in cache (one pass over a whole sample is
    # several times slower there); on a GPU the whole sample at once
    size = tuple(raw.shape[2:4])
    out = torch.empty((n, 3, *size), dtype=torch.float32, device=raw.device)
    step = n if raw.device.type == "cuda" else max(1, _CPU_FINISH_IMAGES // j)
    c255 = torch.full((), 255.0, dtype=torch.float32, device=raw.device)
    buf = torch.empty((min(step, n), j, 3, *size), dtype=torch.float32, device=raw.device)  # reused: no page faults
    for a in range(0, n, step):
        r = raw[a:a + step]
        x = buf[:r.shape[0]]
        x.copy_(r.permute(0, 1, 4, 2, 3)).div_(c255)  # (n, J, 3, S, S) in [0, 1]
        if j == 1:
            y = x[:, 0]
        else:
            c = coef[a:a + step].to(torch.float32)[:, :, None, None, None]  # type: ignore[index]  (n, 5, 1, 1, 1)
            mix = x[:, 1].mul_(c[:, 2])
            for i in range(1, AUGMIX_CHAINS):
                mix.add_(x[:, 1 + i].mul_(c[:, 2 + i]))
            y = x[:, 0].mul_(c[:, 0]).add_(mix.mul_(c[:, 1]))
        torch.div(y.sub_(mean), std, out=out[a:a + step])
    return out


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
        policy: "single" (1 view), "crop_flip", "crop_flip_05" or "augmix" (1 + 63 views; `CROP_SCALE`).
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
        self._mean = torch.tensor(preprocess.mean, dtype=torch.float32)[:, None, None]  # (3, 1, 1)
        self._std = torch.tensor(preprocess.std, dtype=torch.float32)[:, None, None]
        self._norm: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def n_views(self) -> int:
        return 1 if self.policy == "single" else 1 + N_AUG_VIEWS

    def finish(self, raw: torch.Tensor, coef: torch.Tensor | None = None) -> torch.Tensor:
        """`finish_views` with this model's mean and std, on `raw`'s device."""
        dev = raw.device
        if dev not in self._norm:
            self._norm[dev] = (self._mean.to(dev), self._std.to(dev))
        return finish_views(raw, coef, *self._norm[dev])

    def original_raw(self, img: Image.Image) -> np.ndarray:
        """View 0 before the float work: (S, S, 3) uint8, resized (the model's interpolation) and centre-cropped."""
        if self.pre.resize_mode == "squash":
            img = TF.resize(img, [self.size, self.size], interpolation=self.interp)
        else:
            img = TF.resize(img, self.size, interpolation=self.interp)
        return np.array(TF.center_crop(img, [self.size, self.size]))  # a writable copy, for torch.from_numpy

    def original(self, img: Image.Image) -> torch.Tensor:
        """View 0: (3, S, S)."""
        return self.finish(torch.from_numpy(self.original_raw(img))[None, None])[0]

    def _crop_flip(self, img: Image.Image, rng: np.random.Generator) -> Image.Image:
        left, top, w, h = random_resized_crop_box(rng, img.width, img.height, CROP_SCALE[self.policy])
        # crop, then resize (torchvision's resized_crop on PIL images)
        crop = img.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.BILINEAR)
        if rng.uniform() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        return crop

    def _draw_view(self, img: Image.Image, rng: np.random.Generator
                   ) -> tuple[Image.Image, np.ndarray | None, list[list[tuple[int, float]]]]:
        """One augmented view's random draws, in AugMix's order, and its crop: (crop, the mixing coefficients
        [m, 1 - m, w_0, w_1, w_2] float32 or None, per chain its (operation index, parameter) list; no chains
        unless AugMix). No operation is applied (none draws anything), so the Pillow path (`augmented_raw`) and
        the device path (`augmix_program`) share this one sequence of draws."""
        crop = self._crop_flip(img, rng)
        if self.policy != "augmix":
            return crop, None, []
        w_mix = rng.dirichlet([1.0] * AUGMIX_CHAINS).astype(np.float32)
        m = np.float32(rng.beta(1.0, 1.0))
        coef = np.asarray((m, np.float32(1.0) - m, *w_mix), dtype=np.float32)
        chains = []
        for _ in range(AUGMIX_CHAINS):
            chain = []
            for _ in range(int(rng.integers(1, AUGMIX_MAX_DEPTH + 1))):
                op = int(rng.integers(0, len(AUGMIX_OPS)))
                chain.append((op, _DRAWS[op](rng, self.size)))
            chains.append(chain)
        return crop, coef, chains

    def augmented_raw(self, img: Image.Image, sample_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Views 1..63 of sample `sample_id` before the float work (what a loader process computes):
        (63, J, S, S, 3) uint8 and, for AugMix, (63, 5) float32 coefficients (`finish_views`); J = 4 for AugMix
        (the crop and its three chains), else 1 and no coefficients. The random draws are AugMix's, in its order."""
        rng = np.random.default_rng([self.seed, int(sample_id)])
        augmix = self.policy == "augmix"
        raw = np.empty((N_AUG_VIEWS, 1 + AUGMIX_CHAINS if augmix else 1, self.size, self.size, 3), dtype=np.uint8)
        coef = np.empty((N_AUG_VIEWS, N_COEF), dtype=np.float32) if augmix else None
        for v in range(N_AUG_VIEWS):
            crop, coef_v, chains = self._draw_view(img, rng)
            raw[v, 0] = np.asarray(crop)
            if coef is not None:
                coef[v] = coef_v
            for i, chain in enumerate(chains):
                x = crop
                for op, param in chain:
                    x = _APPLY[op](x, param, self.size)
                raw[v, 1 + i] = np.asarray(x)
        return torch.from_numpy(raw), None if coef is None else torch.from_numpy(coef)

    def augmix_program(self, img: Image.Image, sample_id: int) -> dict[str, torch.Tensor]:
        """The AugMix views of sample `sample_id` as a loader process prepares them for `extract.augmix_device`:
        the crops (63, 1, S, S, 3) uint8, the mixing coefficients (63, 5) float32, and per view, chain and depth the
        operation (`ops` (63, 3, 3) int8, -1 past the chain's depth), its point-operation parameter (`lut_params`,
        int16) and its affine matrix (`affine` (63, 3, 3, 6) float64), with the row lists of `chain_rows`. The
        random draws are `augmented_raw`'s (`_draw_view`); `run_chains` then gives its images bit for bit."""
        from extract.augmix_device import IDENTITY, LUT_OPS, affine_coeffs, chain_rows

        if self.policy != "augmix":
            raise ValueError(f"an AugMix program needs the augmix policy, not {self.policy!r}")
        rng = np.random.default_rng([self.seed, int(sample_id)])
        crops = np.empty((N_AUG_VIEWS, 1, self.size, self.size, 3), dtype=np.uint8)
        coef = np.empty((N_AUG_VIEWS, N_COEF), dtype=np.float32)
        ops = np.full((N_AUG_VIEWS, AUGMIX_CHAINS, AUGMIX_MAX_DEPTH), -1, dtype=np.int8)
        lut_params = np.zeros(ops.shape, dtype=np.int16)
        affine = np.tile(np.asarray(IDENTITY, dtype=np.float64), ops.shape + (1,))
        for v in range(N_AUG_VIEWS):
            crop, coef[v], chains = self._draw_view(img, rng)
            crops[v, 0] = np.asarray(crop)
            for i, chain in enumerate(chains):
                for d, (op, param) in enumerate(chain):
                    ops[v, i, d] = op
                    if op in LUT_OPS:
                        lut_params[v, i, d] = int(param)
                    else:
                        affine[v, i, d] = affine_coeffs(op, param, self.size)
        ops_t = torch.from_numpy(ops)
        return {"crops": torch.from_numpy(crops), "coef": torch.from_numpy(coef), "ops": ops_t,
                "lut_params": torch.from_numpy(lut_params), "affine": torch.from_numpy(affine),
                **chain_rows(ops_t)}

    def augmented(self, img: Image.Image, sample_id: int) -> torch.Tensor:
        """Views 1..63 of sample `sample_id`: (63, 3, S, S)."""
        return self.finish(*self.augmented_raw(img, sample_id))

    def __call__(self, img: Image.Image, sample_id: int) -> torch.Tensor:
        """All views of one sample: (V, 3, S, S), V = 1 or 64."""
        first = self.original(img).unsqueeze(0)
        if self.policy == "single":
            return first
        return torch.cat([first, self.augmented(img, sample_id)])


def reference_augmented(gen: ViewGenerator, img: Image.Image, sample_id: int,
                        mix_space: Literal["unit", "normalised"] = "unit") -> torch.Tensor:
    """The obvious implementation of `gen.augmented`: slow, kept as the reference it is tested and timed against.

    PIL for every operation (translations through the affine transform, as AugMix's code does them), one float
    conversion per image. `mix_space="unit"` mixes images in [0, 1] and normalises the mix: the same floats as
    `gen.augmented`, bit for bit. `mix_space="normalised"` normalises each image and mixes the normalised tensors,
    TPT's own order of operations (`augmix` in TPT's data/augmix_ops.py driver); it differs by float rounding only.
    """
    rng = np.random.default_rng([gen.seed, int(sample_id)])
    mean = torch.tensor(gen.pre.mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(gen.pre.std, dtype=torch.float32)[:, None, None]

    def unit(x: Image.Image) -> torch.Tensor:  # (3, S, S) in [0, 1]
        return torch.from_numpy(np.asarray(x, dtype=np.float32) / 255.0).permute(2, 0, 1)

    views = []
    for _ in range(N_AUG_VIEWS):
        crop = gen._crop_flip(img, rng)
        if gen.policy != "augmix":
            views.append((unit(crop) - mean) / std)
            continue
        w = rng.dirichlet([1.0] * AUGMIX_CHAINS).astype(np.float32)
        m = np.float32(rng.beta(1.0, 1.0))
        prep = unit if mix_space == "unit" else (lambda x: (unit(x) - mean) / std)
        base = prep(crop)
        mix = torch.zeros_like(base)
        for i in range(AUGMIX_CHAINS):
            x = crop.copy()
            for _ in range(int(rng.integers(1, AUGMIX_MAX_DEPTH + 1))):
                x = _REFERENCE_OPS[int(rng.integers(0, len(_REFERENCE_OPS)))](x, rng, gen.size)
            mix += float(w[i]) * prep(x)
        mixed = float(m) * base + float(1.0 - m) * mix
        views.append(mixed if mix_space == "normalised" else (mixed - mean) / std)
    return torch.stack(views)
