"""The sweep's files: the manifest (one row per run) under an exclusive lock, the per-run result files the jobs
write, and atomic JSON I/O for both.

Files of a sweep, all under `<out>/_sweep/` (no `*.parquet` there, so `zaec-calibrate <out>` sees only shards):

    manifest.json        one row per run (run key, group, job id, state, shard dir, error line, ...)
    runs/<run>.json      written by the job as a run starts / ends (state, error line, shards)
    submitit/            submitit's pickles and job logs (`<job id>_0_log.out` / `.err`)
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from extract.sweep.errors import NotSubmitted, SweepError
from extract.sweep.runspec import OLD_MANIFEST, RunSpec
from extract.sweep.state import STATES
from schemas.atomic import write_json_atomic

SWEEP_DIRNAME = "_sweep"
MANIFEST_NAME = "manifest.json"
#: 2: a run's spec is {"options": RunOptions.to_dict(), "execution": ..., "policy": ...} (1: the older flat spec)
MANIFEST_VERSION = 2


def sweep_dir(out: str | os.PathLike) -> Path:
    return Path(out) / SWEEP_DIRNAME


def manifest_path(out: str | os.PathLike) -> Path:
    return sweep_dir(out) / MANIFEST_NAME


def result_path(out: str | os.PathLike, run_id: str) -> Path:
    """`<out>/_sweep/runs/<readable run id>-<hash>.json`; the hash keeps distinct ids distinct after sanitising."""
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", run_id)
    return sweep_dir(out) / "runs" / f"{safe}-{hashlib.sha1(run_id.encode()).hexdigest()[:8]}.json"


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_json(path: Path) -> Any | None:
    """The JSON document at `path`, or None when absent or unreadable (a result file being replaced)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def error_line(exc: BaseException) -> str:
    """One line for the manifest: `Type: first line of the message` (the traceback goes to the job's log).

    >>> error_line(ValueError("bad value\\nmore detail"))
    'ValueError: bad value'
    """
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0].strip()}" if msg else type(exc).__name__


#: a manifest row's fields and their JSON types (those the sweep reads: `record_submission` writes them all);
#: `run_id`, the run key, `state` and `spec` are required
ROW_FIELDS: dict[str, type] = {
    "run_id": str, "backbone": str, "dataset": str, "method": str, "seed": int, "state": str, "spec": dict,
    "group": str, "policy": str, "job_id": str, "executor": str, "shard_dir": str, "error": str, "log": str,
    "token": str, "submitted": str, "updated": str, "attempts": int}
REQUIRED_ROW_FIELDS: tuple[str, ...] = ("run_id", "backbone", "dataset", "method", "seed", "state", "spec")


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def manifest_problem(doc: Any) -> str | None:
    """The first thing that keeps `doc` (a parsed manifest.json) from being a manifest of this version, as a
    clause (`is not a sweep manifest: runs[2] lacks 'spec'`), or None. Every row is checked for the fields the
    sweep reads, and its spec for what `retry` resubmits (`RunSpec.from_dict`), so that no command meets a broken
    row halfway."""
    if not isinstance(doc, dict):
        return f"is not a sweep manifest: expected a JSON object, got {_json_type(doc)}"
    version = doc.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version < MANIFEST_VERSION:
        return f"was {OLD_MANIFEST}"
    if version != MANIFEST_VERSION:
        return f"has version {version!r}, expected {MANIFEST_VERSION}"
    if not isinstance(doc.get("runs"), list):
        return f"is not a sweep manifest: 'runs' must be a list, got {_json_type(doc.get('runs'))}"
    if not isinstance(doc.get("executor", {}), dict):
        return f"is not a sweep manifest: 'executor' must be an object, got {_json_type(doc['executor'])}"
    seen: set[str] = set()
    for i, row in enumerate(doc["runs"]):
        why = _row_problem(row, seen)
        if why is not None:
            return f"is not a sweep manifest: runs[{i}] {why}"
    return None


