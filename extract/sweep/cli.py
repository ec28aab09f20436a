"""`zaec-sweep`: run the grid methods x datasets x backbones x seeds as jobs (SLURM or one machine) via submitit.

    zaec-sweep --methods zero-shot,tda,dpe,dlae --datasets all --backbones ViT-B-16,RN50 --seeds 1
               [--executor local|slurm] [--partition P --gpus-per-job 1 --timeout-min N ...] [--dry-run]
    zaec-sweep --config grid.toml [any option above overrides the file]
    zaec-sweep status [--out DIR]         the manifest as a table, states refreshed from the jobs
    zaec-sweep retry  [--out DIR]         resubmit the failed runs only

Every name is resolved before anything is submitted. Runs whose shards are complete (the extractor's own
`run_is_complete`) are skipped, so re-running the same command submits only what is missing or failed. Runs that
share a feature cache - same backbone, weights, dataset, view policy and seed - form one group; SLURM gets one array
task per group, the local executor packs the groups into `--local-jobs` processes. The manifest lives in
`<out>/_sweep/manifest.json`; calibrate the results with `zaec-calibrate <out>`.

A user error ends in one line on stderr and exit status 2; `run --wait` and `retry --wait` exit with 1 when a run
failed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence

import typer

from extract.sweep.plan import (
    ACTIVE_STATES,
    EXECUTORS,
    Grid,
    Group,
    Manifest,
    Rates,
    RunSpec,
    SweepError,
    check_data,
    check_finished_settings,
    class_names_files,
    default_timeout_min,
    expand_grid,
    fmt_hours,
    group_runs,
    is_complete,
    load_rates,
    locked_manifest,
    manifest_frame,
    new_token,
    pack_groups,
    parse_seeds,
    plan_frame,
    read_json,
    result_path,
    split_list,
    sweep_dir,
)

app = typer.Typer(add_completion=False, help=__doc__, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None)

COMMANDS = ("run", "status", "retry")
DEFAULT_OUT = Path("data") / "shards"
SLURM_JOB_NAME = "zaec-sweep"
#: local jobs run until done unless `--timeout-min` says otherwise (submitit's local default is 2 minutes)
LOCAL_TIMEOUT_MIN = 30 * 24 * 60
#: seconds between two refreshes while waiting
POLL_S = 2.0
#: SLURM states in which a job may still run our code (sacct/squeue vocabulary)
SLURM_ACTIVE = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING",
                          "COMPLETING", "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "PREEMPTED"})


# ---------------------------------------------------------------------------------------------------------------
# executor settings

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
        rates: JSON of `python -m extract.bench_gpu --json`: estimates (plan, SLURM time limit, local packing) use
            its measured rates instead of the fixed guesses of `extract.sweep.plan`.
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
        """The measured rates of `--rates`, or None (the fixed guesses)."""
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
            kw["rates"] = None  # the rates file of the first submission is gone: `retry` prices with the guesses
        return cls(**kw)


def slurm_parameters(opts: ExecOptions, groups: Sequence[Group]) -> dict[str, Any]:
    """Keyword arguments of `submitit.SlurmExecutor.update_parameters` for one job array over `groups`.

    One task per job (the groups are the array), `gpus_per_job` GPUs on one node, a `timeout_min` limit (default
    from the estimate), the USR2 time-out signal 120 s early so submitit can requeue the job (it resumes).
    """
    params: dict[str, Any] = {
        "job_name": SLURM_JOB_NAME,
        "nodes": 1,
        "ntasks_per_node": 1,
        "cpus_per_task": opts.cpus_per_job,
        "time": opts.timeout_min if opts.timeout_min is not None else default_timeout_min(groups, opts.cost()),
        "array_parallelism": opts.array_parallelism,
        "signal_delay_s": 120,
    }
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


def submit_groups(groups: Sequence[Group], opts: ExecOptions, out: Path, token: str) -> list[tuple[Group, Any]]:
    """Submit the groups; returns (group, submitit job) pairs. Raises SweepError when the scheduler refuses."""
    submitit = _import_submitit()
    from extract.sweep.job import GroupJob

    folder = sweep_dir(out) / "submitit"
    try:
        if opts.executor == "slurm":
            ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=3)
            ex.update_parameters(**slurm_parameters(opts, groups))
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
        lines = str(e).strip().splitlines()
        raise SweepError(f"submission failed ({opts.executor}): {lines[0] if lines else type(e).__name__}") from None


# ---------------------------------------------------------------------------------------------------------------
# refreshing states

def _job_outcome(folder: Path, job_id: str) -> tuple[str, str] | None:
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


def _pid_alive(pid: str) -> bool:
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


def job_state(row: Mapping[str, Any], folder: Path, live: Mapping[str, Any] | None = None,
              slurm: SlurmStates | None = None) -> tuple[str, str]:
    """("active" | "ended" | "unknown", detail) of the job a manifest row points to.

    `live` maps job ids to submitit job objects held by this process (they know their processes); otherwise the
    job's result pickle, then its process (local) or `sacct` (SLURM, through `slurm`) decide.
    """
    job_id = str(row.get("job_id", ""))
    if not job_id:
        return ("ended", "no job was submitted")
    job = (live or {}).get(job_id)
    if job is not None and not job.done():
        return ("active", "")
    outcome = _job_outcome(folder, job_id)
    if outcome is not None:
        return ("ended", outcome[1])
    if job is not None:
        return ("ended", f"job {job_id} ended without a result ({getattr(job, 'state', '?')})")
    executor = row.get("executor", "local")
    if executor == "slurm":
        state = (slurm or SlurmStates(folder, [job_id])).get(job_id)
        if state in SLURM_ACTIVE:
            return ("active", state)
        if state in ("UNKNOWN", "READY"):
            return ("unknown", state)
        return ("ended", f"job {job_id} ended as {state}")
    return ("active", "") if _pid_alive(job_id) else ("ended", f"local job process {job_id} ended without a result")


def refresh(manifest: Manifest, live: Mapping[str, Any] | None = None) -> list[tuple[str, str, str]]:
    """Bring every row's state up to date; returns (run_id, new state, error) for the rows that changed.

    done: the extractor says the run is complete. failed: the job recorded an error line, or the job ended before
    the run finished (its last traceback line or scheduler state is recorded), or a finished run's shards are gone.
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
        spec = manifest.spec(run_id)
        new, err = state, row.get("error", "")
        if is_complete(spec):
            new, err = "done", ""
        elif state == "done":
            new, err = "failed", "shards incomplete or removed since the run finished"
        else:
            res = read_json(result_path(manifest.out, run_id))
            if res is not None and res.get("token") != row.get("token"):
                res = None  # written by an earlier submission
            if res is not None and res.get("state") == "failed":
                new, err = "failed", str(res.get("error", ""))
            else:
                js, detail = job_state(row, folder, live, slurm)
                if js == "active":
                    new = "running" if res is not None and res.get("state") == "running" else "pending"
                elif js == "ended":
                    if res is not None and res.get("state") == "done":
                        detail = "the run reported done but its shards are incomplete"
                    new, err = "failed", detail or f"job {row.get('job_id')} ended before this run finished"
        if (new, err) != (state, row.get("error", "")):
            row.update(state=new, error=err, updated=_now())
            changes.append((run_id, new, err))
    return changes


