"""The options of a run and its plan: every option that decides the result in one frozen `RunOptions`, the options
that only decide how it executes in `ExecOptions`, and `plan()` resolving names and the method config before any
file is read.

The run's defaults live here (`DEFAULT_*`: seed, anchor, sizes, output folder); those the low floors need too (the
default backbone, and the data root, feature cache and CuPL folders with their environment fallbacks) live one
floor down in `extract.defaults`, so that `extract.datasets`, `extract.cache`, `extract.models` and
`extract.prompts` never import this module. It imports nothing heavy (no torch), so a command line can read its
defaults before the model stack loads.

Example:
    >>> opts = RunOptions("tda", "dtd", seed=2, overrides=(("alpha", "2.0"),))
    >>> RunOptions.from_dict(opts.to_dict()) == opts
    True
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

from extract.defaults import DEFAULT_BACKBONE, DEFAULT_MAX_IMAGE_PIXELS
from schemas.atomic import check_output_dir as schemas_check_output_dir

if TYPE_CHECKING:
    from schemas.shard import RunKey

Anchor = Literal["single", "method"]
ANCHORS: tuple[str, ...] = ("single", "method")
OnChanged = Literal["refuse", "recompute"]
#: how an interrupted run rebuilds the method's state (`PlannedRun.restore`)
Restore = Literal["replay", "footer", "file"]
ON_CHANGED: tuple[str, ...] = ("refuse", "recompute")

DEFAULT_PRETRAINED = "openai"
#: TDA, DPE and DLAE seed their stream with 1 (docs/methods.md, "Stream order and seeds")
DEFAULT_SEED = 1
DEFAULT_ANCHOR: Anchor = "single"
DEFAULT_FINGERPRINT = "stat"
DEFAULT_OUT = Path("data") / "shards"
DEFAULT_BATCH_SIZE = 256
DEFAULT_CHUNK_SIZE = 512
DEFAULT_ADAPT_BATCH = 64
DEFAULT_PART_SIZE = 4096
#: the help of `--adapt-batch` and `--part-size`, one text for zaec-extract and zaec-sweep
ADAPT_BATCH_HELP = ("samples per adapt call; recorded with the run (a call's rows may round with its width, and "
                    "a finished run serves a shorter --limit only where the limit ends one of its calls)")
PART_SIZE_HELP = "rows per shard, a multiple of --adapt-batch"
#: image-loading processes on CUDA when none are given: one per CPU core, at most this many (CPU: 0, in-process)
MAX_CUDA_WORKERS = 16


class RunError(ValueError):
    """A user-side problem with a run (bad argument, shards on disk from a different configuration)."""


class BackboneRefusal(RunError):
    """A method that cannot run on the run's backbone (`TTAMethod.towers`), found by `plan` from the backbone's
    config: `zaec-extract` stops with the line, the sweep leaves the run out of its grid with a note."""


def parse_overrides(pairs: Sequence[str]) -> dict[str, str]:
    """["k=v", ...] -> {k: v}; raises RunError for an item without '='."""
    out: dict[str, str] = {}
    for item in pairs:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise RunError(f"--set expects key=value, got {item!r}")
        out[k.strip()] = v.strip()
    return out


def _path_str(p: str | os.PathLike | None) -> str | None:
    return None if p is None else str(p)


@dataclass(frozen=True)
class RunOptions:
    """Every option that decides what a run writes (its shards and their metadata).

    Attributes:
        method: method key (`extract.methods.REGISTRY`).
        dataset: dataset key, or the name a user's dataset was registered under (`dataset_ref`).
        backbone: open_clip model name; None = `DEFAULT_BACKBONE`, or with `pretrained="local-dir:DIR"` the
            directory's model name.
        pretrained: tag (`openai`), checkpoint file or `local-dir:DIR`.
        seed: orders the stream and seeds the augmented views.
        limit: only the first `limit` stream positions (None: all).
        overrides: (config field, value) pairs in the order given, as `--set` (strings converted to the field type).
        anchor: "single" = zero-shot logits from "a photo of a {}." on view 0; "method" = the method's own prompts.
        data_root: datasets folder (None: `extract.defaults.default_data_root()`).
        cupl_dir: CuPL prompt files (None: `extract.defaults.default_cupl_dir()`).
        descriptions_dir: class-description files of a method that reads them (AWT's `<dataset>.json`; None:
            `extract.defaults.default_descriptions_dir()`).
        sh_filter: TDA's file-listing quirk on ImageNet-A/-R/-Sketch/-V2, off by default
            (docs/methods.md, "TDA's file-listing quirk (sh_filter)").
        fingerprint: how image files are fingerprinted: "stat" (size and modification time) or "content" (sha256).
        exif_transpose: turn each image as its EXIF orientation tag says before the views are made. Off by
            default: the official code and torchvision's ImageFolder ignore EXIF (docs/extract.md, "Your own data").
        adapt_batch: samples per `method.adapt` call (an online method's result depends on it).
        part_size: rows per shard (a multiple of `adapt_batch`).
        dataset_ref: for a user's dataset, the `folder:PATH` / `split:FILE.json` it was registered from, so that
            another process registers the same dataset (`register_dataset`); None for a registered key.
        class_names_file: the class-names file of a user's dataset (with `dataset_ref`).
        ood_for: an out-of-distribution run: the in-distribution dataset's key; `dataset` is then the OOD set, the
            stream mixes both sets' images and every image is classified with the in-distribution set's class
            names, prompts and method settings (docs/extract.md, "Out-of-distribution runs"). None: a plain run.
        ood_for_ref, ood_for_class_names_file: for a user's in-distribution set, what `dataset_ref` and
            `class_names_file` are for `dataset` (another process registers it from them).
    """

    method: str
    dataset: str
    backbone: str | None = None
    pretrained: str = DEFAULT_PRETRAINED
    seed: int = DEFAULT_SEED
    limit: int | None = None
    overrides: tuple[tuple[str, Any], ...] = ()
    anchor: str = DEFAULT_ANCHOR
    data_root: str | None = None
    cupl_dir: str | None = None
    descriptions_dir: str | None = None
    sh_filter: bool = False
    fingerprint: str = DEFAULT_FINGERPRINT
    exif_transpose: bool = False
    adapt_batch: int = DEFAULT_ADAPT_BATCH
    part_size: int = DEFAULT_PART_SIZE
    dataset_ref: str | None = None
    class_names_file: str | None = None
    ood_for: str | None = None
    ood_for_ref: str | None = None
    ood_for_class_names_file: str | None = None

    @classmethod
    def make(cls, method: str, dataset: str, *, overrides: Mapping[str, Any] | None = None,
             data_root: str | os.PathLike | None = None, cupl_dir: str | os.PathLike | None = None,
             descriptions_dir: str | os.PathLike | None = None, **kw: Any) -> "RunOptions":
        """Build from the keyword style of `run_extraction` (a mapping of overrides, path-like folders)."""
        return cls(method, dataset, overrides=tuple((overrides or {}).items()), data_root=_path_str(data_root),
                   cupl_dir=_path_str(cupl_dir), descriptions_dir=_path_str(descriptions_dir), **kw)

    def overrides_dict(self) -> dict[str, Any]:
        """The overrides as a mapping, in the order given."""
        return dict(self.overrides)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (what a sweep manifest stores); `from_dict` gives back an equal object."""
        d = dataclasses.asdict(self)
        d["overrides"] = [list(kv) for kv in self.overrides]
        return d

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "RunOptions":
        """Inverse of `to_dict`; raises RunError naming unknown or missing keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - names)
        if unknown:
            raise RunError(f"unknown run option(s) {', '.join(unknown)}; available: {', '.join(sorted(names))}")
        missing = [k for k in ("method", "dataset") if k not in doc]
        if missing:
            raise RunError(f"run options lack {', '.join(missing)}")
        kw = dict(doc)
        kw["overrides"] = tuple((str(k), v) for k, v in kw.get("overrides", ()))
        return cls(**kw)

    def run_dataset(self) -> str:
        """The dataset key the run's shards record: `dataset`, or for an OOD run `<dataset>@<ood_for>`
        (`schemas.shard.ood_run_dataset`)."""
        if self.ood_for is None:
            return self.dataset
        from schemas.shard import ood_run_dataset

        return ood_run_dataset(self.dataset, self.ood_for)

    def register_dataset(self) -> str:
        """Register a user's dataset in this process (from `dataset_ref`), and a user's in-distribution set of an
        OOD run (`ood_for_ref`); returns the dataset key."""
        from extract.datasets import resolve_dataset

        if self.ood_for is not None and self.ood_for_ref is not None:
            resolve_dataset(self.ood_for_ref, name=self.ood_for, class_names=self.ood_for_class_names_file)
        if self.dataset_ref is None:
            return self.dataset
        return resolve_dataset(self.dataset_ref, name=self.dataset, class_names=self.class_names_file)


@dataclass(frozen=True)
class ExecOptions:
    """Options that decide how a run executes, never what it writes.

    Attributes:
        out: shard root (`<out>/backbone=../dataset=../method=../seed=../part-00000.parquet`).
        cache_dir: feature cache root (None: `extract.defaults.default_cache_dir()`).
        device: torch device (None: cuda if available).
        batch_size: images per encoder call. workers: image-loading processes (None: 0 on CPU, up to
            `MAX_CUDA_WORKERS` on CUDA).
        chunk_size: samples per feature-cache chunk.
        resume: keep valid parts of an interrupted run; False recomputes every part.
        force: recompute even a finished run.
        on_changed: a finished run whose settings differ: "refuse" (RunError naming what changed) or "recompute".
        progress: show the rich progress bar.
        wait_lock: seconds to wait while another process owns the run folder (`RunDir.lock`); None: for ever,
            0: stop at once with one line naming the owner.
        max_image_pixels: an image of more pixels stops the run with one line naming it (Pillow's
            decompression-bomb guard, `extract.datasets.open_image`); 0: no limit.
    """

    out: str | os.PathLike = DEFAULT_OUT
    cache_dir: str | os.PathLike | None = None
    device: str | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    workers: int | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    resume: bool = True
    force: bool = False
    on_changed: str = "refuse"
    progress: bool = True
    wait_lock: float | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS


def config_dict(config: Any) -> dict[str, Any]:
    """A method config as plain JSON values (what shards and the finished-run check record). A field whose metadata
    names a bool field in `recorded_with` is recorded only while that field is true (Panda's settings on its hosts:
    a run without Panda records what it recorded before Panda existed)."""
    off = {f.name for f in dataclasses.fields(config)
           if "recorded_with" in f.metadata and not getattr(config, f.metadata["recorded_with"])}
    full = json.loads(json.dumps(dataclasses.asdict(config), default=str))
    return {k: v for k, v in full.items() if k not in off}


@dataclass(frozen=True)
class PlannedRun:
    """A run with every name resolved, before any file is read (`plan`).

    Attributes:
        options: what was asked for.
        method_cls: the method class; config: its config with the overrides applied.
        dataset: the dataset's canonical key; backbone: the model name the shards record.
        policy: the view policy ("single", "crop_flip", "augmix", "crop_flip_05");
            key: RunKey(backbone, dataset, method, seed).
        settings_note: for a dataset without official settings: which settings apply (printed, kept in shards).
        ood_for: an OOD run's in-distribution key (None: a plain run); ood_dataset: its OOD set's key. `dataset` is
            then `<ood_dataset>@<ood_for>`.
        model_notes: defaults lowered to fit the model (TTL's lora_blocks on a model with fewer vision blocks), one
            line each (printed and kept in the shards' `zaec:warnings`).
        one_image: the refusal of a batch of one image on this backbone (`Towers.one_image_fails`: a method on batch
            statistics over a ResNet whose last stage is 1x1), "" when any batch runs; `last_batch_refusal`.
    """

    options: RunOptions
    method_cls: type
    config: Any
    dataset: str
    backbone: str
    policy: str
    key: "RunKey"
    settings_note: str = ""
    ood_for: str | None = None
    ood_dataset: str | None = None
    model_notes: tuple[str, ...] = ()
    one_image: str = ""

    @property
    def class_dataset(self) -> str:
        """The dataset whose class names, prompts and method settings the run uses (the in-distribution set of an
        OOD run)."""
        return self.ood_for or self.dataset

    @property
    def spec_key(self) -> str:
        """The dataset's canonical key (the name the older `plan_run` result used)."""
        return self.dataset

    @property
    def episodic(self) -> bool:
        """Whether the method resets its state per sample (its state after a part is then stored in the part)."""
        return bool(getattr(self.config, "episodic", False))

    def config_dict(self) -> dict[str, Any]:
        """The method config as recorded in shards and settings."""
        return config_dict(self.config)

    @property
    def consumes(self) -> str:
        """What the run feeds the method (`TTAMethod.consumes_for`): "features", "view_pixels", "batch_pixels" or
        "set_features"."""
        return self.method_cls.consumes_for(self.config)  # type: ignore[attr-defined]

    @property
    def adapt_width(self) -> int:
        """Samples per `adapt` call: the method's batch where it has one (`TTAMethod.adapt_width`), else
        `--adapt-batch`."""
        own = self.method_cls.adapt_width(self.config)  # type: ignore[attr-defined]
        return self.options.adapt_batch if own is None else int(own)

    def width_note(self) -> str | None:
        """The line a run prints when `--adapt-batch` was given to a method that adapts in batches of its own
        (it does not apply there), else None."""
        own = self.method_cls.adapt_width(self.config)  # type: ignore[attr-defined]
        asked = self.options.adapt_batch
        if own is None or asked in (DEFAULT_ADAPT_BATCH, own):
            return None
        return (f"{self.options.method} adapts in batches of its batch_size ({own}): --adapt-batch {asked} does not "
                "apply (--set batch_size=N changes the batch)")

    @property
    def restore(self) -> Restore:
        """How an interrupted run rebuilds the method's state at the end of its kept parts: "replay" (an online
        method on cached features: the same `adapt` calls again), "footer" (an episodic method: the small state
        recorded in the last kept part's metadata) or "file" (a method that adapts over batches of pixels: the
        state saved beside the last kept part, `RunDir.state`)."""
        if self.consumes == "batch_pixels":
            return "file"
        return "footer" if self.episodic else "replay"

    def n_run(self, n_total: int) -> int:
        """Stream positions the run covers out of `n_total`."""
        return n_total if self.options.limit is None else min(self.options.limit, n_total)

    def last_batch_refusal(self, n_total: int) -> str | None:
        """Why the run of `n_total` listed samples cannot end: its last batch holds one image, which `one_image`
        refuses; None otherwise. The runner asks once it has listed the test set, before the model loads."""
        n, width = self.n_run(n_total), self.adapt_width
        if not self.one_image or width < 2 or n % width != 1:
            return None
        return (f"{self.one_image}; {n} samples in batches of {width} leave one in the last: choose a batch_size "
                "that leaves no such batch (or another --limit)")


def resolve_backbone_name(backbone: str | None, pretrained: str) -> str:
    """The backbone name a run records, without loading weights (for `local-dir:`, the folder's model decides:
    `extract.models.local_dir_name`, a ModelError for a `backbone` that disagrees)."""
    from extract.models import LOCAL_DIR, local_dir_name

    if pretrained.startswith(LOCAL_DIR):
        return local_dir_name(Path(pretrained[len(LOCAL_DIR):]).expanduser(), backbone)
    return backbone or DEFAULT_BACKBONE


def plan(options: RunOptions) -> PlannedRun:
    """Resolve method, dataset, backbone name, config (+ overrides) and the view policy; raises on any bad name.

    Raises:
        RunError (bad anchor, limit, seed, view settings, prompts on a user's dataset), BackboneRefusal (a method
        that cannot run on the backbone: `TTAMethod.towers`), ValueError (unknown method or config key),
        DatasetError (unknown dataset).
    """
    from extract.datasets import get_dataset
    from extract.methods import get_method
    from extract.views import view_policy
    from schemas.shard import RunKey

    o = options
    cls = get_method(o.method)
    spec = get_dataset(o.dataset)
    ood = None
    if o.ood_for is not None:
        ood, spec = spec, _in_distribution(o.ood_for, spec.key)
    elif spec.group == "ood":
        raise RunError(f"dataset {spec.key!r} is an out-of-distribution set (images without classes); run it "
                       f"against an in-distribution set with --ood-for KEY (e.g. imagenet)")
    if o.anchor not in ANCHORS:
        raise RunError(f"unknown anchor {o.anchor!r}; available: {', '.join(ANCHORS)}")
    if o.limit is not None and o.limit < 1:
        raise RunError(f"--limit must be >= 1, got {o.limit}")
    if o.seed < 0:
        raise RunError(f"seed must be >= 0, got {o.seed}")
    name = resolve_backbone_name(o.backbone, o.pretrained)
    unseen = spec.hparams_from is None  # a user's dataset: the method's documented settings for unseen data
    config = cls.unseen_config(name) if unseen else cls.default_config(spec.hparams_from, name)
    overrides = o.overrides_dict()
    config, model_notes = _checked_config(o.method, config, overrides, name, o.pretrained)
    one_image = _check_towers(o.method, cls, config, name, o.pretrained)
    refusal = cls.config_refusal(config)
    if refusal is not None:
        raise RunError(refusal)
    try:
        policy = view_policy(int(config.n_views), bool(config.augmix), config.crop_scale)
    except ValueError as e:
        raise RunError(f"{o.method}: {e}") from None
    note = _unseen_note(o.method, cls, spec.key, config, overrides) if unseen else ""
    _check_part_size(o, cls.adapt_width(config))
    if ood is None:
        return PlannedRun(o, cls, config, spec.key, name, policy, RunKey(name, spec.key, o.method, int(o.seed)), note,
                          model_notes=model_notes, one_image=one_image)
    from schemas.shard import ood_run_dataset

    key = ood_run_dataset(ood.key, spec.key)
    return PlannedRun(o, cls, config, key, name, policy, RunKey(name, key, o.method, int(o.seed)), note,
                      ood_for=spec.key, ood_dataset=ood.key, model_notes=model_notes, one_image=one_image)


def backbone_refusal(options: RunOptions) -> str | None:
    """Why `options`' method cannot run on its backbone (the `BackboneRefusal` that `plan` raises, from the method's
    `towers`), or None; any other problem of the options raises as `plan` does. What the demo and the benches ask
    to skip such a method without trying it.

    Example:
        >>> backbone_refusal(RunOptions("tca", "dtd", backbone="RN50")).startswith("tca condenses")  # doctest: +SKIP
        True
    """
    try:
        plan(options)
    except BackboneRefusal as e:
        return str(e)
    return None


def _check_part_size(o: RunOptions, width: int | None) -> None:
    """Parts hold whole adapt calls: `part_size` a multiple of `adapt_batch`, or of the method's own batch where it
    has one (`width`, `TTAMethod.adapt_width`; `--adapt-batch` does not apply to it). RunError otherwise. Sizes
    below 1 are `check_options`' to refuse, naming the option."""
    if min(o.part_size, o.adapt_batch) < 1:
        return
    if width is None and o.part_size % o.adapt_batch:
        raise RunError(f"part_size ({o.part_size}) must be a multiple of adapt_batch ({o.adapt_batch})")
    if width is not None and o.part_size % width:
        raise RunError(f"{o.method} adapts in batches of {width} samples: --part-size ({o.part_size}) must be a "
                       f"multiple of it (e.g. --part-size {max(1, o.part_size // width) * width})")


def _checked_config(method: str, config: Any, overrides: Mapping[str, Any], backbone: str,
                    pretrained: str) -> tuple[Any, tuple[str, ...]]:
    """`config` with the overrides applied, every field within its declared range (`extract.methods.base.setting`),
    ranges that depend on the model's architecture included where its config can be read without the weights
    (`extract.models.architecture_facts`; otherwise the method checks them on the loaded model). A default (not a
    `--set` value) above a bound of the model is lowered to it, with a note: TTL's last 3 of ViT-B/16's 12 blocks
    on a model of 2 blocks adapts both.

    Returns:
        (config, notes): one note per default lowered.

    Raises:
        ConfigRangeError: one line naming the method, the key, the value and the valid range; ValueError (unknown
            key, a value of the wrong type) naming the method.
    """
    from extract.methods.base import ConfigRangeError, apply_overrides, check_ranges, fit_to_model

    try:
        config = apply_overrides(config, dict(overrides)) if overrides else config
    except ConfigRangeError as e:
        raise e.for_method(method) from None
    except ValueError as e:  # an unknown key, a value of the wrong type
        raise RunError(f"{method}: {e}") from None
    facts = _architecture_facts(type(config), backbone, pretrained)
    config, notes = fit_to_model(config, facts, keep=overrides)
    check_ranges(config, method, facts)
    return config, tuple(f"{method} on {backbone}: {n}" for n in notes)


def _check_towers(method: str, cls: type, config: Any, backbone: str, pretrained: str) -> str:
    """Refuse a backbone the method cannot run on (`TTAMethod.towers` against the towers of the backbone's config,
    `extract.models.tower_kinds`; a config open_clip does not know passes, and the method's check on the loaded
    model decides). Returns the refusal of a batch of one image on it (`PlannedRun.one_image`), "" when none.

    Raises:
        BackboneRefusal: one line naming the method, the backbone and what the method runs on.
    """
    towers = cls.towers(config)  # type: ignore[attr-defined]
    if not towers.restricted:  # runs on every backbone: the config need not be read
        return ""
    from extract.models import tower_kinds

    kinds = tower_kinds(backbone, pretrained)
    why = towers.refusal(method, backbone, kinds, cls.adapt_width(config))  # type: ignore[attr-defined]
    if why is not None:
        raise BackboneRefusal(why)
    return towers.one_image_line(method, backbone) if towers.one_image_fails(kinds) else ""


def _architecture_facts(config_cls: type, backbone: str, pretrained: str) -> dict[str, int]:
    """The model facts the config's ranges need (`extract.models.architecture_facts`), {} when they need none."""
    from extract.methods.base import model_fact_names

    if not model_fact_names(config_cls):
        return {}
    from extract.models import architecture_facts

    return architecture_facts(backbone, pretrained)


def _in_distribution(ood_for: str, ood_key: str) -> Any:
    """The in-distribution set of an OOD run (its registry entry); RunError for one that cannot be.

    Every registered method takes a mixed stream: none reads labels, and an online method's state over the mixed
    stream is what the run measures (docs/extract.md, "Out-of-distribution runs").
    """
    from extract.datasets import DatasetError, get_dataset

    try:
        spec = get_dataset(ood_for)
    except DatasetError as e:
        raise RunError(f"--ood-for: {e}") from None
    if spec.group == "ood":
        raise RunError(f"--ood-for {ood_for!r} is an out-of-distribution set (no classes); --ood-for names the "
                       "in-distribution set whose classes the run predicts (e.g. imagenet)")
    if spec.key == ood_key:
        raise RunError(f"--dataset {ood_key!r} is the in-distribution set itself (--ood-for {ood_for!r}); the "
                       "out-of-distribution set must be another set")
    return spec


def _unseen_note(method: str, cls: type, dataset: str, config: Any, overrides: Mapping[str, Any]) -> str:
    """Which settings apply to a dataset without official ones; raises RunError for prompts that need them."""
    from extract.prompts import USER_PROMPT_POLICIES

    if config.prompts not in USER_PROMPT_POLICIES or config.cupl:
        raise RunError(f"dataset {dataset!r} has no per-dataset templates or CuPL sentences: prompts must be "
                       f"one of {', '.join(USER_PROMPT_POLICIES)} and cupl false, got prompts={config.prompts}, "
                       f"cupl={config.cupl}")
    changes = "".join(f", {k}={v}" for k, v in cls.unseen_changes.items())  # type: ignore[attr-defined]
    note = f"{method}'s settings for unseen data: {cls.unseen_like}'s row{changes}"  # type: ignore[attr-defined]
    note += f", then --set {', '.join(f'{k}={v}' for k, v in overrides.items())}" if overrides else ""
    return note


def check_options(options: RunOptions, execution: ExecOptions) -> None:
    """The numeric options and the output folders of a run, checked before any image is read (RunError); that the
    parts hold whole adapt calls is `plan`'s check (it knows the method's batch)."""
    for name in ("adapt_batch", "part_size"):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RunError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if execution.batch_size < 1:
        raise RunError(f"--batch-size must be a positive integer, got {execution.batch_size}")
    if execution.workers is not None and execution.workers < 0:
        raise RunError(f"--workers must be >= 0, got {execution.workers}")
    from extract.cache import resolve_cache_dir

    check_output_dir(execution.out, "--out")
    cache = execution.cache_dir
    check_output_dir(resolve_cache_dir(cache), "--cache-dir" if cache is not None else "the cache folder "
                     "($ZAEC_CACHE_DIR or data/cache; set --cache-dir)")
    if execution.wait_lock is not None and not execution.wait_lock >= 0:
        raise RunError(f"--wait-lock must be >= 0 seconds, got {execution.wait_lock}")
    n = execution.max_image_pixels
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise RunError(f"--max-image-pixels must be an integer >= 0 (0: no limit), got {n!r}")
    if execution.on_changed not in ON_CHANGED:
        raise RunError(f"on_changed must be 'refuse' or 'recompute', got {execution.on_changed!r}")


def check_output_dir(path: str | os.PathLike, option: str) -> Path:
    """`schemas.atomic.check_output_dir` (the one check every command runs on its output folder) as a RunError.

    Raises:
        RunError: one line naming the option, the path and what is wrong.
    """
    try:
        return schemas_check_output_dir(path, option)
    except ValueError as e:
        raise RunError(str(e)) from None
