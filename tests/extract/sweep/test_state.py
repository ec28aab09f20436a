"""`extract.sweep.state`: the job-state transition of a manifest row, one table row per case, and the order in
which it reads its facts (a complete run asks nothing of its job, a local job never asks SLURM)."""

from __future__ import annotations

import pytest

from extract.sweep.state import STATES, Facts, slurm_log_end, transition

ENDED = "shards incomplete or removed since the run finished"
LOST = ("job 4242_0 left the queue without a result and nothing says how it ended (no accounting record, no end in "
        "its log)")
STEPD_TIMEOUT = "*** JOB 4243 ON n1 CANCELLED AT 2026-11-26T19:34:12 DUE TO TIME LIMIT ***"
STEPD_CANCEL = "*** JOB 4243 ON n1 CANCELLED AT 2026-11-26T19:16:20 ***"


def _row(state="pending", *, job_id="77", executor="local", token="t", error=""):
    return {"run_id": "b/d/m/seed=1", "state": state, "job_id": job_id, "executor": executor, "token": token,
            "error": error}


def _res(state, token="t", error=""):
    return {"run_id": "b/d/m/seed=1", "token": token, "state": state, "error": error}


# (case, manifest row, facts, expected (state, error line))
CASES = [
    ("failed stays failed", _row("failed", error="E"), Facts(complete=True), ("failed", "E")),
    ("an unknown state is left alone", _row("weird"), Facts(complete=True), ("weird", "")),
    ("done and complete", _row("done"), Facts(complete=True), ("done", "")),
    ("done but shards gone", _row("done"), Facts(), ("failed", ENDED)),
    ("pending and complete", _row("pending"), Facts(complete=True), ("done", "")),
    ("running and complete clears the error", _row("running", error="old"), Facts(complete=True), ("done", "")),
    ("a failure recorded by this submission", _row("running"),
     Facts(result=_res("failed", error="DatasetError: bad image"), live_done=False), ("failed",
                                                                                      "DatasetError: bad image")),
    ("a failure of an earlier submission is ignored", _row("pending"),
     Facts(result=_res("failed", token="old", error="stale"), live_done=False), ("pending", "")),
    ("a held job still running, run started", _row("pending"), Facts(result=_res("running"), live_done=False),
     ("running", "")),
    ("a held job still running, run not started", _row("pending"), Facts(live_done=False), ("pending", "")),
    ("active job, result file gone: back to pending", _row("running"), Facts(live_done=False), ("pending", "")),
    ("active job keeps the row's error", _row("pending", error="kept"), Facts(live_done=False), ("pending", "kept")),
    ("a held job that ended without a result", _row("pending"), Facts(live_done=True, live_state="FINISHED"),
     ("failed", "job 77 ended without a result (FINISHED)")),
    ("the held job decides before the pickle", _row("pending"),
     Facts(live_done=False, outcome=("error", "boom")), ("pending", "")),
    ("job raised: its last traceback line", _row("running"), Facts(outcome=("error", "RuntimeError: boom")),
     ("failed", "RuntimeError: boom")),
    ("job succeeded, run unfinished", _row("running"), Facts(outcome=("success", "")),
     ("failed", "job 77 ended before this run finished")),
    ("job succeeded, run said done, shards incomplete", _row("running"),
     Facts(result=_res("done"), outcome=("success", "")), ("failed", "the run reported done but its shards are "
                                                                     "incomplete")),
    ("ended job, an earlier submission's done is ignored", _row("running"),
     Facts(result=_res("done", token="old"), outcome=("success", "")),
     ("failed", "job 77 ended before this run finished")),
    ("no job id", _row("pending", job_id=""), Facts(), ("failed", "no job was submitted")),
    ("local process alive", _row("pending"), Facts(pid_alive=True), ("pending", "")),
    ("local process alive, run started", _row("pending"), Facts(result=_res("running"), pid_alive=True),
     ("running", "")),
    ("local process gone", _row("running"), Facts(pid_alive=False),
     ("failed", "local job process 77 ended without a result")),
    ("a row without executor is local", {k: v for k, v in _row("pending").items() if k != "executor"},
     Facts(pid_alive=True, slurm_state="TIMEOUT"), ("pending", "")),
    ("slurm running", _row("pending", job_id="4242_0", executor="slurm"), Facts(slurm_state="RUNNING"),
     ("pending", "")),
    ("slurm requeued, run started", _row("running", job_id="4242_0", executor="slurm"),
     Facts(result=_res("running"), slurm_state="REQUEUED"), ("running", "")),
    ("slurm cannot tell", _row("pending", job_id="4242_0", executor="slurm", error="e"),
     Facts(slurm_state="UNKNOWN"), ("pending", "e")),
    ("slurm ready", _row("running", job_id="4242_0", executor="slurm"), Facts(slurm_state="READY"),
     ("running", "")),
    ("slurm timed out", _row("pending", job_id="4242_0", executor="slurm"), Facts(slurm_state="TIMEOUT"),
     ("failed", "job 4242_0 ended as TIMEOUT")),
    ("slurm cancelled after the run said done", _row("running", job_id="4242_0", executor="slurm"),
     Facts(result=_res("done"), slurm_state="CANCELLED"), ("failed", "the run reported done but its shards are "
                                                                     "incomplete")),
    ("slurm ignores the process table", _row("pending", job_id="4242_0", executor="slurm"),
     Facts(slurm_state="FAILED", pid_alive=True), ("failed", "job 4242_0 ended as FAILED")),
    ("a held slurm job decides before sacct", _row("pending", job_id="4242_0", executor="slurm"),
     Facts(live_done=False, slurm_state="TIMEOUT"), ("pending", "")),
    # issue 30: a job gone from squeue that accounting does not know is not pending for ever
    ("slurm gone, nothing names its end: lost", _row("running", job_id="4242_0", executor="slurm"),
     Facts(result=_res("running"), slurm_state="GONE"), ("lost", LOST)),
    ("slurm gone, its log names the time limit", _row("running", job_id="4242_0", executor="slurm"),
     Facts(slurm_state="GONE", log_end=("TIMEOUT", STEPD_TIMEOUT)),
     ("failed", f"job 4242_0 ended as TIMEOUT (its log: {STEPD_TIMEOUT})")),
    ("sacct's end with slurmstepd's line", _row("pending", job_id="4242_0", executor="slurm"),
     Facts(slurm_state="CANCELLED", log_end=("CANCELLED", STEPD_CANCEL)),
     ("failed", f"job 4242_0 ended as CANCELLED ({STEPD_CANCEL})")),
    ("a log line of another end is not appended", _row("pending", job_id="4242_0", executor="slurm"),
     Facts(slurm_state="FAILED", log_end=("CANCELLED", STEPD_CANCEL)), ("failed", "job 4242_0 ended as FAILED")),
    ("lost stays lost", _row("lost", error="E"), Facts(slurm_state="RUNNING"), ("lost", "E")),
    ("a lost run found complete is done", _row("lost", error="E"), Facts(complete=True), ("done", "")),
]


