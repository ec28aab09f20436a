"""Waiting for a state of other processes, not for a time: a test of a subprocess polls what it waits for (a file
written, a process started or gone) until a deadline, so a loaded machine only makes it slower, never wrong."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable


def wait_until(ready: Callable[[], bool], what: str, timeout: float = 120.0, poll: float = 0.02) -> None:
    """Poll `ready()` until it is true; AssertionError naming `what` after `timeout` seconds."""
    t0 = time.monotonic()
    while not ready():
        assert time.monotonic() - t0 < timeout, f"still waiting after {timeout:.0f} s for {what}"
        time.sleep(poll)


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (Linux: the fifth field of /proc/PID/stat), zombies left out."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def forked_children(pid: int) -> list[int]:
    """Live members of `pid`'s process group that run `pid`'s own program (the same command line, as a forked
    loader process does): a helper process the interpreter starts on its own while it imports (`ldconfig -p`,
    which ctypes runs while torch loads) is not one of them."""
    try:
        own = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    out = []
    for member in group_members(pid):
        try:
            if member != pid and Path(f"/proc/{member}/cmdline").read_bytes() == own:
                out.append(member)
        except OSError:
            continue  # gone meanwhile
    return out
