"""`RunDir`: the one object that knows where a run's files live (its shard folder, parts and completion marker).

Parts are shards over fixed stream ranges [p * part_size, (p + 1) * part_size), named `part-00000.parquet`, ...;
a finished run carries the marker `_zaec_complete.json` beside them, listing its parts. A method that adapts over
batches of pixels has its state after part p saved beside it, `state-0000p.pt` (`state`). Every file is written under
a temporary name `.<name>.<random>.tmp` in the same folder and renamed (`schemas.atomic`), so a reader never sees a
half-written part or marker. The run's lock (`lock`) lives in the same folder (`.zaec-lock`, `.zaec-owner`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from schemas.shard import COMPLETE_MARKER, RunKey, shard_dir, shard_path
from schemas.atomic import write_json_atomic

#: the file of the method's state after part p (`RunDir.state`), and the pattern that finds them all
STATE_TEMPLATE = "state-{:05d}.pt"
STATE_GLOB = "state-*.pt"

if TYPE_CHECKING:
    from extract.run.lock import RunLock


@dataclass(frozen=True)
class RunDir:
    """The files of run `key` under the shard root `root`.

    Example:
        >>> d = RunDir(Path("out"), RunKey("ViT-B-16", "dtd", "tda", 1))
        >>> d.part(2).name, d.marker.name
        ('part-00002.parquet', '_zaec_complete.json')
    """

    root: Path
    key: RunKey

    @property
    def path(self) -> Path:
        """The run's shard folder `<root>/backbone=../dataset=../method=../seed=..`."""
        return shard_dir(self.root, self.key)

    @property
    def marker(self) -> Path:
        """The completion marker (written last, only by a run that finished)."""
        return self.path / COMPLETE_MARKER

    def part(self, index: int) -> Path:
        """The path of part `index` (stream positions [index * part_size, (index + 1) * part_size))."""
        return shard_path(self.root, self.key, index)

    @staticmethod
    def part_index(path: Path) -> int:
        """The index of a part (or of the state saved beside it) from its file name (`part-00003.parquet` -> 3)."""
        return int(path.stem.split("-")[1])

    def state(self, index: int) -> Path:
        """The method's state after part `index` (`state-00003.pt`, `torch.save`, read with `weights_only=True`)
        for a method that adapts over batches of pixels (`PlannedRun.restore` "file"), written just before the part.

        Example:
            >>> RunDir(Path("out"), RunKey("ViT-B-16", "dtd", "tent", 1)).state(3).name
            'state-00003.pt'
        """
        return self.path / STATE_TEMPLATE.format(index)

    def existing_parts(self) -> list[Path]:
        """Part files on disk, sorted by index (not validated)."""
        return sorted(self.path.glob("part-*.parquet")) if self.path.is_dir() else []

    def temp_files(self) -> list[Path]:
        """Temporary files of interrupted writes (never read; a later write replaces them under a new name)."""
        return sorted(self.path.glob(".*.tmp")) if self.path.is_dir() else []

    def remove_parts_from(self, start: int) -> list[Path]:
        """Delete every part with index >= `start` (parts a run will rewrite, or stale parts of a longer run) and the
        method states saved beside them (`state`)."""
        gone = [p for p in self.existing_parts() if self.part_index(p) >= start]
        states = sorted(self.path.glob(STATE_GLOB)) if self.path.is_dir() else []
        gone += [p for p in states if self.part_index(p) >= start]
        for p in gone:
            p.unlink()
        return gone

    def read_marker(self) -> dict[str, Any] | None:
        """The marker's document, or None when absent or unreadable."""
        try:
            doc = json.loads(self.marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def write_marker(self, doc: dict[str, Any]) -> Path:
        """Mark the run finished (atomic)."""
        return write_json_atomic(self.marker, doc)

    def remove_marker(self) -> None:
        """Unmark the run (before any part is rewritten)."""
        self.marker.unlink(missing_ok=True)

    def lock(self, wait: float | None = None, on_wait: Callable[[str], None] | None = None) -> "RunLock":
        """The run's lock (a context manager): held around every read or write of its parts and marker, so one
        process at a time owns the run (`extract.run.lock`). `wait`: seconds to wait for another owner (None: for
        ever, 0: stop at once, RunError naming the holder); `on_wait` gets one line when waiting starts."""
        from extract.run.lock import RunLock

        return RunLock(self.path, wait=wait, on_wait=on_wait)

    def finished_counts(self) -> tuple[int, int] | None:
        """(samples done, samples in the test set) of a finished run whose listed parts are all on disk, else
        None."""
        info = self.read_marker()
        try:
            n_done, n_total = int(info["n_samples"]), int(info["n_total"])  # type: ignore[index]
            parts = [self.marker.parent / p for p in info["parts"]]  # type: ignore[index]
        except (ValueError, KeyError, TypeError):
            return None
        return (n_done, n_total) if all(p.is_file() for p in parts) else None

    def is_complete(self, limit: int | None = None) -> bool:
        """Whether the run finished with the samples `limit` asks for: its marker exists, every listed part is on
        disk, and it holds exactly the first min(limit, n_total) stream positions, or more of them where its first
        rows are those of the shorter run (`shorter_refusal`).

        Args:
            limit: the `--limit` asked for (None: the whole test set); a limited run never finishes a longer one.
        """
        counts = self.finished_counts()
        if counts is None:
            return False
        n_done, n_total = counts
        wanted = n_total if limit is None else min(int(limit), n_total)
        return n_done == wanted or (n_done > wanted and self.shorter_refusal(wanted) is None)

    def shorter_refusal(self, n_run: int) -> str | None:
        """Why the finished run here, of more than `n_run` samples, cannot serve a run of its first `n_run`
        stream positions (one clause), or None when it can.

        It can when its marker says that the method's rows read neither the stream's length nor a later sample
        (`prefix_dependence`: null, `TTAMethod.prefix_dependence`) and `n_run` ends an `adapt` call of both runs (a
        multiple of its `adapt_batch`): a shorter last call holds fewer samples, and a call's rows may round
        differently with its width (a GPU's matrix products pick their kernels by shape)."""
        info = self.read_marker() or {}
        if "prefix_dependence" not in info or "adapt_batch" not in info:
            return "it predates the record of whether its first rows are those of a shorter run"
        if info["prefix_dependence"] is not None:
            return str(info["prefix_dependence"])
        batch = int(info["adapt_batch"])
        if n_run % batch:
            return (f"{n_run} is not a multiple of its adapt_batch {batch}: a {n_run}-sample run ends with an "
                    f"adapt call of {n_run % batch} samples where it had {batch}, whose rows may round differently")
        return None


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes (a state file's identity, recorded in the part it follows)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_is_complete(out: str | os.PathLike, key: RunKey, *, limit: int | None = None) -> bool:
    """Whether the run `key` under the shard root `out` finished (`RunDir.is_complete`)."""
    return RunDir(Path(out), key).is_complete(limit)
