"""On-disk caches: image features (per model, dataset, seed and view part) and text prototypes.

The image encoder is frozen in every method of this stage, so features are computed once and reused by every method
(zero-shot, TDA, DPE, DLAE, ...). Layout under the cache root (default `data/cache`):

    <root>/<model fingerprint>/<dataset>-<test-set key>/seed=<s>/   (key: sample list, data root, data fingerprint)
        meta.json                     n_total, chunk size, feature dim, dtype, stream fingerprint
        view0/chunk-00000.npy         (n, D)      original view of stream positions [0, chunk)
        augmix/chunk-00000.npy        (n, 63, D)  views 1..63 (AugMix policy)
        crop_flip/chunk-00000.npy     (n, 63, D)  views 1..63 (crop + flip policy)
        crop_flip_05/chunk-00000.npy  (n, 63, D)  views 1..63 (crop + flip at scale 0.5-1, DMN's)
    <root>/<model fingerprint>/text/<prompt-set fingerprint>.npy    (K, D) prototypes
    <root>/<model fingerprint>/difftpt-<generation key>/<dataset>-<test-set key>/seed=<s>/
        generated/chunk-00000.npy     (n, G, D)   DiffTPT's G views generated per sample (extract/run/diffusion.py)

Chunks follow the stream order of the seed, and every chunk always holds the same samples, encoded in the same
micro-batches: a chunk's content never depends on which run produced it. `--limit N` encodes only the first N
positions: the last chunk it touches is stored as a prefix (fewer rows than the chunk), which a later run extends,
re-encoding from the last micro-batch boundary of that prefix, so that the extended chunk equals one encoded whole.
View 0 is stored once per (model, dataset, seed) and shared by the single-view and the multi-view policies, so a
single-view method reuses the original view of a multi-view cache exactly (same numbers).
Every file is written under a temporary name and renamed: a crash leaves no half-written chunk, and a restarted run
encodes only the missing chunks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from extract.defaults import CACHE_DIR_ENV as CACHE_ENV, DEFAULT_CACHE_DIR
from schemas.atomic import atomic_path, write_json_atomic

Part = Literal["view0", "augmix", "crop_flip", "crop_flip_05", "generated"]
PARTS: tuple[str, ...] = ("view0", "augmix", "crop_flip", "crop_flip_05")
CHUNK_TEMPLATE = "chunk-{:05d}.npy"


class CacheError(RuntimeError):
    """The cache on disk disagrees with the run (different chunking or dimension)."""


def resolve_cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    """`cache_dir`, else $ZAEC_CACHE_DIR, else data/cache."""
    raw = cache_dir if cache_dir is not None else os.environ.get(CACHE_ENV)
    return Path(raw).expanduser() if raw else DEFAULT_CACHE_DIR


def save_npy_atomic(path: Path, array: np.ndarray) -> Path:
    """np.save (no pickles) to a temporary file in the same folder, then rename."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        np.save(fh, np.ascontiguousarray(array), allow_pickle=False)
    return path


