"""Where the sweep meets the extractor: a sweep run is the extractor's own `RunOptions` and `ExecOptions`.

The sweep keeps no copy of `zaec-extract`'s options, defaults or checks:
- `RunSpec` holds a `RunOptions` (every option that decides the result), the runner's `ExecOptions` (how it
  executes) and the run's view policy (which group it joins); a worker passes the first two to `execute`;
- the options a sweep can set are derived from the fields of those two classes (`sweep_run_fields`,
  `sweep_exec_fields`), so a new `RunOptions` field is a new sweep option and config key without an edit here;
- defaults and environment fallbacks are `extract.run.options`'s (applied in the submitting process, so that every
  job sees the same folders whatever its environment);
- the finished-run check is the extractor's `finished_run_mismatch` (`finished_mismatches`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from extract.defaults import (
    DEFAULT_BACKBONE,
    default_cache_dir,
    default_cupl_dir,
    default_data_root,
    default_descriptions_dir,
)
from extract.run.options import DEFAULT_OUT, ExecOptions, RunOptions
from extract.sweep.errors import SweepError
from schemas.shard import RunKey, shard_dir

#: a `--pretrained` value ending so (or holding a path separator) names a checkpoint file (as extract.models reads it)
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
#: `RunOptions` fields that are dimensions of the grid, with the sweep option that gives them (the others are one
#: value for the whole sweep)
GRID_FIELDS: dict[str, str] = {"method": "methods", "dataset": "datasets", "dataset_ref": "datasets",
                               "class_names_file": "class_names", "backbone": "backbones", "pretrained": "pretrained",
                               "seed": "seeds", "overrides": "set", "ood_for_ref": "ood_for",
                               "ood_for_class_names_file": "class_names"}
#: sweep option names that differ from the field's name: `zaec-extract`'s spelling of the option
OPTION_NAMES: dict[str, str] = {"sh_filter": "tda_sh_filter"}
#: `ExecOptions` fields a sweep fixes: a job resumes, never forces, refuses changed settings (the sweep checks them
#: before submitting), and logs lines instead of drawing a progress bar
FIXED_EXECUTION: dict[str, Any] = {"resume": True, "force": False, "on_changed": "refuse", "progress": False}
OLD_MANIFEST = "made by an older zaec-sweep; start a new sweep with another --out"


def sweep_run_fields() -> dict[str, str]:
    """{RunOptions field: sweep option / config key} for the fields one value sets for the whole sweep."""
    return {f.name: OPTION_NAMES.get(f.name, f.name) for f in dataclasses.fields(RunOptions)
            if f.name not in GRID_FIELDS}


def sweep_exec_fields() -> dict[str, str]:
    """{ExecOptions field: sweep option / config key} for the execution options a sweep passes to its jobs."""
    return {f.name: f.name for f in dataclasses.fields(ExecOptions) if f.name not in FIXED_EXECUTION}


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: what `execute` gets on the worker, and the view policy that decides its group.

    Attributes:
        options: every option that decides the result; `backbone` is the name the shards record (for `local-dir:`
            the directory's model name), `pretrained` the string the loaded model records (`LoadedModel.pretrained`),
            folders absolute.
        execution: the runner's execution options (shard root, cache, device, batch size, workers, chunk size).
        policy: the view policy of the method's config after `--set` (from `plan`).
    """

    options: RunOptions
    execution: ExecOptions
    policy: str

    # read-only views of the options: what grouping, the manifest and the cost model read
    method = property(lambda self: self.options.method)
    #: the dataset key the shards record (an OOD run's `<ood>@<id>`, `RunOptions.run_dataset`)
    dataset = property(lambda self: self.options.run_dataset())
    backbone = property(lambda self: str(self.options.backbone))
    pretrained = property(lambda self: self.options.pretrained)
    seed = property(lambda self: int(self.options.seed))
    limit = property(lambda self: self.options.limit)
    out = property(lambda self: str(self.execution.out))

    def register_dataset(self) -> None:
        """Register a user's dataset in this process under the run's dataset name (a no-op for registered keys)."""
        self.options.register_dataset()

    @property
    def key(self) -> RunKey:
        return RunKey(self.backbone, self.dataset, self.method, self.seed)

    @property
    def run_id(self) -> str:
        return str(self.key)

    @property
    def group_key(self) -> tuple[str, str, str, str, int]:
        """What the feature cache of the run is keyed on: (backbone, weights, dataset, view policy, seed)."""
        return (self.backbone, self.pretrained, self.dataset, self.policy, self.seed)

    @property
    def group_id(self) -> str:
        return f"{self.backbone}/{self.dataset}/{self.policy}/seed={self.seed}"

    @property
    def shard_dir(self) -> Path:
        return shard_dir(self.out, self.key)

    def run_dir(self) -> Any:
        """The extractor's `RunDir` of this run."""
        from extract.run.rundir import RunDir

        return RunDir(Path(self.out), self.key)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (the manifest's `spec`): {"options": RunOptions.to_dict(), "execution": {...}, "policy": ...}."""
        execution = dataclasses.asdict(self.execution)
        execution.update(out=str(self.execution.out), cache_dir=_str(self.execution.cache_dir))
        return {"options": self.options.to_dict(), "execution": execution, "policy": self.policy}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunSpec":
        """Inverse of `to_dict`; SweepError for the spec of an older manifest."""
        if not isinstance(d, Mapping) or not {"options", "execution", "policy"} <= set(d):
            raise SweepError(f"a run of the sweep manifest was {OLD_MANIFEST}")
        try:
            execution = ExecOptions(**d["execution"])
        except TypeError:
            raise SweepError(f"a run of the sweep manifest was {OLD_MANIFEST}") from None
        return cls(RunOptions.from_dict(d["options"]), execution, str(d["policy"]))


def _str(p: Any) -> str | None:
    return None if p is None else str(p)


def _abs(p: str | os.PathLike | None) -> str | None:
    return None if p is None else str(Path(p).expanduser().resolve())


def _coerce(cls: type, name: str, option: str, value: Any) -> Any:
    """A config-file or command-line value as the field's type (from its annotation); SweepError otherwise."""
    kind = str({f.name: f.type for f in dataclasses.fields(cls)}[name]).split("|")[0].strip()
    flag = f"--{option.replace('_', '-')}"
    if kind == "bool":
        if not isinstance(value, bool):
            raise SweepError(f"{flag}: expected true or false, got {value!r}")
        return value
    if kind == "int":
        try:
            if isinstance(value, (bool, float)):
                raise ValueError
            return int(value)
        except ValueError:
            raise SweepError(f"{flag}: expected an integer, got {value!r}") from None
    if kind == "float":  # wait_lock
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except ValueError:
            raise SweepError(f"{flag}: expected a number, got {value!r}") from None
    return str(value)


def sweep_options(settings: Mapping[str, Any]) -> tuple[RunOptions, ExecOptions]:
    """The options every run of a sweep shares, from settings named by field (`sweep_run_fields`,
    `sweep_exec_fields`; None or absent: the extractor's default). The method and dataset stay empty.

    The data root, feature cache, CuPL and descriptions folders get the extractor's fallbacks (`default_data_root()`, ...) here,
    and every folder is made absolute: a worker shares neither our environment nor our working directory.

    Raises:
        SweepError: an unknown setting, a value of the wrong type.
        RunError, ValueError: the extractor's own checks (`check_options`: adapt_batch and part_size, folders;
            the fingerprint mode).
    """
    from extract.fingerprint import check_mode
    from extract.run.options import check_options

    run_fields, exec_fields = sweep_run_fields(), sweep_exec_fields()
    unknown = sorted(set(settings) - set(run_fields) - set(exec_fields))
    if unknown:
        raise SweepError(f"unknown run setting(s) {', '.join(unknown)}; available: "
                         f"{', '.join(sorted({**run_fields, **exec_fields}.values()))}")
    given = {k: v for k, v in settings.items() if v is not None}
    run_kw = {k: _coerce(RunOptions, k, run_fields[k], v) for k, v in given.items() if k in run_fields}
    exec_kw = {k: _coerce(ExecOptions, k, exec_fields[k], v) for k, v in given.items() if k in exec_fields}
    run_kw["data_root"] = _abs(run_kw.get("data_root") or default_data_root())
    run_kw["cupl_dir"] = _abs(run_kw.get("cupl_dir") or default_cupl_dir())
    run_kw["descriptions_dir"] = _abs(run_kw.get("descriptions_dir") or default_descriptions_dir())
    exec_kw["cache_dir"] = _abs(exec_kw.get("cache_dir") or default_cache_dir())
    exec_kw["out"] = _abs(exec_kw.get("out") or DEFAULT_OUT)
    options = RunOptions("", "", **run_kw)
    execution = ExecOptions(**exec_kw, **FIXED_EXECUTION)
    check_mode(options.fingerprint)
    check_options(options, execution)
    return options, execution


def is_local_dir(pretrained: str) -> bool:
    """True for `local-dir:DIR` weights: the directory names the model, so no backbone needs to be given."""
    from extract.models import LOCAL_DIR

    return pretrained.startswith(LOCAL_DIR)


def default_backbones(pretrained: str) -> tuple[str, ...]:
    """The backbones of a grid that names none: `zaec-extract`'s default, or none with `local-dir:` weights."""
    return () if is_local_dir(pretrained) else (DEFAULT_BACKBONE,)


def absolute_weights(p: str) -> str:
    """A checkpoint file or local-dir path made absolute (a worker does not share our working directory); a
    pretrained tag unchanged. Raises SweepError for a checkpoint file that does not exist.

    The result is what the run's options carry and so what the loaded model records (`LoadedModel.pretrained` is
    the string it was loaded with) and what the finished-run check compares."""
    from extract.models import LOCAL_DIR

    if p.startswith(LOCAL_DIR):
        return LOCAL_DIR + str(Path(p[len(LOCAL_DIR):]).expanduser().resolve())
    path = Path(p).expanduser()
    if path.suffix in CHECKPOINT_SUFFIXES or os.sep in p:
        if not path.is_file():
            raise SweepError(f"checkpoint file {p} does not exist (--pretrained / --backbones NAME=FILE)")
        return str(path.resolve())
    return p


def resolve_run(options: RunOptions, execution: ExecOptions) -> RunSpec:
    """The extractor's own resolution of one run (`plan`): the backbone name its shards record and the view
    policy of its method config after the overrides. Raises on any unknown name or bad override."""
    from extract.run.options import plan

    planned = plan(options)
    return RunSpec(dataclasses.replace(options, backbone=planned.backbone), execution, str(planned.policy))


def load_group_model(run: RunSpec) -> Any:
    """Load the model of a group (its first run's backbone, weights and device) the way `zaec-extract` does."""
    from extract.models import load_model

    return load_model(run.options.backbone, run.options.pretrained, run.execution.device)


def extract_run(run: RunSpec, model: Any, log: Callable[[str], None]) -> list[Path]:
    """Run one extraction with an already loaded model: `extract.runner.execute`; returns its shard paths."""
    from extract import runner

    return runner.execute(run.options, run.execution, model=model, log=log)


def check_data(runs: Sequence[RunSpec]) -> None:
    """List every test set of the sweep once (split files and folders only, no image is opened), so a missing or
    misnamed folder fails before submission with the extractor's expected-layout message; read the class
    descriptions of each run whose method needs them (AWT) as `zaec-extract` does before its model loads; and
    refuse a run whose last batch would hold one image its method cannot adapt (`PlannedRun.last_batch_refusal`,
    which depends on the set's size: a method on batch statistics over a ResNet whose last stage is 1x1).

    Raises:
        DatasetError: the extractor's line for a set it cannot list.
        RunError: the extractor's line for a last batch of one, prefixed with the run it refuses.
    """
    from extract.run.options import RunError, plan
    from extract.run.settings import data_key
    from extract.run.setup import run_descriptions

    listed: dict[tuple[Any, ...], tuple[Any, int]] = {}  # data_key -> `_list_stream`
    read = set()
    for r in runs:
        o, key = r.options, data_key(r.options)
        if key not in listed:
            listed[key] = _list_stream(o)
        testset, n_total = listed[key]
        r.register_dataset()
        planned = plan(o)  # as `resolve_run` planned it
        last_batch = planned.last_batch_refusal(n_total)
        if last_batch is not None:
            raise RunError(f"{r.run_id}: {last_batch}")
        if planned.method_cls.needs_descriptions and (o.method, key, o.descriptions_dir) not in read:
            read.add((o.method, key, o.descriptions_dir))
            run_descriptions(planned, testset)  # its classes: an OOD run's in-distribution set's


def _list_stream(o: RunOptions) -> tuple[Any, int]:
    """(the listed test set whose classes the run predicts, the samples of its stream): an OOD run's are the
    in-distribution set's classes and both sets' samples, as `load_mixed_data` mixes them."""
    from extract.datasets import load_ood_images, load_testset

    if o.ood_for is None:
        testset = load_testset(o.dataset, o.data_root, sh_filter=o.sh_filter)
        return testset, len(testset)
    testset = load_testset(o.ood_for, o.data_root, sh_filter=o.sh_filter)
    return testset, len(testset) + len(load_ood_images(o.dataset, o.data_root, sh_filter=o.sh_filter))


def check_backbones(runs: Sequence[RunSpec]) -> None:
    """Check each run's backbone and weights as `load_model` checks them before it reads a weight
    (`extract.models.check_weights`: the architecture, the pretrained tag, a checkpoint file, a `local-dir:`
    folder), each pair once, so that no job is submitted to fail on a name; a tag's weights may be cached where
    the jobs run, so their presence on this machine is not asked.

    Raises:
        ModelError: the line `zaec-extract` would print.
    """
    from extract.models import check_weights

    for backbone, pretrained in dict.fromkeys((r.backbone, r.pretrained) for r in runs):
        check_weights(backbone, pretrained, tag_weights=False)


def check_models(runs: Sequence[RunSpec]) -> None:
    """Check the files each run's method reads besides the CLIP checkpoint (RLCF's reward model, DiffTPT's diffusion
    pipeline, PromptAlign's prompts and statistics: `TTAMethod.external_files`) as `zaec-extract` does before its
    policy loads (`extract.run.externals.check_external_files`), each (method, files) once, so that no job is
    submitted to fail on them. The runs' own backbones are loaded by the jobs.

    Raises:
        RunError: one line naming the method, the file, its `--set` setting and where it comes from.
    """
    from extract.methods import get_method
    from extract.run.externals import check_external_files
    from extract.run.options import plan

    seen = set()
    for r in runs:
        if not get_method(r.method).external_files:
            continue
        r.register_dataset()
        planned = plan(r.options)
        named = tuple((f.setting, getattr(planned.config, f.setting), getattr(planned.config, f.backbone_setting, ""))
                      for f in planned.method_cls.needed_files(planned.config))
        if (r.method, named) not in seen:
            seen.add((r.method, named))
            check_external_files(planned)


def is_complete(run: RunSpec) -> bool:
    """The extractor's own finished test (marker + parts on disk, enough samples for the run's `--limit`)."""
    return bool(run.run_dir().is_complete(run.limit))


def _planned_runs(runs: Sequence[RunSpec], wanted: Callable[[RunSpec], bool]
                  ) -> Iterator[tuple[RunSpec, Any, Any]]:
    """(run, its `plan`, its `load_run_data`) for each run `wanted` picks, each test set listed and fingerprinted
    once (`data_key`), and only for the runs picked."""
    from extract.run.options import plan
    from extract.run.settings import data_key, load_run_data

    data: dict[tuple[Any, ...], Any] = {}
    for r in runs:
        if not wanted(r):
            continue
        r.register_dataset()
        planned = plan(r.options)
        if data_key(r.options) not in data:
            data[data_key(r.options)] = load_run_data(planned)
        yield r, planned, data[data_key(r.options)]


def finished_mismatches(runs: Sequence[RunSpec]) -> list[tuple[RunSpec, str]]:
    """(run, what differs) for each finished run whose recorded settings differ from the sweep's: the extractor's
    `finished_run_mismatch`, which `zaec-extract` applies before it reuses or refuses a finished run (only runs
    that are finished are listed)."""
    from extract.run.settings import finished_run_mismatch

    found = ((r, finished_run_mismatch(planned, r.run_dir(), data))
             for r, planned, data in _planned_runs(runs, is_complete))
    return [(r, why) for r, why in found if why]


def check_finished_settings(runs: Sequence[RunSpec]) -> None:
    """Raise SweepError when finished runs were made with other settings than the sweep asks for."""
    bad = finished_mismatches(runs)
    if bad:
        r, d = bad[0]
        raise SweepError(f"{len(bad)} finished run(s) used other settings than this sweep, e.g. {r.run_id} "
                         f"({d}) under {r.shard_dir}; write the sweep to another --out, or recompute them with "
                         "zaec-extract --force")


def _holds_more(run: RunSpec) -> bool:
    """A finished run lies in the run's folder with more samples than its `--limit` asks for, and does not serve
    it."""
    counts = run.run_dir().finished_counts()
    return counts is not None and run.limit is not None and counts[0] > run.limit and not is_complete(run)


def check_longer_runs(runs: Sequence[RunSpec]) -> None:
    """Raise SweepError when a run would replace a finished run of the same settings that holds more samples than
    its `--limit` asks for and cannot serve it: the extractor's `longer_run_refusal`, which `zaec-extract` refuses
    without `--force` (a sweep never forces)."""
    from extract.run.settings import longer_run_refusal

    bad = [why for r, planned, data in _planned_runs(runs, _holds_more)
           for why in [longer_run_refusal(planned, r.run_dir(), data)] if why]
    if bad:
        raise SweepError(f"{len(bad)} run(s) would replace a finished longer run, e.g. {bad[0]}; write the sweep "
                         "to another --out (both are kept), or replace them with zaec-extract --force")
