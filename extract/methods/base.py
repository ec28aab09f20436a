"""The contract every TTA method implements, its configuration base class, and `--set` overrides.

A method is a class with a `key`, a frozen `Config` dataclass next to it (the paper's defaults, each with its
source) and `default_config(hparams_key, backbone)` applying the per-dataset tables of the official configs. The
runner builds the method once per run with the text prototypes and the model's logit scale, then feeds it the view
features of consecutive samples in stream order:

    >>> cfg = method_cls.default_config("dtd", "ViT-B-16")          # doctest: +SKIP
    >>> m = method_cls(cfg, text_features, logit_scale, backbone="ViT-B-16", dataset="dtd")  # doctest: +SKIP
    >>> logits = m.adapt(view_feats)  # (B, V, D) -> (B, K) float32   # doctest: +SKIP

Online methods keep their state across `adapt` calls; episodic ones (the TPT family) reset it per sample. A
method that needs the text encoder (TPT tunes prompt tokens) sets `needs_text_encoder = True` and receives it as
the `text_encoder` keyword; adding such a method is one file plus one registry entry.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Mapping, Sequence

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
# Each template embedding is L2-normalised, averaged (with the CuPL sentences when `cupl`), and re-normalised.
PromptSet = Literal["single", "dataset", "imagenet80", "dpe_cars"]
# What a method's output rows are (the shard's `zaec:output_kind`, docs/contract.md): "logits" (any real vector the
# official code ranks and calibrates through a softmax) or "log_probs" (natural-log probabilities, finite: where the
# official code outputs probabilities or vote fractions).
OutputKind = Literal["logits", "log_probs"]
BackboneFamily = Literal["rn", "vit"]

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


@dataclass(frozen=True)
class MethodConfig:
    """Fields the runner reads; every method's `Config` extends this.

    Attributes:
        n_views: views per sample: 1 (the original) or 1 + 63 augmented
            (docs/methods.md, "Test-time views").
        augmix: views 1.. use AugMix (True) or only RandomResizedCrop + flip (False).
        prompts: prompt set for the class prototypes (see `PromptSet`).
        cupl: add the CuPL GPT-3 sentences to the prototypes (DPE/DLAE).
        episodic: the method resets its state after every sample (a property of the method, not a setting).
    """

    n_views: int = 1
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
            if hints[f.name] is float and not math.isfinite(value):
                raise ValueError(f"{type(self).__qualname__}.{f.name} must be a finite number, got {value!r}")
            if hints[f.name] is int and value < 0:
                raise ValueError(f"{type(self).__qualname__}.{f.name} must be >= 0, got {value!r}")
            # `*_p` fields are fractions of the views (selection_p: the confident views kept)
            if f.name.endswith("_p") and hints[f.name] is float and not 0.0 < value <= 1.0:
                raise ValueError(f"{type(self).__qualname__}.{f.name} is a fraction in (0, 1], got {value!r}")
        if self.n_views < 1:
            raise ValueError(f"{type(self).__qualname__}.n_views must be >= 1, got {self.n_views}")


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
        ValueError: unknown key (the message lists the valid keys), a fixed field, or a value of the wrong type.

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
    def prefix_dependence(cls, config: MethodConfig) -> str | None:
        """Why the first rows of a run with `config` depend on what follows them, or None when they do not
        (`prefix_stable`; a method whose dependence is a setting, OnZeta's `stream_length`, overrides this).

        Example:
            >>> from extract.methods import get_method
            >>> get_method("tda").prefix_dependence(get_method("tda").default_config("dtd", "RN50")) is None
            True
        """
        return None if cls.prefix_stable else f"{cls.key}'s rows depend on the samples after them"

    def set_stream_length(self, n: int) -> None:
        """Announce the number of samples the run will adapt on (before the first one). A no-op except for methods
        whose official schedule needs it in advance (OnZeta's β_i = β·√((i+1)/n)); the runner calls it."""

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