def _now() -> str:
    from extract.sweep.plan import now

    return now()


# ---------------------------------------------------------------------------------------------------------------
# rendering (rich) of the polars frames built in extract.sweep.plan

STATE_STYLE = {"done": "green", "failed": "bold red", "running": "cyan", "pending": "yellow"}


def render_manifest(manifest: Manifest, console: Any, *, only: str | None = None) -> None:
    from rich.table import Table

    df = manifest_frame(manifest)
    if only:
        df = df.filter(df["state"] == only)
    t = Table(title=f"sweep {manifest.out}", show_lines=False)
    for h in ("backbone", "dataset", "method", "seed", "job", "state", "error / shards"):
        t.add_column(h, overflow="fold")
    for r in df.iter_rows(named=True):
        style = STATE_STYLE.get(r["state"], "")
        detail = r["error"] if r["state"] == "failed" else _relative(r["shard_dir"], manifest.out)
        t.add_row(r["backbone"], r["dataset"], r["method"], str(r["seed"]), r["job_id"] or "-",
                  f"[{style}]{r['state']}[/{style}]" if style else r["state"], _escape(detail))
    console.print(t)
    counts = manifest_frame(manifest)["state"].value_counts(sort=True)
    summary = ", ".join(f"{n} {s}" for s, n in counts.iter_rows())
    console.print(f"{len(manifest.rows)} run(s): {summary or 'none'}", highlight=False)


