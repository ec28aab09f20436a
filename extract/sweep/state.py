"""The state of a sweep's run, as a pure function of plain facts (no file, process or scheduler is touched here).

A manifest row is in one of four states: pending (submitted, not started), running, done (the extractor says the
run is complete), failed (an error line is recorded). `transition(row, facts)` gives a row's next state and error
line from what is known about its run and its job; `extract.sweep.track.refresh` gathers those facts (shards on
disk, the run's result file, the job's result pickle, the scheduler, the process) and applies it to every row.

The facts are read in a fixed order and only as far as the decision needs them (a complete run needs no job facts,
a recorded failure no scheduler): `refresh` hands in an object that looks each one up on first use, a test a
`Facts` of plain values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Protocol

#: pending: submitted, not started; running; done: run_is_complete; failed: error line recorded
State = Literal["pending", "running", "done", "failed"]
STATES: tuple[str, ...] = ("pending", "running", "done", "failed")
ACTIVE_STATES: frozenset[str] = frozenset({"pending", "running"})
#: SLURM states in which a job may still run our code (sacct/squeue vocabulary)
SLURM_ACTIVE = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING",
                          "COMPLETING", "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "PREEMPTED"})
#: what is known of a job: it may still run our code, it ended, or the scheduler cannot tell (yet)
JobStatus = Literal["active", "ended", "unknown"]


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
    pid_alive: bool = False


def job_status(row: Mapping[str, Any], facts: JobFacts) -> tuple[JobStatus, str]:
    """("active" | "ended" | "unknown", detail) of the job a manifest row points to.

    A job object held by this process decides first (it knows its process), then the job's result pickle, then the
    scheduler (SLURM) or the process (local).
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
        return ("ended", f"job {job_id} ended as {state}")
    if facts.pid_alive:
        return ("active", "")
    return ("ended", f"local job process {job_id} ended without a result")


def transition(row: Mapping[str, Any], facts: JobFacts) -> tuple[str, str]:
    """The (state, error line) a manifest row moves to; the row's own when nothing changed.

    done: the extractor says the run is complete. failed: the job recorded an error line (in a result file of the
    row's own submission: the token matches), or the job ended before the run finished (its last traceback line or
    scheduler state is recorded), or a finished run's shards are gone. A failed row stays failed (`retry` resubmits
    it); a job the scheduler cannot tell about leaves the row as it is.

    Example:
        >>> transition({"state": "pending", "job_id": "7", "token": "t"}, Facts(complete=True))
        ('done', '')
    """
    state, error = row.get("state"), row.get("error", "")
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
    return (state, error)