def _row_problem(row: Any, seen: set[str]) -> str | None:
    """What is wrong with one row (a clause), or None; `seen` collects the run ids so far."""
    if not isinstance(row, dict):
        return f"must be an object, got {_json_type(row)}"
    missing = [k for k in REQUIRED_ROW_FIELDS if k not in row]
    if missing:
        return f"lacks {', '.join(repr(k) for k in missing)}"
    for k, kind in ROW_FIELDS.items():
        v = row.get(k)
        if k in row and (not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
            return f"({row['run_id']!r}): {k!r} must be {_json_type(kind())}, got {_json_type(v)} {v!r}"[:300]
    if row["run_id"] in seen:
        return f"repeats run id {row['run_id']!r}"
    seen.add(row["run_id"])
    if row["state"] not in STATES:
        return f"({row['run_id']!r}): unknown state {row['state']!r}; states: {', '.join(STATES)}"
    try:
        RunSpec.from_dict(row["spec"])
    except SweepError:
        return f"({row['run_id']!r}): its spec was {OLD_MANIFEST}"
    except (TypeError, ValueError, KeyError) as e:  # RunError is a ValueError
        return f"({row['run_id']!r}): 'spec' is not a run's spec ({error_line(e)})"
    return None


@dataclass
class Manifest:
    """The sweep manifest: one row per run, keyed by run id, plus the executor settings of the last submission.

    A row: run_id, backbone, dataset, method, seed, group, policy, job_id, executor, state, shard_dir, error, log
    (the job's stderr), token (identifies the submission the row belongs to), submitted, updated, attempts, spec
    (`RunSpec.to_dict()`: the run's `RunOptions` and execution options, what `retry` resubmits).
    """

    out: Path
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    executor: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, out: str | os.PathLike, *, must_exist: bool = False) -> "Manifest":
        path = manifest_path(out)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            if must_exist or path.exists():
                what = "is unreadable" if path.exists() else "does not exist"
                raise SweepError(f"sweep manifest {path} {what}; start a sweep with `zaec-sweep --out {out} ...`")
            return cls(Path(out))
        why = manifest_problem(doc)
        if why is not None:
            raise SweepError(f"sweep manifest {path} {why}")
        rows = {r["run_id"]: r for r in doc["runs"]}
        return cls(Path(out), rows, dict(doc.get("executor", {})))

    def save(self) -> Path:
        doc = {"version": MANIFEST_VERSION, "out": str(self.out), "updated": now(), "executor": self.executor,
               "runs": [self.rows[k] for k in sorted(self.rows)]}
        return write_json_atomic(manifest_path(self.out), doc)

    def record_submission(self, run: RunSpec, *, job_id: str, token: str, log: str = "",
                          executor: str = "local") -> None:
        old = self.rows.get(run.run_id, {})
        self.rows[run.run_id] = {
            "run_id": run.run_id, **run.key.as_dict(), "group": run.group_id, "policy": run.policy,
            "job_id": job_id, "executor": executor, "state": "pending", "shard_dir": str(run.shard_dir),
            "error": "", "log": log,
            "token": token, "submitted": now(), "updated": now(), "attempts": int(old.get("attempts", 0)) + 1,
            "spec": run.to_dict(),
        }

    def record_not_submitted(self, run: RunSpec, *, error: str, executor: str) -> None:
        """A run whose submission was refused: failed, with `error` (the scheduler's answer); no job id."""
        self.record_submission(run, job_id="", token="", executor=executor)
        self.rows[run.run_id].update(state="failed", error=f"not submitted: {error}")

    def record_done(self, run: RunSpec) -> None:
        """A run found complete at planning time (no submission)."""
        old = self.rows.get(run.run_id, {})
        self.rows[run.run_id] = {
            "run_id": run.run_id, **run.key.as_dict(), "group": run.group_id, "policy": run.policy,
            "job_id": old.get("job_id", ""), "state": "done", "shard_dir": str(run.shard_dir), "error": "",
            "log": old.get("log", ""), "token": old.get("token", ""), "submitted": old.get("submitted", ""),
            "updated": now(), "attempts": int(old.get("attempts", 0)), "spec": run.to_dict(),
        }

    def spec(self, run_id: str) -> RunSpec:
        """The run's RunSpec; a user's dataset is registered in this process on the way."""
        spec = RunSpec.from_dict(self.rows[run_id]["spec"])
        spec.register_dataset()
        return spec


@contextlib.contextmanager
def locked_manifest(out: str | os.PathLike, *, must_exist: bool = False) -> Iterator[Manifest]:
    """Load, yield and save the manifest under an exclusive lock (`status` and `run` may run at the same time).
    The manifest is not saved when the body raises, except for `NotSubmitted` (its rows say what was refused)."""
    d = sweep_dir(out)
    if must_exist and not manifest_path(out).exists():
        raise SweepError(f"no sweep manifest at {manifest_path(out)}; start a sweep with `zaec-sweep --out {out} ...`")
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".manifest.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            m = Manifest.load(out, must_exist=must_exist)
            try:
                yield m
            except NotSubmitted:
                m.save()
                raise
            m.save()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def new_token() -> str:
    """Identifies one submission: a job's result files count only for the submission that wrote them."""
    return hashlib.sha1(os.urandom(16)).hexdigest()[:12]


def write_result(run: RunSpec, token: str, state: str, *, error: str = "", shards: Sequence[str] = ()) -> None:
    """Record a run's state for `zaec-sweep status` (atomic; the token ties it to one submission)."""
    write_json_atomic(result_path(run.out, run.run_id), {
        "run_id": run.run_id, "token": token, "state": state, "error": error, "shards": list(shards),
        "updated": now()})


def manifest_frame(manifest: Manifest) -> "Any":
    """One row per run of the manifest: run key, group, job id, state, shard dir, error line (sorted by run id)."""
    import polars as pl

    cols = ("backbone", "dataset", "method", "seed", "group", "job_id", "state", "attempts", "shard_dir", "error",
            "log")
    schema = {c: pl.Utf8 for c in cols} | {"seed": pl.Int64, "attempts": pl.Int64}
    rows = [{c: manifest.rows[k].get(c, "" if schema[c] == pl.Utf8 else 0) for c in cols}
            for k in sorted(manifest.rows)]
    return pl.DataFrame(rows, schema=schema)

