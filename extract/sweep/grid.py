"""The grid of a sweep: what the user asked for (`Grid`), its expansion into resolved runs, and their grouping.

A sweep is the product methods x datasets x backbones x seeds. Every run is resolved with the extractor's own
`plan` (unknown names fail here, before anything is submitted; see `extract.sweep.runspec`). Runs are grouped by
what their feature cache is keyed on - (backbone, weights, dataset, view policy, seed), the policy taken from the
method's config for that dataset after `--set` overrides - so one job loads the model once and encodes each image
once, and every method of the group adapts from the cache.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from extract.sweep.cost import Rates, estimate_hours, n_images, views_per_image
from extract.sweep.errors import SweepError
from extract.defaults import DEFAULT_BACKBONE
from extract.run.options import DEFAULT_PRETRAINED, DEFAULT_SEED, BackboneRefusal
from extract.sweep.runspec import RunSpec, absolute_weights, is_local_dir, resolve_run, sweep_options


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
    backbones: tuple[str, ...] = (DEFAULT_BACKBONE,)
    seeds: tuple[int, ...] = (DEFAULT_SEED,)
    pretrained: str = DEFAULT_PRETRAINED
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


def expand_methods(entries: Sequence[str]) -> tuple[str, ...]:
    """`--methods` entries -> method keys, in order, duplicates removed: `all` = every registered method
    (`extract.methods.REGISTRY`, in its order, as the demo's `--methods all`); other names are resolved by `plan`.

    >>> expand_methods(["tda", "all"])[:3]
    ('tda', 'zero-shot', 'dpe')
    """
    from extract.methods import REGISTRY

    return tuple(dict.fromkeys(m for e in entries for m in (REGISTRY if e == "all" else (e,))))


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


def expand_datasets(entries: Sequence[str], class_names: Mapping[str, str] | None = None,
                    others: Sequence[str] = ()) -> tuple[str, ...]:
    """`--datasets` entries -> canonical dataset keys, in order, duplicates removed.

    `all` = the 15 of the paper; `imagenet_c` = its 75 keys, `imagenet_c:<corruption>` its 5 severities;
    `folder:PATH` / `split:FILE.json` a user's dataset named after its folder, `NAME=folder:PATH` named NAME
    (registered in this process, see `extract.datasets.resolve_dataset`). `class_names` maps such a dataset's
    canonical name to its class-names file; `others` are user datasets' names given elsewhere (`--ood-for`) that
    `class_names` may name too.

    Raises:
        SweepError: two different user datasets with one name, a `class_names` name that is no user dataset of
            the entries. DatasetError: a bad reference, name or class-names file.
    """
    from extract.datasets import PAPER_DATASETS, dataset_source, expand_dataset_keys

    class_names = class_names or {}
    out: list[str] = []
    refs: dict[str, str] = {}
    for d in entries:
        key = user_dataset(d, class_names, "--datasets")
        if key is not None:
            source = dataset_source(key)
            if refs.setdefault(key, str(source)) != str(source):
                raise SweepError(f"--datasets: two datasets are named {key!r}; name one with NAME=folder:PATH")
            out.append(key)
        else:
            out += PAPER_DATASETS if d == "all" else expand_dataset_keys(d)
    unknown = [n for n in class_names if n not in refs and n not in others]
    if unknown:
        where = "--datasets or --ood-for" if others else "--datasets"
        raise SweepError(f"--class-names {unknown[0]}=...: no folder:PATH or split:FILE.json dataset of {where} is "
                         f"named {unknown[0]!r}; the sweep's own datasets: {', '.join([*refs, *others]) or 'none'}")
    return tuple(dict.fromkeys(out))


def user_dataset(entry: str, class_names: Mapping[str, str], option: str) -> str | None:
    """The key of a user's dataset entry (`folder:PATH`, `split:FILE.json`, `NAME=` either), registered in this
    process with its `class_names` file where one is given for its name; None for any other entry (a registered
    key, resolved by `plan`).

    Raises:
        SweepError: `NAME=` before something else. DatasetError: a bad reference, name or class-names file.
    """
    from extract.datasets import resolve_dataset

    name, sep, ref = entry.partition("=")
    if not sep or entry.startswith(("folder:", "split:")):
        name, ref = "", entry
    if not ref.startswith(("folder:", "split:")):
        if sep:
            raise SweepError(f"{option} entry {entry!r}: NAME=... names folder:PATH or split:FILE.json datasets only")
        return None
    key = resolve_dataset(ref, name=name or None)
    return resolve_dataset(ref, name=key, class_names=class_names[key]) if key in class_names else key


def ood_for_source(ood_for: str | None, class_names: Mapping[str, str]) -> dict[str, str | None]:
    """The `RunOptions` fields of `--ood-for`: a registered key as it is, or a user's `folder:`/`split:` set
    (`NAME=` allowed, `--class-names NAME=FILE` for its class names) registered here, by its key, with the source
    a job registers it from (`ood_for_ref`, `ood_for_class_names_file`), as `zaec-extract --ood-for` takes it."""
    from extract.datasets import dataset_source

    key = user_dataset(ood_for, class_names, "--ood-for") if ood_for is not None else None
    if key is None:
        return {"ood_for": ood_for}
    ref, names = dataset_source(key) or (None, None)
    return {"ood_for": key, "ood_for_ref": ref, "ood_for_class_names_file": names}


def expand_grid(grid: Grid, *, out: str | os.PathLike | None = None, left_out: list[str] | None = None,
                **settings: Any) -> list[RunSpec]:
    """Resolve every run of the grid with the extractor's `plan`; raises on any unknown name or bad `--set`.

    A run whose method cannot run on its backbone (`plan` raises `BackboneRefusal`: `TTAMethod.towers`) is left out
    of the grid, never submitted to fail: `--methods all --backbones ViT-B-16,RN50` plans on RN50 only the methods
    that run there.

    Args:
        grid: what to run.
        out: the shard root (None: `zaec-extract`'s default).
        left_out: receives one line per (method, backbone) pair left out (the refusal, naming both), in grid order.
        settings: the options every run shares, by `RunOptions` / `ExecOptions` field name (`limit`, `anchor`,
            `sh_filter`, `fingerprint`, `data_root`, `cache_dir`, `device`, ...; None: the extractor's default),
            see `extract.sweep.runspec.sweep_options`. Folders are made absolute so a worker does not depend on its
            working directory.

    Returns:
        RunSpecs in grid order (backbone, dataset, seed, method), duplicates removed.

    Raises:
        SweepError: empty grid (given so, or left empty by the pairs left out), duplicate shard paths (one backbone
            name with two different weights).
        ValueError and its subclasses from the extractor (unknown method, dataset, config key, missing local-dir).
    """
    from extract.datasets import dataset_source

    grid = dataclasses.replace(grid, methods=expand_methods(grid.methods))
    ood = ood_for_source(settings.get("ood_for"), dict(grid.class_names))
    user_ood = ood["ood_for"] if "ood_for_ref" in ood else None  # a registered key has its own class names
    datasets, backbones, per_method = _checked_grid(grid, settings.get("limit"), user_ood)
    base, execution = sweep_options({**settings, "out": out, "ood_for": ood["ood_for"]})
    base = dataclasses.replace(base, **{k: v for k, v in ood.items() if k != "ood_for"})
    runs: dict[str, RunSpec] = {}
    weights_of: dict[str, str] = {}
    refused: dict[str, None] = {}  # the refusals, once each, in order
    for entry in backbones:
        name, weights = _split_backbone(entry, grid.pretrained) if entry is not None else (None, grid.pretrained)
        weights = absolute_weights(weights)
        for dataset in datasets:
            ref, names = dataset_source(dataset) or (None, None)
            for seed in grid.seeds:
                for method in grid.methods:
                    options = dataclasses.replace(
                        base, method=method, dataset=dataset, backbone=name, pretrained=weights, seed=int(seed),
                        overrides=tuple(sorted(per_method[method].items())), dataset_ref=ref,
                        class_names_file=names)
                    try:
                        spec = resolve_run(options, execution)
                    except BackboneRefusal as e:
                        refused.setdefault(str(e))
                        continue
                    if weights_of.setdefault(spec.backbone, weights) != weights:
                        raise SweepError(f"backbone {spec.backbone!r} appears with two weights "
                                         f"({weights_of[spec.backbone]} and {weights}); their shards would share "
                                         "one folder: run them into different --out roots")
                    runs.setdefault(spec.run_id, spec)
    if refused and not runs:
        raise SweepError(f"no run of the grid can run: {' | '.join(refused)}")
    if left_out is not None:
        left_out.extend(refused)
    return list(runs.values())


def _checked_grid(grid: Grid, limit: Any, user_ood: str | None = None
                  ) -> tuple[tuple[str, ...], tuple[str | None, ...], dict[str, dict[str, str]]]:
    """(dataset keys, backbone entries, per-method overrides) of a grid; SweepError for an empty dimension or a bad
    `--limit` (checked in this order, so the first problem of the command line is the one named). `user_ood`: the
    key of a user's `--ood-for` set (`folder:`/`split:`), which `--class-names` may name too."""
    if not grid.methods:
        raise SweepError("no methods given (--methods tda,dpe,...)")
    datasets = expand_datasets(grid.datasets or (), dict(grid.class_names), (user_ood,) if user_ood else ())
    if not datasets:
        raise SweepError("no datasets given (--datasets all, or a list: dtd,eurosat,...)")
    if not grid.seeds:
        raise SweepError("no seeds given (--seeds 1)")
    backbones: tuple[str | None, ...] = grid.backbones or ((None,) if is_local_dir(grid.pretrained) else ())
    if not backbones:
        raise SweepError("no backbones given (--backbones ViT-B-16,RN50)")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit < 1:
        raise SweepError(f"--limit must be >= 1, got {limit}")
    return datasets, backbones, method_overrides(grid.overrides, grid.methods)


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
        the measured `rates` where they cover it, else from each method's work (`extract.sweep.cost`)."""
        return estimate_hours(self.runs, rates)


def group_runs(runs: Sequence[RunSpec]) -> list[Group]:
    """Group runs by their feature cache key, keeping the first-seen order of groups and of runs within a group.

    Example:
        >>> from extract.run.options import ExecOptions, RunOptions
        >>> a = RunSpec(RunOptions("tda", "dtd", backbone="RN50"), ExecOptions(), "single")
        >>> b = dataclasses.replace(a, options=dataclasses.replace(a.options, method="zero-shot"))
        >>> c = dataclasses.replace(a, options=dataclasses.replace(a.options, dataset="eurosat"))
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


def plan_frame(groups: Sequence[Group], rates: Rates | None = None) -> "Any":
    """One row per group: group, backbone, dataset, policy, seed, methods, runs, images, views, est. GPU-hours."""
    import polars as pl

    rows = []
    for g in groups:
        r0 = g.runs[0]
        n = n_images(r0.dataset, r0.limit)
        rows.append({"group": g.group_id, "backbone": r0.backbone, "dataset": r0.dataset, "policy": r0.policy,
                     "seed": r0.seed, "methods": ",".join(g.methods), "runs": len(g.runs), "images": n,
                     "views": n * views_per_image(r0.policy), "gpu_hours": g.estimate_hours(rates)})
    schema = {"group": pl.Utf8, "backbone": pl.Utf8, "dataset": pl.Utf8, "policy": pl.Utf8, "seed": pl.Int64,
              "methods": pl.Utf8, "runs": pl.Int64, "images": pl.Int64, "views": pl.Int64, "gpu_hours": pl.Float64}
    return pl.DataFrame(rows, schema=schema)
