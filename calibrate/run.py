"""The streaming calibration run behind `zaec-calibrate`: shards in, one metrics DataFrame out.

Every name (calibrator specs, binning, paths, shard metadata, temperature-scaling sources) is resolved before the
first logit is read. Each run (backbone, dataset, method, seed) is then streamed shard by shard: memory is bounded
by one shard plus the (N,) per-sample confidence/correctness arrays that equal-mass ECE needs and the per-distinct-
score counts (at most N) that the tie-exact selective metrics need (`calibrate.trust`).
"""

from __future__ import annotations

import os

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from calibrate.calibrators import ZAEC, Calibrator, TemperatureScaling, parse_calibrators
from calibrate.functional.softmax import adapted_stats, softmax_stats
from calibrate.metrics import METRIC_NAMES, CalibrationStats, _check_binning, _check_bins
from calibrate.ood import NOT_OOD, OOD_NAMES, OODStats, missing_ood
from calibrate.trust import TRUST_NAMES, TrustStats, describe_missing
from schemas.atomic import atomic_path, write_json_atomic
from schemas.shard import (
    Completeness,
    PartialRunError,
    RunKey,
    Shard,
    ShardError,
    ShardMeta,
    find_shards,
    group_shards,
    read_shard,
    run_completeness,
)

ZERO_SHOT = "zero-shot"
KEY_COLUMNS = ("backbone", "dataset", "method", "seed")
#: the run's announced test-set size and `--limit` (null: not announced, or no limit), its out-of-distribution rows
#: (`n_ood`: an OOD run's rows labelled -1, null for a plain run; `n` counts the in-distribution rows) and whether it
#: is partial (`--allow-partial`: fewer rows than announced, or a `--limit` subset): with `n` they say how much of the
#: test set a row covers (`check_complete`)
COUNT_COLUMNS = ("n_total", "limit", "n_ood", "partial")
METRIC_COLUMNS = (*KEY_COLUMNS, "calibrator", "n", *COUNT_COLUMNS, *(m for m in METRIC_NAMES if m != "n"),
                  *TRUST_NAMES, *OOD_NAMES)
SAMPLE_COLUMNS = (
    *KEY_COLUMNS, "sample_id", "label", "calibrator", "temperature", "prediction", "confidence", "entropy",
)
DEFAULT_CALIBRATORS = "none,temperature,sals,zaec"
DEFAULT_TS_SOURCE = "imagenet"

Members = list[tuple[Path, ShardMeta]]


@dataclass
class RunReport:
    """What a run produced: the metrics table and human-readable notes (fitted T, capped samples, skips, drops)."""

    metrics: pl.DataFrame
    notes: list[str] = field(default_factory=list)
    temperatures: dict[str, float] = field(default_factory=dict)
    capped: dict[str, int] = field(default_factory=dict)
    dropped_nonfinite: int = 0
    #: "run|calibrator" -> {column: reason} for every metric written as missing (NaN)
    missing: dict[str, dict[str, str]] = field(default_factory=dict)


def _clean(shard: Shard, drop_nonfinite: bool) -> tuple[Shard, int]:
    bad = shard.nonfinite_rows()
    n_bad = int(bad.sum())
    if n_bad and not drop_nonfinite:
        raise ShardError(
            f"{shard.path}: {n_bad} row(s) have NaN or inf in 'zs_logits' or 'tta_logits' "
            "(pass --drop-nonfinite to drop them and report the count)"
        )
    return (shard.select(~bad) if n_bad else shard), n_bad


class _DuplicateCheck:
    """Detects a sample_id repeated across the shards of one run; state: the sorted (N,) ids seen so far."""

    def __init__(self, key: RunKey) -> None:
        self.key = key
        self.seen = np.zeros(0, dtype=np.int64)

    def add(self, path: Path, ids: np.ndarray) -> None:
        ids = np.sort(ids)
        if self.seen.size and ids.size:
            pos = np.clip(np.searchsorted(self.seen, ids), 0, self.seen.size - 1)
            dup = ids[self.seen[pos] == ids]
            if dup.size:
                raise ShardError(
                    f"{path}: {dup.size} sample_id value(s) (e.g. {int(dup[0])}) already appear in another shard of "
                    f"run {self.key}; every sample must appear once per run"
                )
        self.seen = np.concatenate([self.seen, ids])
        self.seen.sort(kind="stable")


def run_counts(groups: dict[RunKey, Members]) -> dict[RunKey, Completeness]:
    """Rows present and announced (`schemas.shard.run_completeness`) of every run; reads only the Parquet footers."""
    return {key: run_completeness(members) for key, members in groups.items()}


