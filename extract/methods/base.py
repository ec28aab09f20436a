"""The contract every TTA method implements, its configuration base class, and `--set` overrides.

A method is a class with a `key`, a frozen `Config` dataclass next to it (the paper's defaults, each with its
source) and `default_config(hparams_key, backbone)` applying the per-dataset tables of the official configs. The
runner builds the method once per run with the text prototypes and the model's logit scale, then feeds it the view
features of consecutive samples in stream order:

    >>> cfg = method_cls.default_config("dtd", "ViT-B-16")          # doctest: +SKIP
    >>> m = method_cls(cfg, text_features, logit_scale, backbone="ViT-B-16", dataset="dtd")  # doctest: +SKIP
    >>> logits = m.adapt(view_feats)  # (B, V, D) -> (B, K) float32   # doctest: +SKIP

Each number or text of a config declares its valid range next to its default (`setting(0.04, gt=0)`,
`text_setting(...)`); `check_ranges` is the one validator (on construction, and in the run's plan with the facts of
the model's architecture). Online methods keep their state across `adapt` calls; episodic ones (the TPT family)
reset it per sample. A method that needs the text encoder (TPT tunes prompt tokens) sets `needs_text_encoder = True`
and receives it as the `text_encoder` keyword; adding such a method is one file plus one registry entry.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Collection, Literal, Mapping, Sequence

import torch

# The canonical dataset keys for which the official configs have per-dataset tables
# (docs/methods.md, "Per-dataset settings").
HPARAMS_KEYS: tuple[str, ...] = (
    "imagenet", "imagenet_a", "imagenet_v2", "imagenet_r", "imagenet_sketch", "caltech101", "dtd", "eurosat",
    "fgvc_aircraft", "food101", "flowers102", "oxford_pets", "stanford_cars", "sun397", "ucf101",
)
IMAGENET_FAMILY: frozenset[str] = frozenset({"imagenet", "imagenet_a", "imagenet_v2", "imagenet_r", "imagenet_sketch"})

# How the runner builds the class prototypes (docs/methods.md, "Class prototypes: prompts per method"):
#   single      "a photo of a {}."
#   dataset     TDA's per-dataset templates (the 7 Tip-Adapter templates for ImageNet/A/V2/Caltech/Cars/SUN, one
#               custom template for the others, the 80 CLIP templates for R/Sketch)
#   imagenet80  the 80 CLIP ImageNet templates
#   dpe_cars    DPE/DLAE's Stanford Cars pair: "a photo of a {}." and
#               "A {} featuring a wide range of color options for easy selection." (DPE `datasets/stanford_cars.py`)
#   clip_dataset CLIP's per-dataset prompt ensembles (TCA `datasets/*.py`; the 80 templates for the ImageNet family)
#   transclip   TransCLIP's and StatA's one template per dataset (their `datasets/*.py` `template`): "a photo of a
#               {}." for the ImageNet family, Caltech101, Stanford Cars and SUN397, "{} texture" (no full stop) for
#               DTD, the CoOp template of each other set
# Each template embedding is L2-normalised, averaged (with the CuPL sentences when `cupl`), and re-normalised.
PromptSet = Literal["single", "dataset", "imagenet80", "dpe_cars", "clip_dataset", "transclip"]
# What a method's output rows are (the shard's `zaec:output_kind`, docs/contract.md): "logits" (any real vector the
# official code ranks and calibrates through a softmax) or "log_probs" (natural-log probabilities, finite: where the
# official code outputs probabilities or vote fractions).
OutputKind = Literal["logits", "log_probs"]
BackboneFamily = Literal["rn", "vit"]
# What a method reads from the run; the run's steps serve each kind (docs/architecture.md, "The objects of a run"):
#   features      the cached view features of consecutive samples, (B, V, D) per `adapt` call (the default)
#   view_pixels   besides them, the pixels of each sample's views (TTL adapts the image encoder per sample: the
#                 run calls its `attach_views`, extract/run/pixels.py)
#   batch_pixels  besides them, the pixels of a batch of test images (`attach_pixels`, extract/run/pixels.py): the
#                 image encoder itself is adapted over batches (Tent, SAR, DeYO, BATCLIP); each `adapt` call is one
#                 batch of the method's own width (`adapt_width`), and the state after each part is saved beside
#                 it (docs/architecture.md, "A method that adapts over batches")
#   set_features  the cached features of a whole transductive unit (the run, or a batch of it) before any of its
#                 rows is written (StatA, TransCLIP, ZLaP)
Consumes = Literal["features", "view_pixels", "batch_pixels", "set_features"]

DPE_CARS_TEMPLATES: tuple[str, ...] = (
    "a photo of a {}.",
    "A {} featuring a wide range of color options for easy selection.",
)


def backbone_family(backbone: str) -> BackboneFamily:
    """Which column of a per-backbone table applies: "rn" for names starting with "RN" (RN50, RN50-quickgelu,
    RN101), "vit" for every other name (ViT-B-16 and the demo's small models).

    >>> backbone_family("RN50"), backbone_family("ViT-B-16"), backbone_family("tiny-vit")
    ('rn', 'vit', 'vit')
    """
    return "rn" if backbone.upper().startswith("RN") else "vit"


def check_hparams_key(hparams_key: str) -> None:
    if hparams_key not in HPARAMS_KEYS:
        raise ValueError(f"unknown dataset key {hparams_key!r} for the hyper-parameter tables; available: "
                         f"{', '.join(HPARAMS_KEYS)}")


# ---------------------------------------------------------------------------------------------- valid ranges
# Every settable number or text of a method config declares its valid range where it is declared, with `setting`
# (numbers) or `text_setting`; bool and Literal fields are ranged by their type. `check_ranges` is the one validator:
# every config runs it on construction (`MethodConfig.__post_init__`), the run's plan runs it again with the facts of
# the model's architecture, and a method built on a loaded model with the facts of that model.


@dataclass(frozen=True)
class Ref:
    """A bound read from another field of the config (`of_model=False`) or from a fact about the model's
    architecture (`of_model=True`, e.g. "vision_blocks"), plus `offset`, and at least `floor`.

    >>> Ref("n_views", -1, floor=1).text()
    'max(1, n_views - 1)'
    """

    name: str
    offset: int = 0
    of_model: bool = False
    floor: int | None = None

    def value(self, config: Any, facts: Mapping[str, int]) -> float | None:
        """The bound for `config`, or None where it depends on a model fact that is not known yet."""
        if self.of_model and self.name not in facts:
            return None
        base = facts[self.name] if self.of_model else getattr(config, self.name)
        return base + self.offset if self.floor is None else max(self.floor, base + self.offset)

    def text(self) -> str:
        core = f"the model's {self.name.replace('_', ' ')}" if self.of_model else self.name
        core += f" {'+' if self.offset > 0 else '-'} {abs(self.offset)}" if self.offset else ""
        return core if self.floor is None else f"max({self.floor}, {core})"


@dataclass(frozen=True)
class Valid:
    """The valid values of one config field: a closed or open interval of numbers (`lo`/`hi`: a number, a `Ref`, or
    None for unbounded), or for a text field whether it may be empty. Floats must also be finite."""

    lo: float | int | Ref | None = None
    hi: float | int | Ref | None = None
    lo_open: bool = False
    hi_open: bool = False
    text_field: bool = False
    nonempty: bool = False

    def violated(self, value: Any, config: Any, facts: Mapping[str, int], refs: bool = True) -> bool:
        """True when `value` lies outside the range (a bound not known yet is not checked; `refs=False`: only the
        fixed bounds)."""
        if self.text_field:
            return self.nonempty and not str(value).strip()
        if isinstance(value, float) and not math.isfinite(value):
            return True

        def bound(b: Any) -> Any:
            return (b.value(config, facts) if refs else None) if isinstance(b, Ref) else b

        lo, hi = bound(self.lo), bound(self.hi)
        return ((lo is not None and (value <= lo if self.lo_open else value < lo))
                or (hi is not None and (value >= hi if self.hi_open else value > hi)))

    def describe(self, name: str, config: Any = None, facts: Mapping[str, int] | None = None) -> str:
        """The range in words: `0 <= beta <= 1`, `tau_i > 0`, `1 <= top_k <= max(1, n_views - 1) = 63`."""
        if self.text_field:
            return "a non-empty text" if self.nonempty else "any text"

        def show(b: Any) -> str:
            if not isinstance(b, Ref):
                return repr(b)
            v = b.value(config, facts or {}) if config is not None else None
            return b.text() if v is None else f"{b.text()} = {v}"

        if self.lo is None and self.hi is None:
            return f"{name}: any finite number"
        low = f"{show(self.lo)} {'<' if self.lo_open else '<='} " if self.lo is not None else ""
        high = f" {'<' if self.hi_open else '<='} {show(self.hi)}" if self.hi is not None else ""
        if self.lo is not None and self.hi is None:
            return f"{name} {'>' if self.lo_open else '>='} {show(self.lo)}"
        return f"{low}{name}{high}"


def setting(default: Any, *, ge: Any = None, gt: Any = None, le: Any = None, lt: Any = None, **kw: Any) -> Any:
    """A numeric config field with its valid range (`ge`/`gt`: lower bound, closed/open; `le`/`lt`: upper bound;
    each a number or a `Ref`); other keywords go to `dataclasses.field`.

    >>> @dataclass(frozen=True)
    ... class C(MethodConfig):
    ...     tau: float = setting(0.04, gt=0)  # a temperature: scores are divided by it
    >>> C(tau=0.0)
    Traceback (most recent call last):
    ...
    extract.methods.base.ConfigRangeError: C: tau=0.0 is out of range; valid: tau > 0
    """
    valid = Valid(lo=gt if gt is not None else ge, hi=lt if lt is not None else le, lo_open=gt is not None,
                  hi_open=lt is not None)
    return field(default=default, metadata={"valid": valid, **kw.pop("metadata", {})}, **kw)


def text_setting(default: str, *, nonempty: bool = False) -> Any:
    """A text config field: any text, or (`nonempty`) any text with a non-blank character."""
    return field(default=default, metadata={"valid": Valid(text_field=True, nonempty=nonempty)})


class ConfigRangeError(ValueError):
    """A config value outside its declared range: one line naming the owner (the method's key where known, else the
    config class), the key, the value and the valid range."""

    def __init__(self, owner: str, key: str, value: Any, valid: str) -> None:
        super().__init__(f"{owner}: {key}={value!r} is out of range; valid: {valid}")
        self.owner, self.key, self.value, self.valid = owner, key, value, valid

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (a sweep job's error travels back to the manifest)
        return ConfigRangeError, (self.owner, self.key, self.value, self.valid)

    def for_method(self, method: str) -> "ConfigRangeError":
        """The same error naming the method key instead of the config class."""
        return ConfigRangeError(method, self.key, self.value, self.valid)


def field_ranges(config_cls: type) -> dict[str, Valid | None]:
    """Each settable field's declared `Valid` (None for bool and Literal fields, whose type is their range, and for
    a field that declares none); a field redeclared in a subclass to change its default keeps its range.

    Example:
        >>> from extract.methods.onzeta import OnZetaConfig
        >>> field_ranges(OnZetaConfig)["tau_i"].describe("tau_i")
        'tau_i > 0'
    """
    return dict(_field_ranges(config_cls))


@functools.lru_cache(maxsize=None)
def _field_ranges(config_cls: type) -> tuple[tuple[str, Valid | None], ...]:
    out = []
    for f in dataclasses.fields(config_cls):
        meta: dict[str, Any] = {}
        for klass in reversed(config_cls.__mro__):  # the parent's declaration first, a subclass's on top
            own = klass.__dict__.get("__dataclass_fields__", {}).get(f.name)
            if own is not None:
                meta.update(own.metadata)
        if not meta.get("fixed"):
            out.append((f.name, meta.get("valid")))
    return tuple(out)


def check_ranges(config: Any, owner: str | None = None, facts: Mapping[str, int] | None = None) -> None:
    """Check every field of `config` against its declared range (`setting`, `text_setting`), bounds that depend on
    another field or on a model fact (`facts`, e.g. {"vision_blocks": 12}; unknown facts are not checked) included.

    Raises:
        ConfigRangeError: the first field out of range, naming `owner` (default: the config class).
    """
    facts = facts or {}
    ranges = field_ranges(type(config))
    for refs in (False, True):  # a value outside its own fixed bounds is named before one that only disagrees
        for name, valid in ranges.items():  # with another field
            value = getattr(config, name)
            if valid is not None and valid.violated(value, config, facts, refs):
                raise ConfigRangeError(owner or type(config).__qualname__, name, value,
                                       valid.describe(name, config, facts))


def fit_to_model(config: Any, facts: Mapping[str, int], keep: Collection[str] = ()) -> tuple[Any, list[str]]:
    """`config` with every field above a bound that depends on a model fact lowered to that bound, except the
    fields named in `keep` (values the user gave, which `check_ranges` refuses instead); and one note per change.

    Example:
        >>> from extract.methods.ttl import TTLConfig
        >>> fit_to_model(TTLConfig(), {"vision_blocks": 2})[1]
        ["lora_blocks=2 (the default 3 exceeds the model's vision blocks, 2)"]
    """
    changes, notes = {}, []
    for name, valid in field_ranges(type(config)).items():
        hi = None if valid is None else valid.hi
        if name in keep or not isinstance(hi, Ref) or not hi.of_model:
            continue
        bound = hi.value(config, facts)
        value = getattr(config, name)
        if bound is not None and value > bound:
            changes[name] = type(value)(bound)
            notes.append(f"{name}={changes[name]} (the default {value} exceeds {hi.text()}, {bound})")
    return (dataclasses.replace(config, **changes) if changes else config), notes


def model_fact_names(config_cls: type) -> set[str]:
    """The model facts some range of `config_cls` depends on (empty: the config alone decides)."""
    return {b.name for v in field_ranges(config_cls).values() if v is not None
            for b in (v.lo, v.hi) if isinstance(b, Ref) and b.of_model}


@dataclass(frozen=True)
class MethodConfig:
    """Fields the runner reads; every method's `Config` extends this. Construction checks every field: Literal
    choices, and each number or text against the range it declares (`setting`, `text_setting`; `check_ranges`).

    Attributes:
        n_views: views per sample: 1 (the original) or 1 + 63 augmented
            (docs/methods.md, "Test-time views").
        augmix: views 1.. use AugMix (True) or only RandomResizedCrop + flip (False).
        prompts: prompt set for the class prototypes (see `PromptSet`).
        cupl: add the CuPL GPT-3 sentences to the prototypes (DPE/DLAE).
        episodic: the method resets its state after every sample (a property of the method, not a setting).
    """

    n_views: int = setting(1, ge=1)
    augmix: bool = False
    prompts: PromptSet = "single"
    cupl: bool = False
    episodic: bool = field(default=False, metadata={"fixed": True})

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            choices = _literal_choices(hints[f.name])
            if choices is not None and value not in choices:
                raise ValueError(f"{type(self).__qualname__}.{f.name}: expected one of "
                                 f"{', '.join(map(repr, choices))}, got {value!r}")
        check_ranges(self)

    @property
    def crop_scale(self) -> tuple[float, float]:
        """Area range of the random resized crops of views 1.. (`extract.views.CROP_SCALE` picks the policy):
        torchvision's default, which TPT and its followers use; a method whose official crops differ overrides it."""
        return (0.08, 1.0)


