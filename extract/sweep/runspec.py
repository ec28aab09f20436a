"""Where the sweep meets the extractor: the one module to change when the runner's options change.

Everything the sweep knows about `zaec-extract`'s options lives here, so that no copy can drift elsewhere:
- `RunSpec`, the options of one run that a worker passes to `run_extraction` (`extract_run`, `load_group_model`);
- the defaults `zaec-extract` uses (backbone, weights, anchor, batch size, seed) and its environment fallbacks for
  the data root, the feature cache and the CuPL prompts, applied before the paths are made absolute for the workers;
- how a run is resolved (`resolve_run`: the extractor's `plan_run`) and how `--pretrained` names a file;
- the finished-run check: `is_complete` (the extractor's `run_is_complete`) and `settings_mismatch` /
  `check_finished_settings` (the settings recorded in a finished run's marker against the sweep's);
- `check_data`: every dataset listed once before submission.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from extract.sweep.errors import SweepError
from schemas import RunKey, shard_dir

#: `zaec-extract`'s defaults (extract/cli.py), used where a sweep option is not given
DEFAULT_BACKBONE = "ViT-B-16"
DEFAULT_PRETRAINED = "openai"
DEFAULT_ANCHOR = "single"
DEFAULT_BATCH_SIZE = 256
DEFAULT_SEEDS = "1"
#: a `--pretrained` value ending so (or holding a path separator) names a checkpoint file (as extract.models reads it)
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs to call `run_extraction` for one run (paths absolute, names resolved).

    `backbone` is the name recorded in the shards (for `local-dir:` the directory's model name); `backbone_arg` is
    what is passed to the loader (None for `local-dir:`).
    """

    method: str
    dataset: str
    backbone: str
    backbone_arg: str | None
    pretrained: str
    seed: int
    policy: str
    overrides: tuple[tuple[str, str], ...] = ()
    out: str = ""
    data_root: str | None = None
    cache_dir: str | None = None
    cupl_dir: str | None = None
    limit: int | None = None
    anchor: str = DEFAULT_ANCHOR
    device: str | None = None
    workers: int | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    #: a user's dataset (`folder:`/`split:`): its reference and class-names file, to register it in the worker
    dataset_ref: str = ""
    class_names_file: str | None = None

    def register_dataset(self) -> None:
        """Register a user's dataset in this process under the run's dataset name (a no-op for registered keys)."""
        if self.dataset_ref:
            from extract.datasets import resolve_dataset

            resolve_dataset(self.dataset_ref, name=self.dataset, class_names=self.class_names_file)

    @property
    def key(self) -> RunKey:
        return RunKey(self.backbone, self.dataset, self.method, int(self.seed))

    @property
    def run_id(self) -> str:
        return str(self.key)

    @property
    def group_key(self) -> tuple[str, str, str, str, int]:
        """What the feature cache of the run is keyed on: (backbone, weights, dataset, view policy, seed)."""
        return (self.backbone, self.pretrained, self.dataset, self.policy, int(self.seed))

    @property
    def group_id(self) -> str:
        return f"{self.backbone}/{self.dataset}/{self.policy}/seed={self.seed}"

    @property
    def shard_dir(self) -> Path:
        return shard_dir(self.out, self.key)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["overrides"] = [list(kv) for kv in self.overrides]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["overrides"] = tuple((str(k), str(v)) for k, v in kw.get("overrides", ()))
        kw["seed"] = int(kw["seed"])
        return cls(**kw)


def is_local_dir(pretrained: str) -> bool:
    """True for `local-dir:DIR` weights: the directory names the model, so no backbone needs to be given."""
    from extract.models import LOCAL_DIR

    return pretrained.startswith(LOCAL_DIR)


def default_backbones(pretrained: str) -> tuple[str, ...]:
    """The backbones of a grid that names none: `zaec-extract`'s default, or none with `local-dir:` weights."""
    return () if is_local_dir(pretrained) else (DEFAULT_BACKBONE,)


def default_dirs(data_root: Any, cache_dir: Any, cupl_dir: Any) -> tuple[Any, Any, Any]:
    """(data root, feature cache, CuPL folder) with the extractor's fallbacks for the ones not given: $ZAEC_DATA_ROOT
    else ./data, $ZAEC_CACHE_DIR else data/cache, $ZAEC_CUPL_DIR (resolved here, in the submitting process, so that
    every job sees the same folders whatever its environment)."""
    from extract.cache import CACHE_ENV
    from extract.datasets import DATA_ROOT_ENV
    from extract.prompts import CUPL_ENV

    root = data_root or os.environ.get(DATA_ROOT_ENV) or "data"
    cache = cache_dir or os.environ.get(CACHE_ENV) or Path("data") / "cache"
    cupl = cupl_dir or os.environ.get(CUPL_ENV)
    return root, cache, cupl


