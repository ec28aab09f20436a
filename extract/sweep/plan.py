"""The grid of a sweep: expansion, grouping by feature cache, cost estimate, and the sweep manifest.

A sweep is the product methods x datasets x backbones x seeds. Every run is resolved with the extractor's own
`plan_run` (unknown names fail here, before anything is submitted) and skipped when `run_is_complete` says its
shards are finished. The remaining runs are grouped by what their feature cache is keyed on - (backbone, weights,
dataset, view policy, seed), the policy taken from the method's config for that dataset after `--set` overrides -
so one job loads the model once and encodes each image once, and every method of the group adapts from the cache.

Everything here is pure or file-level and imports neither submitit nor typer; `extract.sweep.cli` (the command
line) submits, `extract.sweep.job` runs on the worker.

Files of a sweep, all under `<out>/_sweep/` (no `*.parquet` there, so `zaec-calibrate <out>` sees only shards):

    manifest.json        one row per run (run key, group, job id, state, shard dir, error line, ...)
    runs/<run>.json      written by the job as a run starts / ends (state, error line, shards)
    submitit/            submitit's pickles and job logs (`<job id>_0_log.out` / `.err`)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import fcntl
import functools
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Sequence

from schemas import RunKey, shard_dir

SWEEP_DIRNAME = "_sweep"
MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1

Executor = Literal["local", "slurm"]
EXECUTORS: tuple[str, ...] = ("local", "slurm")
#: pending: submitted, not started; running; done: run_is_complete; failed: error line recorded
State = Literal["pending", "running", "done", "failed"]
STATES: tuple[str, ...] = ("pending", "running", "done", "failed")
ACTIVE_STATES: frozenset[str] = frozenset({"pending", "running"})


class SweepError(ValueError):
    """A user-side problem with a sweep (bad grid, unknown name, no manifest). One clear line."""


# ---------------------------------------------------------------------------------------------------------------
# cost model of `--dry-run` (an estimate, documented as such)

#: Test-set sizes (images) of the paper's 15 datasets: ImageNet val, the released ImageNet-A/-V2 (matched
#: frequency)/-R/-Sketch, and the CoOp `split_zhou_*` test splits (FGVC-Aircraft: `images_variant_test.txt`).
TEST_SIZES: dict[str, int] = {
    "imagenet": 50000, "imagenet_a": 7500, "imagenet_v2": 10000, "imagenet_r": 30000, "imagenet_sketch": 50889,
    "caltech101": 2465, "dtd": 1692, "eurosat": 8100, "fgvc_aircraft": 3333, "food101": 30300,
    "flowers102": 2463, "oxford_pets": 3669, "stanford_cars": 8041, "sun397": 19850, "ucf101": 3783,
}
#: Fashion-MNIST's test set, used by every demo set (`fmnist`, `fmnist_noise`, ...).
DEMO_TEST_SIZE = 10000

#: Encoder GPU-seconds per encoded view, by backbone family. An estimate for one A100/H100-class GPU with autocast
#: fp16 and 8 image-loading workers: the network alone runs several thousand views/s, so JPEG decoding and AugMix
#: on the CPU set the pace; ~1000 views/s (ViT-B-16) and ~1500 views/s (RN50, smaller input pipeline cost per
#: forward) are the planning figures. Multi-view policies encode 64 views per image.
ENCODE_S_PER_VIEW: dict[str, float] = {"vit": 1 / 1000, "rn": 1 / 1500}
#: Adaptation GPU-seconds per sample, by method (estimate): zero-shot is one matmul; TDA a per-sample cache update;
#: DPE and DLAE one AdamW step on the prototype residuals per sample (DLAE adds its reflection step); TPS one AdamW
#: step on a (K, D) shift for a batch of samples at once.
ADAPT_S_PER_SAMPLE: dict[str, float] = {"zero-shot": 0.0001, "tda": 0.003, "dpe": 0.025, "dlae": 0.03, "tps": 0.005,
                                        "tpt": 0.005, "ctpt": 0.005, "otpt": 0.005, "atpt": 0.005}
#: ... plus GPU-seconds per sample and class, for the methods that run the text encoder per sample: the TPT family
#: does one forward + backward and one forward of the text transformer over the K prompts per sample (about
#: 25 GFLOP per prompt at ~100 TFLOP/s effective fp16), so ImageNet's 1000 classes cost ~0.25 s a sample.
ADAPT_S_PER_SAMPLE_CLASS: dict[str, float] = {"tpt": 2.5e-4, "ctpt": 2.5e-4, "otpt": 2.5e-4, "atpt": 2.5e-4}
#: Adaptation cost assumed for a registered method missing from the tables above (flagged in the plan).
DEFAULT_ADAPT_S_PER_SAMPLE = 0.03
#: Per-job overhead: start-up, model load, text prototypes (seconds).
JOB_OVERHEAD_S = 120.0
#: Classes per dataset (CoOp splits; ImageNet-A/-R are 200-class subsets), for the per-class costs.
NUM_CLASSES: dict[str, int] = {
    "imagenet": 1000, "imagenet_a": 200, "imagenet_v2": 1000, "imagenet_r": 200, "imagenet_sketch": 1000,
    "caltech101": 100, "dtd": 47, "eurosat": 10, "fgvc_aircraft": 100, "food101": 101, "flowers102": 102,
    "oxford_pets": 37, "stanford_cars": 196, "sun397": 397, "ucf101": 101,
}
DEMO_NUM_CLASSES = 10


#: Methods priced with another method's measured rate: C-TPT, O-TPT and A-TPT tune the same prompts with the same
#: text-encoder passes per sample as TPT (their extra loss terms cost little next to them).
RATE_PROXY: dict[str, str] = {"ctpt": "tpt", "otpt": "tpt", "atpt": "tpt"}


@dataclass(frozen=True)
class Rates:
    """Rates measured on one device by `python -m extract.bench_gpu --json FILE`, by backbone: what `--rates FILE`
    prices a sweep with instead of the fixed guesses above (backbones and methods it did not measure keep those).

    Attributes:
        source: the file.
        encode_s: (backbone, view policy) -> seconds per view through loader and encoder.
        adapt_s: (backbone, method) -> ((K, seconds per sample), ...) sorted by K.
        overhead_s: backbone -> seconds of a process's fixed cost.
    """

    source: str
    encode_s: Mapping[tuple[str, str], float]
    adapt_s: Mapping[tuple[str, str], tuple[tuple[int, float], ...]]
    overhead_s: Mapping[str, float]

    def adapt(self, backbone: str, method: str, k: int) -> float | None:
        """Seconds per sample at K classes: linear between the measured K, the end segments extended beyond them
        (the TPT family's cost grows linearly in K), never below zero; None when not measured."""
        pts = self.adapt_s.get((backbone, RATE_PROXY.get(method, method)))
        if not pts:
            return None
        if len(pts) == 1:
            return pts[0][1]
        (k0, s0), (k1, s1) = (pts[0], pts[1]) if k <= pts[0][0] else (pts[-2], pts[-1]) if k >= pts[-1][0] else \
            next((a, b) for a, b in zip(pts, pts[1:]) if a[0] <= k <= b[0])
        return max(0.0, s0 + (s1 - s0) * (k - k0) / (k1 - k0))


def _positive(doc: Mapping[str, Any], key: str, where: str) -> float:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise SweepError(f"{where}: expected a positive number at {key!r}, got {v!r}")
    return float(v)


@functools.lru_cache(maxsize=8)
def load_rates(path: str) -> Rates:
    """Read the JSON of `python -m extract.bench_gpu --json` (format version 1). Raises SweepError naming the file
    and the key when it is not such a file."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SweepError(f"--rates {path}: cannot read a JSON file ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(doc.get("backbones"), dict) \
            or not doc["backbones"]:
        raise SweepError(f"--rates {path}: expected the JSON of `python -m extract.bench_gpu --json` (version 1, "
                         "a 'backbones' object)")
    enc: dict[tuple[str, str], float] = {}
    adapt: dict[tuple[str, str], tuple[tuple[int, float], ...]] = {}
    over: dict[str, float] = {}
    for bb, r in doc["backbones"].items():
        where = f"--rates {path}, backbone {bb}"
        if not isinstance(r, dict):
            raise SweepError(f"{where}: expected an object, got {r!r}")
        enc[(bb, "single")] = 1.0 / _positive(r, "single_view_images_per_s", where)
        enc[(bb, "crop_flip")] = 1.0 / _positive(r, "crop_flip_views_per_s", where)
        enc[(bb, "augmix")] = 1.0 / _positive(r, "augmix_views_per_s", where)
        if isinstance(r.get("fixed_cost"), dict):
            over[bb] = _positive(r["fixed_cost"], "process_s", where)
        for method, per_k in (r.get("adapt_samples_per_s") or {}).items():
            if not isinstance(per_k, dict) or not per_k:
                raise SweepError(f"{where}: expected {{K: samples/s}} for {method!r}, got {per_k!r}")
            try:
                pts = sorted((int(k), 1.0 / _positive(per_k, k, where)) for k in per_k)
            except ValueError:
                raise SweepError(f"{where}: class counts of {method!r} must be integers, got {list(per_k)}") from None
            adapt[(bb, method)] = tuple(pts)
    return Rates(str(path), enc, adapt, over)


def _listed_size(dataset: str) -> tuple[int, int] | None:
    """(images, classes) of a user's dataset registered in this process, from its listing; None otherwise."""
    from extract.datasets import dataset_source

    source = dataset_source(dataset)
    return None if source is None else _listing(dataset, source)


@functools.lru_cache(maxsize=None)
def _listing(dataset: str, source: tuple[str, str | None]) -> tuple[int, int]:
    from extract.datasets import load_testset

    ts = load_testset(dataset)
    return len(ts), ts.num_classes


def _table_size(dataset: str) -> tuple[int, int] | None:
    # ImageNet-C: every corruption and severity holds the 50,000 validation images of the 1000 classes
    base = "imagenet" if dataset.startswith("imagenet_c:") else dataset
    if base in TEST_SIZES:
        return TEST_SIZES[base], NUM_CLASSES[base]
    if dataset.startswith("fmnist"):
        return DEMO_TEST_SIZE, DEMO_NUM_CLASSES
    return _listed_size(dataset)


def adapt_seconds(method: str, dataset: str, backbone: str | None = None, rates: Rates | None = None) -> float:
    """Estimated adaptation GPU-seconds per sample of `method` on `dataset`: measured (`rates`) where it holds the
    backbone and method, else the tables above."""
    k = (_table_size(dataset) or (0, DEMO_NUM_CLASSES))[1]
    measured = rates.adapt(backbone, method, k) if rates is not None and backbone is not None else None
    if measured is not None:
        return measured
    return ADAPT_S_PER_SAMPLE.get(method, DEFAULT_ADAPT_S_PER_SAMPLE) + ADAPT_S_PER_SAMPLE_CLASS.get(method, 0.0) * k


def encode_seconds(backbone: str, policy: str, rates: Rates | None = None) -> float:
    """Estimated GPU-seconds per encoded view: measured (`rates`) for this backbone and policy, else the table."""
    measured = rates.encode_s.get((backbone, policy)) if rates is not None else None
    return measured if measured is not None else ENCODE_S_PER_VIEW[_family(backbone)]


def overhead_seconds(backbone: str, rates: Rates | None = None) -> float:
    """Fixed seconds of one job: measured (`rates`) for this backbone, else JOB_OVERHEAD_S."""
    measured = rates.overhead_s.get(backbone) if rates is not None else None
    return measured if measured is not None else JOB_OVERHEAD_S


def n_images(dataset: str, limit: int | None = None) -> int:
    """Images a run over `dataset` processes: the table's test size (a user's dataset: its listing), capped by
    `--limit`.

    >>> n_images("dtd"), n_images("imagenet", limit=1000), n_images("imagenet_c:fog:3")
    (1692, 1000, 50000)
    """
    size = _table_size(dataset)
    if size is None:
        raise SweepError(f"no test size for dataset {dataset!r}; known: {', '.join(TEST_SIZES)}")
    return size[0] if limit is None else min(int(limit), size[0])


def _family(backbone: str) -> str:
    return "rn" if backbone.upper().startswith("RN") else "vit"


# ---------------------------------------------------------------------------------------------------------------
# runs and groups

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
    anchor: str = "single"
    device: str | None = None
    workers: int | None = None
    batch_size: int = 256
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


@dataclass(frozen=True)
class Group:
    """Runs sharing one feature cache; one job runs them one after the other with one loaded model."""

    runs: tuple[RunSpec, ...]

    @property
    def group_id(self) -> str:
        return self.runs[0].group_id

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(r.method for r in self.runs)

    def estimate_hours(self, rates: Rates | None = None) -> float:
        """Estimated GPU-hours: one encoding pass of the group's views plus each method's adaptation, priced with
        the measured `rates` where they cover it, else with the fixed guesses."""
        r0 = self.runs[0]
        n = n_images(r0.dataset, r0.limit)
        views = 1 if r0.policy == "single" else 64
        enc = n * views * encode_seconds(r0.backbone, r0.policy, rates)
        adapt = sum(n * adapt_seconds(r.method, r.dataset, r.backbone, rates) for r in self.runs)
        return (overhead_seconds(r0.backbone, rates) + enc + adapt) / 3600.0


def group_runs(runs: Sequence[RunSpec]) -> list[Group]:
    """Group runs by their feature cache key, keeping the first-seen order of groups and of runs within a group.

    Example:
        >>> a = RunSpec("tda", "dtd", "RN50", "RN50", "openai", 1, "single")
        >>> b = dataclasses.replace(a, method="zero-shot")
        >>> c = dataclasses.replace(a, dataset="eurosat")
        >>> [g.methods for g in group_runs([a, c, b])]
        [('tda', 'zero-shot'), ('tda',)]
    """
    groups: dict[tuple, list[RunSpec]] = {}
    for r in runs:
        groups.setdefault(r.group_key, []).append(r)
    return [Group(tuple(v)) for v in groups.values()]


def pack_groups(groups: Sequence[Group], n_jobs: int, rates: Rates | None = None) -> list[list[Group]]:
    """Split groups over at most `n_jobs` jobs, longest estimate first onto the least loaded job (LPT).

    Used by the local executor, where jobs share one machine; SLURM gets one array task per group.
    """
    if n_jobs < 1:
        raise SweepError(f"--local-jobs must be >= 1, got {n_jobs}")
    packs: list[list[Group]] = [[] for _ in range(min(n_jobs, len(groups)))]
    loads = [0.0] * len(packs)
    for g in sorted(groups, key=lambda g: -g.estimate_hours(rates)):  # stable: equal estimates keep their order
        i = loads.index(min(loads))
        packs[i].append(g)
        loads[i] += g.estimate_hours(rates)
    return packs


# ---------------------------------------------------------------------------------------------------------------
# the grid

@dataclass(frozen=True)
class Grid:
    """What to run, as given by the user (before resolution).

    Attributes:
        methods, datasets: keys of the method and dataset registries (`datasets=("all",)` = the 15 of the paper;
            see `expand_datasets` for `imagenet_c` and a user's `folder:`/`split:` datasets).
        backbones: open_clip names, each optionally `NAME=PRETRAINED` to give it its own weights; empty with a
            `local-dir:` `pretrained` (the directory names the model).
        seeds: stream/view seeds.
        pretrained: weights for every backbone without its own (`openai`, a file, `local-dir:DIR`).
        overrides: `--set` items: `key=value` for every method, or `method.key=value` for one method.
        class_names: (dataset name, class-names file) pairs for a user's `folder:`/`split:` datasets (see
            `class_names_files`).
    """

    methods: tuple[str, ...]
    datasets: tuple[str, ...]
    backbones: tuple[str, ...] = ("ViT-B-16",)
    seeds: tuple[int, ...] = (1,)
    pretrained: str = "openai"
    overrides: tuple[str, ...] = ()
    class_names: tuple[tuple[str, str], ...] = ()


def split_list(raw: str | Sequence[Any] | None, what: str) -> tuple[str, ...]:
    """'a,b, c' or ['a', 'b'] -> ('a', 'b', 'c'); an empty result is an error naming the option."""
    if raw is None:
        return ()
    items = raw.split(",") if isinstance(raw, str) else [str(x) for x in raw]
    out = tuple(s.strip() for s in items if str(s).strip())
    if not out:
        raise SweepError(f"{what}: expected a comma-separated list, got {raw!r}")
    return out


def parse_seeds(raw: str | Sequence[Any]) -> tuple[int, ...]:
    """'1,2,3' or [1, 2] -> (1, 2, 3); seeds are integers >= 0."""
    out = []
    for s in split_list(raw, "--seeds"):
        try:
            v = int(s)
        except ValueError:
            raise SweepError(f"--seeds expects integers, got {s!r}") from None
        if v < 0:
            raise SweepError(f"--seeds must be >= 0, got {v}")
        out.append(v)
    return tuple(dict.fromkeys(out))


def method_overrides(items: Sequence[str], methods: Sequence[str]) -> dict[str, dict[str, str]]:
    """`--set` items -> {method: {key: value}}: `key=value` applies to every method, `method.key=value` to one.

    Raises:
        SweepError: an item without '=', or a method prefix that is not in the grid.

    Example:
        >>> method_overrides(["tda.alpha=3", "batch=2"], ["tda", "dpe"])
        {'tda': {'batch': '2', 'alpha': '3'}, 'dpe': {'batch': '2'}}
    """
    out: dict[str, dict[str, str]] = {m: {} for m in methods}
    scoped = []
    for item in items:
        k, sep, v = item.partition("=")
        k = k.strip()
        if not sep or not k:
            raise SweepError(f"--set expects key=value or method.key=value, got {item!r}")
        if "." in k:
            m, _, k = k.partition(".")
            if m not in out:
                raise SweepError(f"--set {item!r}: method {m!r} is not in the sweep; methods: {', '.join(methods)}")
            scoped.append((m, k, v.strip()))
        else:
            for m in out:
                out[m][k] = v.strip()
    for m, k, v in scoped:  # a method-scoped value wins over a global one
        out[m][k] = v
    return out


def _split_backbone(entry: str, pretrained: str) -> tuple[str | None, str]:
    name, sep, weights = entry.partition("=")
    name, weights = name.strip(), weights.strip()
    if sep and not weights:
        raise SweepError(f"--backbones entry {entry!r}: expected NAME or NAME=PRETRAINED")
    return (name or None), (weights if sep else pretrained)


def class_names_files(raw: Mapping[str, Any] | str | Sequence[Any] | None) -> dict[str, str]:
    """`--class-names NAME=FILE` items (or the config's `class_names` table {NAME: FILE}) -> {NAME: FILE}.

    Raises:
        SweepError: an item that is not NAME=FILE, or one NAME given two files.

    Example:
        >>> class_names_files(["derm=names.txt"]) == class_names_files({"derm": "names.txt"}) == {"derm": "names.txt"}
        True
    """
    if isinstance(raw, Mapping):
        items = [(str(k).strip(), str(v).strip()) for k, v in raw.items()]
    else:
        items = []
        for item in split_list(raw, "--class-names") if raw else ():
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise SweepError(f"--class-names expects NAME=FILE (NAME: a folder:/split: dataset of --datasets), "
                                 f"got {item!r}")
            items.append((name.strip(), path.strip()))
    out: dict[str, str] = {}
    for name, path in items:
        if out.setdefault(name, path) != path:
            raise SweepError(f"--class-names: dataset {name!r} is given two files ({out[name]} and {path})")
    return out


def expand_datasets(entries: Sequence[str], class_names: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """`--datasets` entries -> canonical dataset keys, in order, duplicates removed.

    `all` = the 15 of the paper; `imagenet_c` = its 75 keys, `imagenet_c:<corruption>` its 5 severities;
    `folder:PATH` / `split:FILE.json` a user's dataset named after its folder, `NAME=folder:PATH` named NAME
    (registered in this process, see `extract.datasets.resolve_dataset`). `class_names` maps such a dataset's
    canonical name to its class-names file.

    Raises:
        SweepError: two different user datasets with one name, a `class_names` name that is no user dataset of
            the entries. DatasetError: a bad reference, name or class-names file.
    """
    from extract.datasets import PAPER_DATASETS, dataset_source, expand_dataset_keys, resolve_dataset

    class_names = class_names or {}
    out: list[str] = []
    refs: dict[str, str] = {}
    for d in entries:
        name, sep, ref = d.partition("=")
        if not sep or d.startswith(("folder:", "split:")):
            name, ref = "", d
        if ref.startswith(("folder:", "split:")):
            key = resolve_dataset(ref, name=name or None)
            if key in class_names:
                key = resolve_dataset(ref, name=key, class_names=class_names[key])
            source = dataset_source(key)
            if refs.setdefault(key, str(source)) != str(source):
                raise SweepError(f"--datasets: two datasets are named {key!r}; name one with NAME=folder:PATH")
            out.append(key)
        elif sep:
            raise SweepError(f"--datasets entry {d!r}: NAME=... names folder:PATH or split:FILE.json datasets only")
        else:
            out += PAPER_DATASETS if d == "all" else expand_dataset_keys(d)
    unknown = [n for n in class_names if n not in refs]
    if unknown:
        raise SweepError(f"--class-names {unknown[0]}=...: no folder:PATH or split:FILE.json dataset of --datasets "
                         f"is named {unknown[0]!r}; the sweep's own datasets: {', '.join(refs) or 'none'}")
    return tuple(dict.fromkeys(out))


def expand_grid(grid: Grid, *, out: str | os.PathLike, data_root: str | os.PathLike | None = None,
                cache_dir: str | os.PathLike | None = None, cupl_dir: str | os.PathLike | None = None,
                limit: int | None = None, anchor: str = "single", device: str | None = None,
                workers: int | None = None, batch_size: int = 256) -> list[RunSpec]:
    """Resolve every run of the grid with the extractor's `plan_run`; raises on any unknown name or bad `--set`.

    Paths are made absolute so a worker does not depend on its working directory.

    Returns:
        RunSpecs in grid order (backbone, dataset, seed, method), duplicates removed.

    Raises:
        SweepError: empty grid, duplicate shard paths (one backbone name with two different weights).
        ValueError and its subclasses from the extractor (unknown method, dataset, config key, missing local-dir).
    """
    from extract.datasets import dataset_source
    from extract.models import LOCAL_DIR
    from extract.runner import plan_run

    if not grid.methods:
        raise SweepError("no methods given (--methods tda,dpe,...)")
    datasets = expand_datasets(grid.datasets or (), dict(grid.class_names))
    if not datasets:
        raise SweepError("no datasets given (--datasets all, or a list: dtd,eurosat,...)")
    if not grid.seeds:
        raise SweepError("no seeds given (--seeds 1)")
    backbones = grid.backbones or ((None,) if grid.pretrained.startswith(LOCAL_DIR) else ())
    if not backbones:
        raise SweepError("no backbones given (--backbones ViT-B-16,RN50)")
    if limit is not None and limit < 1:
        raise SweepError(f"--limit must be >= 1, got {limit}")
    per_method = method_overrides(grid.overrides, grid.methods)

    def _abs(p: str | os.PathLike | None) -> str | None:
        return None if p is None else str(Path(p).expanduser().resolve())

    def _weights(p: str) -> str:  # a checkpoint file or local-dir path, absolute; a tag unchanged
        if p.startswith(LOCAL_DIR):
            return LOCAL_DIR + str(Path(p[len(LOCAL_DIR):]).expanduser().resolve())
        path = Path(p).expanduser()
        if path.suffix in (".pt", ".pth", ".bin", ".safetensors") or os.sep in p:
            if not path.is_file():
                raise SweepError(f"checkpoint file {p} does not exist (--pretrained / --backbones NAME=FILE)")
            return str(path.resolve())
        return p

    runs: dict[str, RunSpec] = {}
    weights_of: dict[str, str] = {}
    for entry in backbones:
        name, weights = _split_backbone(entry, grid.pretrained) if entry is not None else (None, grid.pretrained)
        weights = _weights(weights)
        for dataset in datasets:
            for seed in grid.seeds:
                for method in grid.methods:
                    plan = plan_run(method, dataset, backbone=name, pretrained=weights, seed=seed,
                                    overrides=per_method[method] or None, anchor=anchor, limit=limit)
                    if weights_of.setdefault(plan.backbone, weights) != weights:
                        raise SweepError(f"backbone {plan.backbone!r} appears with two weights "
                                         f"({weights_of[plan.backbone]} and {weights}); their shards would share "
                                         "one folder: run them into different --out roots")
                    spec = RunSpec(method=method, dataset=dataset, backbone=plan.backbone, backbone_arg=name,
                                   pretrained=weights, seed=int(seed), policy=str(plan.policy),
                                   overrides=tuple(sorted(per_method[method].items())), out=_abs(out) or "",
                                   data_root=_abs(data_root), cache_dir=_abs(cache_dir), cupl_dir=_abs(cupl_dir),
                                   limit=limit, anchor=anchor, device=device, workers=workers,
                                   batch_size=batch_size)
                    source = dataset_source(dataset)
                    if source is not None:
                        spec = dataclasses.replace(spec, dataset_ref=source[0], class_names_file=source[1])
                    runs.setdefault(spec.run_id, spec)
    return list(runs.values())


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
    from extract.runner import COMPLETE_MARKER, data_identity, plan_run

    info = read_json(run.shard_dir / COMPLETE_MARKER) or {}
    recorded = info.get("settings") or {}
    plan = plan_run(run.method, run.dataset, backbone=run.backbone_arg, pretrained=run.pretrained, seed=run.seed,
                    overrides=dict(run.overrides) or None, anchor=run.anchor, limit=run.limit)
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


# ---------------------------------------------------------------------------------------------------------------
# sweep folder, per-run result files, manifest

def sweep_dir(out: str | os.PathLike) -> Path:
    return Path(out) / SWEEP_DIRNAME


def manifest_path(out: str | os.PathLike) -> Path:
    return sweep_dir(out) / MANIFEST_NAME


def result_path(out: str | os.PathLike, run_id: str) -> Path:
    """`<out>/_sweep/runs/<readable run id>-<hash>.json`; the hash keeps distinct ids distinct after sanitising."""
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", run_id)
    return sweep_dir(out) / "runs" / f"{safe}-{hashlib.sha1(run_id.encode()).hexdigest()[:8]}.json"


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_json_atomic(path: Path, obj: Any) -> Path:
    """Write JSON under a temporary name in the same folder, then rename (never half-written)."""
    from extract.cache import write_json_atomic as _w

    return _w(path, obj)


def read_json(path: Path) -> Any | None:
    """The JSON document at `path`, or None when absent or unreadable (a result file being replaced)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def error_line(exc: BaseException) -> str:
    """One line for the manifest: `Type: first line of the message` (the traceback goes to the job's log).

    >>> error_line(ValueError("bad value\\nmore detail"))
    'ValueError: bad value'
    """
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0].strip()}" if msg else type(exc).__name__


@dataclass
class Manifest:
    """The sweep manifest: one row per run, keyed by run id, plus the executor settings of the last submission.

    A row: run_id, backbone, dataset, method, seed, group, policy, job_id, executor, state, shard_dir, error, log
    (the job's stderr), token (identifies the submission the row belongs to), submitted, updated, attempts, spec
    (the RunSpec as a dict, what `retry` resubmits).
    """

    out: Path
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    executor: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, out: str | os.PathLike, *, must_exist: bool = False) -> "Manifest":
        path = manifest_path(out)
        doc = read_json(path)
        if doc is None:
            if must_exist or path.exists():
                what = "is unreadable" if path.exists() else "does not exist"
                raise SweepError(f"sweep manifest {path} {what}; start a sweep with `zaec-sweep --out {out} ...`")
            return cls(Path(out))
        if doc.get("version") != MANIFEST_VERSION:
            raise SweepError(f"{path}: manifest version {doc.get('version')!r}, expected {MANIFEST_VERSION}")
        rows = {r["run_id"]: r for r in doc.get("runs", [])}
        return cls(Path(out), rows, dict(doc.get("executor", {})))

    def save(self) -> Path:
        doc = {"version": MANIFEST_VERSION, "out": str(self.out), "updated": now(), "executor": self.executor,
               "runs": [self.rows[k] for k in sorted(self.rows)]}
        return write_json_atomic(manifest_path(self.out), doc)

    def record_submission(self, run: RunSpec, *, job_id: str, token: str, log: str = "",
                          executor: str = "local") -> None:
        old = self.rows.get(run.run_id, {})
        self.rows[run.run_id] = {
            "run_id": run.run_id, **run.key.as_dict(), "group": run.group_id, "policy": run.policy,
            "job_id": job_id, "executor": executor, "state": "pending", "shard_dir": str(run.shard_dir),
            "error": "", "log": log,
            "token": token, "submitted": now(), "updated": now(), "attempts": int(old.get("attempts", 0)) + 1,
            "spec": run.to_dict(),
        }

    def record_done(self, run: RunSpec) -> None:
        """A run found complete at planning time (no submission)."""
        old = self.rows.get(run.run_id, {})
        self.rows[run.run_id] = {
            "run_id": run.run_id, **run.key.as_dict(), "group": run.group_id, "policy": run.policy,
            "job_id": old.get("job_id", ""), "state": "done", "shard_dir": str(run.shard_dir), "error": "",
            "log": old.get("log", ""), "token": old.get("token", ""), "submitted": old.get("submitted", ""),
            "updated": now(), "attempts": int(old.get("attempts", 0)), "spec": run.to_dict(),
        }

    def spec(self, run_id: str) -> RunSpec:
        """The run's RunSpec; a user's dataset is registered in this process on the way."""
        spec = RunSpec.from_dict(self.rows[run_id]["spec"])
        spec.register_dataset()
        return spec


@contextlib.contextmanager
def locked_manifest(out: str | os.PathLike, *, must_exist: bool = False) -> Iterator[Manifest]:
    """Load, yield and save the manifest under an exclusive lock (`status` and `run` may run at the same time)."""
    d = sweep_dir(out)
    if must_exist and not manifest_path(out).exists():
        raise SweepError(f"no sweep manifest at {manifest_path(out)}; start a sweep with `zaec-sweep --out {out} ...`")
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".manifest.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            m = Manifest.load(out, must_exist=must_exist)
            yield m
            m.save()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def new_token() -> str:
    """Identifies one submission: a job's result files count only for the submission that wrote them."""
    return hashlib.sha1(os.urandom(16)).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------------------------
# tables (polars DataFrames; the CLI renders them)

def plan_frame(groups: Sequence[Group], rates: Rates | None = None) -> "Any":
    """One row per group: group, backbone, dataset, policy, seed, methods, runs, images, views, est. GPU-hours."""
    import polars as pl

    rows = []
    for g in groups:
        r0 = g.runs[0]
        n = n_images(r0.dataset, r0.limit)
        rows.append({"group": g.group_id, "backbone": r0.backbone, "dataset": r0.dataset, "policy": r0.policy,
                     "seed": r0.seed, "methods": ",".join(g.methods), "runs": len(g.runs), "images": n,
                     "views": n * (1 if r0.policy == "single" else 64), "gpu_hours": g.estimate_hours(rates)})
    schema = {"group": pl.Utf8, "backbone": pl.Utf8, "dataset": pl.Utf8, "policy": pl.Utf8, "seed": pl.Int64,
              "methods": pl.Utf8, "runs": pl.Int64, "images": pl.Int64, "views": pl.Int64, "gpu_hours": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def manifest_frame(manifest: Manifest) -> "Any":
    """One row per run of the manifest: run key, group, job id, state, shard dir, error line (sorted by run id)."""
    import polars as pl

    cols = ("backbone", "dataset", "method", "seed", "group", "job_id", "state", "attempts", "shard_dir", "error",
            "log")
    schema = {c: pl.Utf8 for c in cols} | {"seed": pl.Int64, "attempts": pl.Int64}
    rows = [{c: manifest.rows[k].get(c, "" if schema[c] == pl.Utf8 else 0) for c in cols}
            for k in sorted(manifest.rows)]
    return pl.DataFrame(rows, schema=schema)


def fmt_hours(h: float) -> str:
    return f"{h:.2f}" if h < 10 else f"{h:.0f}"


def default_timeout_min(groups: Sequence[Group], rates: Rates | None = None) -> int:
    """SLURM time limit when `--timeout-min` is not given: twice the longest group's estimate, at least an hour,
    rounded up to 30 minutes (a run that still times out resumes from its shards on `retry` or requeue)."""
    longest = max((g.estimate_hours(rates) for g in groups), default=0.0)
    return max(60, int(math.ceil(2 * longest * 60 / 30.0)) * 30)