@dataclass
class FeatureCache:
    """Chunked feature store of one (model, dataset, seed).

    Args:
        root: cache root.
        model_fp: `LoadedModel.fingerprint`.
        dataset: canonical dataset key.
        testset_fp: the test-set key: the runner hashes the sample list (`TestSet.fingerprint()`), the resolved
            data root and the data fingerprint of the image files (`extract.fingerprint`) into it.
        seed: the run seed (orders the stream, seeds the views).
        n_total: number of samples in the test set.
        dim: feature dimension D.
        dtype: stored dtype (fp16 for autocast encodings, fp32 otherwise).
        stream_fp: fingerprint of the stream permutation (guards against a changed stream rule).
        chunk_size: samples per chunk (fixed once the store exists).
        aug_views: views per sample in the parts other than view 0 (63; DiffTPT's generated views: its count).
    """

    root: Path
    model_fp: str
    dataset: str
    testset_fp: str
    seed: int
    n_total: int
    dim: int
    dtype: np.dtype
    stream_fp: str
    chunk_size: int = 512
    aug_views: int = 63

    def __post_init__(self) -> None:
        from extract.views import N_AUG_VIEWS

        self.dir = Path(self.root) / self.model_fp / f"{self.dataset}-{self.testset_fp}" / f"seed={self.seed}"
        meta = {"n_total": self.n_total, "chunk_size": self.chunk_size, "dim": self.dim,
                "dtype": np.dtype(self.dtype).name, "stream_fp": self.stream_fp, "dataset": self.dataset,
                "seed": self.seed}
        if self.aug_views != N_AUG_VIEWS:  # absent at 63: the stores written before it still match
            meta["aug_views"] = self.aug_views
        meta_path = self.dir / "meta.json"
        if meta_path.is_file():
            try:
                old = json.loads(meta_path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                old = None
            if old is not None and old != meta:
                if {k: v for k, v in old.items() if k != "chunk_size"} == {k: v for k, v in meta.items()
                                                                           if k != "chunk_size"}:
                    self.chunk_size = int(old["chunk_size"])  # keep the store's chunking
                    return
                raise CacheError(f"feature cache {self.dir} was built for {old}, this run needs {meta}; delete "
                                 "that folder or use another --cache-dir")
            if old == meta:
                return
        write_json_atomic(meta_path, meta)

    @property
    def n_chunks(self) -> int:
        return -(-self.n_total // self.chunk_size)

    def chunk_range(self, c: int) -> tuple[int, int]:
        """Stream positions [start, stop) of chunk c."""
        return c * self.chunk_size, min((c + 1) * self.chunk_size, self.n_total)

    def chunks_for(self, n_positions: int) -> range:
        """Chunks covering stream positions [0, n_positions)."""
        return range(-(-n_positions // self.chunk_size))

    def path(self, part: Part, c: int) -> Path:
        return self.dir / part / CHUNK_TEMPLATE.format(c)

    def has(self, part: Part, c: int) -> bool:
        return self.path(part, c).is_file()

    def expected_shape(self, part: Part, c: int, rows: int | None = None) -> tuple[int, ...]:
        """Shape of chunk c of `part` when whole, or holding its first `rows` positions."""
        start, stop = self.chunk_range(c)
        n = stop - start if rows is None else rows
        return (n, self.dim) if part == "view0" else (n, self.aug_views, self.dim)

    def save(self, part: Part, c: int, array: np.ndarray) -> Path:
        """Store chunk c of `part`, whole or a prefix of it (its first `len(array)` positions)."""
        start, stop = self.chunk_range(c)
        if not 0 < array.shape[0] <= stop - start or array.shape != self.expected_shape(part, c, array.shape[0]):
            raise ValueError(f"chunk {c} of {part}: shape {array.shape}, expected {self.expected_shape(part, c)} or "
                             "a prefix of it")
        return save_npy_atomic(self.path(part, c), array.astype(self.dtype, copy=False))

    def load(self, part: Part, c: int) -> np.ndarray:
        """A chunk as stored, whole or a prefix (memory-mapped); raises CacheError if its shape does not fit."""
        p = self.path(part, c)
        try:
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise CacheError(f"{p}: unreadable cache chunk ({e}); delete it to recompute") from None
        start, stop = self.chunk_range(c)
        if arr.ndim < 1 or not 0 < arr.shape[0] <= stop - start or arr.shape != self.expected_shape(part, c,
                                                                                                    arr.shape[0]):
            raise CacheError(f"{p}: shape {arr.shape}, expected {self.expected_shape(part, c)} or a prefix of it; "
                             "delete it to recompute")
        return arr

    def rows(self, part: Part, c: int) -> int:
        """Positions stored in chunk c of `part` (0: absent or unreadable, then recomputed)."""
        if not self.has(part, c):
            return 0
        try:
            return int(self.load(part, c).shape[0])
        except CacheError:
            return 0

    def missing(self, parts: tuple[str, ...], n_positions: int) -> list[tuple[int, tuple[str, ...]]]:
        """[(chunk, parts missing in it)] for the chunks covering [0, n_positions); a part stored as a prefix too
        short for `n_positions` counts as missing."""
        out = []
        for c in self.chunks_for(n_positions):
            start, stop = self.chunk_range(c)
            need = min(stop, n_positions) - start
            miss = tuple(p for p in parts if self.rows(p, c) < need)  # type: ignore[arg-type]
            if miss:
                out.append((c, miss))
        return out


class TextCache:
    """(K, D) text prototypes per (model, prompt set), as .npy files under `<root>/<model_fp>/text/`."""

    def __init__(self, root: Path, model_fp: str):
        self.dir = Path(root) / model_fp / "text"

    def path(self, prompt_fp: str) -> Path:
        return self.dir / f"{prompt_fp}.npy"

    def get(self, prompt_fp: str, k: int) -> np.ndarray | None:
        p = self.path(prompt_fp)
        if not p.is_file():
            return None
        try:
            arr = np.load(p, allow_pickle=False)
        except (OSError, ValueError):
            return None
        return arr if arr.ndim == 2 and arr.shape[0] == k else None

    def put(self, prompt_fp: str, array: np.ndarray) -> Path:
        return save_npy_atomic(self.path(prompt_fp), np.asarray(array, dtype=np.float32))
