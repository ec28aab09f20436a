"""`zaec-sweep --executor slurm` against a real single-node SLURM cluster (tools/slurm_local.sh: Debian's slurm-wlm,
munge, and for the accounting tests slurmdbd with a private MariaDB), with the tiny model on tiny sets.

The cluster is brought up once per session (accounting tests first, then the same cluster restarted without
accounting) and brought down at the end when this session started it. Where it cannot be brought up (not Linux,
not root, packages missing: `make test` installs them as root, or `tools/slurm_local.sh install`) the tests skip
with the script's one line. Every wait is bounded and fails with what was last seen.

Scenarios run side by side where they are independent (the cluster offers more CPUs than the machine has: jobs
mostly wait on imports and locks); only the time-limit test waits out SLURM's one-minute granularity.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from extract.sweep import cli as sweep
from extract.sweep.manifest import Manifest, sweep_dir
from schemas.shard import read_shard
from tests.support.extract import make_json_dataset

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "slurm_local.sh"
#: the cluster's CPUs: more than the machine's so independent scenarios' jobs run side by side
CLUSTER_CPUS = 8
#: seconds SLURM keeps an ended job in squeue: short, so "gone from the queue" comes quickly, but long enough that
#: status still sees the cancelled tasks in squeue after the slowest run of a test reached its kill (with 5 s, a
#: loaded machine let a cancelled task leave the queue first: rightly `lost` without accounting, not what the
#: test looks at there)
MIN_JOB_AGE_S = 30
#: bound of every wait for a job to reach a state (jobs start Python with torch on a loaded 2-core machine)
WAIT_S = 240
runner = CliRunner()


# ---------------------------------------------------------------------------------------------------------------
# the cluster

class Cluster:
    """tools/slurm_local.sh driven from the tests: `up(accounting)` (skips with the script's line when it cannot)."""

    def __init__(self, state_dir: Path) -> None:
        self.env = {**os.environ, "ZAEC_SLURM_DIR": str(state_dir), "ZAEC_SLURM_NO_INSTALL": "1"}
        self.conf = state_dir / "etc" / "slurm.conf"
        self.started = False
        self.accounting: bool | None = None

    def up(self, accounting: bool) -> None:
        if platform.system() != "Linux":
            pytest.skip(f"SLURM tests need Linux (this is {platform.system()})")
        if os.geteuid() != 0:
            pytest.skip("SLURM tests need root (tools/slurm_local.sh starts SLURM's daemons)")
        if self.accounting is not None and self.accounting == accounting:
            return
        was_up = subprocess.run(["bash", str(SCRIPT), "status"], env=self.env, capture_output=True).returncode == 0
        args = ["bash", str(SCRIPT), "up", "--cpus", str(CLUSTER_CPUS), "--min-job-age", str(MIN_JOB_AGE_S)]
        args.append("--accounting" if accounting else "--no-accounting")
        p = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=300)
        line = (p.stderr.strip().splitlines() or [""])[-1]
        if p.returncode == 3:
            pytest.skip(line)
        assert p.returncode == 0, f"tools/slurm_local.sh up failed: {p.stderr.strip()}"
        self.started = self.started or not was_up
        self.accounting = accounting
        os.environ["SLURM_CONF"] = str(self.conf)  # sbatch, squeue, sacct of this process and of the jobs

    def down(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "down"], env=self.env, capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def cluster():
    state_dir = Path(os.environ.get("ZAEC_SLURM_DIR", "/tmp/zaec-slurm"))
    c = Cluster(state_dir)
    old = os.environ.get("SLURM_CONF")
    yield c
    if c.started:
        c.down()
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old


@pytest.fixture
def with_accounting(cluster):
    cluster.up(accounting=True)
    return cluster


@pytest.fixture
def without_accounting(cluster):
    cluster.up(accounting=False)
    return cluster


# ---------------------------------------------------------------------------------------------------------------
# data and sweep invocations

#: the grid's sets, and a slower set (TPT, 64 views) for the runs killed mid-run
GRID_SETS = ("dtd", "eurosat")
SLOW_SET = "oxford_pets"


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-data")
    make_json_dataset(root, "dtd", n_classes=3, per_class=2, seed=0)  # 6 images
    make_json_dataset(root, "eurosat", n_classes=3, per_class=3, seed=1)  # 9 images
    # 40 images, 20 parts of 2: a run is suspended well before its last part, however fast the machine adapts
    make_json_dataset(root, SLOW_SET, n_classes=4, per_class=10, seed=2)
    return root


