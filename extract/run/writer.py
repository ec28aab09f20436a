"""Writing a run: `PartWriter` turns the adapt loop's rows into one shard per part as the stream advances, and
`marker_doc` is what the completion marker records once every part is on disk.

Each part is written atomically (`schemas.shard.write_shard`: a temporary name, then a rename), so an interrupted run
leaves whole parts only; the marker is written last, so a run without it is not finished. A method that adapts over
batches of pixels (`PlannedRun.restore` "file") has its state after the part saved first, atomically, beside it
(`RunDir.state`: `torch.save` of tensors, numbers, lists and dicts, read back with `weights_only=True`); the part's
metadata names the file, its sha256 and the stream position it follows (`zaec:method_state_file`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from extract.run.rundir import RunDir, file_sha256
from schemas.atomic import atomic_path
from schemas.shard import ShardMeta, write_shard

_COLUMNS = ("sid", "label", "zs", "tta", "pos")


def part_meta(meta: ShardMeta, method: Any, episodic: bool, state_file: Mapping[str, Any] | None = None
              ) -> ShardMeta:
    """The metadata of a part just finished: the run's, plus the method's summary and, for an episodic method, its
    state (plain numbers) after the part's last row, which a resumed run loads; `state_file`: where the state of a
    method that adapts over batches was saved instead (`save_state`)."""
    extra = {**meta.extra, "zaec:method_summary": json.dumps(method.summary(), sort_keys=True)}
    if episodic:
        extra["zaec:method_state"] = json.dumps(method.state_dict(), sort_keys=True)
    if state_file is not None:
        extra["zaec:method_state_file"] = json.dumps(dict(state_file), sort_keys=True)
    return dataclasses.replace(meta, extra=extra)


def save_state(path: Path, method: Any) -> dict[str, Any]:
    """Save `method.state_dict()` to `path` atomically (`torch.save`; loadable with `weights_only=True`) and return
    what the part's metadata records of it: {"file": its name, "sha256": of its bytes, "n_seen": the samples the
    state follows}."""
    import torch

    state = method.state_dict()
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return {"file": path.name, "sha256": file_sha256(path), "n_seen": int(state["n_seen"])}


class PartWriter:
    """Collects rows in stream order and writes part p when position (p + 1) * part_size, or the end of the run,
    is reached; the method's summary and state are read at that moment (`part_meta`).

    Args:
        run_dir: where the parts go. meta: the run's shard metadata. method: the method object (read, not changed).
        episodic: record the method's state in each part. part_size: rows per part. n_run: positions of the run.
        kept: the parts kept from an interrupted run (listed first in `written`). state_files: save the method's
        state beside each part instead (`save_state`, `RunDir.state`).
    """

    def __init__(self, run_dir: RunDir, meta: ShardMeta, method: Any, *, episodic: bool, part_size: int,
                 n_run: int, kept: Sequence[Path] = (), state_files: bool = False):
        self.run_dir, self.meta, self.method, self.episodic = run_dir, meta, method, episodic
        self.state_files = state_files
        self.part_size, self.n_run = part_size, n_run
        self.written: list[Path] = list(kept)
        self._rows: dict[str, list[np.ndarray]] = {k: [] for k in _COLUMNS}

    def add(self, sample_id: np.ndarray, label: np.ndarray, zs: np.ndarray, tta: np.ndarray, pos: np.ndarray
            ) -> Path | None:
        """Append rows (B,) sample ids, labels, (B, K) zero-shot and adapted logits, (B,) stream positions, which
        continue the stream; returns the part written when these rows complete one, else None."""
        for k, v in zip(_COLUMNS, (sample_id, label, zs, tta, pos)):
            self._rows[k].append(v)
        e = int(pos[-1]) + 1
        if e % self.part_size and e != self.n_run:
            return None
        cat = {k: np.concatenate(v) for k, v in self._rows.items()}
        index = (e - 1) // self.part_size
        saved = save_state(self.run_dir.state(index), self.method) if self.state_files else None
        path = write_shard(self.run_dir.part(index), part_meta(self.meta, self.method, self.episodic, saved),
                           cat["sid"], cat["label"], cat["zs"], cat["tta"], stream_pos=cat["pos"])
        self.written.append(path)
        self._rows = {k: [] for k in _COLUMNS}
        return path


def marker_doc(*, n_run: int, n_total: int, limit: int | None, settings: Mapping[str, Any], parts: Sequence[Path],
               method_summary: Mapping[str, Any], accuracies: Mapping[str, float], prefix_dependence: str | None,
               adapt_batch: int) -> dict[str, Any]:
    """The completion marker's document: how much of the stream is done, the settings a later run is checked
    against, the parts in order, the method's summary and the accuracies; and whether a shorter `--limit` may be
    served by this run's first rows (`prefix_dependence`: None, or why not; `adapt_batch`: the width of its adapt
    calls; `RunDir.shorter_refusal`)."""
    return {"n_samples": n_run, "n_total": n_total, "limit": limit, "settings": dict(settings),
            "parts": [p.name for p in parts], "method_summary": dict(method_summary), **accuracies,
            "prefix_dependence": prefix_dependence, "adapt_batch": int(adapt_batch)}