#: how the caller spells `--allow-partial`, when it is not the command line itself: `make tables` sets it to
#: `ALLOW_PARTIAL=1 (make tables ALLOW_PARTIAL=1)`, so that a refusal names what the user can type there
ALLOW_PARTIAL_AS_ENV = "ZAEC_ALLOW_PARTIAL_AS"


def allow_partial_option() -> str:
    """`--allow-partial`, or the caller's spelling of it (`ALLOW_PARTIAL_AS_ENV`)."""
    return os.environ.get(ALLOW_PARTIAL_AS_ENV) or "--allow-partial"


def check_complete(
    groups: dict[RunKey, Members], allow_partial: bool = False, counts: dict[RunKey, Completeness] | None = None
) -> list[str]:
    """Check that every run's shards hold the whole test set their writer announced; returns notes for the reader.

    A run with fewer rows than its shards' `zaec:n_total` / `zaec:limit` announce (an interrupted extraction, one
    still running, or only some of its parts given), or a `--limit` run of fewer samples than the test set holds
    (a subset: `5 of 24 samples (--limit 5)`), raises PartialRunError naming the run and the counts, unless
    `allow_partial`, in which case a note says the run is partial. Runs whose shards carry no `zaec:n_total`
    (other writers) get a note that their completeness is unknown. A run with no rows at all raises ShardError.
    Reads only the Parquet footers (`counts`: the runs' `run_counts` when the caller has them already).
    """
    counts = counts if counts is not None else run_counts(groups)
    notes: list[str] = []
    unknown: list[str] = []
    for key in sorted(groups, key=lambda k: (k.backbone, k.dataset, k.method, k.seed)):
        c = counts[key]
        if c.n_rows == 0:
            # metrics of no sample are NaN, not a result: stop here, before any logit is read
            raise ShardError(f"run {key} holds no samples: {c.n_shards} shard(s) with 0 rows "
                             f"({groups[key][0][0]}); nothing to calibrate")
        if not c.known:
            unknown.append(str(key))
        elif c.partial:
            if allow_partial:
                notes.append(f"{key}: PARTIAL run, {c.describe()} (--allow-partial)")
            elif c.interrupted:
                raise PartialRunError(
                    f"run {key} is incomplete: {c.describe()} (an interrupted or still running extraction?); "
                    f"finish it by rerunning the same zaec-extract command, or pass {allow_partial_option()} to use "
                    "what is there")
            else:
                raise PartialRunError(
                    f"run {key} covers only part of its test set: {c.describe()}; rerun zaec-extract without "
                    f"--limit for all {c.n_total} samples, or pass {allow_partial_option()} to use the subset")
    if unknown:
        notes.append(f"completeness not checked for {len(unknown)} run(s) whose shards carry no 'zaec:n_total' "
                     f"(written by another tool?): {', '.join(unknown[:5])}{', ...' if len(unknown) > 5 else ''}")
    return notes


def resolve_ts_sources(
    groups: dict[RunKey, Members], source: str
) -> dict[RunKey, tuple[tuple[RunKey, ...], str]]:
    """For every run: the source runs whose labelled logits fit its temperature, and a description.

    Same backbone and method on the `source` dataset; the same seed when present, else every seed pooled.
    Runs without a source are absent from the result.
    """
    out: dict[RunKey, tuple[tuple[RunKey, ...], str]] = {}
    for key in groups:
        cands = [k for k in groups if (k.backbone, k.dataset, k.method) == (key.backbone, source, key.method)]
        same = [k for k in cands if k.seed == key.seed]
        chosen = tuple(sorted(same or cands, key=lambda k: k.seed))
        if chosen:
            seeds = ",".join(str(k.seed) for k in chosen)
            out[key] = (chosen, f"{key.backbone}/{source}/{key.method}/seed={seeds}")
    return out


#: source logits of temperature scaling are kept in memory up to this size (ImageNet's 50,000 x 1,000 adapted
#: float32 logits take 200 MB), so the fit reads them once; larger sources are re-read on every fitting pass
TS_CACHE_BYTES = 512 * 2**20


def _batches(members: Members, drop_nonfinite: bool) -> Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]:
    cache: list[tuple[np.ndarray, np.ndarray]] = []
    state = {"complete": False, "over": False, "bytes": 0}

    def gen() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if state["complete"]:
            yield from cache
            return
        for p, _ in members:
            shard, _ = _clean(read_shard(p), drop_nonfinite)
            if shard.meta.ood_for is not None:  # an OOD run as the source: its labelled rows only
                shard = shard.select(shard.label >= 0)
            item = (shard.tta_logits, shard.label)
            if not state["over"]:
                state["bytes"] += shard.tta_logits.nbytes + shard.label.nbytes
                if state["bytes"] <= TS_CACHE_BYTES:
                    cache.append(item)
                else:
                    state["over"] = True
                    cache.clear()
            yield item
        state["complete"] = not state["over"]

    return gen


