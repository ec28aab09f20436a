"""Per-sample summaries of runs: every table and figure is computed from (N,)-sized arrays, never (N, K) logits.

Shards are streamed one at a time. Each shard is reduced to per-sample statistics of the paired zero-shot logits, the
adapted logits, and the adapted logits under every calibrator that the tables need (none, temperature, SaLS, ZAEC,
the subset ablation, the strength sweep). The pieces of one run are concatenated (N values each) and sorted by
`sample_id`, so a run split into any number of shards gives the same summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from calibrate.calibrators import TemperatureScaling, parse_calibrator
from calibrate.classwise import ClasswiseStats
from calibrate.functional.softmax import adapted_stats, softmax_stats
from calibrate.run import Members, check_complete, resolve_ts_sources, run_counts
from schemas.shard import Completeness, RunKey, Shard, ShardError, ShardMeta, find_shards, group_shards, iter_run

#: (zs_logits (n, K), tta_logits (n, K)) -> per-sample temperatures (n,)
TemperatureFn = Callable[[np.ndarray, np.ndarray], np.ndarray]

#: predictions whose classwise ECE needs every class's probability, so it is folded while the (n, K) logits are
#: read (`RunSummary.classwise`): the paired zero-shot and the main tables' calibrators (not the ablation specs)
CLASSWISE_SPECS: tuple[str, ...] = ("zero-shot", "none", "temperature", "sals", "zaec")


@dataclass(frozen=True)
class CalibratedStats:
    """Per-sample results of the adapted logits divided by a per-sample temperature T (all (N,) float64)."""

    temperature: np.ndarray
    confidence: np.ndarray
    entropy: np.ndarray
    #: -log softmax(z / T)[label]
    nll: np.ndarray


@dataclass(frozen=True)
class RunSummary:
    """One run (backbone, dataset, method, seed) reduced to per-sample arrays, sorted by `sample_id`.

    Temperature scaling never changes the arg-max, so every calibrator shares `tta_pred`; `calibrated["none"]`
    holds the raw adapted confidences. Ranges are max - min of the logits (paper eq. 7).
    """

    key: RunKey
    num_classes: int
    sample_id: np.ndarray
    label: np.ndarray
    zs_pred: np.ndarray
    zs_confidence: np.ndarray
    zs_entropy: np.ndarray
    zs_nll: np.ndarray
    zs_range: np.ndarray
    tta_pred: np.ndarray
    tta_range: np.ndarray
    calibrated: Mapping[str, CalibratedStats]
    #: "zero-shot" or a spec of `CLASSWISE_SPECS` -> classwise/top-label ECE statistics (need (n, K) probabilities)
    classwise: Mapping[str, ClasswiseStats] = field(default_factory=dict)
    #: an OOD run's in-distribution dataset (`zaec:ood_for`): its label -1 rows are out-of-distribution, and the
    #: tables keep it out of every paper item (calibrate/tables/ood_tables.py); None for a plain run
    ood_for: str | None = None
    #: a partial run read with `--allow-partial` (fewer rows than announced, or a `--limit` subset): its count, e.g.
    #: "150 of 400"; every table and figure marks its cells (`calibrate.tables.render.PARTIAL_MARK`); None: whole
    partial: str | None = None

    def __len__(self) -> int:
        return int(self.sample_id.shape[0])

    @property
    def zs_correct(self) -> np.ndarray:
        return self.zs_pred == self.label

    @property
    def tta_correct(self) -> np.ndarray:
        return self.tta_pred == self.label

    @property
    def tta_confidence(self) -> np.ndarray:
        return self.calibrated["none"].confidence

    @property
    def tta_entropy(self) -> np.ndarray:
        return self.calibrated["none"].entropy

    @property
    def delta_entropy(self) -> np.ndarray:
        """Normalised entropy change delta_i^H = (H_tta - H_zs) / log K (paper eq. 9), (N,) float64 (0 for K = 1)."""
        log_k = np.log(self.num_classes) if self.num_classes > 1 else 1.0  # K = 1: both entropies are 0
        return (self.tta_entropy - self.zs_entropy) / log_k


def summarise_arrays(
    key: RunKey,
    sample_id: np.ndarray,
    label: np.ndarray,
    zs_logits: np.ndarray,
    tta_logits: np.ndarray,
    calibrators: Mapping[str, TemperatureFn],
    output_kind: str = "logits",
) -> RunSummary:
    """Reduce one slice of a run (n samples) to a RunSummary (not yet sorted by sample_id).

    Args:
        key: the run.
        sample_id, label: (n,) integers.
        zs_logits, tta_logits: (n, K) paired logits.
        calibrators: spec -> function giving per-sample temperatures; "none" is added when missing.
        output_kind: what `tta_logits` holds (`zaec:output_kind`); log-probability rows at T = 1 keep the
            confidences they were stored with (`calibrate.functional.adapted_stats`).
    """
    label = np.asarray(label, dtype=np.int64)
    n, k = np.shape(tta_logits)
    zs = np.asarray(zs_logits)
    # an OOD run's label -1 rows: NLL against class 0 (never used), classwise statistics of the labelled rows only
    ind = label >= 0
    y_nll = np.maximum(label, 0)
    zs_stats = softmax_stats(zs, 1.0, y_nll)
    cal: dict[str, CalibratedStats] = {}
    cw = {"zero-shot": ClasswiseStats().update_logits(zs[ind], 1.0, label[ind])}
    fns = dict(calibrators)
    fns.setdefault("none", lambda z, t: np.ones(z.shape[0]))
    for spec, fn in fns.items():
        t = np.asarray(fn(zs_logits, tta_logits), dtype=np.float64).reshape(-1)
        if t.shape != (n,):
            t = np.broadcast_to(t, (n,)).copy()
        st = adapted_stats(tta_logits, t, y_nll, output_kind)
        cal[spec] = CalibratedStats(t, st.confidence, st.entropy, st.nll)
        if spec in CLASSWISE_SPECS:
            cw[spec] = ClasswiseStats().update_logits(np.asarray(tta_logits)[ind], t[ind], label[ind])
    tta = np.asarray(tta_logits)
    return RunSummary(
        key=key,
        num_classes=int(k),
        sample_id=np.asarray(sample_id, dtype=np.int64),
        label=label,
        zs_pred=zs_stats.prediction,
        zs_confidence=zs_stats.confidence,
        zs_entropy=zs_stats.entropy,
        zs_nll=zs_stats.nll,
        zs_range=zs.max(axis=1).astype(np.float64) - zs.min(axis=1),
        tta_pred=tta.argmax(axis=1).astype(np.int64),
        tta_range=tta.max(axis=1).astype(np.float64) - tta.min(axis=1),
        calibrated=cal,
        classwise=cw,
    )


_ARRAYS = (
    "sample_id", "label", "zs_pred", "zs_confidence", "zs_entropy", "zs_nll", "zs_range", "tta_pred", "tta_range",
)


def merge_summaries(parts: Sequence[RunSummary], where: str = "") -> RunSummary:
    """Concatenate the slices of one run and sort by sample_id.

    Raises:
        ShardError: a sample_id occurs in more than one slice.
    """
    if not parts:
        raise ValueError("no parts to merge")
    first = parts[0]
    cat = {name: np.concatenate([getattr(p, name) for p in parts]) for name in _ARRAYS}
    order = np.argsort(cat["sample_id"], kind="stable")
    sid = cat["sample_id"][order]
    dup = np.flatnonzero(sid[1:] == sid[:-1])
    if dup.size:
        raise ShardError(
            f"{where or first.key}: column 'sample_id' has {dup.size} value(s) repeated across shards of run "
            f"{first.key} (e.g. {int(sid[dup[0]])})"
        )
    cal = {}
    for spec in first.calibrated:
        cal[spec] = CalibratedStats(
            *(np.concatenate([getattr(p.calibrated[spec], f) for p in parts])[order]
              for f in ("temperature", "confidence", "entropy", "nll"))
        )
    classwise = {spec: ClasswiseStats().merge(stats) for spec, stats in first.classwise.items()}
    for p in parts[1:]:
        for spec, stats in p.classwise.items():
            classwise[spec].merge(stats)
    return RunSummary(
        key=first.key,
        num_classes=first.num_classes,
        calibrated=cal,
        classwise=classwise,
        ood_for=first.ood_for,
        **{name: cat[name][order] for name in _ARRAYS},
    )


def _checked(shard: Shard, drop_nonfinite: bool, notes: list[str]) -> Shard:
    bad = shard.nonfinite_rows()
    if bad.any():
        if not drop_nonfinite:
            raise ShardError(
                f"{shard.path}: {int(bad.sum())} row(s) have NaN or inf in 'zs_logits' or 'tta_logits' "
                "(pass --drop-nonfinite to drop them)"
            )
        notes.append(f"{shard.path}: dropped {int(bad.sum())} row(s) with NaN or inf logits")
        shard = shard.select(~bad)
    return shard


def summarise_run(
    members: Sequence[tuple[Path, ShardMeta]],
    calibrators: Mapping[str, TemperatureFn],
    *,
    drop_nonfinite: bool = False,
    notes: list[str] | None = None,
    on_shard: Callable[[Shard], None] | None = None,
) -> RunSummary:
    """Stream the shards of one run (one at a time) into a RunSummary. Memory: one shard plus (N,) arrays."""
    notes = notes if notes is not None else []
    key = members[0][1].key
    parts = []
    for shard in iter_run(members):
        shard = _checked(shard, drop_nonfinite, notes)
        parts.append(
            summarise_arrays(key, shard.sample_id, shard.label, shard.zs_logits, shard.tta_logits, calibrators,
                             members[0][1].output_kind))
        if on_shard is not None:
            on_shard(shard)
    return replace(merge_summaries(parts, str(members[0][0].parent)), ood_for=members[0][1].ood_for)


def load_labelled_logits(
    members: Sequence[tuple[Path, ShardMeta]], *, drop_nonfinite: bool = False, notes: list[str] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """All adapted logits (N, K) float32 and labels (N,) of one run: the labelled source of temperature scaling."""
    notes = notes if notes is not None else []
    logits, labels = [], []
    for shard in iter_run(members):
        shard = _checked(shard, drop_nonfinite, notes)
        logits.append(shard.tta_logits)
        labels.append(shard.label)
    return np.concatenate(logits), np.concatenate(labels)


@dataclass
class Summaries:
    """Everything the tables are built from: run summaries, fitted source temperatures, and notes for the reader."""

    runs: dict[RunKey, RunSummary] = field(default_factory=dict)
    #: source description (e.g. "RN50/imagenet/tda/seed=1") -> the temperature fitted there (or fixed)
    temperatures: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def backbones(self) -> list[str]:
        from calibrate.tables.layout import order_backbones

        return order_backbones({k.backbone for k in self.runs})

    def select(self, **fields) -> list[RunSummary]:
        """Runs whose key matches every given field, e.g. `select(backbone="RN50", dataset="dtd")`."""
        return [s for k, s in sorted(self.runs.items(), key=lambda kv: str(kv[0]))
                if all(getattr(k, f) == v for f, v in fields.items())]


def run_keys(runs: Iterable[RunKey]) -> list[RunKey]:
    return sorted(runs, key=lambda k: (k.backbone, k.dataset, k.method, k.seed))


def partial_text(c: Completeness) -> str | None:
    """`150 of 400` for a partial run (`Completeness.partial`: fewer rows than announced, or a `--limit` subset),
    None for a whole one or one whose completeness is unknown."""
    if not (c.known and c.partial):
        return None
    return f"{c.n_rows} of {c.n_total if c.subset and c.n_total is not None else c.n_expected}"


def check_same_test_sets(groups: dict[RunKey, Members], counts: dict[RunKey, Completeness]) -> None:
    """Every run of one dataset key must hold the same test set: the same number of classes K and of samples N.

    The tables put all runs of a dataset into one column (seeds averaged, the zero-shot row from one run), so runs
    of different test sets under one key (third-party shards, a re-extraction after the folder changed) would be
    mixed without a word; they are refused instead (docs/tables.md, "One dataset key, one test set"). N is the
    announced `zaec:n_total` where the shards carry it (a partial or `--limit` run is then still the same test
    set, noted by `calibrate.run.check_complete`), else the row count. Reads only what the footers say.

    Raises:
        ShardError: one line naming the dataset, each distinct (K, N) and a run of it.
    """
    shapes: dict[str, dict[tuple[int, int], list[RunKey]]] = {}
    for key in run_keys(groups):
        c = counts[key]
        shape = (groups[key][0][1].num_classes, c.n_total if c.n_total is not None else c.n_rows)
        shapes.setdefault(key.dataset, {}).setdefault(shape, []).append(key)
    for dataset, by_shape in shapes.items():
        if len(by_shape) > 1:
            seen = "; ".join(f"K={k}, N={n}: {keys[0]}" + (f" and {len(keys) - 1} more run(s)" if len(keys) > 1
                                                               else "") for (k, n), keys in sorted(by_shape.items()))
            raise ShardError(f"dataset {dataset!r} has runs of different test sets, which the tables would average "
                             f"into one column ({seen}); give each test set its own dataset key, or tabulate them "
                             "separately")


def load_summaries(
    paths: Iterable[str | Path],
    specs: Sequence[str],
    *,
    ts_source: str | None = "imagenet",
    temperature: float | None = None,
    drop_nonfinite: bool = False,
    allow_partial: bool = False,
    on_run: Callable[[RunKey, int, int], None] | None = None,
) -> Summaries:
    """Find, group and stream every run under `paths` into per-sample summaries.

    Calibrator specs are resolved before any shard is read (fail fast). `temperature` (temperature scaling) is fitted
    by NLL on the labelled adapted logits of the `ts_source` dataset, same backbone and method, same seed when present
    else every seed pooled (`calibrate.run.resolve_ts_sources`, as `zaec-calibrate` does), streamed; or fixed to
    `temperature`; without a source it is skipped with a note.

    A run whose shards hold fewer samples than announced, or a `--limit` subset, stops the load (PartialRunError)
    unless `allow_partial` (`calibrate.run.check_complete`; then a note names it). Runs of one dataset key with
    different class or sample counts stop it too (`check_same_test_sets`).

    Raises:
        ShardError: no shards, a shard that violates the contract, an incomplete run (PartialRunError), or runs of
            one dataset holding different test sets.
        ValueError: an unknown calibrator spec.
    """
    cals = {spec: parse_calibrator(spec) for spec in specs if spec != "temperature"}
    groups = group_shards(find_shards(paths))
    counts = run_counts(groups)
    out = Summaries(notes=check_complete(groups, allow_partial, counts))
    check_same_test_sets(groups, counts)
    fitted: dict[RunKey, float] = {}
    if "temperature" in specs and temperature is not None:
        t = float(TemperatureScaling(T=temperature).temperature_)
        fitted = {key: t for key in groups}
        out.temperatures["fixed (--temperature)"] = t
    elif "temperature" in specs:
        sources = resolve_ts_sources(groups, ts_source) if ts_source else {}
        cache: dict[tuple[str, str, tuple[RunKey, ...]], float] = {}
        missing: set[tuple[str, str]] = set()
        for key in run_keys(groups):
            if key not in sources:
                missing.add((key.backbone, key.method))
                continue
            src_keys, desc = sources[key]
            ck = (key.backbone, key.method, src_keys)
            if ck not in cache:
                members = [m for k in src_keys for m in groups[k]]

                def batches(members=members):
                    for shard in iter_run(members):
                        shard = _checked(shard, drop_nonfinite, [])
                        shard = shard.select(shard.label >= 0)  # an OOD run as the source: its labelled rows
                        yield shard.tta_logits, shard.label

                ts = TemperatureScaling().fit(batches=batches)
                cache[ck] = float(ts.temperature_)
                out.temperatures[desc] = cache[ck]
                if ts.at_bound_:
                    out.notes.append(ts.describe_fit(desc))
            fitted[key] = cache[ck]
        for backbone, method in sorted(missing):
            out.notes.append(
                f"temperature scaling skipped for {backbone}/{method}: no labelled source shards of dataset "
                f"{ts_source!r} (choose one with --ts-source or fix T with --temperature)"
            )
    keys = run_keys(groups)
    for i, key in enumerate(keys):
        fns: dict[str, TemperatureFn] = {spec: cal.temperatures for spec, cal in cals.items()}
        if key in fitted:
            fns["temperature"] = lambda zs, tta, t=fitted[key]: np.full(np.shape(tta)[0], t)
        c = counts[key]
        out.runs[key] = replace(summarise_run(groups[key], fns, drop_nonfinite=drop_nonfinite, notes=out.notes),
                                partial=partial_text(c))
        if on_run is not None:
            on_run(key, i + 1, len(keys))
    return out
