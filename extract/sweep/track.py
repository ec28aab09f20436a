"""Following submitted jobs: what submitit, the scheduler and the process table say about a job; `refresh`, which
brings every manifest row up to date with `extract.sweep.state.transition`; `split_runs`, which tells the runs of a
grid to submit from the complete and the still active ones.

The facts of a row are looked up on first use (`_RowFacts`), so a complete run costs no pickle read and the one
`squeue` call (and `sacct` for the jobs squeue no longer lists) for all SLURM jobs of the manifest is made only when
some row needs it.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from extract.sweep.manifest import Manifest, now, read_json, result_path, sweep_dir
from extract.sweep.runspec import RunSpec, is_complete
from extract.sweep.state import ACTIVE_STATES, SLURM_GONE, slurm_log_end, transition


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


#: seconds one squeue or sacct call may take before the states count as unknown this time
SLURM_CALL_TIMEOUT_S = 60
#: what `status` says once when sacct does not answer
NO_ACCOUNTING_NOTE = ("SLURM accounting is unavailable here (sacct: {why}): a job is followed through squeue, which "
                      "lists it while it is queued or running and for MinJobAge seconds after it ended; a job gone "
                      "from squeue without a result is failed when its log names its end (slurmstepd's CANCELLED or "
                      "TIME LIMIT line), lost otherwise; `zaec-sweep retry` resubmits both")


def _slurm_call(args: Sequence[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a SLURM command; 127 when it is not installed, 124 when it hangs."""
    import subprocess

    try:
        p = subprocess.run(list(args), capture_output=True, text=True, timeout=SLURM_CALL_TIMEOUT_S)
    except FileNotFoundError:
        return (127, "", f"{args[0]}: command not found")
    except subprocess.TimeoutExpired:
        return (124, "", f"{args[0]} did not answer within {SLURM_CALL_TIMEOUT_S} s")
    return (p.returncode, p.stdout, p.stderr)


def _expand_ids(job_id: str) -> list[str]:
    """`12_[0-2,5]` (a pending array as sacct may print it) -> 12_0, 12_1, 12_2, 12_5; other ids as they are."""
    m = re.fullmatch(r"(\d+)_\[([\d,\-]+)(?:%\d+)?\]", job_id)
    if m is None:
        return [job_id]
    out = []
    for part in m.group(2).split(","):
        lo, _, hi = part.partition("-")
        out += [f"{m.group(1)}_{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def _parse_states(text: str) -> dict[str, str]:
    """`JOBID|STATE` lines -> {job id: first word of the state}; a later line of the same job wins (a requeued
    job's newest record comes last in sacct)."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        jid, sep, state = line.strip().partition("|")
        if sep and state.strip():
            for j in _expand_ids(jid.strip()):
                states[j] = state.split()[0].upper()  # "CANCELLED by 123" -> "CANCELLED"
    return states


class SlurmStates:
    """SLURM states of the manifest's jobs, asked once on first use: one `squeue` (the controller: jobs queued,
    running, or ended less than MinJobAge ago), then one `sacct` for the jobs squeue no longer lists. A job neither
    knows is `SLURM_GONE`; when squeue itself fails every state is UNKNOWN (nothing is concluded). `note` says once
    why sacct did not answer (accounting disabled, slurmdbd down)."""

    def __init__(self, job_ids: Sequence[str]):
        self.job_ids = sorted(set(job_ids))
        self._states: dict[str, str] | None = None
        self.note = ""

    def _ask(self) -> dict[str, str]:
        bases = sorted({j.split("_")[0] for j in self.job_ids})
        if not bases:
            return {}
        rc, out, err = _slurm_call(["squeue", "--noheader", "--array", "--states=all", "--format=%i|%T",
                                    f"--jobs={','.join(bases)}"])
        if rc != 0 and "Invalid job id" not in err:  # one job id asked and it is gone: squeue says so and fails
            return {}
        states = _parse_states(out if rc == 0 else "")
        gone = [j for j in self.job_ids if j not in states]
        if not gone:
            return states
        rc, out, err = _slurm_call(["sacct", "--allocations", "--noheader", "--parsable2", "--format=JobID,State",
                                    f"--jobs={','.join(sorted({j.split('_')[0] for j in gone}))}"])
        known = _parse_states(out) if rc == 0 else {}
        if rc != 0:
            lines = [ln.strip() for ln in (err or out).strip().splitlines() if ln.strip()]
            self.note = NO_ACCOUNTING_NOTE.format(why=lines[-1] if lines else f"exit status {rc}")
        return {**states, **{j: known.get(j, SLURM_GONE) for j in gone}}

    def get(self, job_id: str) -> str:
        if self._states is None:
            self._states = self._ask()
        return self._states.get(job_id) or "UNKNOWN"


def slurm_log_text(log: str, limit: int = 64 * 1024) -> str:
    """The last `limit` characters of a job's stderr log ("" when it cannot be read)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class _RowFacts:
    """`extract.sweep.state.JobFacts` of one manifest row, each looked up on first use."""

    def __init__(self, manifest: Manifest, run_id: str, spec: RunSpec, row: Mapping[str, Any], folder: Path,
                 live: Mapping[str, Any], slurm: SlurmStates) -> None:
        self._out, self._run_id, self._spec, self._row = manifest.out, run_id, spec, row
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
    def log_end(self) -> tuple[str, str]:
        from submitit.core.utils import JobPaths

        log = self._row.get("log") or str(JobPaths(self._folder, job_id=self._job_id, task_id=0).stderr)
        return slurm_log_end(slurm_log_text(log))

    @functools.cached_property
    def pid_alive(self) -> bool:
        return pid_alive(self._job_id)


def refresh(manifest: Manifest, live: Mapping[str, Any] | None = None,
            notes: list[str] | None = None) -> list[tuple[str, str, str]]:
    """Bring every row's state up to date (`extract.sweep.state.transition`); returns (run_id, new state, error)
    for the rows that changed.

    `live` maps job ids to submitit job objects held by this process (they know their processes); otherwise the
    job's result pickle, then its process (local) or `squeue`/`sacct` (SLURM, one call each for the whole manifest)
    decide. `notes` receives a line when SLURM accounting did not answer (how jobs are followed without it).
    """
    folder = sweep_dir(manifest.out) / "submitit"
    slurm = SlurmStates([str(r["job_id"]) for r in manifest.rows.values()
                         if r.get("executor") == "slurm" and r.get("state") in ACTIVE_STATES and r.get("job_id")])
    changes = []
    for run_id, row in manifest.rows.items():
        state = row.get("state")
        if state not in ACTIVE_STATES and state not in ("done", "lost"):
            continue
        spec = manifest.spec(run_id)  # registers a user's dataset in this process, for the finished test
        new, err = transition(row, _RowFacts(manifest, run_id, spec, row, folder, live or {}, slurm))
        if (new, err) != (state, row.get("error", "")):
            row.update(state=new, error=err, updated=now())
            changes.append((run_id, new, err))
    if notes is not None and slurm.note:
        notes.append(slurm.note)
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
