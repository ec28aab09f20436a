"""The lock of a run directory: one process at a time reads or writes a run's parts and marker (`RunDir.lock`).

Two locks are taken, both needed to own the run (docs/extract.md, "One process per run directory"):

1. `flock` on `.zaec-lock` in the run folder. The kernel releases it when the holder dies however it dies
   (`kill -9` included), so a killed process never leaves it held. Linux NFS clients (kernel >= 2.6.12) send it to
   the server as a whole-file byte-range lock (flock(2), "NFS details"), so it holds across machines too, unless
   the share is mounted with `nolock` or `local_lock=flock|all`; Lustre honours it only when mounted with `-o flock`
   (otherwise the call fails, and only the owner file below is used). A file system that accepts the call but keeps
   the lock local to one machine cannot be detected from user space: hence the second lock.
2. An owner file `.zaec-owner` holding host, pid, start time and a token, made atomically with link(2) from a
   private file already written (the way open(2) recommends for lock files on NFS: no reliance on O_EXCL, and a
   reader never sees a half-written owner file). The holder touches it every `HEARTBEAT_S` seconds. It is stale,
   and taken over, when its process is gone (same host, pid not running) or its heartbeat is older than
   `STALE_AFTER_S`; ages are measured against the modification time of a file this process has just written, i.e.
   on the file server's clock, so clock skew between machines does not matter.

A waiting process polls both; it waits for ever by default, or stops after `wait` seconds with one line naming the
holder. When both locks work, only one process at a time ever looks at the owner file, so a take-over never races.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from extract.run.options import RunError

LOCK_FILE = ".zaec-lock"
OWNER_FILE = ".zaec-owner"
#: seconds between two touches of the owner file by its holder
HEARTBEAT_S = 10.0
#: an owner file not touched for this long is stale (six missed heartbeats: a loaded file server may be slow)
STALE_AFTER_S = 60.0
#: seconds between two attempts of a waiting process
POLL_S = 0.5
#: errors of a file system that does not support flock (the owner file alone then locks the run)
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
#: errors of a file system without hard links (the owner file is then created with O_EXCL)
_NO_LINK = {errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, errno.EMLINK}


def _pid_running(pid: int) -> bool:
    """Whether process `pid` exists on this machine (a process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Holder:
    """Who owns a run folder, as its owner file says.

    Attributes:
        host, pid, started: the owner's machine, process id and start time (ISO, local time of the owner).
        token: random id of this ownership. age: seconds since the owner's last heartbeat (server clock).
    """

    host: str
    pid: int
    started: str
    token: str
    age: float

    def stale(self, here: str) -> bool:
        """Gone (same host, process not running) or silent for longer than `STALE_AFTER_S`."""
        return (self.host == here and not _pid_running(self.pid)) or self.age > STALE_AFTER_S

    def describe(self) -> str:
        """`process 4711 on host node3 (since 2025-01-01T10:00:00, heartbeat 3 s ago)`."""
        return (f"process {self.pid} on host {self.host} (since {self.started or '?'}, heartbeat "
                f"{max(self.age, 0.0):.0f} s ago)")


def _read_holder(path: Path, now: float) -> Holder | None:
    """The owner file at `path` (None when absent); `now` is a modification time just written by this process.

    Opening the file makes an NFS client revalidate its attributes (close-to-open consistency), so the heartbeat
    read from `fstat` is fresh."""
    try:
        with open(path, encoding="utf-8") as fh:
            mtime = os.fstat(fh.fileno()).st_mtime
            raw = fh.read()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        return Holder(str(doc["host"]), int(doc["pid"]), str(doc.get("started", "")), str(doc["token"]), now - mtime)
    except (ValueError, KeyError, TypeError):  # being written (O_EXCL fallback) or damaged: only its age counts
        return Holder("?", -1, "", "", now - mtime)


class RunLock:
    """Exclusive ownership of one run folder (see the module docstring); a context manager.

    Args:
        folder: the run folder (created when missing; folders it created are removed on release when empty).
        wait: seconds to wait for another owner (None: for ever; 0: stop at once).
        on_wait: called once with one line when the lock is found busy and the process starts waiting.

    Raises:
        RunError (on entering): still busy after `wait` seconds; the message names the holder.

    Example:
        >>> with RunLock(Path("out/backbone=RN50/dataset=dtd/method=tda/seed=1"), wait=0):  # doctest: +SKIP
        ...     pass
    """

    def __init__(self, folder: Path, *, wait: float | None = None, on_wait: Callable[[str], None] | None = None):
        self.folder, self.wait, self.on_wait = Path(folder), wait, on_wait
        self.host = socket.gethostname()
        self.token = f"{self.host}.{os.getpid()}.{secrets.token_hex(6)}"
        self._fd: int | None = None
        self._created: list[Path] = []
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.lost = False

    @property
    def owner_path(self) -> Path:
        return self.folder / OWNER_FILE

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        """Take both locks, waiting as `wait` says (RunError when it runs out)."""
        self._make_folder()
        t0, announced = time.monotonic(), False
        while True:
            flock = self._flock()
            holder = self._take_owner() if flock is not False else _read_holder(self.owner_path, time.time())
            if holder is None and flock is not False:
                self._start_heartbeat()
                return
            self._unflock()
            who = holder.describe() if holder is not None else "another process"
            waited = time.monotonic() - t0
            if self.wait is not None and waited >= self.wait:
                self._remove_created()
                after = f" after waiting {waited:.0f} s" if self.wait > 0 else ""
                raise RunError(f"{self.folder} is in use by {who}{after}: another zaec-extract or sweep job is "
                               "writing this run; rerun when it has finished, or wait for it with --wait-lock "
                               "SECONDS")
            if not announced and self.on_wait is not None:
                limit = "for ever" if self.wait is None else f"up to {self.wait:g} s"
                self.on_wait(f"{self.folder} is in use by {who}; waiting {limit} (--wait-lock SECONDS sets "
                             "the limit, 0 stops at once)")
            announced = True
            time.sleep(POLL_S)

    def check(self) -> None:
        """Raise RunError when the owner file was taken over (this process was silent past `STALE_AFTER_S`)."""
        if self.lost:
            raise RunError(f"{self.folder}: another process took this run over while it was silent for more than "
                           f"{STALE_AFTER_S:g} s; this run's result is not marked complete")

    def release(self) -> None:
        """Give both locks back and remove the folders `acquire` created when they are empty."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        holder = _read_holder(self.owner_path, time.time())
        if holder is not None and holder.token == self.token:
            self.owner_path.unlink(missing_ok=True)
        if self._fd is not None:  # removed while held, so a process that opened it before re-checks (`_flock`)
            (self.folder / LOCK_FILE).unlink(missing_ok=True)
        self._unflock()
        self._remove_created()

    # -- the two locks -----------------------------------------------------------------------------------------

    def _make_folder(self) -> None:
        missing = []
        p = self.folder
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        self.folder.mkdir(parents=True, exist_ok=True)
        self._created = missing  # deepest first

    def _remove_created(self) -> None:
        for p in self._created:
            try:
                p.rmdir()
            except OSError:  # not empty (parts were written, or another run shares a parent): kept
                break
        self._created = []

    def _flock(self) -> bool | None:
        """True: held; False: another process holds it; None: the file system does not support flock."""
        import fcntl

        path = self.folder / LOCK_FILE
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # the previous holder removed the folder it had created, empty
                self.folder.mkdir(parents=True, exist_ok=True)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if isinstance(e, BlockingIOError):
                    return False
                if e.errno in _NO_FLOCK:
                    return None
                raise
            try:  # the previous holder removes the file on release: lock the file the name points to now
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return True
            os.close(fd)

    def _unflock(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None

    def _take_owner(self) -> Holder | None:
        """Create the owner file; None when this process now owns it, else its holder."""
        mine = self.folder / f"{OWNER_FILE}.{self.token}"
        mine.write_text(json.dumps({"host": self.host, "pid": os.getpid(), "token": self.token,
                                    "started": time.strftime("%Y-%m-%dT%H:%M:%S")}), encoding="utf-8")
        try:
            for _ in range(3):
                if self._link(mine):
                    return None
                holder = _read_holder(self.owner_path, os.stat(mine).st_mtime)
                if holder is not None and not holder.stale(self.host):
                    return holder
                if holder is not None:
                    self._evict(holder)
            return _read_holder(self.owner_path, os.stat(mine).st_mtime)
        finally:
            mine.unlink(missing_ok=True)

    def _link(self, mine: Path) -> bool:
        """Make `mine` the owner file if there is none (atomic); whether it now is."""
        try:
            os.link(mine, self.owner_path)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_LINK:  # NFS: the reply to a link that succeeded can be lost; the count says
                return os.stat(mine).st_nlink == 2
        try:  # no hard links here: O_EXCL (atomic on local file systems and NFSv3+)
            fd = os.open(self.owner_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(mine.read_text(encoding="utf-8"))
        return True

    def _evict(self, holder: Holder) -> None:
        """Move a stale owner file aside; if it turns out to be a fresh one made since it was read, put it back."""
        grave = self.folder / f"{OWNER_FILE}.stale.{self.token}"
        try:
            os.rename(self.owner_path, grave)
        except FileNotFoundError:
            return
        moved = _read_holder(grave, time.time())
        if moved is not None and moved.token != holder.token:
            try:
                os.link(grave, self.owner_path)
            except OSError:  # a third process owns it now; the one moved learns it at its next heartbeat
                pass
        grave.unlink(missing_ok=True)

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="zaec-run-lock", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            holder = _read_holder(self.owner_path, time.time())
            if holder is None or holder.token != self.token:
                self.lost = True
                return
            try:
                os.utime(self.owner_path)  # no times given: the file server stamps its own clock
            except OSError:  # a transient network error; a later beat retries
                pass
