"""Following submitted jobs: what submitit, the scheduler and the process table say about a job; `refresh`, which
brings every manifest row up to date with `extract.sweep.state.transition`; `split_runs`, which tells the runs of a
grid to submit from the complete and the still active ones.

The facts of a row are looked up on first use (`_RowFacts`), so a complete run costs no pickle read and the one
`sacct` call for all SLURM jobs of the manifest is made only when some row needs it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from extract.sweep.manifest import Manifest, now, read_json, result_path, sweep_dir
from extract.sweep.runspec import RunSpec, is_complete
from extract.sweep.state import ACTIVE_STATES, transition


def job_outcome(folder: Path, job_id: str) -> tuple[str, str] | None:
    """("success", "") or ("error", last traceback line) once a job's result pickle exists, else None."""
    from submitit.core import utils

    path = utils.JobPaths(folder, job_id=job_id, task_id=0).result_pickle
    if not path.exists():
        return None
    try:
        tag, value = utils.pickle_load(path)
    except Exception:  # a pickle being written, or unreadable: no verdict yet
        return None
    if tag == "success":
        return ("success", "")
    lines = [ln.strip() for ln in str(value).strip().splitlines() if ln.strip()]
    return ("error", lines[-1] if lines else "the job raised an error")


def pid_alive(pid: str) -> bool:
    """A local job's process (its job id is the pid) still exists and runs submitit."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    cmd = Path(f"/proc/{pid}/cmdline")
    if cmd.exists():  # guard against a reused pid
        try:
            return b"submitit" in cmd.read_bytes()
        except OSError:
            return True
    return True


class SlurmStates:
    """SLURM states of the manifest's jobs from one `sacct` call (through submitit's watcher), made on first use."""

    def __init__(self, folder: Path, job_ids: Sequence[str]):
        self.folder, self.job_ids = folder, sorted(set(job_ids))
        self._states: dict[str, str] | None = None

    def get(self, job_id: str) -> str:
        if self._states is None:
            self._states = {}
            try:
                import submitit

                jobs = [submitit.SlurmJob(folder=self.folder, job_id=j) for j in self.job_ids]  # registers them
                submitit.SlurmJob.watcher.update()  # one sacct for all; errors become UNKNOWN
                for j in jobs:
                    self._states[j.job_id] = str(j.watcher.get_state(j.job_id, mode="cache"))
            except Exception:  # no sacct, or a scheduler hiccup: states stay unknown
                pass
        raw = self._states.get(job_id) or "UNKNOWN"
        return raw.split()[0].upper()  # "CANCELLED by 123" -> "CANCELLED"


class _RowFacts:
    """`extract.sweep.state.JobFacts` of one manifest row, each looked up on first use."""

    def __init__(self, manifest: Manifest, run_id: str, spec: RunSpec, row: Mapping[str, Any], folder: Path,
                 live: Mapping[str, Any], slurm: SlurmStates) -> None:
        self._out, self._run_id, self._spec = manifest.out, run_id, spec
        self._job_id = str(row.get("job_id", ""))
        self._job = live.get(self._job_id)
        self._folder, self._slurm = folder, slurm

    @functools.cached_property
    def complete(self) -> bool:
        return is_complete(self._spec)

    @functools.cached_property
    def result(self) -> Mapping[str, Any] | None:
        return read_json(result_path(self._out, self._run_id))

    @functools.cached_property
    def live_done(self) -> bool | None:
        return None if self._job is None else bool(self._job.done())

    @functools.cached_property
    def live_state(self) -> str:
        return str(getattr(self._job, "state", "?"))

    @functools.cached_property
    def outcome(self) -> tuple[str, str] | None:
        return job_outcome(self._folder, self._job_id)

    @functools.cached_property
    def slurm_state(self) -> str:
        return self._slurm.get(self._job_id)

    @functools.cached_property
    def pid_alive(self) -> bool:
        return pid_alive(self._job_id)


def refresh(manifest: Manifest, live: Mapping[str, Any] | None = None) -> list[tuple[str, str, str]]:
    """Bring every row's state up to date (`extract.sweep.state.transition`); returns (run_id, new state, error)
    for the rows that changed.

    `live` maps job ids to submitit job objects held by this process (they know their processes); otherwise the
    job's result pickle, then its process (local) or `sacct` (SLURM, one call for the whole manifest) decide.
    """
    folder = sweep_dir(manifest.out) / "submitit"
    slurm = SlurmStates(folder, [str(r["job_id"]) for r in manifest.rows.values()
                                 if r.get("executor") == "slurm" and r.get("state") in ACTIVE_STATES
                                 and r.get("job_id")])
    changes = []
    for run_id, row in manifest.rows.items():
        state = row.get("state")
        if state not in ACTIVE_STATES and state != "done":
            continue
        spec = manifest.spec(run_id)  # registers a user's dataset in this process, for the finished test
        new, err = transition(row, _RowFacts(manifest, run_id, spec, row, folder, live or {}, slurm))
        if (new, err) != (state, row.get("error", "")):
            row.update(state=new, error=err, updated=now())
            changes.append((run_id, new, err))
    return changes


def split_runs(runs: Sequence[RunSpec], manifest: Manifest, *, record_done: bool = False
               ) -> tuple[list[RunSpec], list[str], list[RunSpec]]:
    """(complete runs, run ids still pending or running in the (refreshed) manifest, runs to submit), in grid
    order. With `record_done`, each complete run is recorded as done in the manifest (found at planning time)."""
    skipped: list[RunSpec] = []
    active: list[str] = []
    todo: list[RunSpec] = []
    for r in runs:
        if is_complete(r):
            if record_done:
                manifest.record_done(r)
            skipped.append(r)
        elif manifest.rows.get(r.run_id, {}).get("state") in ACTIVE_STATES:
            active.append(r.run_id)
        else:
            todo.append(r)
    return skipped, active, todo
