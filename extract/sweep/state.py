"""The state of a sweep's run, as a pure function of plain facts (no file, process or scheduler is touched here).

A manifest row is in one of five states: pending (submitted, not started), running, done (the extractor says the
run is complete), failed (an error line says how: the run's error, or the scheduler's end of its job, TIMEOUT,
CANCELLED, ..., or why it was not submitted), lost (its SLURM job left the queue without a result and nothing can say
how it ended: no accounting, no end in its log). `retry` resubmits the failed and the lost runs.
`transition(row, facts)` gives a row's next state and error line from what is known about its run and its job;
`extract.sweep.track.refresh` gathers those facts (shards on disk, the run's result file, the job's result pickle,
the scheduler, the job's log, the process) and applies it to every row.

The facts are read in a fixed order and only as far as the decision needs them (a complete run needs no job facts,
a recorded failure no scheduler): `refresh` hands in an object that looks each one up on first use, a test a
`Facts` of plain values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Protocol

#: pending: submitted, not started; running; done: run_is_complete; failed: error line recorded; lost: the job
#: is gone and nothing says how it ended
State = Literal["pending", "running", "done", "failed", "lost"]
STATES: tuple[str, ...] = ("pending", "running", "done", "failed", "lost")
ACTIVE_STATES: frozenset[str] = frozenset({"pending", "running"})
#: the states `retry` resubmits
RETRY_STATES: frozenset[str] = frozenset({"failed", "lost"})
#: SLURM states in which a job may still run our code (sacct/squeue vocabulary)
SLURM_ACTIVE = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING",
                          "COMPLETING", "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "PREEMPTED"})
#: the SLURM "state" of a job that squeue no longer lists and accounting does not know (or is unavailable)
SLURM_GONE = "GONE"
#: what is known of a job: it may still run our code, it ended, it is gone without a trace, or the scheduler
#: cannot tell (yet)
JobStatus = Literal["active", "ended", "lost", "unknown"]


class JobFacts(Protocol):
    """What `transition` may read about one row's run and job (each read at most once, in the order below)."""

    @property
    def complete(self) -> bool:
        """The extractor's finished test holds for the run's shards."""

    @property
    def result(self) -> Mapping[str, Any] | None:
        """The run's result file written by a job (`token`, `state`, `error`), or None when absent or unreadable."""

    @property
    def live_done(self) -> bool | None:
        """For a job object held by this process: whether it is done; None when none is held."""

    @property
    def live_state(self) -> str:
        """The held job object's last known scheduler state (read only once it is done)."""

    @property
    def outcome(self) -> tuple[str, str] | None:
        """("success", "") or ("error", last traceback line) once the job's result pickle exists, else None."""

    @property
    def slurm_state(self) -> str:
        """The job's SLURM state (first word, upper case; UNKNOWN when sacct cannot tell)."""

    @property
    def log_end(self) -> tuple[str, str]:
        """A SLURM job: (end state, line) that slurmstepd wrote to the job's stderr log ("TIMEOUT", "*** JOB 7 ON n1
        CANCELLED AT ... DUE TO TIME LIMIT ***"), or ("", "") when the log names no end (`slurm_log_end`)."""

    @property
    def pid_alive(self) -> bool:
        """A local job: its process (the job id is its pid) still runs submitit."""


@dataclass(frozen=True)
class Facts:
    """`JobFacts` as plain values (the defaults: nothing held, no result, no pickle, a dead process)."""

    complete: bool = False
    result: Mapping[str, Any] | None = None
    live_done: bool | None = None
    live_state: str = "?"
    outcome: tuple[str, str] | None = None
    slurm_state: str = "UNKNOWN"
    log_end: tuple[str, str] = ("", "")
    pid_alive: bool = False


#: slurmstepd's line in a job's stderr when SLURM ends it: `*** JOB 7 ON n1 CANCELLED AT 2026-01-01T00:00:00 ***`,
#: with ` DUE TO TIME LIMIT` (or PREEMPTION, NODE FAILURE, JOB REQUEUE) before the closing stars
_STEPD_END = re.compile(r"\*\*\* JOB \d+ ON \S+ CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))?(?: \(.*\))? \*\*\*")
_DUE_TO = {None: "CANCELLED", "TIME LIMIT": "TIMEOUT", "PREEMPTION": "PREEMPTED", "NODE FAILURE": "NODE_FAIL"}
#: what submitit logs each time a job (or a requeued one) starts its Python function
SUBMITIT_START = "Starting with JobEnvironment"


