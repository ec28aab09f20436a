"""Resume: which parts of an interrupted run are kept, read without touching a file (`scan_resume`), then the
rewrites that reading calls for (`apply_resume`).

A part is kept while, in order from part 0: it is on disk and readable, it carries a data fingerprint (written
after they existed), its settings equal this run's (apart from the keys that follow the stream,
`PART_STATE_KEYS`, and the limit it announces, `RESTAMPED_KEYS`), it holds exactly its stream range, and, for an
episodic method, it records the method's state after its last row (for a method that adapts over batches of
pixels: the state file saved beside it, `RunDir.state`, is there with the recorded sha256). The first part that
fails ends the kept prefix;
a part with other settings ends it too when the caller recomputes changed runs, and is refused otherwise.
The last part of a shorter run (`--limit`) holds only the start of its range: its rows are carried into the part
this run rewrites (`ResumePoint.carried`) where they are this run's rows, that is where the method reads neither
the stream's length nor a later sample and the shorter run ended an adapt call of this run.
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
        unit: for a transductive method (`TTAMethod.transductive_unit`), the stream positions it solves jointly
            (n_run for the whole run); the kept prefix then ends at a unit boundary, so that every row of a unit
            comes from one solve: the parts of a unit the interrupted run did not write whole are recomputed with
            it. None: any part boundary ends it.
        state_files: the method's state after each part lies in a file beside it (`PlannedRun.restore` "file");
            a part whose file is missing or changed ends the kept prefix.
        adapt_batch: samples per `adapt` call: the rows of a shorter run are this run's only up to its last whole
            call.
    """

    expected: Mapping[bytes, bytes]
    n_run: int
    part_size: int
    recompute_changed: bool = False
    state_keys: tuple[str, ...] | None = None
    prefix_dependence: str | None = None
    unit: int | None = None
    state_files: bool = False
    adapt_batch: int = 1


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
        carried: the rows of part `start_part` kept from a finished shorter run (sample ids, labels, zero-shot
            and adapted logits, stream positions: the start of its range), which the part this run writes begins
            with; () when none.
        kept_note: what was kept from a shorter run, for the console (None when nothing was).
    """

    start_part: int = 0
    correct_tta: int = 0
    correct_zs: int = 0
    state: dict[str, Any] | None = None
    restamp: tuple[Path, ...] = field(default=())
    refusal: str | None = None
    note: str | None = None
    state_file: Path | None = None
    carried: tuple[np.ndarray, ...] = field(default=())
    kept_note: str | None = None

    def start_pos(self, scope: ResumeScope) -> int:
        """The first stream position to compute."""
        return min(self.start_part * scope.part_size + (len(self.carried[0]) if self.carried else 0), scope.n_run)


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
    point = _scan(run_dir, scope, -(-scope.n_run // scope.part_size))
    start = _unit_start(point.start_part, scope)
    if point.refusal is not None or start == point.start_part:
        return point
    kept = _scan(run_dir, scope, start)  # the counts and restamps of the parts before the unit's first
    note = (f"parts {start}..{point.start_part - 1} of {run_dir.path} hold rows of a transductive unit of "
            f"{scope.unit} positions that the interrupted run did not write whole; they are recomputed with the rest "
            "of it")
    return dataclasses.replace(kept, note=note if point.note is None else f"{note}; {point.note}")


def _unit_start(start_part: int, scope: ResumeScope) -> int:
    """The largest p <= `start_part` whose parts [0, p) end at a transductive unit's boundary (`ResumeScope.unit`):
    every part when they hold the whole run, else p * part_size a multiple of the unit."""
    if scope.unit is None or min(start_part * scope.part_size, scope.n_run) == scope.n_run:
        return start_part
    return next(p for p in range(start_part, -1, -1) if (p * scope.part_size) % scope.unit == 0)


def _scan(run_dir: RunDir, scope: ResumeScope, n_parts: int) -> ResumePoint:
    """The kept prefix among parts [0, n_parts)."""
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
        whole = sh.stream_pos is not None and np.array_equal(sh.stream_pos, np.arange(lo, hi))
        why = None if whole else _shorter_end(sh.stream_pos, lo, hi, written_for, scope)
        if why is not None:
            return _ends_at(point, path, why)
        end = lo + len(sh.stream_pos)  # type: ignore[arg-type]
        state, state_file = point.state, point.state_file
        if scope.state_keys is not None:  # its state after this part: recompute from here when missing
            state = _episodic_state(sh, end, scope.state_keys)
            if state is None:
                return _ends_at(point, path, "lacks the method state a resumed run loads")
        if scope.state_files:
            state_file = _state_file(run_dir, p, sh, end)
            if state_file is None:
                return _ends_at(point, path, f"lacks the method state a resumed run loads ({run_dir.state(p).name} "
                                "missing or changed)")
        point = ResumePoint(p + 1, point.correct_tta + int((sh.tta_logits.argmax(1) == sh.label).sum()),
                            point.correct_zs + int((sh.zs_logits.argmax(1) == sh.label).sum()), state,
                            point.restamp + ((path,) if kv != scope.expected and whole else ()), state_file=state_file)
        if not whole:  # the end of a finished shorter run: its rows begin the part this run rewrites
            return dataclasses.replace(point, start_part=p, carried=(sh.sample_id, sh.label, sh.zs_logits,
                                                                     sh.tta_logits, sh.stream_pos),
                                       kept_note=f"{path} holds stream positions {lo}..{end - 1}, the end of a "
                                       f"finished {end}-sample run of the same settings: they are this run's rows "
                                       f"and are kept; computing from position {end}")
    return point


def _shorter_end(stream_pos: np.ndarray | None, lo: int, hi: int, written_for: int | None,
                 scope: ResumeScope) -> str | None:
    """Why a part that does not hold its whole range [lo, hi) cannot begin this run's part there, or None where it
    is the last part of a shorter run (positions lo.. up to that run's end, before hi) whose rows are this run's:
    the method reads neither the run's length nor a later sample (else the scan ended before), and the shorter run
    ended an adapt call of this run."""
    n = 0 if stream_pos is None else len(stream_pos)
    if not n or n >= hi - lo or written_for != lo + n or not np.array_equal(stream_pos, np.arange(lo, lo + n)):
        return f"does not hold stream positions {lo}..{hi - 1} (another --limit or part size)"
    if (lo + n) % scope.adapt_batch:
        return (f"holds the end of a finished {lo + n}-sample run, whose last adapt call held "
                f"{(lo + n) % scope.adapt_batch} samples where this run's holds {scope.adapt_batch} (its rows may "
                "round differently)")
    return None


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
    # a part whose rows are carried stays on disk until the writer replaces it (an interruption keeps them)
    run_dir.remove_parts_from(point.start_part + (1 if point.carried else 0))
