"""The run folder's lock (`extract.run.lock`, `RunDir.lock`): one owner at a time, released by a killed holder,
working without flock, taking over stale owner files; and two real `zaec-extract` processes on one `--out`."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from extract.run import lock as run_lock
from extract.run.lock import OWNER_FILE, RunLock
from extract.run.options import RunError
from extract.run.rundir import RunDir
from schemas.shard import RunKey

from tests.support.extract import make_json_dataset, make_tiny_model_dir

ROOT = Path(__file__).resolve().parents[3]
KEY = RunKey("tiny-clip", "dtd", "tda", 1)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")


def test_second_owner_stops_naming_the_first_and_gets_it_after_release(tmp_path):
    run_dir = RunDir(tmp_path / "out", KEY)
    first = run_dir.lock(wait=0)
    first.acquire()
    with pytest.raises(RunError) as e:
        run_dir.lock(wait=0).acquire()
    msg = str(e.value)
    assert f"process {os.getpid()} on host {socket.gethostname()}" in msg and "--wait-lock" in msg
    assert "\n" not in msg
    first.release()
    with run_dir.lock(wait=0):
        assert (run_dir.path / OWNER_FILE).is_file()
    # the folders the lock created are gone again: nothing was written
    assert not (tmp_path / "out").exists()


def test_waits_then_stops_after_the_limit_with_one_message(tmp_path):
    run_dir = RunDir(tmp_path / "out", KEY)
    lines: list[str] = []
    with run_dir.lock(wait=0):
        t0 = time.monotonic()
        with pytest.raises(RunError, match="after waiting"):
            run_dir.lock(wait=1.0, on_wait=lines.append).acquire()
        assert time.monotonic() - t0 >= 1.0
    assert len(lines) == 1 and "waiting up to 1 s" in lines[0]


def test_killed_holder_does_not_keep_the_run(tmp_path):
    """kill -9 leaves the owner file behind; the kernel has dropped the flock and the pid is gone: taken over."""
    folder = tmp_path / "run"
    code = ("import sys, time; from pathlib import Path; from extract.run.lock import RunLock; "
            f"RunLock(Path({str(folder)!r}), wait=0).acquire(); print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(RunError, match=f"process {p.pid} "):
            RunLock(folder, wait=0).acquire()
    finally:
        p.kill()
        p.wait()
    assert json.loads((folder / OWNER_FILE).read_text())["pid"] == p.pid  # left behind by the killed process
    with RunLock(folder, wait=0) as lock:
        assert json.loads((folder / OWNER_FILE).read_text())["token"] == lock.token


def test_owner_file_alone_locks_where_flock_is_not_supported(tmp_path, monkeypatch):
    """A file system that refuses flock (Lustre without -o flock): the owner file still excludes a second owner."""
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    folder = tmp_path / "run"
    with RunLock(folder, wait=0):
        with pytest.raises(RunError, match="in use by process"):
            RunLock(folder, wait=0).acquire()
    with RunLock(folder, wait=0):
        pass


def _foreign_owner(folder: Path, age: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    owner = folder / OWNER_FILE
    owner.write_text(json.dumps({"host": "another-node", "pid": 1, "token": "x", "started": "then"}))
    t = time.time() - age
    os.utime(owner, (t, t))


def test_owner_file_of_another_host_held_while_its_heartbeat_is_fresh(tmp_path):
    """flock not honoured across machines (NFS mounted with nolock): another host's fresh owner file holds."""
    _foreign_owner(tmp_path / "run", age=5)
    with pytest.raises(RunError, match="process 1 on host another-node"):
        RunLock(tmp_path / "run", wait=0).acquire()


def test_stale_owner_file_of_another_host_is_taken_over(tmp_path):
    _foreign_owner(tmp_path / "run", age=run_lock.STALE_AFTER_S + 30)
    with RunLock(tmp_path / "run", wait=0) as lock:
        assert json.loads((tmp_path / "run" / OWNER_FILE).read_text())["token"] == lock.token
    assert not (tmp_path / "run" / OWNER_FILE).exists()


def test_heartbeat_keeps_the_owner_file_fresh_and_notices_a_take_over(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    folder = tmp_path / "run"
    with RunLock(folder, wait=0) as lock:
        old = time.time() - 1000
        os.utime(folder / OWNER_FILE, (old, old))
        time.sleep(0.5)
        assert time.time() - (folder / OWNER_FILE).stat().st_mtime < 100
        lock.check()
        (folder / OWNER_FILE).write_text(json.dumps({"host": "h", "pid": 1, "token": "other"}))
        time.sleep(0.5)
        with pytest.raises(RunError, match="took this run over"):
            lock.check()
    assert (folder / OWNER_FILE).is_file()  # the other owner's file is left alone


# --- two real zaec-extract processes on one --out -------------------------------------------------------------

PAUSED_CLI = """
import sys, time
from pathlib import Path
import extract.runner as runner
real = runner.adapt_stream
def paused(*args, **kwargs):  # hold the run between encoding and the adapt loop until the test says go
    Path(sys.argv[1]).touch()
    while not Path(sys.argv[2]).exists():
        time.sleep(0.05)
    return real(*args, **kwargs)
runner.adapt_stream = paused
from extract.cli import main
main(sys.argv[3:])
"""


def _cli_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--method", "tda", "--dataset", "dtd", "--pretrained", f"local-dir:{tmp_path / 'model'}", "--data-root",
            str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
            "--device", "cpu", "--quiet", *extra]


def _wait_for(pred, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)


def test_two_processes_on_one_out_never_replace_each_other(tmp_path):
    """The first run owns the folder; one with --set alpha=3.0 stops with one line (--wait-lock 0) or waits and
    is then refused by the finished-run check done again under the lock; the shards are the first run's."""
    make_tiny_model_dir(tmp_path / "model")
    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=4)
    ready, go = tmp_path / "ready", tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", PAUSED_CLI, str(ready), str(go), *_cli_args(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    try:
        _wait_for(lambda: ready.exists() or first.poll() is not None)
        assert first.poll() is None, first.communicate()
        other = _cli_args(tmp_path, "--set", "alpha=3.0")
        now = subprocess.run([sys.executable, "-m", "extract.cli", *other, "--wait-lock", "0"],
                             capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
        assert now.returncode == 2, now.stderr
        assert f"in use by process {first.pid} on host" in now.stderr and "Traceback" not in now.stderr
        assert len(now.stderr.strip().splitlines()) == 1
        log = tmp_path / "waiting.err"
        with open(log, "w") as err:
            waiting = subprocess.Popen([sys.executable, "-m", "extract.cli", *other], stdout=subprocess.PIPE,
                                       stderr=err, text=True, env=_env(), cwd=ROOT)
            _wait_for(lambda: "waiting for ever" in log.read_text() or waiting.poll() is not None)
            assert waiting.poll() is None, log.read_text()
            go.touch()
            out, _ = first.communicate(timeout=300)
            assert first.returncode == 0, out
            waiting.wait(timeout=300)
        assert waiting.returncode == 2, log.read_text()
        assert "used different settings: method_config" in log.read_text()
    finally:
        go.touch()
        for p in (first, locals().get("waiting")):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    marker = json.loads(next((tmp_path / "out").rglob("_zaec_complete.json")).read_text())
    assert marker["settings"]["method_config"]["alpha"] == 2.0
    assert not list((tmp_path / "out").rglob(".zaec-*"))  # both locks given back
