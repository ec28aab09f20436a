"""Beyond the paper: selective prediction and classwise calibration per method and calibrator (issue 24).

Pure builders (run summaries in, polars DataFrames out), kept apart from `builders.py` (the paper's items):

- `trust_cells`: every run's metrics `calibrate.trust.TRUST_NAMES` for the paired zero-shot prediction and each
  calibrator, seeds averaged, with paired bootstrap replicates drawn from exactly the resamples of the tables' ECE
  bootstrap (`bootstrap.resample_counts` with `bootstrap.dataset_seed`), so every difference is per resample.
- `trust_table` / `trust_differences`: the table (blocks zero-shot, then one per method; rows raw / SaLS / ZAEC /
  temperature scaling), averaged over each dataset group as the main table averages (unweighted over the group's
  datasets present in the row), and ZAEC minus raw / minus temperature scaling with paired intervals.
- `risk_coverage_curves`: the arrays of the risk-coverage figure for one run per method.

Scores: the selective metrics are computed from the max softmax probability (`_msp` columns) and from the negative
entropy (`_negent`); classwise and top-label ECE use 15 equal-width bins (`_15w`; `calibrate.classwise`).
Undefined values (AUROC and FPR95 of a run without a misclassified sample, classwise ECE without the (N, K)
probabilities) stay null, with the reason in `TrustCell.reasons`; averages are over the datasets where defined
(`n_datasets`), never over made-up numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import polars as pl

from calibrate.classwise import CLASSWISE_NAMES, top_label_ece
from calibrate.selective import SCORES, SelectiveStats, confidence_score, interval, oracle_curve, risk_coverage
from calibrate.tables import layout
from calibrate.tables.bootstrap import ZERO_SHOT, BootstrapResult, dataset_seed, resample_counts
from calibrate.tables.data import RunSummary
from calibrate.trust import TRUST_NAMES, paired_replicates

#: the calibrators of the table, in its row order: raw, SaLS, ZAEC, temperature scaling
TRUST_CALIBRATORS: tuple[str, ...] = ("none", "sals", "zaec", "temperature")
#: the differences the table claims: ZAEC against raw TTA and against temperature scaling
TRUST_COMPARISONS: tuple[tuple[str, str], ...] = (("zaec", "none"), ("zaec", "temperature"))
#: metrics where higher is better (the misclassification AUROC); every other metric is better lower
HIGHER_IS_BETTER: frozenset[str] = frozenset(f"auroc_{s}" for s in SCORES)
_SCORE_LABELS = {"msp": "MSP", "negent": "−H"}
_METRIC_LABELS = {"aurc": "AURC", "eaurc": "E-AURC", "auroc": "AUROC", "fpr95": "FPR95"}
#: why classwise ECE is missing from a summary without the streamed (N, K) statistics
NO_PROBS = "needs every class's probability, not kept for this prediction"


def metric_label(metric: str) -> str:
    """Column header naming the metric and the score or binning it uses, e.g. `AURC (MSP)`, `cw-ECE (15 bins)`.

    Example:
        >>> metric_label("auroc_negent"), metric_label("tl_ece_15w")
        ('AUROC (−H)', 'tl-ECE (15 bins)')
    """
    if metric in CLASSWISE_NAMES:
        kind, _, bins = metric.split("_")
        return f"{kind}-ECE ({bins.rstrip('w')} bins)"
    name, score = metric.rsplit("_", 1)
    return f"{_METRIC_LABELS[name]} ({_SCORE_LABELS[score]})"


def metric_score(metric: str) -> str:
    """The confidence score a column is computed from: `msp`, `negent`, or `probs` (classwise / top-label ECE)."""
    return "probs" if metric in CLASSWISE_NAMES else metric.rsplit("_", 1)[1]


@dataclass
class TrustCell:
    """Metrics of one prediction (one run, or seeds averaged): fractions, NaN where undefined.

    Attributes:
        values: {TRUST_NAMES column: value}.
        reasons: {column: why it is undefined}.
        reps: {column: (B,) bootstrap replicates (NaN in a resample where undefined)}; empty without a bootstrap.
    """

    values: dict[str, float]
    reasons: dict[str, str] = field(default_factory=dict)
    reps: dict[str, np.ndarray] = field(default_factory=dict)
    #: the run is partial (`RunSummary.partial`, e.g. `150 of 400`; seeds averaged: the distinct ones); None: whole
    partial: str | None = None


def _predictions(s: RunSummary, calibrators: Sequence[str]) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """(name, prediction, confidence, entropy) of the paired zero-shot prediction and each calibrator present."""
    out = [(ZERO_SHOT, s.zs_pred, s.zs_confidence, s.zs_entropy)]
    out += [(c, s.tta_pred, s.calibrated[c].confidence, s.calibrated[c].entropy)
            for c in calibrators if c in s.calibrated]
    return out


def run_trust(
    s: RunSummary, calibrators: Sequence[str] = TRUST_CALIBRATORS, boot: BootstrapResult | None = None
) -> dict[str, TrustCell]:
    """`TRUST_NAMES` of one run's zero-shot prediction and each calibrator, with paired bootstrap replicates.

    The selective metrics and the top-label ECE come from the per-sample arrays; the classwise ECE from the
    statistics folded while the logits were read (`RunSummary.classwise`), without replicates (its bootstrap needs
    N x K residuals per prediction: `calibrate.classwise.classwise_residuals`). The replicates use the resamples of
    the tables' ECE bootstrap of this run (`resample_counts(N, B, dataset_seed(seed, backbone, dataset,
    sample_id))`), so they are paired with each other, with the ECE intervals and across runs of the same samples.
    """
    preds = _predictions(s, calibrators)
    cells: dict[str, TrustCell] = {}
    for name, pred, conf, ent in preds:
        correct = pred == s.label
        sel = SelectiveStats().update(conf, ent, correct)
        values = sel.compute()
        reasons = sel.reasons()
        values[CLASSWISE_NAMES[1]] = top_label_ece(pred, conf, correct, s.num_classes) if len(s) else float("nan")
        cw = s.classwise.get(name)
        values[CLASSWISE_NAMES[0]] = float("nan") if cw is None else cw.compute()[CLASSWISE_NAMES[0]]
        reasons.update({} if cw is not None else {CLASSWISE_NAMES[0]: NO_PROBS})
        if not len(s):
            reasons.update({c: "no samples" for c in TRUST_NAMES})
        cells[name] = TrustCell(values, reasons, partial=s.partial)
    if boot is not None and boot.n_resamples and len(s):
        counts = resample_counts(len(s), boot.n_resamples,
                                 dataset_seed(boot.seed, s.key.backbone, s.key.dataset, s.sample_id))
        reps = paired_replicates(np.stack([p[1] for p in preds]), np.stack([p[2] for p in preds]),
                                 np.stack([p[3] for p in preds]), s.label, s.num_classes, counts)
        for j, (name, *_rest) in enumerate(preds):
            cells[name].reps = {col: r[j] for col, r in reps.items()}
    return cells


def _mean_cells(cells: Sequence[TrustCell], names: Sequence[str]) -> TrustCell:
    """Several runs averaged (seeds, or methods' zero-shot): values and replicates (a NaN in any stays NaN);
    reasons name the run (`names`) when several."""
    values = {c: float(np.mean([x.values[c] for x in cells])) for c in cells[0].values}
    reasons: dict[str, str] = {}
    for name, x in zip(names, cells):
        for col, why in x.reasons.items():
            reasons.setdefault(col, why if len(cells) == 1 else f"{name}: {why}")
    cols = set.intersection(*(set(x.reps) for x in cells))
    reps = {c: np.mean([x.reps[c] for x in cells], axis=0) for c in cols}
    partial = "; ".join(dict.fromkeys(x.partial for x in cells if x.partial)) or None
    return TrustCell(values, reasons, reps, partial)


def trust_cells(
    runs: Iterable[RunSummary], boot: BootstrapResult | None = None, calibrators: Sequence[str] = TRUST_CALIBRATORS,
    per_run: Callable[..., dict[str, TrustCell]] | None = None,
) -> dict[tuple[str, str, str, str], TrustCell]:
    """(backbone, dataset, method, prediction) -> seeds averaged `TrustCell`, prediction "zero-shot" or a calibrator.

    Zero-shot per (backbone, dataset) is stored under method "zero-shot": the `zero-shot` method's run where
    present, else the mean of the paired zero-shot predictions stored with every method (as the main table).
    `per_run(summary, calibrators, boot)` gives one run's cells (default `run_trust`; the OOD table passes
    `calibrate.tables.ood_tables.run_ood`).
    """
    per_run = per_run or run_trust
    by_cell: dict[tuple[str, str, str, str], list[tuple[int, TrustCell]]] = {}
    for s in runs:
        for name, cell in per_run(s, calibrators, boot).items():
            k = s.key
            by_cell.setdefault((k.backbone, k.dataset, k.method, name), []).append((k.seed, cell))
    out = {key: _mean_cells([c for _, c in v], [f"seed {sd}" for sd, _ in v]) for key, v in by_cell.items()}
    for bb, ds in {(k[0], k[1]) for k in out}:
        if (bb, ds, layout.ZERO_SHOT, ZERO_SHOT) in out:
            continue
        zs = sorted((k[2], v) for k, v in out.items() if k[:2] == (bb, ds) and k[3] == ZERO_SHOT)
        out[(bb, ds, layout.ZERO_SHOT, ZERO_SHOT)] = _mean_cells([v for _, v in zs],
                                                                 [f"{m}'s zero-shot" for m, _ in zs])
    return {k: v for k, v in out.items() if not (k[3] == ZERO_SHOT and k[2] != layout.ZERO_SHOT)}


_TABLE_SCHEMA = {
    "backbone": pl.Utf8, "block": pl.Utf8, "block_label": pl.Utf8, "block_pos": pl.Int64, "row": pl.Utf8,
    "row_label": pl.Utf8, "row_pos": pl.Int64, "group": pl.Utf8, "dataset": pl.Utf8, "column_label": pl.Utf8,
    "metric": pl.Utf8, "metric_label": pl.Utf8, "score": pl.Utf8, "value": pl.Float64, "ci_low": pl.Float64,
    "ci_high": pl.Float64, "n_undefined": pl.Int64, "n_datasets": pl.Int64, "group_size": pl.Int64,
    "in_sample": pl.Boolean, "missing_reason": pl.Utf8, "partial": pl.Utf8,
}


def _interval(estimate: float | None, reps: np.ndarray | None, level: float, clip: bool) -> tuple:
    """(low, high, n_undefined) in percent from fraction replicates; metrics clipped to [0, 100]."""
    if estimate is None or reps is None:
        return None, None, None
    lo, hi, und = interval(estimate, np.asarray(reps) * 100.0, level)
    lo, hi = float(lo), float(hi)
    if not np.isfinite(lo):
        return None, None, int(und)
    if clip:
        lo, hi = max(lo, 0.0), min(hi, 100.0)
    return lo, hi, int(und)


def _average(parts: Sequence[tuple[float | None, np.ndarray | None]]) -> tuple[float | None, np.ndarray | None, int]:
    """Unweighted mean of the defined values (percent), the mean of their replicates (only when each has them) and
    how many were averaged."""
    have = [(v, r) for v, r in parts if v is not None]
    if not have:
        return None, None, 0
    reps = [r for _, r in have]
    avg_rep = np.mean(reps, axis=0) if all(r is not None for r in reps) else None
    return float(np.mean([v for v, _ in have])), avg_rep, len(have)


def _rows_of(cells: dict, backbone: str, calibrators: Sequence[str]) -> list[tuple[str, str, str, str]]:
    """(block, block_label, row, row_label) of one backbone, top to bottom: zero-shot, then each method's
    calibrators present."""
    keys = [k for k in cells if k[0] == backbone]
    rows = [(layout.ZERO_SHOT, f"Zero-shot {backbone}", ZERO_SHOT, "Zero-shot")] if any(
        k[3] == ZERO_SHOT for k in keys) else []
    for m in layout.order_methods({k[2] for k in keys}):
        rows += [(m, layout.method_label(m), c, layout.calibrator_label(c)) for c in calibrators
                 if any(k[2] == m and k[3] == c for k in keys)]
    return rows


def trust_table(
    cells: dict[tuple[str, str, str, str], TrustCell],
    backbone: str,
    level: float = 0.95,
    calibrators: Sequence[str] = TRUST_CALIBRATORS,
    ts_in_sample: str | None = None,
) -> pl.DataFrame:
    """The trust table of one backbone, long format: one row per (row of the table, dataset or group average, metric).

    Values in percent (AURC and E-AURC: risk x 100; AUROC, FPR95, ECEs x 100). Per dataset the seeds' mean; per
    group (`dataset == "avg"`) the unweighted mean over the group's datasets where the metric is defined
    (`n_datasets` of `group_size`), its replicates the mean of theirs. `ci_low`/`ci_high`: basic bootstrap interval
    (`calibrate.selective.interval`, clipped to [0, 100]), `n_undefined` resamples left out; null without replicates.
    `missing_reason`: why a null value is missing. `in_sample`: a temperature-scaling value scored on the dataset its
    T was fitted on (`ts_in_sample`), or an average including it. `partial`: a partial run's count (`TrustCell`), an
    average's partial datasets; null when whole.
    """
    present = {k[1] for k in cells if k[0] == backbone}
    out = []
    block_pos: dict[str, int] = {}
    for row_pos, (block, block_label, row, row_label) in enumerate(_rows_of(cells, backbone, calibrators)):
        pos = (block_label, block_pos.setdefault(block, len(block_pos)), row, row_label, row_pos)
        for group, datasets in layout.order_datasets(present):
            for metric in TRUST_NAMES:
                parts, fitted, partial = [], False, []
                for d in datasets:
                    cell = cells.get((backbone, d, block, row))
                    raw = None if cell is None else cell.values[metric]
                    v = None if raw is None or not np.isfinite(raw) else raw * 100.0
                    rep = None if cell is None else cell.reps.get(metric)
                    own = row == "temperature" and d == ts_in_sample and v is not None
                    fitted |= own
                    why = "no run" if cell is None else cell.reasons.get(metric) if v is None else None
                    part = cell.partial if cell is not None and v is not None else None
                    partial += [f"{layout.dataset_label(d)} {part}"] if part else []
                    out.append(_table_row(backbone, block, *pos, group, d, metric, v,
                                          _interval(v, rep, level, True), 1 if v is not None else 0, None, own, why,
                                          part))
                    parts.append((v, rep))
                v, rep, n = _average(parts)
                out.append(_table_row(backbone, block, *pos, group, "avg", metric, v,
                                      _interval(v, rep, level, True), n, len(layout.GROUPS.get(group, datasets)),
                                      fitted, None if v is not None else "undefined on every dataset of the group",
                                      "; ".join(partial) or None))
    return pl.DataFrame(out, schema=_TABLE_SCHEMA)


def _table_row(backbone, block, block_label, block_pos, row, row_label, row_pos, group, dataset, metric, value, ci,
               n_datasets, group_size, in_sample, why, partial=None) -> dict:
    return dict(backbone=backbone, block=block, block_label=block_label, block_pos=block_pos, row=row,
                row_label=row_label, row_pos=row_pos, group=group, dataset=dataset,
                column_label="Avg." if dataset == "avg" else layout.dataset_label(dataset), metric=metric,
                metric_label=metric_label(metric), score=metric_score(metric), value=value, ci_low=ci[0],
                ci_high=ci[1], n_undefined=ci[2], n_datasets=n_datasets, group_size=group_size,
                in_sample=in_sample, missing_reason=why, partial=partial)


_DIFF_SCHEMA = {
    "backbone": pl.Utf8, "method": pl.Utf8, "group": pl.Utf8, "dataset": pl.Utf8, "column_label": pl.Utf8,
    "metric": pl.Utf8, "metric_label": pl.Utf8, "comparison": pl.Utf8, "estimate": pl.Float64, "ci_low": pl.Float64,
    "ci_high": pl.Float64, "contains_zero": pl.Boolean, "n_undefined": pl.Int64, "n_datasets": pl.Int64,
    "partial": pl.Utf8,
}


def paired_difference(cells: Mapping[tuple, Any], run: tuple, a: str, b: str, metric: str
                      ) -> tuple[float, np.ndarray | None] | None:
    """Calibrator `a` minus `b` on one run's cell, in points, with its paired bootstrap replicates (None when either
    side has none); None when either cell is absent or the metric is undefined (NaN) on either side."""
    ca, cb = cells.get((*run, a)), cells.get((*run, b))
    if ca is None or cb is None:
        return None
    va, vb = ca.values[metric], cb.values[metric]
    if not (np.isfinite(va) and np.isfinite(vb)):
        return None
    ra, rb = ca.reps.get(metric), cb.reps.get(metric)
    return (va - vb) * 100.0, None if ra is None or rb is None else ra - rb


def trust_differences(
    cells: dict[tuple[str, str, str, str], TrustCell],
    backbone: str,
    level: float = 0.95,
    comparisons: Sequence[tuple[str, str]] = TRUST_COMPARISONS,
) -> pl.DataFrame:
    """ZAEC minus each baseline per method, metric and dataset (and group average), points, with paired intervals.

    A group average is taken over the datasets where both predictions define the metric, so both sides average the
    same data; its replicates are the mean of the per-dataset replicate differences (same resamples). A difference
    is left out where either side is undefined on every dataset. `contains_zero`: the interval includes 0 (no
    difference claimed); null without replicates.
    """
    present = {k[1] for k in cells if k[0] == backbone}
    methods = layout.order_methods({k[2] for k in cells if k[0] == backbone})
    out = []
    for m in methods:
        for a, b in comparisons:
            for group, datasets in layout.order_datasets(present):
                for metric in TRUST_NAMES:
                    parts = []
                    for d in datasets:
                        diff = paired_difference(cells, (backbone, d, m), a, b, metric)
                        if diff is None:
                            continue
                        part = cells[(backbone, d, m, a)].partial
                        parts.append((d, *diff, part))
                        out.append(_diff_row(backbone, m, group, d, metric, a, b, *diff, level, 1, part))
                    if parts:
                        v, rep, n = _average([(v, r) for _, v, r, _ in parts])
                        partial = "; ".join(f"{layout.dataset_label(d)} {p}" for d, _, _, p in parts if p) or None
                        out.append(_diff_row(backbone, m, group, "avg", metric, a, b, v, rep, level, n, partial))
    return pl.DataFrame(out, schema=_DIFF_SCHEMA)


def _diff_row(backbone, method, group, dataset, metric, a, b, estimate, rep, level, n, partial=None) -> dict:
    lo, hi, und = _interval(estimate, rep, level, False)
    return dict(backbone=backbone, method=method, group=group, dataset=dataset,
                column_label="Avg." if dataset == "avg" else layout.dataset_label(dataset), metric=metric,
                metric_label=metric_label(metric),
                comparison=f"{layout.calibrator_label(a)} − {layout.calibrator_label(b)}", estimate=estimate,
                ci_low=lo, ci_high=hi, contains_zero=None if lo is None else bool(lo <= 0.0 <= hi),
                n_undefined=und, n_datasets=n, partial=partial)


def missing_notes(table: pl.DataFrame) -> list[str]:
    """One line per (block, row, reason) of the per-dataset values that are missing, naming metrics and datasets."""
    miss = table.filter(pl.col("value").is_null() & (pl.col("dataset") != "avg")
                        & (pl.col("missing_reason") != "no run"))
    notes = []
    for (bb, block, row, why), part in miss.group_by(["backbone", "block", "row", "missing_reason"],
                                                     maintain_order=True):
        who = layout.method_label(block) + ("" if row == ZERO_SHOT else f" + {layout.calibrator_label(row)}")
        metrics = ", ".join(part["metric"].unique(maintain_order=True).to_list())
        datasets = ", ".join(part["dataset"].unique(maintain_order=True).to_list())
        notes.append(f"{bb} {who}: {metrics} missing on {datasets}: {why}")
    return notes


#: the risk-coverage figure's panel of the oracle (every correct sample of the raw prediction accepted first)
ORACLE = "oracle"


def risk_coverage_curves(
    runs: dict[str, RunSummary], calibrators: Sequence[str] = TRUST_CALIBRATORS, score: str = "msp",
    ts_in_sample: str | None = None,
) -> pl.DataFrame:
    """Risk-coverage curves of one run per method (`calibrate.selective.risk_coverage`): the paired zero-shot
    prediction and each calibrator present, selected by `score`, and panel "oracle": the oracle of the raw
    prediction over the whole coverage range (`calibrate.selective.oracle_curve`; threshold and AURC null), which
    a run's own points may not span (a tied group of top probabilities exactly 1.0 is accepted whole).

    Returns:
        Columns backbone, dataset, method, seed, panel ("zero-shot", a calibrator or "oracle"), score, point
        (0..G-1), threshold, coverage, risk, oracle_risk (fractions), aurc (fraction, the panel's AURC), n (samples),
        in_sample (a temperature-scaling panel of dataset `ts_in_sample`, the labelled set its T was fitted on),
        partial (`RunSummary.partial`).
    """
    frames = []
    for m in layout.order_methods(runs):
        s = runs[m]
        if not len(s):
            continue
        key = {"backbone": s.key.backbone, "dataset": s.key.dataset, "method": m, "seed": s.key.seed}
        for name, pred, conf, ent in _predictions(s, calibrators):
            rc = risk_coverage(confidence_score(score, conf, ent), pred == s.label)
            frames.append(pl.DataFrame({
                **key, "panel": name, "score": score, "point": np.arange(rc.coverage.size), "threshold": rc.threshold,
                "coverage": rc.coverage, "risk": rc.risk, "oracle_risk": rc.oracle_risk, "aurc": rc.aurc,
                "n": len(s), "in_sample": name == "temperature" and s.key.dataset == ts_in_sample,
                "partial": s.partial}))
        cov, risk = oracle_curve(len(s), int(s.tta_correct.sum()))
        frames.append(pl.DataFrame({
            **key, "panel": ORACLE, "score": score, "point": np.arange(cov.size), "threshold": None,
            "coverage": cov, "risk": risk, "oracle_risk": risk, "aurc": None, "n": len(s), "in_sample": False,
            "partial": s.partial}))
    schema = {"backbone": pl.Utf8, "dataset": pl.Utf8, "method": pl.Utf8, "seed": pl.Int64, "panel": pl.Utf8,
              "score": pl.Utf8, "point": pl.Int64, "threshold": pl.Float64, "coverage": pl.Float64,
              "risk": pl.Float64, "oracle_risk": pl.Float64, "aurc": pl.Float64, "n": pl.Int64,
              "in_sample": pl.Boolean, "partial": pl.Utf8}
    return pl.concat([f.cast(schema) for f in frames]) if frames else pl.DataFrame(schema=schema)
