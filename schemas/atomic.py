"""Atomic file writes shared by every stage: nothing half-written is ever visible under a final name."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class DiskFullError(OSError):
    """A write that ran out of space (or quota): the message names the file, its folder and the free space."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def _is_disk_full(e: OSError) -> bool:
    # numpy's np.save/tofile reports a short write as "8192 requested and 5088 written", without an errno
    short_write = "requested and" in str(e) and "written" in str(e)
    return e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)) or short_write


def _disk_full_message(path: Path, e: OSError) -> str:
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return (f"{path}: cannot be written, the disk holding {path.parent} is full or over quota ({free}; "
            f"the system said: {str(e).strip() or type(e).__name__}); free space or write elsewhere")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block succeeds, fsync it, give it the usual permissions and
    rename it onto `path`; when it fails, remove it.

    mkstemp creates files readable by the owner only; the permissions are reset to what a plain `open` would give
    (0o666 minus the umask), so shards and tables stay readable by collaborators on a shared cluster.

    Example:
        >>> with atomic_path("out/table.csv") as tmp:   # doctest: +SKIP
        ...     df.write_csv(tmp)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, DiskFullError) and _is_disk_full(e):
            raise DiskFullError(errno.ENOSPC, _disk_full_message(path, e)) from None
        raise


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; when the block succeeds, replace `path` by it (an existing `path`
    is removed first); when it fails, remove it. Readers see the old folder or the complete new one.

    Example:
        >>> with atomic_dir("data/models/tiny") as tmp:   # doctest: +SKIP
        ...     (tmp / "open_clip_config.json").write_text("{}")
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_current_umask())  # mkdtemp makes it owner-only
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write UTF-8 text atomically; returns the final path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj: Any, *, indent: int = 1) -> Path:
    """Write JSON atomically (keys sorted); returns the final path."""
    return write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=True))


def check_output_dir(path: str | os.PathLike, option: str) -> Path:
    """Fail fast on an output folder that cannot be written, before any input is read.

    `path` (or the folder it would be created in) must not be a file, and its nearest existing folder must be
    writable. Every command checks its output folder with this one function.

    Raises:
        ValueError: one line naming the option, the path and what is wrong, e.g.
            `--out results/m.csv: results/m.csv is a file, expected a folder`.
    """
    path = Path(path)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    where = f"{option} {path}" + ("" if probe == path else f" (to be created in {probe})")
    if probe.exists() and not probe.is_dir():
        raise ValueError(f"{where}: {probe} is a file, expected a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{where}: folder {probe} is not writable; choose another with {option}")
    return path
