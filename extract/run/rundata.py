"""A run's data: the listed test set (split files only, no image opened) and the identity of its files.

`RunData` is what `extract.run.settings.load_run_data` returns for a plain run and `extract.run.ood.load_mixed_data`
for an out-of-distribution one; both build the identity with `resolved_root` / `set_identity` from here, so this
module sits below both (tests/test_import_layers.py).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from extract.datasets import TestSet


@dataclass(frozen=True)
class RunData:
    """A run's listed test set (split files only, no image opened) and the identity of its data.

    Attributes:
        testset: the listed test set (an OOD run's: the mixed list, in-distribution images first, `extract.run.ood`).
        identity: {"data_root": resolved folder, "data_fingerprint": fingerprint of the image files}; an OOD run
            adds "ood_data_root", the OOD set's folder.
        n_id: an OOD run's in-distribution images (sample ids [0, n_id)); None for a plain run.
        sources: an OOD run's two listed sets (in-distribution, OOD); () for a plain run.
    """

    testset: "TestSet"
    identity: Mapping[str, str]
    n_id: int | None = None
    sources: tuple["TestSet", ...] = ()

    def listed_sets(self) -> tuple["TestSet", ...]:
        """The registered or user sets whose listings the run reads (for `check_outside_dataset`)."""
        return self.sources or (self.testset,)

    @property
    def n_total(self) -> int:
        """Samples in the test set."""
        return len(self.testset)

    def cache_key(self) -> str:
        """The test-set part of the feature cache key: sample list, data root and data fingerprint (16 hex)."""
        parts = [self.testset.fingerprint(), self.identity["data_root"], self.identity["data_fingerprint"]]
        if self.testset.exif_transpose:
            parts.append("exif_transpose")
        raw = "\n".join(parts)
        return hashlib.sha256(raw.encode()).hexdigest()[:16]


def resolved_root(testset: "TestSet", data_root: str | os.PathLike | None) -> str:
    """The data root a run records for `testset`: for a user's `folder:`/`split:` dataset, which needs none, its own
    folder; otherwise the resolved data root."""
    from extract.datasets import get_dataset, resolve_data_root

    own = get_dataset(testset.key).ref is not None
    return str(Path(testset.dataset_dir if own else resolve_data_root(data_root)).resolve())


def set_identity(testset: "TestSet", data_root: str | os.PathLike | None, mode: str) -> dict[str, str]:
    """The resolved data root (`resolved_root`) and the data fingerprint of the test set's image files
    (`extract.fingerprint`)."""
    from extract.fingerprint import fingerprint

    return {"data_root": resolved_root(testset, data_root), "data_fingerprint": fingerprint(testset, mode)}