def absolute_weights(p: str) -> str:
    """A checkpoint file or local-dir path made absolute (a worker does not share our working directory); a
    pretrained tag unchanged. Raises SweepError for a checkpoint file that does not exist."""
    from extract.models import LOCAL_DIR

    if p.startswith(LOCAL_DIR):
        return LOCAL_DIR + str(Path(p[len(LOCAL_DIR):]).expanduser().resolve())
    path = Path(p).expanduser()
    if path.suffix in CHECKPOINT_SUFFIXES or os.sep in p:
        if not path.is_file():
            raise SweepError(f"checkpoint file {p} does not exist (--pretrained / --backbones NAME=FILE)")
        return str(path.resolve())
    return p


def resolve_run(method: str, dataset: str, *, backbone_arg: str | None, pretrained: str, seed: int,
                overrides: Mapping[str, str] | None, anchor: str, limit: int | None) -> Any:
    """The extractor's own resolution of one run (`extract.runner.plan_run`): its recorded backbone name, method
    config after `overrides` and view policy. Raises on any unknown name or bad override."""
    from extract.runner import plan_run

    return plan_run(method, dataset, backbone=backbone_arg, pretrained=pretrained, seed=seed, overrides=overrides,
                    anchor=anchor, limit=limit)


def load_group_model(run: RunSpec) -> Any:
    """Load the model of a group (its first run's backbone, weights and device) the way `zaec-extract` does."""
    from extract.models import load_model

    return load_model(run.backbone_arg, run.pretrained, run.device)


def extract_run(run: RunSpec, model: Any, log: Callable[[str], None]) -> list[Path]:
    """Run one extraction with an already loaded model; returns the shard paths (`run_extraction`'s result)."""
    from extract.runner import run_extraction

    return run_extraction(
        run.method, run.dataset, data_root=run.data_root, out=run.out, seed=run.seed, limit=run.limit,
        overrides=dict(run.overrides) or None, anchor=run.anchor, cache_dir=run.cache_dir,
        cupl_dir=run.cupl_dir, workers=run.workers, batch_size=run.batch_size, progress=False,
        model=model, log=log)


def check_data(runs: Sequence[RunSpec]) -> None:
    """List every dataset of the sweep once (split files and folders only, no image is opened), so a missing or
    misnamed folder fails before submission with the extractor's expected-layout message."""
    from extract.datasets import load_testset

    seen = set()
    for r in runs:
        if (r.dataset, r.data_root) not in seen:
            seen.add((r.dataset, r.data_root))
            load_testset(r.dataset, r.data_root)


def is_complete(run: RunSpec) -> bool:
    """The extractor's own finished test (marker + parts on disk, enough samples for the run's `--limit`)."""
    from extract.runner import run_is_complete

    return run_is_complete(run.out, run.key, limit=run.limit)


def settings_mismatch(run: RunSpec, data_cache: dict[tuple[str, str | None], dict[str, str]] | None = None
                      ) -> str | None:
    """For a complete run: the recorded settings (method config, anchor, sample list and class names, data root and
    data fingerprint) that differ from this sweep's, else None.

    The extractor refuses to reuse such a run without `--force`; the sweep reports it before submitting anything.
    The data fingerprint (one `os.stat` per image) is computed once per (dataset, data root) in `data_cache`.
    """
    from extract.runner import COMPLETE_MARKER, data_identity
    from extract.sweep.manifest import read_json

    info = read_json(run.shard_dir / COMPLETE_MARKER) or {}
    recorded = info.get("settings") or {}
    plan = resolve_run(run.method, run.dataset, backbone_arg=run.backbone_arg, pretrained=run.pretrained,
                       seed=run.seed, overrides=dict(run.overrides) or None, anchor=run.anchor, limit=run.limit)
    data_cache = {} if data_cache is None else data_cache
    if (run.dataset, run.data_root) not in data_cache:
        run.register_dataset()
        data_cache[(run.dataset, run.data_root)] = data_identity(run.dataset, run.data_root)
    wanted = {"method_config": json.loads(json.dumps(dataclasses.asdict(plan.config), default=str)),
              "anchor": run.anchor, **data_cache[(run.dataset, run.data_root)]}
    diff = [k for k, v in wanted.items() if k in recorded and recorded[k] != v]
    return ", ".join(diff) or None


def check_finished_settings(runs: Sequence[RunSpec]) -> None:
    """Raise SweepError when complete runs were made with other settings than the sweep asks for."""
    data_cache: dict[tuple[str, str | None], dict[str, str]] = {}
    bad = [(r, d) for r in runs if (d := settings_mismatch(r, data_cache))]
    if bad:
        r, d = bad[0]
        raise SweepError(f"{len(bad)} finished run(s) used other settings than this sweep, e.g. {r.run_id} "
                         f"({d}) under {r.shard_dir}; write the sweep to another --out, or recompute them with "
                         "zaec-extract --force")

