"""The files a run's method reads besides the CLIP checkpoint (`TTAMethod.external_files`: a second pretrained model,
a checkpoint of trained prompts, statistics of a source dataset), checked before any model loads, and their identity
in the run's settings (docs/extract.md, "Files a method reads besides the CLIP checkpoint").

One check for every method, and for the two commands: `zaec-extract` calls `check_external_files` before the policy
loads (`extract.runner.execute`), `zaec-sweep` before it submits anything, in a dry run too
(`extract.sweep.runspec.check_models`). Each problem is one line naming the method, the file, the `--set` setting
that names it and where it comes from:

    difftpt: the Stable Diffusion image-variation pipeline (set by --set sd_pipeline=DIR): not given; get it with ...
"""

from __future__ import annotations

from pathlib import Path

from extract.methods.base import ExternalFile
from extract.run.options import PlannedRun, RunError

#: the run-settings key of the external files' identity (absent for a method that reads none)
SETTINGS_KEY = "external_files"


def _usage(ext: ExternalFile) -> str:
    if ext.kind == "open_clip":
        return f"{ext.backbone_setting}=NAME --set {ext.setting}=WEIGHTS"
    return f"{ext.setting}={'DIR' if ext.kind == 'dir' else 'FILE'}"


def external_error(planned: PlannedRun, ext: ExternalFile, problem: str) -> RunError:
    """One line: the method, the file (and its value), the setting that names it, the problem, where it comes from.

    Example (RLCF's reward model, absent offline):
        rlcf: reward model ViT-L-14/openai (set by --set reward_backbone=NAME --set reward_pretrained=WEIGHTS): ...;
        or --set reward_backbone=policy (the policy as its own reward model)
    """
    cfg = planned.config
    value = str(getattr(cfg, ext.setting))
    shown = f"{getattr(cfg, ext.backbone_setting)}/{value}" if ext.kind == "open_clip" else value
    head = f"{planned.options.method}: {ext.what}" + (f" {shown}" if shown.strip() else "")
    return RunError(f"{head} (set by --set {_usage(ext)}): {problem}; {ext.source}")


def _path_problem(ext: ExternalFile, value: str) -> str | None:
    """What is wrong with the path a "file" or "dir" setting names, or None."""
    if not value.strip():
        return "not given"
    p = Path(value).expanduser()
    if ext.kind == "dir":
        if not p.is_dir():
            return "is a file, expected a folder" if p.exists() else "no such folder"
        lacking = [n for n in ext.contains if not (p / n).exists()]
        return f"the folder lacks {', '.join(lacking)}" if lacking else None
    if not p.is_file():
        return "is a folder, expected a file" if p.exists() else "no such file"
    return None


def check_external_files(planned: PlannedRun) -> None:
    """Every file the planned run's method reads besides the CLIP checkpoint (`needed_files`), checked without
    reading it: a path that exists as a file or a folder (with the files it must hold), an open_clip model as
    `load_model` would check it before reading a weight (`extract.models.check_weights`). Nothing for a method that
    reads none.

    Raises:
        RunError: one line per `external_error`, for the first problem found.
    """
    for ext in planned.method_cls.needed_files(planned.config):
        if ext.kind == "open_clip":
            _check_open_clip(planned, ext)
            continue
        problem = _path_problem(ext, str(getattr(planned.config, ext.setting)))
        if problem is not None:
            raise external_error(planned, ext, problem)


def _check_open_clip(planned: PlannedRun, ext: ExternalFile) -> None:
    from extract.models import ModelError, WeightFlags, check_weights

    cfg = planned.config
    flags = WeightFlags(backbone=f"--set {ext.backbone_setting}=", pretrained=f"--set {ext.setting}=")
    try:
        check_weights(getattr(cfg, ext.backbone_setting) or None, getattr(cfg, ext.setting), flags=flags)
    except ModelError as e:
        raise external_error(planned, ext, str(e)) from None


def path_fingerprint(path: Path) -> str:
    """The path, size and modification time of a file, or of every file under a folder
    (`extract.fingerprint.files_fingerprint`, "stat", relative to the folder or the file's parent)."""
    from extract.fingerprint import files_fingerprint

    if path.is_file():
        return files_fingerprint([path], path.parent)
    return files_fingerprint(sorted(p for p in path.rglob("*") if p.is_file()), path)


def external_identity(planned: PlannedRun) -> dict[str, str]:
    """{setting: fingerprint} of the files and folders the run reads besides the CLIP checkpoint (`path_fingerprint`:
    the path, size and modification time of every file), so that a finished run made with other files is not reused
    (`extract.run.settings.run_settings`). "absent" for a path that does not exist; an open_clip model is identified
    by its setting (and its features by the model's fingerprint) instead.

    Example:
        >>> external_identity(planned)  # doctest: +SKIP
        {'maple_weights': 'stat:3f2a...'}
    """
    out = {}
    for ext in planned.method_cls.needed_files(planned.config):
        value = str(getattr(planned.config, ext.setting))
        if ext.kind == "open_clip" or not value.strip():
            continue
        p = Path(value).expanduser()
        try:
            out[ext.setting] = path_fingerprint(p) if p.exists() else "absent"
        except OSError:  # vanished while listed
            out[ext.setting] = "absent"
    return out

