"""Submitting a sweep's groups through submitit: executor settings, SLURM parameters, local GPU assignment.

SLURM gets one array task per group; the local executor packs the groups into `--local-jobs` processes on this
machine (`extract.sweep.grid.pack_groups`), each seeing its own GPUs when there are enough. What a job runs on its
worker is `extract.sweep.job`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from extract.sweep.cost import Rates, load_rates
from extract.sweep.errors import NotSubmitted, SweepError
from extract.sweep.grid import Group, pack_groups
from extract.sweep.manifest import Manifest, manifest_path, new_token, sweep_dir

Executor = Literal["local", "slurm"]
EXECUTORS: tuple[str, ...] = ("local", "slurm")
SLURM_JOB_NAME = "zaec-sweep"
#: local jobs run until done unless `--timeout-min` says otherwise (submitit's local default is 2 minutes)
LOCAL_TIMEOUT_MIN = 30 * 24 * 60
#: seconds before its time limit SLURM signals a job (USR2) so submitit can checkpoint and requeue it
REQUEUE_SIGNAL_S = 120
#: below this limit (minutes) a job is not requeued at its limit but killed there (TIMEOUT; `retry` resumes it):
#: SLURM may send the signal up to 60 s early, so a short job would be signalled at its start and requeue itself
#: until submitit gives up, each time paying its start-up again
REQUEUE_MIN_LIMIT_MIN = 10
#: the signal those short jobs get instead of USR2: SIGURG, which SLURM accepts and every process ignores by
#: default (submitit always writes a `--signal` line; this overrides it)
NO_REQUEUE_SIGNAL = "URG@1"


@dataclass(frozen=True)
class ExecOptions:
    """How jobs are submitted (recorded in the manifest; `retry` reuses them unless overridden).

    Attributes:
        executor: "local" (this machine, `local_jobs` processes) or "slurm" (one array task per group).
        partition, account, qos, constraint: SLURM placement (None = the cluster's default).
        gpus_per_job, cpus_per_job, mem_gb: resources of each job (SLURM `--gpus-per-node`, `--cpus-per-task`,
            `--mem`); for the local executor `gpus_per_job` GPUs are made visible to each job.
        timeout_min: time limit of each job; None = twice the longest group's estimate (SLURM), 30 days (local).
        array_parallelism: at most this many array tasks at once (SLURM `--array=0-N%P`).
        slurm_setup: shell lines run before the job (e.g. `source /path/.venv/bin/activate`).
        local_jobs: processes the local executor runs side by side (1 = the groups one after the other).
        rates: JSON of `python -m tools.bench_gpu --json`: estimates (plan, SLURM time limit, local packing) use
            its measured rates, and the card of its device for the methods it lacks (`extract.sweep.cost`).
    """

    executor: str = "local"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gpus_per_job: int = 1
    cpus_per_job: int = 10
    mem_gb: float | None = None
    timeout_min: int | None = None
    array_parallelism: int = 256
    slurm_setup: tuple[str, ...] = ()
    local_jobs: int = 1
    rates: str | None = None

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise SweepError(f"unknown executor {self.executor!r}; available: {', '.join(EXECUTORS)}")
        for name in ("cpus_per_job", "array_parallelism", "local_jobs"):
            if getattr(self, name) < 1:
                raise SweepError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_job < 0:
            raise SweepError(f"--gpus-per-job must be >= 0, got {self.gpus_per_job}")
        if self.timeout_min is not None and self.timeout_min < 1:
            raise SweepError(f"--timeout-min must be >= 1, got {self.timeout_min}")
        if self.mem_gb is not None and self.mem_gb <= 0:
            raise SweepError(f"--mem-gb must be > 0, got {self.mem_gb}")
        self.cost()  # a bad --rates file fails here, before anything is planned

    def cost(self) -> Rates | None:
        """The measured rates of `--rates`, or None (each method's work on the default card)."""
        return None if self.rates is None else load_rates(str(self.rates))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["slurm_setup"] = list(self.slurm_setup)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExecOptions":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["slurm_setup"] = tuple(kw.get("slurm_setup", ()))
        if kw.get("rates") and not Path(kw["rates"]).is_file():
            kw["rates"] = None  # the rates file of the first submission is gone: `retry` prices with the estimates
        return cls(**kw)


def default_timeout_min(groups: Sequence[Group], rates: Rates | None = None) -> int:
    """SLURM time limit when `--timeout-min` is not given: twice the longest group's estimate, at least an hour,
    rounded up to 30 minutes (a run that still times out resumes from its shards on `retry` or requeue)."""
    longest = max((g.estimate_hours(rates) for g in groups), default=0.0)
    return max(60, int(math.ceil(2 * longest * 60 / 30.0)) * 30)


def slurm_parameters(opts: ExecOptions, groups: Sequence[Group]) -> dict[str, Any]:
    """Keyword arguments of `submitit.SlurmExecutor.update_parameters` for one job array over `groups`.

    One task per job (the groups are the array), `gpus_per_job` GPUs on one node, a `timeout_min` limit (default
    from the estimate), the USR2 time-out signal 120 s early so submitit can requeue the job (it resumes); a limit
    under `REQUEUE_MIN_LIMIT_MIN` minutes gets no such signal (the job ends as TIMEOUT, `retry` resumes it).
    """
    time_min = opts.timeout_min if opts.timeout_min is not None else default_timeout_min(groups, opts.cost())
    params: dict[str, Any] = {
        "job_name": SLURM_JOB_NAME,
        "nodes": 1,
        "ntasks_per_node": 1,
        "cpus_per_task": opts.cpus_per_job,
        "time": time_min,
        "array_parallelism": opts.array_parallelism,
        "signal_delay_s": REQUEUE_SIGNAL_S,
    }
    if time_min < REQUEUE_MIN_LIMIT_MIN:
        params["additional_parameters"] = {"signal": NO_REQUEUE_SIGNAL}
    if opts.gpus_per_job:
        params["gpus_per_node"] = opts.gpus_per_job
    if opts.mem_gb is not None:
        gb = float(opts.mem_gb)
        params["mem"] = f"{int(gb)}GB" if gb == int(gb) else f"{int(gb * 1024)}MB"
    for name in ("partition", "account", "qos", "constraint"):
        if getattr(opts, name):
            params[name] = getattr(opts, name)
    if opts.slurm_setup:
        params["setup"] = list(opts.slurm_setup)
    return params


def sbatch_preview(opts: ExecOptions, groups: Sequence[Group], folder: Path) -> str:
    """The sbatch script submitit would write for this array (for `--dry-run`; nothing is submitted)."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = f"{sys.executable} -u -m submitit.core._submit {folder}"
    n = len(groups)
    return _make_sbatch_string(command=command, folder=folder, map_count=n if n > 1 else None,
                               **slurm_parameters(opts, groups))


def _visible_gpus() -> list[int]:
    """Physical indices of the GPUs this process may use (CUDA_VISIBLE_DEVICES when set to integers)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        items = [s.strip() for s in env.split(",") if s.strip()]
        if all(s.isdigit() for s in items):
            return [int(s) for s in items]
    try:
        import torch

        return list(range(torch.cuda.device_count()))
    except Exception:  # no usable CUDA: the jobs run on the CPU
        return []


def local_gpu_assignment(n_jobs: int, gpus_per_job: int, gpus: Sequence[int]) -> list[tuple[int, ...]]:
    """The GPUs (physical indices) each local job sees: consecutive blocks of `gpus_per_job`, wrapping around, so
    jobs get their own GPUs when there are enough and share them otherwise; none when there is no GPU.

    >>> local_gpu_assignment(3, 1, [2, 3])
    [(2,), (3,), (2,)]
    """
    k = min(gpus_per_job, len(gpus))
    if k == 0:
        return [()] * n_jobs
    ring = list(gpus) * 2
    return [tuple(ring[(i * k) % len(gpus):(i * k) % len(gpus) + k]) for i in range(n_jobs)]


def _import_submitit() -> Any:
    try:
        import submitit
    except ImportError:
        raise SweepError("zaec-sweep needs submitit: pip install -e .[sweep]") from None
    return submitit


def check_setup(lines: Sequence[str]) -> None:
    """Refuse a `--slurm-setup` line that sources a file missing on this machine: the jobs would start without that
    environment (the data, `--out` and the setup live on a file system the nodes share with this machine)."""
    for line in lines:
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # unbalanced quotes: the job's shell will say so
            continue
        if len(words) < 2 or words[0] not in ("source", "."):
            continue
        path = os.path.expanduser(os.path.expandvars(words[1]))
        if "$" not in path and not Path(path).exists():
            raise NotSubmitted(f"--slurm-setup line {line!r}: {path} does not exist on this machine, so the jobs "
                               "would start without that environment; give a path the compute nodes share")


def _scheduler_answer(exc: BaseException) -> str:
    """One line of what sbatch (or srun's check) answered: its error lines without the `sbatch: error:` prefix,
    joined by "; " (submitit's exception holds sbatch's whole stderr)."""
    lines = []
    for ln in str(exc).strip().splitlines():
        ln = re.sub(r"^\s*(sbatch|srun):\s*(error:\s*)?", "", ln).strip()
        if ln and ln not in lines:
            lines.append(ln)
    return "; ".join(lines) if lines else type(exc).__name__


def submit_groups(groups: Sequence[Group], opts: ExecOptions, out: Path, token: str) -> list[tuple[Group, Any]]:
    """Submit the groups; returns (group, submitit job) pairs. Raises NotSubmitted (one line) when the scheduler
    refuses or a `--slurm-setup` line cannot work."""
    submitit = _import_submitit()
    from extract.sweep.job import GroupJob

    folder = sweep_dir(out) / "submitit"
    try:
        if opts.executor == "slurm":
            check_setup(opts.slurm_setup)
            ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=3)
            ex.update_parameters(**slurm_parameters(opts, groups))
            # submitit echoes sbatch's stderr before raising; the one line below says it instead
            with contextlib.redirect_stderr(io.StringIO()):
                jobs = ex.submit_array([GroupJob([g], token) for g in groups])
            return list(zip(groups, jobs))
        packs = pack_groups(groups, opts.local_jobs, opts.cost())
        ex = submitit.LocalExecutor(folder=folder, max_num_timeout=3)
        pairs = []
        for pack, mine in zip(packs, local_gpu_assignment(len(packs), opts.gpus_per_job, _visible_gpus())):
            ex.update_parameters(timeout_min=opts.timeout_min or LOCAL_TIMEOUT_MIN, gpus_per_node=len(mine),
                                 visible_gpus=mine)
            job = ex.submit(GroupJob(pack, token))
            pairs += [(g, job) for g in pack]
        return pairs
    except SweepError:
        raise
    except Exception as e:  # sbatch refused, srun missing, ...: one line, not a traceback
        what = "sbatch refused the submission" if opts.executor == "slurm" else "submission failed (local)"
        raise NotSubmitted(f"{what}: {_scheduler_answer(e)}") from None


def submit_and_record(manifest: Manifest, groups: Sequence[Group], opts: ExecOptions) -> dict[str, Any]:
    """Submit the groups under a new token and record each run's job in the manifest (state pending); returns the
    local executor's submitit job objects by job id (this process can ask them whether their processes are done).
    SLURM jobs are followed through squeue/sacct instead (`extract.sweep.track`): submitit's own watcher takes a
    job sacct cannot tell about for a running one.

    Raises:
        NotSubmitted: the scheduler refused; every run of `groups` is recorded as failed with its answer.
    """
    token = new_token()
    manifest.executor = opts.to_dict()
    try:
        pairs = submit_groups(groups, opts, manifest.out, token)
    except NotSubmitted as e:
        for group in groups:
            for run in group.runs:
                manifest.record_not_submitted(run, error=str(e), executor=opts.executor)
        raise NotSubmitted(f"{e} ({sum(len(g.runs) for g in groups)} run(s) not submitted, recorded as failed in "
                           f"{manifest_path(manifest.out)}; `zaec-sweep retry` with corrected options resubmits "
                           "them)") from None
    live = {}
    for group, job in pairs:
        jid = str(job.job_id)
        if opts.executor == "local":
            live[jid] = job
        log = str(job.paths.stderr) if hasattr(job, "paths") else ""
        for run in group.runs:
            manifest.record_submission(run, job_id=jid, token=token, log=log, executor=opts.executor)
    return live