def _literal_choices(tp: Any) -> tuple[Any, ...] | None:
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(name: str, tp: Any, raw: Any) -> Any:
    """Convert a `--set` value (usually a string) to the field's declared type."""
    choices = _literal_choices(tp)
    if choices is not None:
        for c in choices:
            if raw == c or str(c) == str(raw):
                return c
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {raw!r}")
    if not isinstance(raw, str):
        if tp is float and isinstance(raw, int) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, tp):
            return raw
        raise ValueError(f"{name}: expected {tp.__name__}, got {raw!r}")
    if tp is bool:
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"{name}: expected a boolean (true/false/1/0/yes/no), got {raw!r}")
    if tp in (int, float):
        try:
            return tp(raw)
        except ValueError:
            raise ValueError(f"{name}: expected {tp.__name__}, got {raw!r}") from None
    if tp is str:
        return raw
    raise ValueError(f"{name}: cannot set a field of type {tp!r} from the command line")


def apply_overrides(config: MethodConfig, overrides: dict[str, Any]) -> MethodConfig:
    """Return `config` with fields replaced from `--set key=value` pairs, values converted to the field types.

    Args:
        config: a method's frozen config.
        overrides: field name -> value (strings are converted: "2.5" -> 2.5, "true" -> True; Literal fields accept
            one of their choices).

    Returns:
        A new config (the result passes the config's own validation).

    Raises:
        ValueError: unknown key (the message lists the valid keys), a fixed field, or a value of the wrong type;
            ConfigRangeError (a ValueError): a value outside the field's declared range.

    Example:
        >>> from extract.methods.tda import TDAConfig
        >>> apply_overrides(TDAConfig(), {"alpha": "2.5"}).alpha
        2.5
    """
    fields = {f.name: f for f in dataclasses.fields(config)}
    hints = typing.get_type_hints(type(config))
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        settable = sorted(n for n, f in fields.items() if not f.metadata.get("fixed"))
        raise ValueError(f"unknown config key(s) {', '.join(map(repr, unknown))} for {type(config).__qualname__}; "
                         f"valid keys: {', '.join(settable)}")
    changes = {}
    for name, raw in overrides.items():
        if fields[name].metadata.get("fixed"):
            raise ValueError(f"{name!r} is a property of the method and cannot be overridden")
        changes[name] = _convert(name, hints[name], raw)
    return dataclasses.replace(config, **changes)