def _relative(path: str, root: Path) -> str:
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def render_plan(groups: Sequence[Group], skipped: Sequence[RunSpec], active: Sequence[str], opts: ExecOptions,
                out: Path, console: Any) -> None:
    from rich.table import Table

    df = plan_frame(groups, opts.cost())
    priced = f"the rates measured in {opts.rates}" if opts.rates else "fixed guesses (extract/sweep/plan.py)"
    t = Table(title=f"sweep plan (GPU-hours: an estimate from {priced})")
    for h in ("group (backbone/dataset/views/seed)", "methods", "images", "views", "est. GPU-h"):
        t.add_column(h, justify="right" if h in ("images", "views", "est. GPU-h") else "left")
    for r in df.iter_rows(named=True):
        t.add_row(r["group"], r["methods"], f"{r['images']:,}", f"{r['views']:,}", fmt_hours(r["gpu_hours"]))
    console.print(t)
    n_runs = int(df["runs"].sum()) if len(df) else 0
    total = float(df["gpu_hours"].sum()) if len(df) else 0.0
    console.print(f"{n_runs} run(s) to submit in {len(groups)} group(s), about {fmt_hours(total)} GPU-hours; "
                  f"{len(skipped)} complete (skipped); {len(active)} already submitted and still active",
                  highlight=False)
    if not groups:
        return
    if opts.executor == "slurm":
        console.print(f"SLURM: one job array of {len(groups)} task(s); sbatch script:", highlight=False)
        console.print(sbatch_preview(opts, groups, sweep_dir(out) / "submitit"), markup=False, highlight=False,
                      soft_wrap=True)
    else:
        packs = pack_groups(groups, opts.local_jobs, opts.cost())
        for i, pack in enumerate(packs):
            hours = sum(g.estimate_hours(opts.cost()) for g in pack)
            ids = [g.group_id for g in pack]
            shown = ", ".join(ids[:4]) + (f", ... ({len(ids) - 4} more)" if len(ids) > 4 else "")
            console.print(f"local job {i}: {len(pack)} group(s) one after the other, about {fmt_hours(hours)} h: "
                          f"{shown}", markup=False, highlight=False)


# ---------------------------------------------------------------------------------------------------------------
# the three commands as functions (the typer commands below parse options and call these)

def _submit_and_record(manifest: Manifest, groups: Sequence[Group], opts: ExecOptions) -> dict[str, Any]:
    token = new_token()
    pairs = submit_groups(groups, opts, manifest.out, token)
    live = {}
    for group, job in pairs:
        jid = str(job.job_id)
        live[jid] = job
        log = str(job.paths.stderr) if hasattr(job, "paths") else ""
        for run in group.runs:
            manifest.record_submission(run, job_id=jid, token=token, log=log, executor=opts.executor)
    manifest.executor = opts.to_dict()
    return live


def wait_for(out: Path, run_ids: Sequence[str], live: Mapping[str, Any], console: Any,
             poll_s: float = POLL_S) -> Manifest:
    """Refresh until none of `run_ids` is pending or running, printing each change; returns the final manifest."""
    while True:
        with locked_manifest(out) as m:
            for run_id, state, err in refresh(m, live):
                line = f"{state:8s} {run_id}" + (f": {err}" if err else "")
                console.print(line, markup=False, highlight=False)
            active = [r for r in run_ids if m.rows.get(r, {}).get("state") in ACTIVE_STATES]
        if not active:
            return m
        time.sleep(poll_s)