def slurm_log_end(text: str) -> tuple[str, str]:
    """(end state, line) of the last start of a job, from its stderr log `text`: slurmstepd's "*** JOB ...
    CANCELLED AT ... ***" line after submitit's last start line, or ("", "") when none (a requeue's own
    "DUE TO JOB REQUEUE" is no end).

    Example:
        >>> slurm_log_end("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-01-01T00:00:01 DUE TO TIME LIMIT ***")
        ('TIMEOUT', '*** JOB 9 ON n1 CANCELLED AT 2026-01-01T00:00:01 DUE TO TIME LIMIT ***')
    """
    last = text.rsplit(SUBMITIT_START, 1)[-1]
    for line in reversed(last.splitlines()):
        m = _STEPD_END.search(line)
        if m is not None and m.group(1) != "JOB REQUEUE":
            return (_DUE_TO.get(m.group(1), m.group(1) or "CANCELLED"), m.group(0))
    return ("", "")


def job_status(row: Mapping[str, Any], facts: JobFacts) -> tuple[JobStatus, str]:
    """("active" | "ended" | "lost" | "unknown", detail) of the job a manifest row points to.

    A job object held by this process decides first (it knows its process), then the job's result pickle, then the
    scheduler (SLURM) or the process (local). A SLURM job that squeue no longer lists and accounting does not know
    ended as slurmstepd wrote in its log, or is lost when the log names no end.
    """
    job_id = str(row.get("job_id", ""))
    if not job_id:
        return ("ended", "no job was submitted")
    held_done = facts.live_done
    if held_done is False:
        return ("active", "")
    outcome = facts.outcome
    if outcome is not None:
        return ("ended", outcome[1])
    if held_done:
        return ("ended", f"job {job_id} ended without a result ({facts.live_state})")
    if row.get("executor", "local") == "slurm":
        state = facts.slurm_state
        if state in SLURM_ACTIVE:
            return ("active", state)
        if state in ("UNKNOWN", "READY"):
            return ("unknown", state)
        end, line = facts.log_end
        if state == SLURM_GONE and not end:
            return ("lost", f"job {job_id} left the queue without a result and nothing says how it ended (no "
                            "accounting record, no end in its log)")
        if state == SLURM_GONE:
            return ("ended", f"job {job_id} ended as {end} (its log: {line})")
        return ("ended", f"job {job_id} ended as {state}" + (f" ({line})" if line and end == state else ""))
    if facts.pid_alive:
        return ("active", "")
    return ("ended", f"local job process {job_id} ended without a result")


def transition(row: Mapping[str, Any], facts: JobFacts) -> tuple[str, str]:
    """The (state, error line) a manifest row moves to; the row's own when nothing changed.

    done: the extractor says the run is complete. failed: the job recorded an error line (in a result file of the
    row's own submission: the token matches), or the job ended before the run finished (its last traceback line or
    scheduler state is recorded), or a finished run's shards are gone. lost: a SLURM job is gone without a result
    and nothing says how it ended. A failed or lost row stays so (`retry` resubmits it; a lost run found complete is
    done); a job the scheduler cannot tell about leaves the row as it is.

    Example:
        >>> transition({"state": "pending", "job_id": "7", "token": "t"}, Facts(complete=True))
        ('done', '')
    """
    state, error = row.get("state"), row.get("error", "")
    if state == "lost" and facts.complete:
        return ("done", "")
    if state not in ACTIVE_STATES and state != "done":
        return (state, error)
    if facts.complete:
        return ("done", "")
    if state == "done":
        return ("failed", "shards incomplete or removed since the run finished")
    res = facts.result
    if res is not None and res.get("token") != row.get("token"):
        res = None  # written by an earlier submission
    if res is not None and res.get("state") == "failed":
        return ("failed", str(res.get("error", "")))
    status, detail = job_status(row, facts)
    if status == "active":
        return ("running" if res is not None and res.get("state") == "running" else "pending", error)
    if status == "ended":
        if res is not None and res.get("state") == "done":
            detail = "the run reported done but its shards are incomplete"
        return ("failed", detail or f"job {row.get('job_id')} ended before this run finished")
    if status == "lost":
        return ("lost", detail)
    return (state, error)
