"""What a run's result depends on beyond its options: the listed test set and the identity of its image files
(`load_run_data`, returning `extract.run.rundata.RunData`), and the settings dict a finished run records and is
checked against (`finished_run`, `finished_run_mismatch`).

The settings: method config, pretrained weights, anchor, TDA's file filter, the sample list (paths, labels, class
names: `TestSet.fingerprint()`), the resolved data root and the data fingerprint of the image files
(`extract.fingerprint`), and for a method that reads class descriptions (AWT) their fingerprint. A finished run
with other settings is refused (or recomputed, `on_changed`), and a finished longer run that cannot serve a shorter
`--limit` is never replaced unless forced (`longer_run_refusal`); the sweep asks the same functions before it
submits anything, so the checks cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from extract.run.externals import SETTINGS_KEY as EXTERNAL_SETTINGS_KEY, external_identity
from extract.run.options import DEFAULT_ADAPT_BATCH, PlannedRun, RunOptions
from extract.run.rundata import RunData, set_identity
from extract.run.rundir import RunDir
from extract.run.setup import run_descriptions

#: `extract.fingerprint.FINGERPRINT_MODES` (kept here: this module loads before the dataset stack)
_FINGERPRINT_MODES = ("stat", "content")
#: what a changed setting of a finished run means, for the refusal message
_SETTING_HINTS = {"data_fingerprint": "the image files changed (size, modification time or content)",
                  "data_root": "another data root", "samples": "another split or class list",
                  EXTERNAL_SETTINGS_KEY: "a file the method reads besides the CLIP checkpoint changed (size or "
                                         "modification time), or is absent"}


def load_run_data(planned: PlannedRun) -> RunData:
    """List the planned run's test set and fingerprint its files (DatasetError, ValueError for a bad mode)."""
    from extract.datasets import load_testset
    from extract.fingerprint import check_mode

    o = planned.options
    check_mode(o.fingerprint)
    if planned.ood_for is not None:
        from extract.run.ood import load_mixed_data

        return load_mixed_data(planned)
    testset = load_testset(planned.dataset, o.data_root, sh_filter=o.sh_filter)
    identity = set_identity(testset, o.data_root, o.fingerprint)
    if o.exif_transpose:  # other pixels: its own cache entry and settings (absent when off: older runs still match)
        testset = dataclasses.replace(testset, exif_transpose=True)
        identity["exif_transpose"] = "true"
    return RunData(testset, identity)


def data_identity(dataset: str, data_root: str | os.PathLike | None = None, *, sh_filter: bool = False,
                  mode: str = "stat") -> dict[str, str]:
    """`{"samples": ..., "data_root": ..., "data_fingerprint": ...}` as a run of `dataset` would record them in its
    settings (for checks outside a run)."""
    from extract.datasets import load_testset

    testset = load_testset(dataset, data_root, sh_filter=sh_filter)
    return {"samples": testset.fingerprint(), **set_identity(testset, data_root, mode)}


def run_settings(planned: PlannedRun, data: RunData) -> dict[str, Any]:
    """What a finished run must match to be reused without --force (recorded in its marker)."""
    o = planned.options
    settings = {"method_config": planned.config_dict(), "pretrained": o.pretrained, "anchor": o.anchor,
                "sh_filter": bool(o.sh_filter), "samples": data.testset.fingerprint(), **data.identity}
    # an adapt call's width may change the rounding of its rows (a batch method's rows themselves: its batch);
    # absent at the default, so that the runs made before it was recorded still match
    if planned.adapt_width != DEFAULT_ADAPT_BATCH:
        settings["adapt_batch"] = planned.adapt_width
    # the files a method reads besides the CLIP checkpoint (size and modification time); absent for the methods
    # that read none, so that their runs made before it was recorded still match
    files = external_identity(planned)
    if files:
        settings[EXTERNAL_SETTINGS_KEY] = files
    # the class descriptions a method reads (AWT): their content decides the rows; absent for the other methods
    descriptions = run_descriptions(planned, data.testset)
    if descriptions is not None:
        settings["descriptions"] = descriptions.fingerprint()
    return settings