def sweep_run(runs: Sequence[RunSpec], opts: ExecOptions, out: Path, *, dry_run: bool, wait: bool,
              console: Any) -> int:
    """Skip complete and still-active runs, group the rest, submit, record; optionally wait. Returns an exit code."""
    out = Path(out).resolve()
    if dry_run:  # states refreshed in memory only; nothing is written
        manifest = Manifest.load(out)
        refresh(manifest)
        skipped = [r for r in runs if is_complete(r)]
        check_finished_settings(skipped)
        done = {r.run_id for r in skipped}
        active = [r.run_id for r in runs
                  if r.run_id not in done and manifest.rows.get(r.run_id, {}).get("state") in ACTIVE_STATES]
        todo = [r for r in runs if r.run_id not in done and r.run_id not in active]
        render_plan(group_runs(todo), skipped, active, opts, out, console)
        return 0
    check_finished_settings([r for r in runs if is_complete(r)])
    with locked_manifest(out) as manifest:
        refresh(manifest)
        skipped, active, todo = [], [], []
        for r in runs:
            if is_complete(r):
                manifest.record_done(r)
                skipped.append(r)
            elif manifest.rows.get(r.run_id, {}).get("state") in ACTIVE_STATES:
                active.append(r.run_id)
            else:
                todo.append(r)
        groups = group_runs(todo)
        live = _submit_and_record(manifest, groups, opts) if groups else {}
    console.print(f"{len(todo)} run(s) submitted in {len(groups)} job group(s) ({opts.executor}); "
                  f"{len(skipped)} complete (skipped); {len(active)} already submitted and still active",
                  highlight=False)
    if not wait or not todo:
        if todo:
            console.print(f"follow with: zaec-sweep status --out {out}", highlight=False)
        return 0
    return _finish(out, [r.run_id for r in todo], live, console)


def _finish(out: Path, run_ids: Sequence[str], live: Mapping[str, Any], console: Any) -> int:
    m = wait_for(out, run_ids, live, console)
    render_manifest(m, console)
    failed = [r for r in run_ids if m.rows[r]["state"] == "failed"]
    if failed:
        console.print(f"{len(failed)} run(s) failed; see the error column, then: zaec-sweep retry --out {out}",
                      highlight=False)
        return 1
    return 0


def sweep_retry(out: Path, overrides: Mapping[str, Any], *, dry_run: bool, wait: bool | None, console: Any) -> int:
    """Resubmit the failed runs of the manifest (regrouped by feature cache), with the recorded executor settings
    updated by `overrides`."""
    out = Path(out).resolve()
    with locked_manifest(out, must_exist=True) as manifest:
        refresh(manifest)
        failed = [manifest.spec(k) for k, r in sorted(manifest.rows.items()) if r.get("state") == "failed"]
        opts = ExecOptions.from_dict({**manifest.executor, **overrides})
        if not failed:
            console.print("nothing to retry: no failed run in the manifest", highlight=False)
            return 0
        groups = group_runs(failed)
        if dry_run:
            render_plan(groups, [], [], opts, out, console)
            return 0
        live = _submit_and_record(manifest, groups, opts)
    console.print(f"{len(failed)} failed run(s) resubmitted in {len(groups)} job group(s) ({opts.executor})",
                  highlight=False)
    if wait is None:
        wait = opts.executor == "local"
    if not wait:
        return 0
    return _finish(out, [r.run_id for r in failed], live, console)


# ---------------------------------------------------------------------------------------------------------------
# configuration file

GRID_KEYS = ("methods", "datasets", "backbones", "seeds", "pretrained", "set", "class_names")
RUN_KEYS = ("out", "data_root", "cache_dir", "cupl_dir", "limit", "anchor", "device", "workers", "batch_size",
            "skip_data_check", "wait")
EXEC_KEYS = tuple(f.name for f in dataclasses.fields(ExecOptions))
CONFIG_KEYS = GRID_KEYS + RUN_KEYS + EXEC_KEYS