class _SampleWriter:
    """Streams per-sample rows of one run into one Parquet file (temporary name, renamed on close)."""

    def __init__(self, root: Path, key: RunKey) -> None:
        self.path = (
            root / f"backbone={key.backbone}" / f"dataset={key.dataset}" / f"method={key.method}"
            / f"seed={key.seed}" / "samples.parquet"
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(".samples.parquet.tmp")
        self.key = key
        self.writer: pq.ParquetWriter | None = None

    def write(self, calibrator: str, sample_id: np.ndarray, label: np.ndarray, temperature: np.ndarray, stats: Any) -> None:
        n = len(sample_id)
        table = pa.table(
            {
                "backbone": pa.array([self.key.backbone] * n, pa.string()),
                "dataset": pa.array([self.key.dataset] * n, pa.string()),
                "method": pa.array([self.key.method] * n, pa.string()),
                "seed": pa.array(np.full(n, self.key.seed, dtype=np.int64)),
                "sample_id": pa.array(sample_id.astype(np.int64)),
                "label": pa.array(label.astype(np.int32)),
                "calibrator": pa.array([calibrator] * n, pa.string()),
                "temperature": pa.array(np.broadcast_to(temperature, (n,)).astype(np.float64)),
                "prediction": pa.array(stats.prediction.astype(np.int32)),
                "confidence": pa.array(stats.confidence),
                "entropy": pa.array(stats.entropy),
            }
        )
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.tmp, table.schema, compression="zstd")
        self.writer.write_table(table)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.tmp.replace(self.path)

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.tmp.unlink(missing_ok=True)


