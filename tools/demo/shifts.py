"""The demo's test sets: Fashion-MNIST's test split, clean and under five distribution shifts, written to disk.

Each set is a registered dataset (``fmnist``, ``fmnist_noise``, ``fmnist_blur``, ``fmnist_contrast``,
``fmnist_invert``, ``fmnist_rotate``; see ``extract.datasets``) in the CoOp JSON-split layout, so the ordinary dataset
loader reads it::

    <data_root>/fashion-mnist/<set>/images/<label:02d>/<index:05d>.png     32x32 RGB
    <data_root>/fashion-mnist/<set>/split_zhou_FashionMNIST.json          {"train": [], "val": [],
                                                                           "test": [[relpath, label, classname], ...]}
    <data_root>/fashion-mnist/<set>/shift.json                            what was applied, with its seed

The JSON ``test`` list follows the idx file's order, which is therefore the canonical order (``sample_id``) in every
set: sample 17 of ``fmnist_blur`` is sample 17 of ``fmnist``, blurred.

Shifts act on the 32x32 grey image in [0, 1] (after upsampling) and are seeded per set, so a rewrite is identical.
Severities follow the design pilot (docs/demo.md, "Design sizes"), where each lowered the small model's zero-shot
accuracy: Gaussian noise sigma 0.15, Gaussian blur sigma 2.0 px, contrast x0.4, 20% of images inverted, rotation by
15 degrees.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import torch
import torch.nn.functional as F

from tools.demo.fmnist import load_split
from tools.demo.images import to_rgb_uint8, upsample
from schemas.atomic import atomic_dir

SPLIT_FILE = "split_zhou_FashionMNIST.json"
SHIFT_FILE = "shift.json"
SET_DIR = "fashion-mnist"

ShiftName = Literal["clean", "noise", "blur", "contrast", "invert", "rotate"]


@dataclass(frozen=True)
class ShiftConfig:
    """Severities of the five shifts (pilot values, see the module docstring) and the base seed."""

    noise_sigma: float = 0.15  # additive Gaussian noise, std in units of the [0, 1] intensity range
    blur_sigma: float = 2.0  # Gaussian blur std in pixels of the 32x32 image
    contrast_factor: float = 0.4  # intensities pulled towards each image's mean: m + f * (x - m)
    invert_fraction: float = 0.2  # share of images (seeded choice) replaced by their negative 1 - x
    rotate_degrees: float = 15.0  # rotation by +/- this angle (sign drawn per image), black fill
    seed: int = 0


def dataset_key(name: str) -> str:
    """``clean`` -> ``fmnist``, ``blur`` -> ``fmnist_blur``: the registry key of a set."""
    return "fmnist" if name == "clean" else f"fmnist_{name}"


def _noise(x: np.ndarray, cfg: ShiftConfig, rng: np.random.Generator) -> np.ndarray:
    return np.clip(x + rng.normal(0.0, cfg.noise_sigma, size=x.shape).astype(np.float32), 0.0, 1.0)


def _blur(x: np.ndarray, cfg: ShiftConfig, rng: np.random.Generator) -> np.ndarray:
    radius = int(np.ceil(3 * cfg.blur_sigma))
    t = np.arange(-radius, radius + 1, dtype=np.float32)
    k = np.exp(-0.5 * (t / cfg.blur_sigma) ** 2)
    k = torch.from_numpy(k / k.sum())
    img = torch.from_numpy(x)[:, None]  # (N, 1, H, W)
    # separable blur; reflect padding keeps the border from darkening
    img = F.conv2d(F.pad(img, (radius, radius, 0, 0), mode="reflect"), k.view(1, 1, 1, -1))
    img = F.conv2d(F.pad(img, (0, 0, radius, radius), mode="reflect"), k.view(1, 1, -1, 1))
    return img[:, 0].clamp(0.0, 1.0).numpy()


def _contrast(x: np.ndarray, cfg: ShiftConfig, rng: np.random.Generator) -> np.ndarray:
    mean = x.mean(axis=(1, 2), keepdims=True)
    return np.clip(mean + cfg.contrast_factor * (x - mean), 0.0, 1.0)


def _invert(x: np.ndarray, cfg: ShiftConfig, rng: np.random.Generator) -> np.ndarray:
    chosen = rng.permutation(len(x))[: int(round(cfg.invert_fraction * len(x)))]
    out = x.copy()
    out[chosen] = 1.0 - out[chosen]
    return out


def _rotate(x: np.ndarray, cfg: ShiftConfig, rng: np.random.Generator) -> np.ndarray:
    sign = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=len(x))
    theta = torch.from_numpy(np.deg2rad(cfg.rotate_degrees) * sign)
    cos, sin = torch.cos(theta), torch.sin(theta)
    zero = torch.zeros_like(theta)
    affine = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)  # (N, 2, 3)
    img = torch.from_numpy(x)[:, None]
    grid = F.affine_grid(affine.float(), list(img.shape), align_corners=False)
    return F.grid_sample(img, grid, mode="bilinear", padding_mode="zeros", align_corners=False)[:, 0].numpy()


SHIFTS: dict[str, Callable[[np.ndarray, ShiftConfig, np.random.Generator], np.ndarray] | None] = {
    "clean": None,
    "noise": _noise,
    "blur": _blur,
    "contrast": _contrast,
    "invert": _invert,
    "rotate": _rotate,
}


def describe(name: str, cfg: ShiftConfig = ShiftConfig()) -> str:
    """A short human description of a shift, e.g. ``gaussian blur, sigma 2.0 px``."""
    return {
        "clean": "no shift",
        "noise": f"gaussian noise, sigma {cfg.noise_sigma:g}",
        "blur": f"gaussian blur, sigma {cfg.blur_sigma:g} px",
        "contrast": f"contrast x{cfg.contrast_factor:g}",
        "invert": f"{cfg.invert_fraction:.0%} of images inverted",
        "rotate": f"rotation by +/-{cfg.rotate_degrees:g} degrees",
    }[name]


def _record(name: str, cfg: ShiftConfig) -> dict[str, object]:
    params = {
        "clean": {},
        "noise": {"sigma": cfg.noise_sigma},
        "blur": {"sigma_px": cfg.blur_sigma},
        "contrast": {"factor": cfg.contrast_factor},
        "invert": {"fraction": cfg.invert_fraction},
        "rotate": {"degrees": cfg.rotate_degrees, "sign": "random per image"},
    }[name]
    return {"set": name, "dataset": dataset_key(name), "params": params, "seed": _set_seed(name, cfg)}


def _set_seed(name: str, cfg: ShiftConfig) -> int:
    return cfg.seed * 1000 + list(SHIFTS).index(name)


def apply_shift(name: str, images: np.ndarray, cfg: ShiftConfig = ShiftConfig()) -> np.ndarray:
    """Apply one named shift to (N, H, W) float grey images in [0, 1]; returns the same shape, float32 in [0, 1].

    Deterministic: the random draws come from a generator seeded by ``cfg.seed`` and the shift's name.
    """
    if name not in SHIFTS:
        raise ValueError(f"unknown shift '{name}'; available: {', '.join(SHIFTS)}")
    fn = SHIFTS[name]
    if fn is None:
        return images.astype(np.float32, copy=True)
    rng = np.random.default_rng(_set_seed(name, cfg))
    return fn(images.astype(np.float32, copy=False), cfg, rng).astype(np.float32, copy=False)


def set_dir(data_root: str | Path, name: str) -> Path:
    return Path(data_root) / SET_DIR / name


def is_written(
    data_root: str | Path, name: str, *, n: int | None | str = "any", cfg: ShiftConfig | None = None
) -> bool:
    """Whether the set is on disk; with ``n`` (an int, or None for the whole test split) and/or ``cfg`` given, also
    whether it was written with that many images and those severities."""
    d = set_dir(data_root, name)
    if not (d / SPLIT_FILE).is_file():
        return False
    if n == "any" and cfg is None:
        return True
    try:
        with open(d / SHIFT_FILE, encoding="utf-8") as fh:
            rec = json.load(fh)
    except (OSError, json.JSONDecodeError):
        return False
    if n != "any" and rec.get("n_requested", rec.get("n")) != n:
        return False
    return cfg is None or rec.get("config") == asdict(cfg)


def write_set(
    name: str,
    fmnist_dir: str | Path,
    data_root: str | Path,
    *,
    cfg: ShiftConfig = ShiftConfig(),
    limit: int | None = None,
    force: bool = False,
) -> Path:
    """Write one set (the whole test split, or its first ``limit`` images) unless already there.

    The set appears atomically: it is written under a temporary folder next to its final place and renamed, so an
    interrupted run never leaves a half-written set that would later be mistaken for a finished one.

    Returns:
        The set's folder.
    """
    from PIL import Image

    from extract.datasets import FASHION_MNIST_CLASSES

    if name not in SHIFTS:
        raise ValueError(f"unknown shift '{name}'; available: {', '.join(SHIFTS)}")
    out = set_dir(data_root, name)
    if is_written(data_root, name) and not force:
        return out
    images, labels = load_split(fmnist_dir, "test")
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    rgb = to_rgb_uint8(apply_shift(name, upsample(images), cfg))  # (N, 32, 32, 3) uint8
    # an existing folder (a forced rewrite, or one without its split file) is replaced whole
    with atomic_dir(out) as tmp:
        entries = []
        for label in range(len(FASHION_MNIST_CLASSES)):
            (tmp / "images" / f"{label:02d}").mkdir(parents=True, exist_ok=True)
        for index, (img, label) in enumerate(zip(rgb, labels.tolist())):
            rel = f"{label:02d}/{index:05d}.png"
            Image.fromarray(img, mode="RGB").save(tmp / "images" / rel, optimize=False, compress_level=1)
            entries.append([rel, int(label), FASHION_MNIST_CLASSES[label]])
        with open(tmp / SHIFT_FILE, "w", encoding="utf-8") as fh:
            record = {**_record(name, cfg), "config": asdict(cfg), "n": len(entries), "n_requested": limit}
            json.dump(record, fh, indent=2)
        with open(tmp / SPLIT_FILE, "w", encoding="utf-8") as fh:
            json.dump({"train": [], "val": [], "test": entries}, fh)
    return out


def write_sets(
    fmnist_dir: str | Path,
    data_root: str | Path,
    *,
    names: tuple[str, ...] = tuple(SHIFTS),
    cfg: ShiftConfig = ShiftConfig(),
    limit: int | None = None,
) -> dict[str, Path]:
    """Write every named set that is not there yet; returns {dataset key: folder}."""
    return {dataset_key(n): write_set(n, fmnist_dir, data_root, cfg=cfg, limit=limit) for n in names}
