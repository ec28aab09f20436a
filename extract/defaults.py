"""The defaults the low floors of the extractor need, at the bottom of the house: the default backbone, the
folders that fall back on an environment variable (data root, feature cache, CuPL prompts, class descriptions) and
the pixel limits of an image.

`extract.models`, `extract.datasets`, `extract.cache` and `extract.prompts` read them from here, and so do the run's
options (`extract.run.options`, where the run's other defaults live) and the command lines; this module imports
nothing of the project and nothing heavy, so every arrow to it points down (tests/test_import_layers.py).

Example:
    >>> str(DEFAULT_CACHE_DIR), CACHE_DIR_ENV
    ('data/cache', 'ZAEC_CACHE_DIR')
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_BACKBONE = "ViT-B-16"

DATA_ROOT_ENV = "ZAEC_DATA_ROOT"
DEFAULT_DATA_ROOT = Path("data")
CACHE_DIR_ENV = "ZAEC_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("data") / "cache"
CUPL_DIR_ENV = "ZAEC_CUPL_DIR"
DESCRIPTIONS_DIR_ENV = "ZAEC_DESCRIPTIONS_DIR"


def default_data_root() -> Path:
    """The data root when none is given: $ZAEC_DATA_ROOT, else ./data (not checked for existence)."""
    return Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)


def default_cache_dir() -> Path:
    """The feature cache when none is given: $ZAEC_CACHE_DIR, else data/cache."""
    raw = os.environ.get(CACHE_DIR_ENV)
    return Path(raw).expanduser() if raw else DEFAULT_CACHE_DIR


def default_cupl_dir() -> Path | None:
    """The CuPL prompt folder when none is given: $ZAEC_CUPL_DIR, else None (templates only)."""
    raw = os.environ.get(CUPL_DIR_ENV)
    return Path(raw).expanduser() if raw else None


def default_descriptions_dir() -> Path | None:
    """The folder of class-description files (AWT's `<dataset>.json`) when none is given: $ZAEC_DESCRIPTIONS_DIR,
    else None (a method that needs them stops before the model loads, naming the file it needs)."""
    raw = os.environ.get(DESCRIPTIONS_DIR_ENV)
    return Path(raw).expanduser() if raw else None

#: Pillow's default limits (`PIL.Image.MAX_IMAGE_PIXELS`): an image of more pixels than the first makes Pillow warn
#: of a possible decompression bomb, of more than twice it Pillow refuses it. A run applies its own limit instead
#: (`extract.datasets.open_image`, `--max-image-pixels`), by default Pillow's refusal, and reports the images above
#: the warning threshold once, through its own printer (`extract.run.encode`).
WARN_IMAGE_PIXELS = 89_478_485
DEFAULT_MAX_IMAGE_PIXELS = 2 * WARN_IMAGE_PIXELS