def _run_args(model_dir, data_root, out, cache, methods, datasets, *extra):
    return ["run", "--methods", methods, "--datasets", datasets, "--pretrained", f"local-dir:{model_dir}",
            "--data-root", str(data_root), "--out", str(out), "--cache-dir", str(cache), "--device", "cpu",
            "--workers", "0", "--adapt-batch", "1", "--part-size", "2", *extra]


SLURM_OPTS = ("--executor", "slurm", "--gpus-per-job", "0", "--cpus-per-job", "1", "--timeout-min", "10",
              "--no-wait")


def _cli(*args):
    res = runner.invoke(sweep.app, list(args))
    return res


def _sweep_subprocess(*args, timeout=120):
    """zaec-sweep as its console script runs it (every line it prints, submitit's logger included)."""
    return subprocess.run([sys.executable, "-m", "extract.sweep", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _rows(out: Path) -> dict[str, dict]:
    return dict(Manifest.load(out).rows)


def _status(out: Path) -> dict[str, dict]:
    res = _cli("status", "--out", str(out))
    assert res.exit_code == 0, res.output + res.stderr
    return _rows(out)


def _wait(what: str, probe, timeout: float = WAIT_S, every: float = 1.0):
    """Call `probe()` until it returns something truthy; fail naming `what` and the last answer after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last and last[0]:
            return last
        time.sleep(every)
    pytest.fail(f"{what}: not within {timeout:.0f} s; last seen: {last}")


def _squeue(job_ids) -> dict[str, str]:
    bases = sorted({j.split("_")[0] for j in job_ids})
    p = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T", "-j", ",".join(bases)],
                       capture_output=True, text=True, timeout=60)
    return dict(ln.split("|", 1) for ln in p.stdout.split() if "|" in ln)


def _squeue_all() -> dict[str, str]:
    p = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T"], capture_output=True, text=True, timeout=60)
    return dict(ln.split("|", 1) for ln in p.stdout.split() if "|" in ln)


def _all_settled(out: Path):
    rows = _status(out)
    states = {k: r["state"] for k, r in rows.items()}
    return (all(s not in ("pending", "running") for s in states.values()), states)


def _table(shard_dir: str):
    """A run's shards, every column, concatenated in part order (each part validated by the schema first)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = sorted(Path(shard_dir).glob("part-*.parquet"))
    assert parts, f"no shard in {shard_dir}"
    for p in parts:
        read_shard(p)
    return pa.concat_tables([pq.read_table(p) for p in parts])


def _assert_same_shards(a_dir: str, b_dir: str) -> None:
    """Column by column, bit for bit: same code, same machine, same thread count."""
    a, b = _table(a_dir), _table(b_dir)
    assert a.column_names == b.column_names and a.num_rows == b.num_rows > 0
    for name in a.column_names:
        assert a.column(name).equals(b.column(name)), f"column {name} differs: {a_dir} vs {b_dir}"


# ---------------------------------------------------------------------------------------------------------------
# the uninterrupted reference: the same runs through the local executor, started once, running alongside

REF_GRID = ("zero-shot,tda,dpe", ",".join(GRID_SETS))
REF_SLOW = ("tpt", SLOW_SET, "1,2,3,4")


@pytest.fixture(scope="module")
def reference(tiny_model_dir, data_root, tmp_path_factory):
    """A getter of the local executor's shard folders by run id, waiting until the runs asked for are done."""
    out = tmp_path_factory.mktemp("slurm-reference")
    for methods, sets, *seeds in (REF_GRID, REF_SLOW):
        extra = ("--seeds", seeds[0]) if seeds else ()
        res = _cli(*_run_args(tiny_model_dir, data_root, out, out / "cache", methods, sets, *extra,
                              "--executor", "local", "--no-wait"))
        assert res.exit_code == 0, res.output + res.stderr

    def shard_dirs(run_ids) -> dict[str, str]:
        def settled():
            rows = _status(out)
            return (all(rows[k]["state"] not in ("pending", "running") for k in run_ids),
                    {k: rows[k]["state"] for k in run_ids})

        _, states = _wait("the local executor's reference runs", settled)
        assert set(states.values()) == {"done"}, states
        return {k: r["shard_dir"] for k, r in _rows(out).items()}

    return shard_dirs


def _script(output: str) -> str:
    """The sbatch script of a `--dry-run` plan (from its `#!/bin/bash` to the end)."""
    return output[output.index("#!/bin/bash"):].strip()


def _started(out: Path) -> dict[str, int]:
    """How often each run started, from every job log of the sweep ("[run id] start ...")."""
    counts: dict[str, int] = {}
    for log in (sweep_dir(out) / "submitit").glob("*_log.out"):
        for m in re.finditer(r"^\[(.+?)\] start ", log.read_text(errors="replace"), re.M):
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


ORDER = {"pending": 0, "running": 1, "done": 2}


def test_grid_array_follows_the_queue_and_equals_the_local_executor(with_accounting, tiny_model_dir, data_root,
                                                                     tmp_path, reference):
    out, cache = tmp_path / "out", tmp_path / "cache"
    # one task at a time: the second waits in the queue (PENDING, JobArrayTaskLimit) while the first runs
    grid_a = _run_args(tiny_model_dir, data_root, out, cache, "zero-shot,tda", ",".join(GRID_SETS), *SLURM_OPTS,
                       "--array-parallelism", "1")
    preview = _cli(*grid_a, "--dry-run")
    assert preview.exit_code == 0, preview.output + preview.stderr
    res = _cli(*grid_a)
    assert res.exit_code == 0, res.output + res.stderr
    rows = _rows(out)
    jobs = {r["job_id"] for r in rows.values()}
    base = {j.split("_")[0] for j in jobs}
    assert len(rows) == 4 and len(jobs) == 2 and len(base) == 1, rows  # one array of two tasks
    (base,) = base

    # the --dry-run preview is the script sbatch got, and SLURM holds the job to its lines
    batch = subprocess.run(["scontrol", "write", "batch_script", base, "-"], capture_output=True, text=True)
    assert batch.returncode == 0, batch.stderr
    assert batch.stdout.strip() == _script(preview.output)
    show = subprocess.run(["scontrol", "show", "job", f"{base}_0"], capture_output=True, text=True).stdout
    for field in ("TimeLimit=00:10:00", "Partition=debug", "JobName=zaec-sweep", "MinCPUsNode=1"):
        assert field in show, (field, show)
    assert f"StdErr={sweep_dir(out.resolve()) / 'submitit'}/{base}_0_0_log.err" in show, show

    # a second grid overlapping the first in TDA submits only DPE; TDA keeps the first grid's job
    grid_b = _run_args(tiny_model_dir, data_root, out, cache, "tda,dpe", ",".join(GRID_SETS), *SLURM_OPTS)
    res_b = _cli(*grid_b)
    assert res_b.exit_code == 0, res_b.output + res_b.stderr
    assert "2 run(s) submitted in 2 job group(s) (slurm); 0 complete (skipped); 2 already submitted and still " \
           "active" in " ".join(res_b.output.split())
    rows_b = _rows(out)
    assert {k: rows_b[k]["job_id"] for k in rows if "/tda/" in k} == {k: rows[k]["job_id"] for k in rows
                                                                     if "/tda/" in k}

    # follow with `status`: each run moves forward only, as the queue says
    seen: dict[str, list[str]] = {}
    pairs = set()

    def settled():
        ok, states = _all_settled(out)
        queue = _squeue(r["job_id"] for r in _rows(out).values())
        for run_id, state in states.items():
            if not seen.get(run_id) or seen[run_id][-1] != state:
                seen.setdefault(run_id, []).append(state)
            pairs.add((state, queue.get(_rows(out)[run_id]["job_id"], "GONE")))
        return (ok, states)

    _wait("every run of both grids done", settled, every=0.5)
    assert set(s[-1] for s in seen.values()) == {"done"}, seen
    for run_id, states in seen.items():
        assert [ORDER[s] for s in states] == sorted(ORDER[s] for s in states), (run_id, states)
    # the queue's PENDING, RUNNING and COMPLETED were each seen, and the runs' states agreed with them
    assert {"PENDING", "RUNNING", "COMPLETED"} <= {q for _, q in pairs}, pairs
    for state, queued in pairs:
        assert queued != "PENDING" or state == "pending", pairs
        assert queued != "RUNNING" or state in ("pending", "running", "done"), pairs
        assert queued != "COMPLETED" or state == "done", pairs
        assert state != "running" or queued in ("RUNNING", "COMPLETING", "COMPLETED"), pairs

    def accounted():  # the jobs end a moment after their runs (Python exits, the step ends); then sacct says so
        acct = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", base], capture_output=True,
                              text=True, timeout=60)
        done = sorted(acct.stdout.split()) == [f"{base}_0|COMPLETED", f"{base}_1|COMPLETED"]
        return (done, acct.stdout + acct.stderr)

    _wait("sacct reporting the array COMPLETED", accounted, timeout=60)

    # no run started twice; every shard equals the local executor's, column by column
    assert _started(out) == {k: 1 for k in _rows(out)}
    ref = reference(list(_rows(out)))
    for run_id, row in _rows(out).items():
        _assert_same_shards(row["shard_dir"], ref[run_id])

    # the finished grid submitted again submits nothing
    pickles = sorted(p.name for p in (sweep_dir(out) / "submitit").glob("*.pkl"))
    again = _cli(*grid_a)
    assert again.exit_code == 0 and "0 run(s) submitted" in " ".join(again.output.split()), again.output
    assert sorted(p.name for p in (sweep_dir(out) / "submitit").glob("*.pkl")) == pickles


# ---------------------------------------------------------------------------------------------------------------
# tasks killed mid-run: named as they ended once SLURM dropped them, resubmitted by `retry`, resumed

def _by_seed(out: Path) -> dict[int, dict]:
    return {int(r["seed"]): r for r in _rows(out).values()}


def _parts(shard_dir: str) -> dict[str, tuple[int, int]]:
    """The run's finished parts: name -> (inode, mtime in ns); a part being written has a temporary name."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in Path(shard_dir).glob("part-*.parquet")}


def _job_python(job_id: str) -> int:
    """The pid of the Python process running job or array task `job_id` (its environment names it)."""
    array, _, task = job_id.partition("_")
    want = ({f"SLURM_ARRAY_JOB_ID={array}".encode(), f"SLURM_ARRAY_TASK_ID={task}".encode()} if task
            else {f"SLURM_JOB_ID={job_id}".encode()})
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
            env = set((proc / "environ").read_bytes().split(b"\0"))
            ppid = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        argv = cmd.split(b"\0")
        # argv[0] is Python itself: srun's own command line names the same Python and module, and killing srun
        # instead leaves the step running to its end
        if b"python" in Path(os.fsdecode(argv[0])).name.encode() and b"submitit.core._submit" in argv and want <= env:
            parents[int(proc.name)] = ppid
    # loader processes forked from the run share its command line and environment: the run is the one whose parent
    # is not one of them
    top = [pid for pid, ppid in parents.items() if ppid not in parents]
    if len(top) != 1:
        pytest.fail(f"expected one Python process of array task {job_id}, found {sorted(top)} (of {parents})")
    return top[0]


def _kill(kind: str, job_id: str) -> None:
    """Kill a suspended task: `scancel` (SIGTERM, which submitit ignores, then SIGKILL after KillWait), `scancel
    --signal=KILL`, or "oom": SIGKILL to its Python process the moment it runs again (the kernel's OOM killer, a
    crash: SLURM sees only its step fail)."""
    if kind == "term":
        subprocess.run(["scancel", job_id], check=True, timeout=60)
    elif kind == "kill":
        subprocess.run(["scancel", "--signal=KILL", job_id], check=True, timeout=60)
    else:
        pid = _job_python(job_id)
        subprocess.run(["scontrol", "resume", job_id], check=True, timeout=60)
        os.kill(pid, signal.SIGKILL)


def _kill_mid_run(kinds: dict[Path, dict[int, str]]) -> dict[Path, dict[int, dict[str, tuple[int, int]]]]:
    """As soon as a run (sweep folder, seed) has a finished part, suspend its task (SIGSTOP: mid-run whatever the
    machine's speed), note its parts and kill it as `kinds` says; returns the parts each run had."""
    rows = {out: _by_seed(out) for out in kinds}
    todo = {(out, seed): kind for out, seeds in kinds.items() for seed, kind in seeds.items()}
    before: dict[Path, dict[int, dict[str, tuple[int, int]]]] = {out: {} for out in kinds}

    def probe():
        ready = [k for k in todo if _parts(rows[k[0]][k[1]]["shard_dir"])]
        for out, seed in ready:  # every run seen with a part is suspended before any is killed (a kill takes long
            # enough, a /proc scan and scontrol calls, for another run of this small set to finish meanwhile)
            subprocess.run(["scontrol", "suspend", rows[out][seed]["job_id"]], check=True, timeout=60)
        for out, seed in ready:
            job_id, shard_dir = rows[out][seed]["job_id"], rows[out][seed]["shard_dir"]
            assert not (Path(shard_dir) / "_zaec_complete.json").exists(), f"{shard_dir} finished before its kill"
            before[out][seed] = _parts(shard_dir)
            _kill(todo.pop((out, seed)), job_id)
        return (not todo, sorted(f"{o.name}/seed={s}" for o, s in todo))

    _wait("a first part of each run to kill", probe, every=0.1)
    return before


def _wait_gone(job_ids) -> None:
    _wait("SLURM dropping the killed jobs from squeue", lambda: (not _squeue(job_ids), _squeue(job_ids)),
          timeout=120)


def _retry(out: Path, n: int) -> None:
    res = _cli("retry", "--out", str(out))
    assert res.exit_code == 0, res.output + res.stderr
    assert f"{n} failed or lost run(s) resubmitted" in " ".join(res.output.split()), res.output


def _resumed(out: Path, before, reference) -> None:
    """The retried runs finished, kept the parts they had before their kill, and equal the uninterrupted runs."""
    _, states = _wait(f"the retried runs of {out.name}", lambda: _all_settled(out))
    assert set(states.values()) == {"done"}, _rows(out)
    ref = reference([r["run_id"] for r in _rows(out).values()])
    for seed, parts in before.items():
        row = _by_seed(out)[seed]
        assert row["attempts"] == 2
        now = _parts(row["shard_dir"])
        assert {k: now[k] for k in parts} == parts  # resume kept every part finished before the kill
        _assert_same_shards(row["shard_dir"], ref[row["run_id"]])


#: the state sacct or squeue gave, with slurmstepd's line from the job's log when it wrote one (it may not for a
#: task cancelled while suspended)
CANCELLED = r"job \d+_\d+ ended as CANCELLED( \(\*\*\* JOB \d+ ON \S+ CANCELLED AT \S+ \*\*\*\))?$"


def test_cancelled_tasks_with_accounting_are_named_by_sacct_and_resumed(with_accounting, tiny_model_dir, data_root,
                                                                        tmp_path, reference):
    out = tmp_path / "out"
    res = _cli(*_run_args(tiny_model_dir, data_root, out, tmp_path / "cache", "tpt", SLOW_SET, "--seeds", "1,2",
                          *SLURM_OPTS))
    assert res.exit_code == 0, res.output + res.stderr
    before = _kill_mid_run({out: {1: "term", 2: "kill"}})[out]
    _wait_gone([r["job_id"] for r in _rows(out).values()])
    _status(out)  # the first look after SLURM dropped them: sacct names the end
    rows = _by_seed(out)
    for seed in (1, 2):
        assert rows[seed]["state"] == "failed" and re.match(CANCELLED, rows[seed]["error"]), rows[seed]
    _retry(out, 2)
    _resumed(out, before, reference)


def test_killed_tasks_without_accounting_are_named_by_their_logs_or_lost(without_accounting, tiny_model_dir,
                                                                         data_root, tmp_path, reference):
    from extract.run.rundir import RunDir
    from extract.sweep.grid import Grid, expand_grid

    cache = tmp_path / "cache"
    # seed 4 waits for a run another process holds (a lock, as a second writer would) until its 1-minute limit
    out_t = tmp_path / "timeout"
    (held,) = expand_grid(Grid(("tpt",), (SLOW_SET,), (), (4,), pretrained=f"local-dir:{tiny_model_dir}"),
                          out=out_t, data_root=data_root)
    lock = RunDir(out_t, held.key).lock()
    lock.__enter__()
    try:
        opts = [o if o != "10" else "1" for o in SLURM_OPTS]  # --timeout-min 1
        res = _cli(*_run_args(tiny_model_dir, data_root, out_t, cache, "tpt", SLOW_SET, "--seeds", "4", *opts))
        assert res.exit_code == 0, res.output + res.stderr
        t_submitted = time.monotonic()

        # seeds 1 and 2 cancelled; seed 3 (its own sweep: looked at only once SLURM dropped it) SIGKILLed
        out, out_l = tmp_path / "out", tmp_path / "lost"
        for o, seeds in ((out, "1,2"), (out_l, "3")):
            res = _cli(*_run_args(tiny_model_dir, data_root, o, cache, "tpt", SLOW_SET, "--seeds", seeds, *SLURM_OPTS))
            assert res.exit_code == 0, res.output + res.stderr
        killed = _kill_mid_run({out: {1: "term", 2: "kill"}, out_l: {3: "oom"}})
        before, before_l = killed[out], killed[out_l]

        # while squeue lists the cancelled tasks (MinJobAge), status names them from it
        def cancelled():
            rows = _by_seed(out) if _status(out) else {}
            return (all(rows[s]["state"] == "failed" for s in (1, 2)), rows)

        _, rows = _wait("status naming the cancelled tasks", cancelled, timeout=60, every=0.2)
        for seed in (1, 2):
            assert re.match(CANCELLED, rows[seed]["error"]), rows[seed]

        # the first look once SLURM dropped the killed process's task (the console script: every line it prints):
        # nothing names its end, it is lost; one plain note on accounting, none of submitit's sacct warnings
        _wait_gone([r["job_id"] for r in _rows(out_l).values()])
        p = _sweep_subprocess("status", "--out", str(out_l))
        assert p.returncode == 0, p.stderr
        assert (p.stdout + p.stderr).count("SLURM accounting is unavailable here") == 1, p.stdout + p.stderr
        assert "Bypassing" not in p.stdout + p.stderr
        row = _by_seed(out_l)[3]
        assert row["state"] == "lost" and "left the queue without a result" in row["error"], row
        _retry(out, 2)
        _retry(out_l, 1)

        job_t = _by_seed(out_t)[4]["job_id"]
        _wait("seed 4 ended by its 1-minute limit and dropped from squeue",
              lambda: (not _squeue([job_t]), _squeue([job_t]), f"{time.monotonic() - t_submitted:.0f} s"),
              timeout=180)
    finally:
        lock.__exit__(None, None, None)
    _status(out_t)
    row = _by_seed(out_t)[4]
    assert row["state"] == "failed" and re.match(
        r"job \d+(_\d+)? ended as TIMEOUT \(its log: \*\*\* JOB \d+ ON \S+ CANCELLED AT \S+ DUE TO TIME LIMIT "
        r"\*\*\*\)$", row["error"]), row
    _retry(out_t, 1)
    for o, parts in ((out, before), (out_l, before_l), (out_t, {4: {}})):
        _resumed(o, parts, reference)


# ---------------------------------------------------------------------------------------------------------------
# submissions SLURM refuses, or that could not work: one line, exit 2, the manifest says what was not submitted

@pytest.mark.parametrize("extra, answer", [
    (("--partition", "nope"), "invalid partition specified: nope"),
    (("--mem-gb", "100000"), "Memory specification can not be satisfied"),
    (("--slurm-setup", "source /no/such/venv/bin/activate"),
     "--slurm-setup line 'source /no/such/venv/bin/activate': /no/such/venv/bin/activate does not exist on this "
     "machine"),
])
def test_a_refused_submission_is_one_line_and_recorded(without_accounting, tiny_model_dir, data_root, tmp_path,
                                                       extra, answer):
    out = tmp_path / "out"
    queued = set(_squeue_all())
    p = _sweep_subprocess(*_run_args(tiny_model_dir, data_root, out, tmp_path / "cache", "zero-shot,tda", "dtd",
                                     *SLURM_OPTS, *extra))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stdout + p.stderr
    assert lines[0].startswith("zaec-sweep: error: ") and answer in lines[0] and "Traceback" not in p.stdout
    assert "2 run(s) not submitted, recorded as failed" in lines[0]
    rows = _rows(out)
    assert len(rows) == 2
    for r in rows.values():
        assert r["state"] == "failed" and r["job_id"] == "" and r["error"].startswith("not submitted: ")
        assert answer in r["error"]
    # nothing ran (a request no node can satisfy leaves a FAILED record in the controller)
    new = {j: st for j, st in _squeue_all().items() if j not in queued}
    assert set(new.values()) <= {"FAILED"}, new
    # `retry` would resubmit exactly those (here: only its plan); a setup line that still sources a missing file is
    # refused by retry's plan too, with the same line, as its submission would refuse it
    plan = _cli("retry", "--out", str(out), "--dry-run")
    if "--slurm-setup" in extra:
        assert plan.exit_code == 2 and answer in " ".join(plan.output.split()), plan.output
    else:
        assert plan.exit_code == 0 and "2 run(s) to submit in 1 group(s)" in " ".join(plan.output.split()), \
            plan.output