@pytest.mark.parametrize("row, facts, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_transition_table(row, facts, expected):
    assert transition(row, facts) == expected
    assert expected[0] in STATES or expected[0] == row["state"]


class _Recorder:
    """Facts that log each read, to check what a decision asks for (and that it asks each fact once)."""

    def __init__(self, facts: Facts) -> None:
        self._facts, self.reads = facts, []

    def __getattr__(self, name: str):
        self.reads.append(name)
        return getattr(self._facts, name)


@pytest.mark.parametrize("row, facts, reads", [
    (_row("failed"), Facts(), []),
    (_row("done"), Facts(complete=True), ["complete"]),
    (_row("done"), Facts(), ["complete"]),
    (_row("running"), Facts(result=_res("failed")), ["complete", "result"]),
    (_row("pending"), Facts(live_done=False), ["complete", "result", "live_done"]),
    (_row("pending"), Facts(outcome=("success", "")), ["complete", "result", "live_done", "outcome"]),
    (_row("pending"), Facts(live_done=True), ["complete", "result", "live_done", "outcome", "live_state"]),
    (_row("pending"), Facts(), ["complete", "result", "live_done", "outcome", "pid_alive"]),
    (_row("pending", executor="slurm"), Facts(), ["complete", "result", "live_done", "outcome", "slurm_state"]),
    (_row("pending", executor="slurm"), Facts(slurm_state="GONE"),
     ["complete", "result", "live_done", "outcome", "slurm_state", "log_end"]),
    (_row("pending", executor="slurm"), Facts(slurm_state="RUNNING"),
     ["complete", "result", "live_done", "outcome", "slurm_state"]),
    (_row("pending", job_id=""), Facts(), ["complete", "result"]),
])
def test_facts_are_read_only_as_far_as_needed(row, facts, reads):
    rec = _Recorder(facts)
    assert transition(row, rec) == transition(row, facts)
    assert rec.reads == reads


START = "submitit INFO (2026-11-26 19:29:31,518) - Starting with JobEnvironment(job_id=7_0, hostname=n1)"


@pytest.mark.parametrize("log, expected", [
    (f"{START}\nslurmstepd-n1: error: {STEPD_TIMEOUT}\nsrun: error: n1: task 0: Terminated\n",
     ("TIMEOUT", STEPD_TIMEOUT)),
    (f"{START}\nsrun: got SIGCONT\nslurmstepd-n1: error: {STEPD_CANCEL}\n"
     "slurmstepd-n1: error: *** STEP 4243.0 ON n1 CANCELLED AT 2026-11-26T19:16:20 ***\n", ("CANCELLED", STEPD_CANCEL)),
    # an end before the job's last start (it was requeued and started again) is not this start's end
    (f"slurmstepd-n1: error: {STEPD_TIMEOUT}\n{START}\nsrun: error: n1: task 0: Killed\n", ("", "")),
    # a requeue is no end; steps' lines are not the job's
    (f"{START}\nslurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-11-26T19:00:00 DUE TO JOB REQUEUE ***\n",
     ("", "")),
    ("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-11-26T19:00:00 DUE TO PREEMPTION ***",
     ("PREEMPTED", "*** JOB 9 ON n1 CANCELLED AT 2026-11-26T19:00:00 DUE TO PREEMPTION ***")),
    ("", ("", "")),
])
def test_slurm_log_end(log, expected):
    assert slurm_log_end(log) == expected