# ---------------------------------------------------------------------------------- files beyond the CLIP checkpoint
# What `ExternalFile.kind` a setting names: a file, a folder (both: a path the user gives; "" = not given), or an
# open_clip model (a pretrained tag, a checkpoint file or `local-dir:DIR`, its architecture in another setting).
ExternalKind = Literal["file", "dir", "open_clip"]


@dataclass(frozen=True)
class ExternalFile:
    """A second pretrained model or another file a method reads besides the CLIP checkpoint, named by one of its
    config settings. The user supplies it (zaec downloads nothing for a method); the method declares it in
    `external_files`, and one check (`extract.run.externals.check_external_files`) refuses a run that lacks it
    with one line naming the setting and where the file comes from, before any model loads: in `zaec-extract` and
    in `zaec-sweep` (its dry run too). docs/extract.md, "Files a method reads besides the CLIP checkpoint".

    Attributes:
        setting: the config field that names it (`--set SETTING=PATH`): a text field, "" while not given.
        what: what it is, in a few words ("the Stable Diffusion image-variation pipeline").
        source: where it comes from, said after the problem in the error line (the command that fetches or makes
            it, or the setting that does without it).
        kind: "file", "dir" (the path must exist as such) or "open_clip" (checked as `load_model` would check it:
            names, files, weights absent while the hub is offline).
        contains: for "dir": files that must be inside the folder ("model_index.json").
        backbone_setting: for "open_clip": the config field naming the architecture.

    Example:
        >>> ExternalFile("maple_weights", "MaPLe's prompts trained on ImageNet", "see docs/extract.md").kind
        'file'
    """

    setting: str
    what: str
    source: str
    kind: ExternalKind = "file"
    contains: tuple[str, ...] = ()
    backbone_setting: str = ""


