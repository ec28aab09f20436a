"""Calibrators for test-time-adapted logits: none, temperature scaling, SaLS and ZAEC; their registry and spec parser.

Every calibrator here is a per-sample temperature: the calibrated prediction of sample i is
softmax(tta_logits[i] / T_i). A temperature never changes the class ranking, so no calibrator in this module changes
a prediction or the accuracy. Calibrators look like scikit-learn estimators: `fit(...)` returns self, fitted state
ends in `_`, and `temperatures(zs_logits, tta_logits)` returns the (N,) float64 effective temperatures. Label-free
calibrators (SaLS, ZAEC) take the paired zero-shot logits as their input, never labels.

The numerical kernels (softmax statistics, the ZAEC solver, the temperature-scaling fit) are pure functions in
`calibrate.functional`, the way torchmetrics keeps `functional/` apart from its stateful classes; this module holds
the estimators only, and each kernel is imported from its own module there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Iterable

import numpy as np

from calibrate.functional.softmax import _as_2d
from calibrate.functional.temperature import TS_BETA_MAX, TS_BETA_MIN, fit_temperature
from calibrate.functional.zaec import SUBSETS, solve_zaec


@dataclass
class Calibrator:
    """Base class. Subclasses are dataclasses whose fields are the spec options (`name:field=value`)."""

    name: ClassVar[str] = ""
    #: needs labelled source logits (`fit`) before `temperatures`
    needs_fit: ClassVar[bool] = False
    spec: str = field(default="", repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.spec:
            self.spec = self.name

    def fit(self, *args: Any, **kwargs: Any) -> "Calibrator":
        """Label-free calibrators have nothing to fit; returns self."""
        return self

    def temperatures(self, zs_logits: Any, tta_logits: Any) -> np.ndarray:
        """(N,) float64 effective per-sample temperatures for `tta_logits`."""
        raise NotImplementedError

    def transform(self, zs_logits: Any, tta_logits: Any) -> np.ndarray:
        """Calibrated logits tta_logits / T[:, None], float64."""
        t = self.temperatures(zs_logits, tta_logits)
        return np.asarray(tta_logits, dtype=np.float64) / t[:, None]


@dataclass
class NoCalibration(Calibrator):
    """`none`: the raw adapted logits (T = 1)."""

    name: ClassVar[str] = "none"

    def temperatures(self, zs_logits: Any, tta_logits: Any) -> np.ndarray:
        return np.ones(_as_2d(tta_logits, "tta_logits").shape[0])


@dataclass
class TemperatureScaling(Calibrator):
    """`temperature`: one temperature fitted by NLL on labelled source logits (or fixed with `T`).

    Fit once, e.g. on the ImageNet shards of the same backbone and method, then apply to every target set.
    `T` (spec `temperature:T=1.2`) fixes the temperature and skips the fit.
    """

    name: ClassVar[str] = "temperature"
    needs_fit: ClassVar[bool] = True
    T: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.T is not None:
            self.T = float(self.T)
            if not (np.isfinite(self.T) and self.T > 0):
                raise ValueError(f"temperature T must be finite and > 0, got {self.T}")
            self.temperature_ = self.T
            self.n_iter_ = 0

    @property
    def is_fitted(self) -> bool:
        return hasattr(self, "temperature_")

    def fit(
        self, logits: Any = None, labels: Any = None, *, batches: Callable[[], Iterable] | None = None
    ) -> "TemperatureScaling":
        """Fit by NLL on labelled logits: in-memory `(logits, labels)` or a streaming `batches` callable."""
        if self.T is not None:
            return self
        if batches is None:
            z, y = _as_2d(logits), np.asarray(labels)
            batches = lambda: [(z, y)]  # noqa: E731
        self.temperature_, self.n_iter_ = fit_temperature(batches)
        return self

    @property
    def at_bound_(self) -> bool:
        """Whether the fitted T sits at a bound of its search range [1/TS_BETA_MAX, 1/TS_BETA_MIN]: the NLL optimum
        lies outside (e.g. source logits that are all wrong), so T is a cap, not a fitted value."""
        t = float(self.temperature_)
        return self.T is None and (t >= (1.0 - 1e-6) / TS_BETA_MIN or t <= (1.0 + 1e-6) / TS_BETA_MAX)

    def describe_fit(self, source: str) -> str:
        """One line for the notes: the fitted T, or that it was capped."""
        t = float(self.temperature_)
        if self.at_bound_:
            return (f"temperature scaling on {source}: T = {t:g} is the bound of its search range "
                    f"[{1 / TS_BETA_MAX:g}, {1 / TS_BETA_MIN:g}], not a fitted optimum (the NLL keeps falling "
                    "beyond it, e.g. all source predictions wrong)")
        return f"temperature scaling fitted on {source}: T = {t:.4f}"

    def temperatures(self, zs_logits: Any, tta_logits: Any) -> np.ndarray:
        if not self.is_fitted:
            raise ValueError("temperature scaling is not fitted: call fit(...) or give T")
        return np.full(_as_2d(tta_logits, "tta_logits").shape[0], float(self.temperature_))


#: SaLS guard: a zero-range row (constant logits) gets T = 1 (its softmax is uniform at every temperature)
SALS_MIN_RANGE = 1e-12


@dataclass
class SaLS(Calibrator):
    """`sals`: per-sample min-max rescaling of the adapted logits onto the zero-shot logit range.

    z' = (z_tta - min z_tta) / range(z_tta) * range(z_zs) + min z_zs, which under softmax equals a per-sample
    temperature T_i = range(z_tta) / range(z_zs). A zero range on either side (constant logits) gives T = 1.
    """

    name: ClassVar[str] = "sals"

    def temperatures(self, zs_logits: Any, tta_logits: Any) -> np.ndarray:
        zs, tta = _as_2d(zs_logits, "zs_logits"), _as_2d(tta_logits, "tta_logits")
        if zs.shape != tta.shape:
            raise ValueError(f"zs_logits and tta_logits must have the same shape; got {zs.shape} and {tta.shape}")
        r_zs = zs.max(axis=1).astype(np.float64) - zs.min(axis=1)
        r_tta = tta.max(axis=1).astype(np.float64) - tta.min(axis=1)
        ok = (r_zs > SALS_MIN_RANGE) & (r_tta > SALS_MIN_RANGE)
        return np.where(ok, r_tta / np.where(ok, r_zs, 1.0), 1.0)


@dataclass
class ZAEC(Calibrator):
    """`zaec`: the paper's Zero-shot-Anchored Entropy Calibration (see `zaec_temperature`).

    Options: `strength` (lambda, default 1.0: full restoration, paper §5 ablation) and `subset` (default
    `reduced`: the paper's method; `all` and `increased` are the corrected-subset ablations).
    After `temperatures(...)`, `capped_` holds the (N,) bool mask of capped samples of that call.
    """

    name: ClassVar[str] = "zaec"
    strength: float = 1.0
    subset: str = "reduced"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.strength = float(self.strength)
        if not 0.0 <= self.strength <= 1.0:
            raise ValueError(f"zaec strength must lie in [0, 1], got {self.strength}")
        if self.subset not in SUBSETS:
            raise ValueError(f"unknown zaec subset {self.subset!r}; valid: {', '.join(SUBSETS)}")

    def temperatures(self, zs_logits: Any, tta_logits: Any) -> np.ndarray:
        sol = solve_zaec(zs_logits, tta_logits, strength=self.strength, subset=self.subset)  # type: ignore[arg-type]
        self.capped_ = sol.capped
        return sol.temperature


#: name -> calibrator class. Adding a calibrator is one class plus one entry here.
CALIBRATORS: dict[str, type[Calibrator]] = {
    c.name: c for c in (NoCalibration, TemperatureScaling, SaLS, ZAEC)
}


def _number(value: str, cls_name: str, key: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"calibrator {cls_name!r}: option {key!r} expects a number, got {value!r}") from None


def parse_calibrator(spec: str) -> Calibrator:
    """Build a calibrator from a spec string `name[:key=value[,key=value...]]`.

    Examples: `none`, `temperature`, `temperature:T=1.2`, `sals`, `zaec`, `zaec:strength=0.5`, `zaec:subset=all`,
    `zaec:strength=0.5,subset=all`. The spec string is the calibrator's name in every output.

    Raises:
        ValueError: unknown name or option (the message lists the valid ones), or a bad value.
    """
    text = spec.strip()
    name, _, opts = text.partition(":")
    name = name.strip()
    if name not in CALIBRATORS:
        raise ValueError(f"unknown calibrator {name!r}; available: {', '.join(CALIBRATORS)}")
    cls = CALIBRATORS[name]
    valid = {f.name: f for f in fields(cls) if f.name != "spec"}
    kwargs: dict[str, Any] = {}
    for item in filter(None, (o.strip() for o in opts.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key not in valid:
            choices = ", ".join(valid) or "none"
            raise ValueError(f"calibrator {name!r} has no option {key!r}; valid options: {choices}")
        if not eq or not value:
            raise ValueError(f"calibrator option {key!r} of {name!r} needs a value ({name}:{key}=VALUE)")
        if key in kwargs:
            raise ValueError(f"calibrator option {key!r} given twice in {spec!r}")
        kwargs[key] = value if isinstance(valid[key].default, str) else _number(value, name, key)
    cal = cls(**kwargs)
    cal.spec = text
    return cal


def parse_calibrators(specs: str | Iterable[str]) -> list[Calibrator]:
    """Parse a comma-free list of specs or one string `a;b` / `a,b` where commas between specs are allowed.

    In a single string, specs are split at commas that start a new known calibrator name, so
    `none,zaec:strength=0.5,subset=all,sals` gives three calibrators. Duplicate specs raise.
    """
    if isinstance(specs, str):
        parts: list[str] = []
        for piece in specs.split(","):
            piece = piece.strip()
            if not piece:
                continue
            head = piece.partition(":")[0].strip()
            if parts and "=" in piece and head not in CALIBRATORS and ":" not in piece:
                parts[-1] += "," + piece  # an option of the previous spec
            else:
                parts.append(piece)
        specs = parts
    cals = [parse_calibrator(s) for s in specs]
    if not cals:
        raise ValueError(f"no calibrator given; available: {', '.join(CALIBRATORS)}")
    seen: set[str] = set()
    for c in cals:
        if c.spec in seen:
            raise ValueError(f"calibrator {c.spec!r} given twice")
        seen.add(c.spec)
    return cals
