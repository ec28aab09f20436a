"""The progress display of a run (a rich progress bar with samples/s and running accuracy) and its warnings."""

from __future__ import annotations

import time
from typing import Any, Callable


class Progress:
    """A rich progress bar with samples/s and running accuracy; a no-op when disabled."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._p = None

    def __enter__(self) -> "Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            # emoji off: dataset keys such as imagenet_c:fog:3 hold rich emoji codes (":fog:")
            self._p = RichProgress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                                   TextColumn("{task.fields[rate]}", markup=False),
                                   TextColumn("{task.fields[info]}", markup=False), TimeRemainingColumn(),
                                   console=Console(emoji=False))
            self._p.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)

    def task(self, description: str, total: int) -> "Task":
        return Task(self._p, description, total)

    def print(self, msg: str) -> None:
        if self._p is not None:
            self._p.console.print(msg)


def warn(message: str, progress: Progress, log: Callable[[str], None] | None) -> None:
    """A warning always reaches the user: through `log`, the progress console, or (progress bar off, `--quiet`)
    stderr - quiet hides the progress, never a warning."""
    if log is not None:
        log(f"warning: {message}")
    elif progress.enabled:
        from rich.markup import escape
        progress.print(f"[yellow]warning:[/yellow] {escape(message)}")
    else:
        import sys
        print(f"warning: {message}", file=sys.stderr)


class Task:
    """One bar of a `Progress` (no-op without one): counts samples, shows samples/s and a note."""

    def __init__(self, progress: Any, description: str, total: int):
        self.p = progress
        self.t0 = time.perf_counter()
        self.done = 0
        self.id = progress.add_task(description, total=total, rate="", info="") if progress is not None else None

    def advance(self, n: int, info: str = "") -> None:
        self.done += n
        if self.p is not None:
            rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
            self.p.update(self.id, advance=n, rate=f"{rate:,.1f} samples/s", info=info)