@dataclass(frozen=True)
class Towers:
    """Which backbones a method runs on (`TTAMethod.towers`), by the kinds of their towers: the keys of
    `extract.models.IMAGE_TOWERS` and `TEXT_TOWERS`, which `extract.models.tower_kinds` reads from an architecture's
    config before any weight. `plan` checks it for `zaec-extract` before any file is read; the sweep leaves the
    (method, backbone) pairs it refuses out of its grid; the demo and the benches skip them by it. The method's own
    check on the loaded model stays as the last guard for an architecture whose config is unknown.

    Attributes:
        image: the image towers it runs on (None: every kind); image_use: what it does with the tower (the
            refusal line says it).
        text, text_use: the same for the text tower.
        batch_statistics: it normalises a ResNet's BatchNorms with the statistics of each batch of images, so a batch
            of one image through a ResNet whose last stage is 1x1 at its input size (< 64 px; RN50 at 224 px is 7x7)
            leaves one value per channel: refused (a whole stream of such batches by `plan`, a last batch of one
            by the run once it has listed the test set, both before the model loads).

    Example:
        >>> from extract.models import TowerKinds
        >>> why = Towers(image=frozenset({"vit"}), image_use="condenses ViT tokens").refusal(
        ...     "tca", "RN50", TowerKinds("resnet", "clip", 7), None)
        >>> why.split(": ")[0], why.split("; ")[1]
        ('tca condenses ViT tokens', "RN50's is a ResNet (CLIP's ModifiedResNet)")
    """

    image: frozenset[str] | None = None
    image_use: str = ""
    text: frozenset[str] | None = None
    text_use: str = ""
    batch_statistics: bool = False

    @property
    def restricted(self) -> bool:
        """Whether some backbone can be refused (else the backbone's config need not be read)."""
        return self.image is not None or self.text is not None or self.batch_statistics

    def refusal(self, key: str, backbone: str, kinds: Any, width: int | None) -> str | None:
        """Why method `key` cannot run on `backbone`, whose towers are `kinds` (`extract.models.TowerKinds`), with
        `width` samples per `adapt` call (the method's batch); None when it can, or when the kinds are unknown."""
        from extract.models import IMAGE_TOWERS, TEXT_TOWERS

        for side, kind, allowed, use, names in (("image", kinds.image, self.image, self.image_use, IMAGE_TOWERS),
                                                ("text", kinds.text, self.text, self.text_use, TEXT_TOWERS)):
            if kind is not None and allowed is not None and kind not in allowed:
                runs_on = " or ".join(names[k] for k in names if k in allowed)
                return f"{key} {use}: it runs on {'an' if side == 'image' else 'a'} {side} tower that is " \
                       f"{runs_on}; {backbone}'s is {names[kind]}"
        if width == 1 and self.one_image_fails(kinds):
            return f"{self.one_image_line(key, backbone)}: set batch_size >= 2"
        return None

    def one_image_fails(self, kinds: Any) -> bool:
        """Whether a batch of one image cannot be adapted on towers `kinds` (`batch_statistics` on a ResNet whose
        last stage is 1x1)."""
        return self.batch_statistics and kinds.image == "resnet" and kinds.last_stage is not None \
            and kinds.last_stage <= 1

    @staticmethod
    def one_image_line(key: str, backbone: str) -> str:
        """The refusal of a batch of one image (`one_image_fails`), without what to change."""
        return (f"{key} normalises the BatchNorms of a ResNet with the statistics of each batch of images, and "
                f"{backbone}'s last stage is 1x1 at its input size: a batch of one image leaves them one value per "
                "channel")