def calibrate_paths(
    paths: Sequence[str | Path],
    *,
    calibrators: str | Iterable[str] = DEFAULT_CALIBRATORS,
    n_bins: int = 20,
    binning: str = "width",
    ts_source: str = DEFAULT_TS_SOURCE,
    temperature: float | None = None,
    drop_nonfinite: bool = False,
    allow_partial: bool = False,
    samples_dir: Path | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> RunReport:
    """Run every calibrator on every run found under `paths`; returns the metrics table and notes.

    Args:
        paths: shard files or directories (searched recursively).
        calibrators: spec strings (`none`, `temperature`, `temperature:T=1.2`, `sals`, `zaec`, `zaec:strength=0.5`...).
        n_bins, binning: ECE binning (`width`: TTABC's 20 equal-width bins; `mass`: equal-count bins).
        ts_source: dataset whose labelled logits (same backbone and method) fit temperature scaling.
        temperature: fix the temperature-scaling T instead of fitting it.
        drop_nonfinite: drop rows with NaN/inf logits (counted in the notes) instead of failing.
        allow_partial: calibrate runs whose shards hold fewer samples than announced (noted per run) instead of
            failing (`check_complete`).
        samples_dir: also write per-sample results there.
        progress: called with the number of rows done after each shard; on_total: called once with the total.

    Raises:
        ShardError, ValueError: bad input; the message names the file/column or lists the valid choices.
        PartialRunError: an incomplete run without `allow_partial`.

    """
    # resolve every name before reading any logit
    cals = _resolve_calibrators(calibrators, temperature)
    n_bins = _check_bins(n_bins)
    _check_binning(binning)
    files = find_shards(paths)
    groups = group_shards(files)
    if on_total is not None:
        on_total(sum(pq.ParquetFile(p).metadata.num_rows for p in files))
    counts = run_counts(groups)
    report = RunReport(pl.DataFrame(), notes=check_complete(groups, allow_partial, counts))
    sources = resolve_ts_sources(groups, ts_source)
    ts_cals = [c for c in cals if isinstance(c, TemperatureScaling)]
    fitted: dict[tuple[str, tuple[RunKey, ...]], float] = {}

    rows: list[dict[str, Any]] = []
    for key in sorted(groups, key=lambda k: (k.backbone, k.dataset, k.method, k.seed)):
        members = groups[key]
        active = _active_calibrators(key, cals, groups, sources, fitted, ts_source, drop_nonfinite, report)
        announced = {"n_total": counts[key].n_total, "limit": counts[key].limit,
                     "partial": counts[key].known and counts[key].partial}
        rows += [{**r, **announced} for r in _calibrate_run(key, members, active, n_bins, binning, drop_nonfinite,
                                                            samples_dir, report, progress)]
    for c in ts_cals:
        if c.T is not None:
            report.notes.append(f"temperature scaling fixed: T = {c.T:g}")
    plain = [k for k in groups if groups[k][0][1].ood_for is None]
    if plain:  # one line for all of them (docs/calibrate.md, "Out-of-distribution detection")
        report.notes.append(f"{len(plain)} run(s) without out-of-distribution rows: ood_* columns missing ({NOT_OOD})")
    report.metrics = pl.DataFrame(rows, schema=_metric_schema(), orient="row") if rows else pl.DataFrame(
        schema=_metric_schema()
    )
    return report


def _resolve_calibrators(calibrators: str | Iterable[str], temperature: float | None) -> list[Calibrator]:
    """Parse the specs; a fixed `temperature` sets every temperature-scaling calibrator without its own T."""
    cals = parse_calibrators(calibrators)
    if temperature is not None:
        if not (np.isfinite(temperature) and temperature > 0):
            raise ValueError(f"--temperature must be finite and > 0, got {temperature}")
        for c in cals:
            if isinstance(c, TemperatureScaling) and c.T is None:
                c.T = c.temperature_ = float(temperature)
                c.n_iter_ = 0
    return cals


def _active_calibrators(key: RunKey, cals: Sequence[Calibrator], groups: dict[RunKey, Members],
                        sources: dict[RunKey, tuple[tuple[RunKey, ...], str]],
                        fitted: dict[tuple[str, tuple[RunKey, ...]], float], ts_source: str, drop_nonfinite: bool,
                        report: RunReport) -> list[Calibrator]:
    """The calibrators of one run: temperature scaling fixed, fitted on the source runs (once per backbone, method
    and source; `fitted` caches it), or skipped with a note; the others as given."""
    active: list[Calibrator] = []
    for c in cals:
        if not (isinstance(c, TemperatureScaling) and c.T is None):
            active.append(c)
            continue
        if key not in sources:
            report.notes.append(
                f"{key}: skipped '{c.spec}': no '{ts_source}' shards of backbone {key.backbone} and method "
                f"{key.method} among the inputs (add them, pick another with --ts-source, or fix --temperature)"
            )
            continue
        src_keys, desc = sources[key]
        cache_key = (key.backbone + "\0" + key.method, src_keys)
        if cache_key not in fitted:
            src_members = [m for k in src_keys for m in groups[k]]
            ts = TemperatureScaling().fit(batches=_batches(src_members, drop_nonfinite))
            fitted[cache_key] = t = float(ts.temperature_)
            report.temperatures[desc] = t
            report.notes.append(ts.describe_fit(desc))
        fc = TemperatureScaling(T=fitted[cache_key])
        fc.spec = c.spec
        active.append(fc)
        if key in src_keys:  # the tables mark such cells ‡ and never bold them (docs/tables.md)
            report.notes.append(f"{key}: '{c.spec}' is scored on the labelled logits its T was fitted on "
                                f"(in-sample: --ts-source {ts_source})")
    return active


def _metric_schema() -> dict[str, Any]:
    schema: dict[str, Any] = {c: pl.Float64 for c in METRIC_COLUMNS}
    schema.update({"backbone": pl.String, "dataset": pl.String, "method": pl.String, "seed": pl.Int64,
                   "calibrator": pl.String, "n": pl.Int64, "n_total": pl.Int64, "limit": pl.Int64,
                   "n_ood": pl.Int64, "partial": pl.Boolean})
    return schema


def _calibrate_run(
    key: RunKey,
    members: Members,
    cals: list[Calibrator],
    n_bins: int,
    binning: str,
    drop_nonfinite: bool,
    samples_dir: Path | None,
    report: RunReport,
    progress: Callable[[int], None] | None,
) -> list[dict[str, Any]]:
    names = [ZERO_SHOT] + [c.spec for c in cals]
    stats = {name: CalibrationStats(n_bins, binning) for name in names}
    trust = {name: TrustStats() for name in names}
    # an OOD run: calibration and trust metrics on its in-distribution rows, detection on all (calibrate/ood.py)
    ood = {name: OODStats() for name in names} if members[0][1].ood_for is not None else None
    capped = {c.spec: 0 for c in cals if isinstance(c, ZAEC)}
    log_probs = members[0][1].output_kind == "log_probs"
    one_hot = 0  # log-probability rows whose softmax is one-hot in float64 at T = 1 (docs/calibrate.md)
    dup = _DuplicateCheck(key)
    writer = _SampleWriter(samples_dir, key) if samples_dir is not None else None
    dropped = 0
    n_ood = 0  # rows labelled -1 (OOD runs only)
    try:
        for p, _ in members:
            raw = read_shard(p)
            shard, n_bad = _clean(raw, drop_nonfinite)
            dropped += n_bad
            dup.add(p, raw.sample_id)
            y = shard.label
            ind = y >= 0  # every row of a plain run; the in-distribution rows of an OOD run
            n_ood += int((~ind).sum())
            y_id = np.maximum(y, 0)  # an OOD row's NLL/Brier against class 0 is computed, never used
            zs_stats = softmax_stats(shard.zs_logits, 1.0, y_id)
            _update(stats[ZERO_SHOT], trust[ZERO_SHOT], ood and ood[ZERO_SHOT], shard.zs_logits, 1.0, y, ind,
                    zs_stats)
            if writer is not None:
                writer.write(ZERO_SHOT, shard.sample_id, y, np.ones(len(shard)), zs_stats)
            if log_probs:
                one_hot += int((softmax_stats(shard.tta_logits, 1.0, y).entropy == 0).sum())
            for c in cals:
                t = c.temperatures(shard.zs_logits, shard.tta_logits)
                if isinstance(c, ZAEC):
                    capped[c.spec] += int(c.capped_.sum())
                s = adapted_stats(shard.tta_logits, t, y_id, members[0][1].output_kind)
                _update(stats[c.spec], trust[c.spec], ood and ood[c.spec], shard.tta_logits, t, y, ind, s)
                if writer is not None:
                    writer.write(c.spec, shard.sample_id, y, t, s)
            if progress is not None:
                progress(len(raw))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()
    if dropped:
        report.dropped_nonfinite += dropped
        report.notes.append(f"{key}: dropped {dropped} row(s) with NaN or inf logits (--drop-nonfinite)")
    if log_probs:
        report.notes.append(f"{key}: the adapted rows are log-probabilities (zaec:output_kind); every calibrator "
                            f"treats them as logits (softmax(log p) = p); {one_hot} row(s) one-hot at T = 1")
    for spec, n in capped.items():
        report.capped[f"{key}|{spec}"] = n
        if n:
            report.notes.append(
                f"{key}: '{spec}': {n} sample(s) capped (target entropy unreachable at finite temperature, e.g. "
                "a uniform zero-shot prediction)"
            )
    for name in names:
        why = {**trust[name].reasons(), **(ood[name].reasons() if ood else {})}
        if why:
            report.missing[f"{key}|{name}"] = why
            report.notes.append(f"{key}: '{name}': {describe_missing(why)}")
    return [{**key.as_dict(), "calibrator": name, **stats[name].compute(), "n_ood": n_ood if ood else None,
             **trust[name].compute(), **(ood[name].compute() if ood else missing_ood())} for name in names]


def _update(stats: CalibrationStats, trust: TrustStats, ood: OODStats | None, logits: np.ndarray, t: Any,
            y: np.ndarray, ind: np.ndarray, s: Any) -> None:
    """Fold one shard's prediction `s` (softmax_stats of logits / t, every row) into the run's statistics: the
    calibration and trust metrics over the in-distribution rows `ind`, the OOD detection (if any) over all rows."""
    if ood is not None:
        ood.update(s.confidence, s.entropy, ind)
    if not ind.all():
        logits, y = logits[ind], y[ind]
        t = t[ind] if np.ndim(t) else t
        s = replace(s, **{f.name: getattr(s, f.name)[ind] for f in fields(s) if getattr(s, f.name) is not None})
    stats.update(s.confidence, s.prediction == y, s.nll, s.brier, s.entropy)
    trust.update(logits, t, y, s.prediction, s.confidence, s.entropy)


def write_metrics(report: RunReport, out: Path) -> tuple[Path, Path, Path]:
    """Write `out/metrics.parquet`, `out/metrics.csv` and `out/notes.json` (each atomically); returns the three
    paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, writer in (("metrics.parquet", report.metrics.write_parquet), ("metrics.csv", report.metrics.write_csv)):
        with atomic_path(out / name) as tmp:
            writer(tmp)
        paths.append(out / name)
    write_json_atomic(out / "notes.json", {"notes": report.notes, "temperatures": report.temperatures,
                                           "capped": report.capped, "dropped_nonfinite": report.dropped_nonfinite,
                                           "missing": report.missing},
                      indent=2)
    return paths[0], paths[1], out / "notes.json"