@dataclass(frozen=True)
class FinishedRun:
    """A finished run on disk compared with the settings of the run asking.

    Attributes:
        run_dir: where it lives; parts: its parts, in order.
        recorded: the settings its marker recorded (any JSON value; a dict unless the marker is damaged).
        wanted: the settings of the run asking.
    """

    run_dir: RunDir
    parts: tuple[Path, ...]
    recorded: Any
    wanted: Mapping[str, Any]

    @property
    def matches(self) -> bool:
        """Same settings: the run is reused as it is."""
        return self.recorded == self.wanted

    @property
    def predates_fingerprints(self) -> bool:
        """Recorded before data fingerprints existed, otherwise the same settings: its data cannot be verified, so
        it is recomputed rather than served or refused."""
        old, new = self.recorded, self.wanted
        return (isinstance(old, dict) and "data_fingerprint" not in old
                and {k: v for k, v in new.items() if k not in ("data_fingerprint", "data_root")} == old)

    def changed(self) -> str:
        """The settings that differ, with what each change means: `method_config, samples (another split ...)`."""
        old = self.recorded if isinstance(self.recorded, dict) else {}
        keys = sorted(k for k in set(old) | set(self.wanted) if old.get(k) != self.wanted.get(k))
        hints = {**_SETTING_HINTS, **self._mode_hint(old)}
        return ", ".join(f"{k} ({hints[k]})" if k in hints else k for k in keys)

    def _mode_hint(self, old: Mapping[str, Any]) -> dict[str, str]:
        """A data fingerprint taken in another `--fingerprint` mode (`stat:...` against `content:...`) says nothing
        about the files: name the modes instead of blaming the files."""
        was, now = (str(v).partition(":")[0]
                    for v in (old.get("data_fingerprint"), self.wanted.get("data_fingerprint")))
        if was == now or was not in _FINGERPRINT_MODES or now not in _FINGERPRINT_MODES:
            return {}
        return {"data_fingerprint": f"the finished run fingerprinted its files with --fingerprint {was}, this run "
                                    f"with {now}: the two cannot be compared and the files may well be unchanged; "
                                    f"pass --fingerprint {was} to check them as that run did"}

    def refusal(self) -> str:
        """One line for a run that will not overwrite it."""
        return (f"a finished run under {self.run_dir.path} used different settings: {self.changed()}; use --force to "
                "recompute it or write elsewhere with --out")


def finished_run(run_dir: RunDir, settings: Mapping[str, Any], limit: int | None) -> FinishedRun | None:
    """The finished run under `run_dir` that covers `limit` (`RunDir.is_complete`), or None."""
    if not run_dir.is_complete(limit):
        return None
    info = run_dir.read_marker() or {}
    return FinishedRun(run_dir, tuple(run_dir.path / p for p in info["parts"]), info.get("settings"), settings)


def finished_run_mismatch(planned: PlannedRun, run_dir: RunDir, data: RunData | None = None) -> str | None:
    """What differs between a finished run under `run_dir` and `planned`, or None (no finished run covering the
    planned limit, the same settings, or a run so old that the extractor recomputes it without asking).

    The same check `zaec-extract` applies before it reuses or refuses a finished run. `data` may be passed when
    several runs share a dataset (`load_run_data` lists and fingerprints it, one `os.stat` per image).

    Example:
        >>> why = finished_run_mismatch(planned, RunDir(out, planned.key))   # doctest: +SKIP
        'method_config'
    """
    if not run_dir.is_complete(planned.options.limit):
        return None
    data = load_run_data(planned) if data is None else data
    done = finished_run(run_dir, run_settings(planned, data), planned.options.limit)
    if done is None or done.matches or done.predates_fingerprints:
        return None
    return done.changed()


def longer_run_refusal(planned: PlannedRun, run_dir: RunDir, data: RunData,
                       settings: Mapping[str, Any] | None = None) -> str | None:
    """One clause when computing `planned` here would replace a finished run of the same settings that holds more
    samples than it asks for and cannot serve it (`RunDir.shorter_refusal` says why its first rows are not this
    run's: the method reads the stream's length or a later sample, or the limit cuts an adapt call); None
    otherwise. A run never replaces such a run unless forced: hours of a full run are not lost to a quick look.
    A finished run with other settings is the finished-run check's and the resume scan's (refused, or recomputed
    with `on_changed="recompute"`). The sweep asks the same before it submits. `settings`: `run_settings(planned,
    data)` where the caller has them."""
    counts = run_dir.finished_counts()
    n_run = planned.n_run(data.n_total)
    if counts is None or counts[0] <= n_run:
        return None
    if settings is None:
        settings = run_settings(planned, data)
    if (run_dir.read_marker() or {}).get("settings") != settings:
        return None
    why = run_dir.shorter_refusal(n_run)
    if why is None:  # served by the finished-run check
        return None
    o = planned.options
    return (f"{o.method} on {planned.dataset}: the finished run under {run_dir.path} holds {counts[0]} samples, but "
            f"its first {n_run} are not what a {n_run}-sample run computes ({why}); computing the {n_run}-sample run "
            "there would replace it")


def data_key(options: RunOptions) -> tuple[Any, ...]:
    """The options `load_run_data` depends on: runs with equal keys share one `RunData`."""
    return (options.dataset, options.data_root, options.sh_filter, options.fingerprint, options.ood_for)
