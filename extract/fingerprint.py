"""A fingerprint of the image files a resolved test set lists: what the feature cache and the finished-run check key on.

The sample list (split file: relative paths, labels, class names) says *which* images a run reads; this says *what
they are*. Two copies of a dataset with the same split under different roots, or an image fixed in place, give the
same sample list but a different data fingerprint, so the cache recomputes and a finished run is not reused.

Modes:
    stat     (default) relative path, size and modification time (ns) of every file: one `os.stat` per file, no
             reading (about 25 us per file, mostly `os.stat`, on a loaded 2-core machine: ~1 s for ImageNet's
             50,000). Touching or copying files without preserving times changes it (a recompute, never stale).
    content  relative path and sha256 of every file's bytes: survives copies, costs reading every image once.

The function works from any `TestSet` (its `paths` and `dataset_dir`), so every dataset kind gets it for free.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Literal, Sequence

FingerprintMode = Literal["stat", "content"]
FINGERPRINT_MODES: tuple[str, ...] = ("stat", "content")
_BLOCK = 1 << 20


def _rel(path: str, prefix: str) -> str:
    # string slicing, not Path.relative_to: this runs once per image (50,000 on ImageNet)
    return path[len(prefix):] if path.startswith(prefix) else path  # outside the folder: the path identifies it


def check_mode(mode: str) -> FingerprintMode:
    """`mode` if it is a valid fingerprint mode; raises ValueError listing the valid ones."""
    if mode not in FINGERPRINT_MODES:
        raise ValueError(f"unknown fingerprint mode {mode!r}; available: {', '.join(FINGERPRINT_MODES)}")
    return mode  # type: ignore[return-value]


def files_fingerprint(paths: Sequence[Path], base: Path, mode: str = "stat") -> str:
    """`"<mode>:<16 hex>"`: sha256 over the resolved `base` folder and, per file in order, its path relative to
    `base` with (size, mtime_ns) (`stat`) or the sha256 of its bytes (`content`).

    Raises:
        FileNotFoundError: a listed file does not exist (its `filename` names it).
        ValueError: an unknown mode.

    Example:
        >>> files_fingerprint([], Path("."))[:5]
        'stat:'
    """
    mode = check_mode(mode)
    prefix = os.fspath(base).rstrip(os.sep) + os.sep
    lines = [f"{mode}\n{Path(base).resolve().as_posix()}\n"]
    for p in map(os.fspath, paths):
        rel = _rel(p, prefix).replace(os.sep, "/")
        if mode == "stat":
            st = os.stat(p)
            lines.append(f"{rel}\t{st.st_size}\t{st.st_mtime_ns}\n")
        else:
            fh_hash = hashlib.sha256()
            with open(p, "rb") as fh:
                for block in iter(lambda: fh.read(_BLOCK), b""):
                    fh_hash.update(block)
            lines.append(f"{rel}\t{fh_hash.hexdigest()}\n")
    return f"{mode}:{hashlib.sha256(''.join(lines).encode()).hexdigest()[:16]}"


def fingerprint(testset, mode: str = "stat") -> str:
    """The data fingerprint of a resolved test set (`extract.datasets.TestSet`, any kind): `files_fingerprint`
    over its image files relative to its `dataset_dir`.

    Raises:
        DatasetError: a listed image does not exist (named), or an unknown mode.
    """
    from extract.datasets import DatasetError

    try:
        return files_fingerprint(testset.paths, testset.dataset_dir, mode)
    except FileNotFoundError as e:
        raise DatasetError(f"{e.filename}: image listed in the test set of {testset.key!r} does not exist") from None
    except ValueError as e:
        raise DatasetError(f"--fingerprint: {e}") from None
    except OSError as e:
        raise DatasetError(f"{e.filename or testset.dataset_dir}: cannot read ({e.strerror or e})") from None