def load_config(path: Path) -> dict[str, Any]:
    """Read a TOML grid file: top-level keys named like the long options (`methods`, `datasets`, `partition`,
    `timeout_min`, ...; lists as TOML arrays or comma-separated strings)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise SweepError("reading --config needs Python >= 3.11 or `pip install tomli`") from None
    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SweepError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SweepError(f"cannot read config file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{path}: not valid TOML ({e})") from None
    unknown = sorted(set(doc) - set(CONFIG_KEYS))
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(CONFIG_KEYS)}")
    return doc


def _pick(cli: Any, cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """CLI value when given, else the config file's, else the default."""
    if cli is not None and cli != [] and cli != ():
        return cli
    return cfg.get(key, default)


def _as_tuple(value: Any) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(str(v) for v in value)


def _exec_options(cfg: Mapping[str, Any], cli: Mapping[str, Any]) -> ExecOptions:
    values = {k: _pick(cli.get(k), cfg, k) for k in EXEC_KEYS}
    values = {k: v for k, v in values.items() if v is not None}
    if "slurm_setup" in values:
        values["slurm_setup"] = _as_tuple(values["slurm_setup"])
    try:
        return ExecOptions(**values)
    except TypeError as e:
        raise SweepError(f"bad executor setting: {e}") from None


# ---------------------------------------------------------------------------------------------------------------
# typer commands

def _user_errors() -> tuple[type[BaseException], ...]:
    # ValueError covers the extractor's DatasetError, ModelError, RunError and unknown methods / config keys
    return (SweepError, ValueError, OSError)


