"""What a sweep job runs on its worker: the groups it was given, one run after the other, one model per group.

A run's failure is caught, logged with its traceback to the job's stderr, recorded as one error line in the run's
result file, and the job goes on with the next run: one bad run never stops the others. A group whose model cannot
be loaded records that error for each of its runs.

`GroupJob` is a submitit `Checkpointable`: when SLURM signals a time-out, submitit requeues the same job, and the
extractor's resume (valid shard parts and feature-cache chunks are kept) makes the requeued job continue where the
first one stopped.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Callable, Sequence

from submitit.helpers import Checkpointable

from extract.sweep.grid import Group
from extract.sweep.manifest import error_line, now, write_result
from extract.sweep.runspec import RunSpec, extract_run, load_group_model


def _say(run: RunSpec) -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(f"[{run.run_id}] {msg}", flush=True)
    return log


def run_group(group: Group, token: str) -> list[dict[str, Any]]:
    """Run every method of a group with one loaded model; the feature cache makes the encoding happen once.

    Returns:
        One dict per run: run_id, state ("done" or "failed"), error line, shard paths.
    """
    r0 = group.runs[0]
    model = None
    model_error = ""
    try:
        model = load_group_model(r0)
    except Exception as e:  # recorded for every run of the group below
        traceback.print_exc()
        model_error = error_line(e)
    results = []
    for run in group.runs:
        print(f"[{run.run_id}] start {now()}", flush=True)
        write_result(run, token, "running")
        if model is None:
            state, err, shards = "failed", model_error, []
        else:
            try:
                run.register_dataset()
                paths = extract_run(run, model, _say(run))
                state, err, shards = "done", "", [str(p) for p in paths]
            except Exception as e:  # one failed run must not stop the others
                traceback.print_exc()
                state, err, shards = "failed", error_line(e), []
                _free_gpu_memory()
        write_result(run, token, state, error=err, shards=shards)
        print(f"[{run.run_id}] {state} {now()}{': ' + err if err else ''}", flush=True)
        results.append({"run_id": run.run_id, "state": state, "error": err, "shards": shards})
    sys.stdout.flush()
    return results


def _free_gpu_memory() -> None:
    """After a failure (an out-of-memory error, say), give cached blocks back before the next run."""
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # cleaning up must never turn a recorded failure into a crash
        pass


class GroupJob(Checkpointable):
    """The callable a sweep submits: runs `groups` in order under submission `token`."""

    def __init__(self, groups: Sequence[Group], token: str) -> None:
        self.groups = list(groups)
        self.token = token

    def __call__(self) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        for g in self.groups:
            results += run_group(g, self.token)
        return results