#: the image towers a method that runs or alters a ViT's blocks itself runs on (TTL, DART: any open_clip ViT)
VIT_TOWERS: frozenset[str] = frozenset({"vit", "vit-pooled"})
#: what a method that learns a prompt in the text tower runs on (`extract.text_encoder.PromptTextEncoder`: the TPT
#: family, DynaPrompt, HisTPT; DART adds its image side)
PROMPT_TUNING = Towers(text=frozenset({"clip", "open_clip"}), text_use="learns a prompt in the text tower")


class TTAMethod(abc.ABC):
    """Base class of every test-time adaptation method.

    Subclasses define `key`, `Config`, `default_config` and `_adapt`. The base class checks inputs, moves the text
    prototypes to the inputs' device once, and returns float32 logits.

    Args:
        config: the method's `Config`.
        text_features: (K, D) float32 L2-normalised class prototypes built with `config.prompts` / `config.cupl`.
        logit_scale: the model's own exp(logit_scale) (100 for OpenAI CLIP). The official TDA/DPE/DLAE code
            hard-codes `100.`; using the model's value is the same for OpenAI weights and right for any other.
        backbone: open_clip model name (recorded; per-backbone tables are applied in `default_config`).
        dataset: canonical dataset key (recorded).
        text_encoder: only for methods with `needs_text_encoder` (the TPT family tunes prompt tokens).
    """

    key: ClassVar[str]
    Config: ClassVar[type[MethodConfig]]
    needs_text_encoder: ClassVar[bool] = False
    # A method that reads class descriptions (AWT) sets this and `descriptions_request`; the run reads them from
    # `--descriptions-dir` before the model loads and passes them as the `descriptions` keyword
    # (`extract.prompts.Descriptions`).
    needs_descriptions: ClassVar[bool] = False
    # What the run feeds the method (`Consumes`); one run loop serves every kind.
    consumes: ClassVar[Consumes] = "features"
    # What `adapt` returns (recorded in the shard as `zaec:output_kind`); "logits" unless the method says otherwise.
    output_kind: ClassVar[OutputKind] = "logits"
    # Attributes holding the online state, saved by `state_dict` (so that an interrupted run can resume).
    _state_fields: ClassVar[tuple[str, ...]] = ()
    # Whether the first n rows of a run are the first n rows of any longer run of the same stream: the method reads
    # neither the stream's length nor a sample after the ones it is given. Only then does a finished longer run
    # serve a shorter `--limit` (extract/run/settings.py, `longer_run_refusal`). Every registered method declares it
    # in its own class (tests/extract/test_methods.py checks the declaration against the method's rows); False here,
    # so that an undeclared method is recomputed rather than served another run's rows.
    prefix_stable: ClassVar[bool] = False
    # Second pretrained models and other files the method reads besides the CLIP checkpoint, each named by one of
    # its settings (`ExternalFile`); `needed_files` says which a given config reads.
    external_files: ClassVar[tuple[ExternalFile, ...]] = ()

    def __init__(
        self,
        config: MethodConfig,
        text_features: torch.Tensor,
        logit_scale: float,
        *,
        backbone: str,
        dataset: str,
        text_encoder: Any = None,
    ) -> None:
        if not isinstance(config, self.Config):
            raise TypeError(f"{type(self).__name__} expects a {self.Config.__qualname__}, "
                            f"got {type(config).__qualname__}")
        if text_features.ndim != 2:
            raise ValueError(f"text_features must be (K, D), got shape {tuple(text_features.shape)}")
        if self.needs_text_encoder and text_encoder is None:
            raise ValueError(f"method {self.key!r} tunes prompts and needs the text encoder (text_encoder=...)")
        self.config = config
        self.text_features = text_features.detach()
        self.logit_scale = float(logit_scale)
        self.backbone = backbone
        self.dataset = dataset
        self.text_encoder = text_encoder
        self.n_classes, self.dim = text_features.shape
        self.n_seen = 0  # samples adapted so far (the stream position of the next sample)
        # Notes on how the method was set up (a fallback, a guess), recorded in the shard metadata (`zaec:warnings`).
        self.warnings: list[str] = []

    # Settings for a dataset the official configs never saw (a user's folder or split file): the method's row for
    # `unseen_like`, then `unseen_changes`. Each method sets both, with the reason; docs/methods.md lists them. The
    # prompts stay within what needs no per-dataset text: "single" or "imagenet80", never CuPL.
    unseen_like: ClassVar[str]
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    @classmethod
    @abc.abstractmethod
    def default_config(cls, hparams_key: str, backbone: str) -> MethodConfig:
        """The spec's configuration for a dataset (canonical key) and an open_clip backbone name."""

    @classmethod
    def unseen_config(cls, backbone: str) -> MethodConfig:
        """The documented configuration for a dataset without an official row (`unseen_like` + `unseen_changes`).

        Example:
            >>> from extract.methods import get_method
            >>> cfg = get_method("tda").unseen_config("ViT-B-16")
            >>> cfg.n_views, cfg.prompts, cfg.alpha, cfg.beta
            (1, 'imagenet80', 2.0, 5.0)
        """
        return dataclasses.replace(cls.default_config(cls.unseen_like, backbone), **dict(cls.unseen_changes))

    def compute_dtype(self, view_feats: torch.Tensor) -> torch.dtype:
        """float32, or float64 when the inputs are float64 (exact references in tests)."""
        return torch.promote_types(view_feats.dtype, torch.float32)

    def adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        """Adapt on B consecutive samples of the stream and return their adapted logits.

        Args:
            view_feats: (B, V, D) L2-normalised image features, view 0 = the original image, V = config.n_views.

        Returns:
            (B, K) float32 logits.
        """
        if view_feats.ndim != 3:
            raise ValueError(f"view_feats must be (B, V, D), got shape {tuple(view_feats.shape)}")
        b, v, d = view_feats.shape
        if d != self.dim:
            raise ValueError(f"view_feats has feature dim {d}, the text prototypes have {self.dim}")
        if v != self.config.n_views:
            raise ValueError(f"{self.key}: config.n_views = {self.config.n_views} but view_feats has {v} views")
        if b == 0:
            return torch.zeros(0, self.n_classes, dtype=torch.float32, device=view_feats.device)
        if self.text_features.device != view_feats.device:
            self.text_features = self.text_features.to(view_feats.device)
        out = self._adapt(view_feats)
        self.n_seen += b
        return out.detach().float()

    @classmethod
    def towers(cls, config: MethodConfig) -> Towers:
        """The backbones the method runs on with `config` (`Towers`): every one, unless the method says otherwise
        (a ViT's blocks, a learnable text prompt, batch statistics, or a setting that decides it: WATT's
        `rn_batchnorm`)."""
        return Towers()

    @classmethod
    def consumes_for(cls, config: MethodConfig) -> Consumes:
        """What the run feeds the method with `config`: its `consumes`, unless a setting changes it (Panda on TPT,
        ZERO and DMN also reads the pixels of a batch of test images: `--set panda=true`)."""
        return cls.consumes

    @classmethod
    def adapt_width(cls, config: MethodConfig) -> int | None:
        """Samples every `adapt` call must hold, or None for the run's `--adapt-batch`.

        A method that adapts over batches of test images returns its batch size (a setting: the official batch); the
        run then cuts the stream into batches [k·B, (k+1)·B) (the last one shorter) and calls `adapt` once per batch,
        so a batch's rows depend on the samples of the batch and on the batches before it, never on later ones."""
        return None

    def attach_pixels(self, reader: Any) -> None:
        """Receive the reader of a batch's pixels (a method that consumes "batch_pixels"; the runner calls it once,
        before the first `adapt`): `reader(start, stop)` -> (stop - start, 3, S, S) float32 original views (view 0)
        of stream positions [start, stop) on the model's device, preprocessed as the encoding pass preprocesses
        them (extract/run/pixels.py `BatchPixels`)."""
        raise ValueError(f"{self.key} reads no pixels (consumes {self.consumes_for(self.config)!r})")

    @classmethod
    def needed_files(cls, config: MethodConfig) -> tuple[ExternalFile, ...]:
        """The declared `external_files` a run with `config` reads (all of them, unless a setting does without
        one: RLCF's reward model with `reward_backbone=policy`).

        Example:
            >>> from extract.methods import get_method
            >>> rlcf = get_method("rlcf")
            >>> [f.setting for f in rlcf.needed_files(rlcf.default_config("dtd", "ViT-B-16"))]
            ['reward_pretrained']
        """
        return cls.external_files

    @classmethod
    def config_refusal(cls, config: MethodConfig) -> str | None:
        """Why this method cannot run with `config` although every field lies in its range (a combination of settings
        it does not support), or None; `plan` refuses such a run in one line before any file is read. None by default;
        Panda's hosts override it (`extract.methods.panda.PandaPlugin`)."""
        return None

    @classmethod
    def prefix_dependence(cls, config: MethodConfig) -> str | None:
        """Why the first rows of a run with `config` depend on what follows them, or None when they do not
        (`prefix_stable`; a method whose dependence is a setting, OnZeta's `stream_length`, overrides this).

        Example:
            >>> from extract.methods import get_method
            >>> get_method("tda").prefix_dependence(get_method("tda").default_config("dtd", "RN50")) is None
            True
        """
        return None if cls.prefix_stable else f"{cls.key}'s rows depend on the samples after them"

    @classmethod
    def transductive_unit(cls, config: MethodConfig) -> int | None:
        """For a method that consumes "set_features": how many consecutive stream positions it solves jointly, 0 for
        the whole run (recorded in the shards as `zaec:transductive_unit`); None for every other method."""
        return None

    def set_stream_length(self, n: int) -> None:
        """Announce the number of samples the run will adapt on (before the first one). A no-op except for methods
        whose official schedule needs it in advance (OnZeta's β_i = β·√((i+1)/n)); the runner calls it."""

    @classmethod
    def descriptions_request(cls, config: MethodConfig, dataset: str) -> tuple[str, int, str]:
        """For a method with `needs_descriptions`: (the dataset's description file name, the sentences every class
        needs, where the files come from). `dataset` is the key whose classes the run predicts."""
        raise NotImplementedError(f"{cls.key} reads no class descriptions")

    @classmethod
    def method_class_names(cls, dataset: str, class_names: Sequence[str],
                           imagenet_indices: Sequence[int] | None = None) -> tuple[str, ...]:
        """The class names this method builds its prompts from: the dataset's own by default; a method whose
        official code uses a different list (TPS on ImageNet) overrides this.

        Args:
            dataset: canonical dataset key.
            class_names: the dataset's K class names.
            imagenet_indices: for the ImageNet family, the ImageNet-1k index of each of the K classes.
        """
        return tuple(class_names)

    def summary(self) -> dict[str, Any]:
        """Plain numbers about the run so far (JSON-able), printed at the end of a run and recorded in the shard
        metadata (`zaec:method_summary`); empty by default."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The online state after `n_seen` samples: tensors, numbers, lists and dicts only (safe for
        `torch.load(..., weights_only=True)`). Loading it into a fresh instance built with the same arguments and
        continuing the stream gives the same logits as never stopping."""
        from extract.methods.common import ClassCache

        state: dict[str, Any] = {"key": self.key, "n_seen": self.n_seen}
        for name in self._state_fields:
            value = getattr(self, name)
            state[name] = {"class_cache": value.state_dict()} if isinstance(value, ClassCache) else copy.deepcopy(value)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (from an instance of the same method)."""
        from extract.methods.common import ClassCache

        if state.get("key") != self.key:
            raise ValueError(f"state of method {state.get('key')!r} cannot be loaded into {self.key!r}")
        missing = [n for n in self._state_fields if n not in state]
        if missing:
            raise ValueError(f"{self.key} state lacks {', '.join(missing)}")
        self.n_seen = int(state["n_seen"])
        for name in self._state_fields:
            value = state[name]
            if isinstance(value, dict) and "class_cache" in value:
                value = ClassCache.from_state_dict(value["class_cache"])
            else:
                value = copy.deepcopy(value)
            setattr(self, name, value)

    @abc.abstractmethod
    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        """Method body: (B, V, D) -> (B, K) logits; inputs already checked."""