def _fail(msg: str) -> typer.Exit:
    from rich.console import Console

    err = Console(stderr=True, emoji=False)
    err.print("[bold red]error:[/bold red]", end=" ")
    err.print(msg, markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(2)


def _console() -> Any:
    from rich.console import Console

    return Console(emoji=False)


_EXEC_HELP = "executor setting (see `zaec-sweep run --help`)"


@app.command()
def run(
    methods: Optional[str] = typer.Option(None, help="comma-separated method keys: zero-shot,tda,dpe,dlae"),
    datasets: Optional[str] = typer.Option(None, help="comma-separated dataset keys, 'all' (the 15 of the paper), "
                                                      "'imagenet_c' (its 75 keys), folder:PATH, split:FILE.json, "
                                                      "NAME=folder:PATH"),
    class_names: List[str] = typer.Option([], "--class-names", help="NAME=FILE: class names of the folder:/split: "
                                                                    "dataset NAME, one per line or a JSON list, in "
                                                                    "label order (repeatable)"),
    backbones: Optional[str] = typer.Option(
        None, help="comma-separated open_clip names (ViT-B-16,RN50), each optionally NAME=PRETRAINED; may be "
                   "omitted with --pretrained local-dir:DIR [default: ViT-B-16]"),
    seeds: Optional[str] = typer.Option(None, help="comma-separated seeds [default: 1]"),
    pretrained: Optional[str] = typer.Option(None, help="weights of every backbone: tag, file, or local-dir:DIR "
                                                        "[default: openai]"),
    set_: List[str] = typer.Option([], "--set", help="config override: key=value (all methods) or "
                                                     "method.key=value (repeatable)"),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML file with the same keys as the options; "
                                                                 "options given here override it"),
    out: Optional[Path] = typer.Option(None, help="shard root [default: data/shards]; the manifest goes to "
                                                  "OUT/_sweep/"),
    data_root: Optional[Path] = typer.Option(None, help="datasets folder [default: $ZAEC_DATA_ROOT, else ./data]"),
    cache_dir: Optional[Path] = typer.Option(None, help="feature cache [default: $ZAEC_CACHE_DIR, else "
                                                        "data/cache]; must be visible to every job"),
    cupl_dir: Optional[Path] = typer.Option(None, help="CuPL prompt files [default: $ZAEC_CUPL_DIR]"),
    limit: Optional[int] = typer.Option(None, help="only the first N samples of each stream (quick looks)"),
    anchor: Optional[str] = typer.Option(None, help="zero-shot anchor: single or method [default: single]"),
    device: Optional[str] = typer.Option(None, help="torch device inside each job [default: cuda if available]"),
    workers: Optional[int] = typer.Option(None, help="image-loading processes per job [default: 8 on CUDA]"),
    batch_size: Optional[int] = typer.Option(None, help="images per encoder call [default: 256]"),
    executor: Optional[str] = typer.Option(None, help="local (this machine) or slurm [default: local]"),
    partition: Optional[str] = typer.Option(None, help="SLURM partition"),
    account: Optional[str] = typer.Option(None, help="SLURM account"),
    qos: Optional[str] = typer.Option(None, help="SLURM quality of service"),
    constraint: Optional[str] = typer.Option(None, help="SLURM node constraint"),
    gpus_per_job: Optional[int] = typer.Option(None, help="GPUs per job [default: 1]"),
    cpus_per_job: Optional[int] = typer.Option(None, help="CPUs per SLURM job [default: 10]"),
    mem_gb: Optional[float] = typer.Option(None, help="memory per SLURM job in GB"),
    timeout_min: Optional[int] = typer.Option(None, help="time limit per job in minutes [default: SLURM twice the "
                                                         "longest group's estimate; local 30 days]"),
    array_parallelism: Optional[int] = typer.Option(None, help="SLURM array tasks running at once [default: 256]"),
    slurm_setup: List[str] = typer.Option([], "--slurm-setup", help="shell line run before each SLURM job, e.g. "
                                                                    "'source .venv/bin/activate' (repeatable)"),
    local_jobs: Optional[int] = typer.Option(None, help="local processes side by side [default: 1]"),
    rates: Optional[Path] = typer.Option(None, "--rates", help="JSON of `python -m extract.bench_gpu --json` (make "
                                                               "bench-gpu): price the plan with its measured rates"),
    wait: Optional[bool] = typer.Option(None, "--wait/--no-wait", help="wait for the jobs and show the result "
                                                                       "[default: wait with local, not with slurm]"),
    skip_data_check: bool = typer.Option(False, "--skip-data-check",
                                         help="do not list the datasets before submitting"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan (runs, groups, GPU-hours); submit nothing"),
) -> None:
    """Run a grid (the default command: `zaec-sweep --methods ...` is `zaec-sweep run --methods ...`)."""
    console = _console()
    try:
        cfg = load_config(config) if config is not None else {}
        grid = Grid(
            methods=split_list(_pick(methods, cfg, "methods"), "--methods"),
            datasets=split_list(_pick(datasets, cfg, "datasets"), "--datasets"),
            backbones=split_list(_pick(backbones, cfg, "backbones"), "--backbones"),
            seeds=parse_seeds(_pick(seeds, cfg, "seeds", "1")),
            pretrained=str(_pick(pretrained, cfg, "pretrained", "openai")),
            overrides=_as_tuple(_pick(set_, cfg, "set", ())),
            class_names=tuple(class_names_files(_pick(class_names, cfg, "class_names")).items()),
        )
        if not grid.backbones and not grid.pretrained.startswith("local-dir:"):
            grid = dataclasses.replace(grid, backbones=("ViT-B-16",))
        out_dir = Path(_pick(out, cfg, "out", DEFAULT_OUT))
        root = _pick(data_root, cfg, "data_root") or os.environ.get("ZAEC_DATA_ROOT") or "data"
        cache = _pick(cache_dir, cfg, "cache_dir") or os.environ.get("ZAEC_CACHE_DIR") or Path("data") / "cache"
        cupl = _pick(cupl_dir, cfg, "cupl_dir") or os.environ.get("ZAEC_CUPL_DIR")
        opts = _exec_options(cfg, {
            "executor": executor, "partition": partition, "account": account, "qos": qos, "constraint": constraint,
            "gpus_per_job": gpus_per_job, "cpus_per_job": cpus_per_job, "mem_gb": mem_gb,
            "timeout_min": timeout_min, "array_parallelism": array_parallelism, "slurm_setup": slurm_setup,
            "local_jobs": local_jobs, "rates": str(rates) if rates is not None else None})
        runs = expand_grid(grid, out=out_dir, data_root=root, cache_dir=cache, cupl_dir=cupl,
                           limit=_pick(limit, cfg, "limit"), anchor=str(_pick(anchor, cfg, "anchor", "single")),
                           device=_pick(device, cfg, "device"), workers=_pick(workers, cfg, "workers"),
                           batch_size=int(_pick(batch_size, cfg, "batch_size", 256)))
        if not dry_run and not (skip_data_check or cfg.get("skip_data_check", False)):
            check_data([r for r in runs if not is_complete(r)])
        do_wait = _pick(wait, cfg, "wait")
        if do_wait is None:
            do_wait = opts.executor == "local"
        code = sweep_run(runs, opts, out_dir, dry_run=dry_run, wait=bool(do_wait), console=console)
    except _user_errors() as e:
        raise _fail(str(e))
    except KeyboardInterrupt:
        console.print("interrupted: the manifest keeps the submitted runs; `zaec-sweep status` shows what "
                      "finished, the same command or `zaec-sweep retry` resumes the rest", highlight=False)
        raise typer.Exit(130)
    raise typer.Exit(code)


@app.command()
def status(
    out: Path = typer.Option(DEFAULT_OUT, help="the sweep's shard root"),
    state: Optional[str] = typer.Option(None, help="show only runs in this state: pending, running, done, failed"),
) -> None:
    """Show the manifest as a table; states are refreshed from the jobs and the shards on disk."""
    from extract.sweep.plan import STATES

    console = _console()
    try:
        if state is not None and state not in STATES:
            raise SweepError(f"unknown state {state!r}; available: {', '.join(STATES)}")
        with locked_manifest(Path(out).resolve(), must_exist=True) as m:
            refresh(m)
    except _user_errors() as e:
        raise _fail(str(e))
    render_manifest(m, console, only=state)


@app.command()
def retry(
    out: Path = typer.Option(DEFAULT_OUT, help="the sweep's shard root"),
    executor: Optional[str] = typer.Option(None, help=_EXEC_HELP),
    partition: Optional[str] = typer.Option(None, help=_EXEC_HELP),
    account: Optional[str] = typer.Option(None, help=_EXEC_HELP),
    qos: Optional[str] = typer.Option(None, help=_EXEC_HELP),
    constraint: Optional[str] = typer.Option(None, help=_EXEC_HELP),
    gpus_per_job: Optional[int] = typer.Option(None, help=_EXEC_HELP),
    cpus_per_job: Optional[int] = typer.Option(None, help=_EXEC_HELP),
    mem_gb: Optional[float] = typer.Option(None, help=_EXEC_HELP),
    timeout_min: Optional[int] = typer.Option(None, help=_EXEC_HELP),
    array_parallelism: Optional[int] = typer.Option(None, help=_EXEC_HELP),
    local_jobs: Optional[int] = typer.Option(None, help=_EXEC_HELP),
    wait: Optional[bool] = typer.Option(None, "--wait/--no-wait", help="wait for the jobs [default: local only]"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print what would be resubmitted"),
) -> None:
    """Resubmit only the failed runs (they resume from their valid shards), with the sweep's executor settings
    updated by the options given here."""
    console = _console()
    overrides = {k: v for k, v in {
        "executor": executor, "partition": partition, "account": account, "qos": qos, "constraint": constraint,
        "gpus_per_job": gpus_per_job, "cpus_per_job": cpus_per_job, "mem_gb": mem_gb, "timeout_min": timeout_min,
        "array_parallelism": array_parallelism, "local_jobs": local_jobs}.items() if v is not None}
    try:
        code = sweep_retry(Path(out), overrides, dry_run=dry_run, wait=wait, console=console)
    except _user_errors() as e:
        raise _fail(str(e))
    raise typer.Exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point; `run` is the default command."""
    args = list(argv if argv is not None else sys.argv[1:])
    if args and args[0] not in COMMANDS and args[0] not in ("--help", "-h"):
        args.insert(0, "run")
    app(args=args, prog_name="zaec-sweep")


if __name__ == "__main__":
    main()
