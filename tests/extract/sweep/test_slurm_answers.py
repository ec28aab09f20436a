"""What the sweep makes of SLURM's answers, given as fixed texts by stand-ins for `squeue`, `sacct` and `sbatch`
(the answers real SLURM 22.05 gave in tests/extract/sweep/test_slurm_real.py): the states of `track.SlurmStates`,
lost jobs and `retry`, refused submissions recorded in the manifest, the time-out signal of short limits."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest
from rich.console import Console

from extract.run.options import ExecOptions, RunOptions
from extract.sweep import cli as sweep
from extract.sweep import submit, track
from extract.sweep.errors import NotSubmitted
from extract.sweep.grid import Grid, expand_grid, group_runs
from extract.sweep.manifest import Manifest
from extract.sweep.runspec import RunSpec
from extract.sweep.state import SLURM_GONE

NOT_IN_QUEUE = "slurm_load_jobs error: Invalid job id specified"
NO_ACCOUNTING = "Slurm accounting storage is disabled"


def _stand_in(bin_dir: Path, name: str, stdout: str = "", stderr: str = "", rc: int = 0) -> Path:
    """An executable `name` printing fixed text and recording its arguments in `<name>.args`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    p = bin_dir / name
    p.write_text(f"#!/bin/sh\necho \"$@\" >> '{bin_dir / name}.args'\ncat <<'EOF'\n{stdout}EOF\n"
                 f"cat >&2 <<'EOF'\n{stderr}\nEOF\nexit {rc}\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return p


@pytest.fixture
def bin_dir(tmp_path, monkeypatch):
    d = tmp_path / "bin"
    d.mkdir()
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")
    return d


def test_squeue_first_then_sacct_for_the_jobs_it_no_longer_lists(bin_dir):
    _stand_in(bin_dir, "squeue", "7_0|RUNNING\n7_1|COMPLETING\n")
    _stand_in(bin_dir, "sacct", "7_2|CANCELLED by 0\n8_[0-1]|PENDING\n7_3|REQUEUED\n7_3|TIMEOUT\n")
    s = track.SlurmStates(["7_0", "7_1", "7_2", "7_3", "8_1", "9"])
    got = {j: s.get(j) for j in ("7_0", "7_1", "7_2", "7_3", "8_1", "9")}
    assert got == {"7_0": "RUNNING", "7_1": "COMPLETING", "7_2": "CANCELLED", "7_3": "TIMEOUT", "8_1": "PENDING",
                   "9": SLURM_GONE}
    assert s.note == ""
    # one squeue for the arrays, one sacct for the jobs squeue does not list
    assert (bin_dir / "squeue.args").read_text().count("\n") == 1
    assert (bin_dir / "sacct.args").read_text().split()[-1] == "--jobs=7,8,9"


def test_without_accounting_a_job_squeue_does_not_know_is_gone_and_a_note_says_why(bin_dir):
    _stand_in(bin_dir, "squeue", stderr=NOT_IN_QUEUE, rc=1)  # the one job asked for is gone
    _stand_in(bin_dir, "sacct", stderr=NO_ACCOUNTING, rc=1)
    s = track.SlurmStates(["5_0"])
    assert s.get("5_0") == SLURM_GONE
    assert NO_ACCOUNTING in s.note and "lost" in s.note


def test_a_controller_that_does_not_answer_concludes_nothing(bin_dir):
    _stand_in(bin_dir, "squeue", stderr="slurm_load_jobs error: Unable to contact slurm controller", rc=1)
    _stand_in(bin_dir, "sacct", "5_0|COMPLETED\n")
    s = track.SlurmStates(["5_0"])
    assert s.get("5_0") == "UNKNOWN" and not (bin_dir / "sacct.args").exists()


def _slurm_row(tmp_path) -> tuple[Manifest, RunSpec]:
    run = RunSpec(RunOptions("tda", "dtd", backbone="tiny-clip", pretrained="local-dir:/x"),
                  ExecOptions(out=str(tmp_path)), "single")
    m = Manifest(tmp_path, executor=submit.ExecOptions(executor="slurm").to_dict())
    m.record_submission(run, job_id="5_0", token="t", log=str(tmp_path / "5_0_0_log.err"), executor="slurm")
    return m, run


def test_a_job_gone_without_a_trace_is_lost_and_retried(tmp_path, bin_dir):
    """Issue 30: an array task SIGKILLed on a cluster without accounting stayed `pending`, and `retry` answered
    "nothing to retry"."""
    _stand_in(bin_dir, "squeue", stderr=NOT_IN_QUEUE, rc=1)
    _stand_in(bin_dir, "sacct", stderr=NO_ACCOUNTING, rc=1)
    m, run = _slurm_row(tmp_path)
    (tmp_path / "5_0_0_log.err").write_text("srun: error: n1: task 0: Killed\n")
    notes: list[str] = []
    assert track.refresh(m, notes=notes) == [(run.run_id, "lost", m.rows[run.run_id]["error"])]
    assert m.rows[run.run_id]["state"] == "lost" and len(notes) == 1
    m.save()
    out = io.StringIO()
    assert sweep.sweep_retry(tmp_path, {}, dry_run=True, wait=False, console=Console(file=out, width=200)) == 0
    assert "1 run(s) to submit in 1 group(s)" in out.getvalue()


def test_a_job_gone_after_its_time_limit_is_named_by_its_log(tmp_path, bin_dir):
    _stand_in(bin_dir, "squeue", stderr=NOT_IN_QUEUE, rc=1)
    _stand_in(bin_dir, "sacct", stderr=NO_ACCOUNTING, rc=1)
    m, run = _slurm_row(tmp_path)
    line = "*** JOB 6 ON n1 CANCELLED AT 2026-11-26T19:34:12 DUE TO TIME LIMIT ***"
    (tmp_path / "5_0_0_log.err").write_text(f"slurmstepd-n1: error: {line}\n")
    track.refresh(m)
    assert m.rows[run.run_id]["state"] == "failed"
    assert m.rows[run.run_id]["error"] == f"job 5_0 ended as TIMEOUT (its log: {line})"


def test_a_refused_submission_is_recorded_and_said_in_one_line(tmp_path, bin_dir):
    _stand_in(bin_dir, "srun")
    _stand_in(bin_dir, "sbatch", stderr="sbatch: error: invalid partition specified: nope\n"
                                        "sbatch: error: Batch job submission failed: Invalid partition name specified",
              rc=1)
    runs = expand_grid(Grid(("zero-shot", "tda"), ("dtd", "eurosat"), ("ViT-B-16",)), out=tmp_path)
    m = Manifest(tmp_path)
    with pytest.raises(NotSubmitted) as e:
        submit.submit_and_record(m, group_runs(runs), submit.ExecOptions(executor="slurm", partition="nope"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("sbatch refused the submission: invalid partition specified: nope; "
                                              "Batch job submission failed: Invalid partition name specified")
    assert "4 run(s) not submitted" in msg
    assert {r["state"] for r in m.rows.values()} == {"failed"} and {r["job_id"] for r in m.rows.values()} == {""}
    assert all(r["error"].startswith("not submitted: sbatch refused") for r in m.rows.values())
    assert m.executor["partition"] == "nope"


def test_a_setup_line_sourcing_a_missing_file_is_refused(tmp_path):
    (tmp_path / "activate").write_text("")
    submit.check_setup([f"source {tmp_path / 'activate'}", "module load cuda", "source $NOT_SET/x"])
    with pytest.raises(NotSubmitted, match=r"--slurm-setup line '\. /no/venv/bin/activate': /no/venv/bin/activate "
                                           r"does not exist on this machine"):
        submit.check_setup([". /no/venv/bin/activate"])


@pytest.mark.parametrize("minutes, signal_line", [
    (1, "#SBATCH --signal=URG@1"), (9, "#SBATCH --signal=URG@1"),
    (10, "#SBATCH --signal=USR2@120"), (600, "#SBATCH --signal=USR2@120"),
])
def test_short_limits_get_no_requeue_signal(tmp_path, minutes, signal_line):
    """SLURM may signal up to a minute early: a short job would be told to requeue at its start, again and again."""
    groups = group_runs(expand_grid(Grid(("tda",), ("dtd",), ("ViT-B-16",)), out=tmp_path))
    text = submit.sbatch_preview(submit.ExecOptions(executor="slurm", timeout_min=minutes), groups, tmp_path)
    assert signal_line in text.splitlines() and text.count("--signal") == 1
