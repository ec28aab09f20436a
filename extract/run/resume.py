"""Resume: which parts of an interrupted run are kept, read without touching a file (`scan_resume`), then the
rewrites that reading calls for (`apply_resume`).

A part is kept while, in order from part 0: it is on disk and readable, it carries a data fingerprint (written
after they existed), its settings equal this run's (apart from the keys that follow the stream,
`PART_STATE_KEYS`, and the limit it announces, `RESTAMPED_KEYS`), it holds exactly its stream range, and, for an
episodic method, it records the method's state after its last row (for a method that adapts over batches of
pixels: the state file saved beside it, `RunDir.state`, is there with the recorded sha256). The first part that
fails ends the kept prefix;
a part with other settings ends it too when the caller recomputes changed runs, and is refused otherwise.
The kept parts' correct counts continue the run's running accuracy; an episodic method's state after the last kept
part is loaded instead of replaying (`docs/methods.md`, "Stream order and seeds").
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from extract.run.options import RunError
from extract.run.rundir import RunDir, file_sha256
from schemas.shard import ShardError, ShardMeta, read_shard, write_shard

# Per-part metadata that follows the stream (the method's state and summary after the part's last row): left out
# when a resumed run compares the settings of the parts on disk with its own.
PART_STATE_KEYS: frozenset[bytes] = frozenset({b"zaec:method_state", b"zaec:method_summary",
                                              b"zaec:method_state_file"})
#: metadata keys that may differ between the kept parts of a resumed run and the run resuming them
RESTAMPED_KEYS: tuple[bytes, ...] = (b"zaec:limit",)


def settings_kv(meta: ShardMeta) -> dict[bytes, bytes]:
    """A part's metadata without the keys that follow the stream (`PART_STATE_KEYS`)."""
    return {k: v for k, v in meta.to_kv().items() if k not in PART_STATE_KEYS}


def meta_diff(old: Mapping[bytes, bytes], new: Mapping[bytes, bytes]) -> list[str]:
    """Sorted metadata keys whose values differ, ignoring those a resumed run rewrites (`RESTAMPED_KEYS`)."""
    return sorted(k.decode() for k in set(old) | set(new) if k not in RESTAMPED_KEYS and old.get(k) != new.get(k))


@dataclass(frozen=True)
class ResumeScope:
    """What the scan compares parts with.

    Attributes:
        expected: this run's part metadata without the stream keys (`settings_kv`).
        n_run: stream positions of the run; part_size: rows per part.
        recompute_changed: a part with other settings ends the kept prefix (True) or is refused (False).
        state_keys: for an episodic method, the keys its recorded state must hold (`n_seen` and its fields);
            None for an online method (its state is rebuilt by replay).
        prefix_dependence: why the method's rows depend on the run's length or later samples
            (`TTAMethod.prefix_dependence`); a part written by a run of another length then ends the kept prefix.
            None: parts of a longer or shorter run of the same settings are kept.
        state_files: the method's state after each part lies in a file beside it (`PlannedRun.restore` "file");
            a part whose file is missing or changed ends the kept prefix.
    """

    expected: Mapping[bytes, bytes]
    n_run: int
    part_size: int
    recompute_changed: bool = False
    state_keys: tuple[str, ...] | None = None
    prefix_dependence: str | None = None
    state_files: bool = False


@dataclass(frozen=True)
class ResumePoint:
    """The result of a scan: parts [0, start_part) are kept.

    Attributes:
        start_part: the first part to compute.
        correct_tta, correct_zs: correct adapted / zero-shot predictions in the kept parts.
        state: an episodic method's state after the last kept part (None: nothing kept, or an online method).
        restamp: kept parts whose footer differs from this run's only in `RESTAMPED_KEYS` (rewritten with it).
        state_file: the state file saved beside the last kept part (`ResumeScope.state_files`; None otherwise).
        refusal: a part with other settings that the run must refuse (the message), or None.
        note: why a part on disk ends the kept prefix (unreadable, other settings, ...), for the console; None when
            the prefix ends where the interrupted run stopped.
    """

    start_part: int = 0
    correct_tta: int = 0
    correct_zs: int = 0
    state: dict[str, Any] | None = None
    restamp: tuple[Path, ...] = field(default=())
    refusal: str | None = None
    note: str | None = None
    state_file: Path | None = None

    def start_pos(self, scope: ResumeScope) -> int:
        """The first stream position to compute."""
        return min(self.start_part * scope.part_size, scope.n_run)


def _episodic_state(sh: Any, hi: int, keys: Sequence[str]) -> dict[str, Any] | None:
    """The state recorded in part `sh` if it is the state after position `hi` and holds every key, else None."""
    try:
        state = json.loads(sh.meta.extra["zaec:method_state"])
        usable = int(state["n_seen"]) == hi and all(f in state for f in keys)
    except (KeyError, ValueError, TypeError):
        return None
    return state if usable else None


def _state_file(run_dir: RunDir, p: int, sh: Any, hi: int) -> Path | None:
    """The state file saved beside part `p` (`sh`) if its metadata names it as the state after position `hi` and
    the file holds the bytes it recorded, else None."""
    try:
        info = json.loads(sh.meta.extra["zaec:method_state_file"])
        path = run_dir.state(p)
        usable = int(info["n_seen"]) == hi and info["file"] == path.name and path.is_file()
    except (KeyError, ValueError, TypeError):
        return None
    return path if usable and file_sha256(path) == info["sha256"] else None


def scan_resume(run_dir: RunDir, scope: ResumeScope) -> ResumePoint:
    """Read the parts of an interrupted run in order and return where the run resumes. Writes nothing."""
    n_parts = -(-scope.n_run // scope.part_size)
    point = ResumePoint()
    for p in range(n_parts):
        path = run_dir.part(p)
        if not path.is_file():  # where the interrupted run stopped
            break
        try:
            sh = read_shard(path)
        except ShardError as e:  # a truncated or damaged part: say so, it is recomputed
            return _ends_at(point, path, f"is unreadable ({str(e).splitlines()[0]})")
        if b"zaec:data_fingerprint" not in sh.meta.to_kv():
            return _ends_at(point, path, "was written before data fingerprints existed")
        kv = settings_kv(sh.meta)
        diff = meta_diff(kv, scope.expected)
        if diff and scope.recompute_changed:
            return _ends_at(point, path, f"was written with other settings ({', '.join(diff)})")
        if diff:
            return dataclasses.replace(point, refusal=f"{path} was written by a run with different settings "
                                       f"({', '.join(diff)}); use --force to overwrite it or write elsewhere "
                                       "with --out")
        written_for = _run_length(sh.meta.extra)
        if scope.prefix_dependence is not None and written_for != scope.n_run:
            return _ends_at(point, path, f"was written by a run of {written_for} samples, this run has "
                            f"{scope.n_run} ({scope.prefix_dependence})")
        lo, hi = p * scope.part_size, min((p + 1) * scope.part_size, scope.n_run)
        if sh.stream_pos is None or not np.array_equal(sh.stream_pos, np.arange(lo, hi)):
            return _ends_at(point, path, f"does not hold stream positions {lo}..{hi - 1} (another --limit or part "
                            "size)")
        state, state_file = point.state, point.state_file
        if scope.state_keys is not None:  # its state after this part: recompute from here when missing
            state = _episodic_state(sh, hi, scope.state_keys)
            if state is None:
                return _ends_at(point, path, "lacks the method state a resumed run loads")
        if scope.state_files:
            state_file = _state_file(run_dir, p, sh, hi)
            if state_file is None:
                return _ends_at(point, path, f"lacks the method state a resumed run loads ({run_dir.state(p).name} "
                                "missing or changed)")
        point = ResumePoint(p + 1, point.correct_tta + int((sh.tta_logits.argmax(1) == sh.label).sum()),
                            point.correct_zs + int((sh.zs_logits.argmax(1) == sh.label).sum()), state,
                            point.restamp + ((path,) if kv != scope.expected else ()), state_file=state_file)
    return point


def _run_length(extra: Mapping[str, str]) -> int | None:
    """The stream positions of the run that wrote a part: min(`zaec:limit`, `zaec:n_total`) (None: unreadable)."""
    try:
        n_total = int(extra["zaec:n_total"])
        limit = extra.get("zaec:limit", "none")
        return n_total if limit == "none" else min(int(limit), n_total)
    except (KeyError, ValueError):
        return None


def _ends_at(point: ResumePoint, path: Path, why: str) -> ResumePoint:
    """`point` with the note saying why the part at `path` ends the kept prefix."""
    kept = f"parts 0..{point.start_part - 1} kept" if point.start_part else "nothing kept"
    return dataclasses.replace(point, note=f"{path} {why}; it is recomputed with the parts after it ({kept})")


def restamp(path: Path, meta: ShardMeta) -> Path:
    """Rewrite a kept part with this run's metadata, keeping its rows and its own stream keys, so every part of a
    run agrees on `zaec:limit` and a reader knows how many samples the run announces."""
    sh = read_shard(path)
    own = {k: v for k, v in sh.meta.extra.items() if k.encode() in PART_STATE_KEYS}
    new = dataclasses.replace(meta, extra={**meta.extra, **own})
    return write_shard(sh.path, new, sh.sample_id, sh.label, sh.zs_logits, sh.tta_logits, stream_pos=sh.stream_pos)


def apply_resume(run_dir: RunDir, point: ResumePoint, meta: ShardMeta) -> None:
    """Carry out what a scan found: restamp kept parts, refuse a part with other settings (RunError), delete the
    parts the run will rewrite (and stale parts of a longer run)."""
    for path in point.restamp:
        restamp(path, meta)
    if point.refusal is not None:
        raise RunError(point.refusal)
    run_dir.remove_parts_from(point.start_part)
