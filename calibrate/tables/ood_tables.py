"""Beyond the paper: in- vs out-of-distribution detection per method and calibrator (issue 24).

Pure builders over the OOD runs' summaries (`RunSummary.ood_for` set; docs/contract.md, "Out-of-distribution
runs"), kept apart from the paper's items, which never see an OOD run:

- `run_ood` / `ood_cells`: `calibrate.ood.OOD_NAMES` (AUROC, FPR95, AUPR; in-distribution positive, score = max
  softmax probability or negative entropy) of the paired zero-shot prediction and each calibrator, seeds averaged,
  with paired bootstrap replicates drawn from the tables' ECE resamples (`bootstrap.resample_counts` with
  `bootstrap.dataset_seed` of the OOD run's rows).
- `ood_table` / `ood_differences`: one column group per in-distribution set (`group`), one column per OOD set of it
  (`dataset` = the run's key `<ood>@<id>`) and their unweighted average (`avg`, as MCM averages its four OOD sets);
  rows zero-shot, then per method raw / SaLS / ZAEC / temperature scaling; ZAEC minus raw and minus temperature
  scaling with paired intervals.
- `ood_sections`: the (group, heading, header, rows) the Markdown/LaTeX show, for `render.trust_markdown`.
- `ood_roc_curves`: the arrays of the OOD figure: ROC curves (in-distribution positive) of the zero-shot, raw and
  ZAEC predictions of one run per method and OOD run.

Undefined values (an OOD run holding one kind of row only) stay null with the reason; averages cover the OOD sets
where defined (`n_datasets`).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import polars as pl

from calibrate.ood import OOD_METRICS, OOD_NAMES, OODStats, ood_replicates
from calibrate.selective import SCORES, ScoreCounts, confidence_score
from calibrate.tables import layout, render
from calibrate.tables.bootstrap import BootstrapResult, dataset_seed, resample_counts
from calibrate.tables.data import RunSummary
from calibrate.tables.trust_tables import (
    _DIFF_SCHEMA,
    _TABLE_SCHEMA,
    TRUST_CALIBRATORS,
    TRUST_COMPARISONS,
    TrustCell,
    _average,
    _interval,
    _predictions,
    _rows_of,
    paired_difference,
    trust_cells,
)

#: metrics where higher is better (AUROC, AUPR); FPR95 is better lower
HIGHER_IS_BETTER: frozenset[str] = frozenset(f"ood_{m}_{s}" for s in SCORES for m in ("auroc", "aupr"))
_LABELS = {"auroc": "AUROC", "fpr95": "FPR95", "aupr": "AUPR"}
_SCORE_LABELS = {"msp": "MSP", "negent": "−H"}


def ood_metric_label(metric: str) -> str:
    """Header of an OOD column, naming the score, e.g. `AUROC (MSP)`.

    Example:
        >>> ood_metric_label("ood_aupr_negent")
        'AUPR (−H)'
    """
    _, name, score = metric.split("_")
    return f"{_LABELS[name]} ({_SCORE_LABELS[score]})"


def ood_set(s: RunSummary) -> str:
    """The OOD set's name of an OOD run: its dataset key `<ood>@<id>` without `@<id>`."""
    return s.key.dataset[: -len(s.ood_for) - 1] if s.ood_for else s.key.dataset


def run_ood(
    s: RunSummary, calibrators: Sequence[str] = TRUST_CALIBRATORS, boot: BootstrapResult | None = None
) -> dict[str, TrustCell]:
    """`OOD_NAMES` of one OOD run's zero-shot prediction and each calibrator, with paired bootstrap replicates.

    In-distribution rows are those with a label >= 0. The replicates resample the run's rows (both kinds together)
    with `resample_counts(N, B, dataset_seed(seed, backbone, dataset, sample_id))`, so every prediction's replicates
    (and ZAEC minus another) are paired.
    """
    preds = _predictions(s, calibrators)
    ind = s.label >= 0
    cells = {}
    for name, _pred, conf, ent in preds:
        st = OODStats().update(conf, ent, ind)
        cells[name] = TrustCell(st.compute(), st.reasons(), partial=s.partial)
    if boot is not None and boot.n_resamples and len(s) and ind.any() and not ind.all():
        counts = resample_counts(len(s), boot.n_resamples,
                                 dataset_seed(boot.seed, s.key.backbone, s.key.dataset, s.sample_id))
        conf, ent = np.stack([p[2] for p in preds]), np.stack([p[3] for p in preds])
        reps = ood_replicates({sc: confidence_score(sc, conf, ent) for sc in SCORES}, ind, counts)
        for j, (name, *_rest) in enumerate(preds):
            cells[name].reps = {col: r[j] for col, r in reps.items()}
    return cells


def ood_cells(
    runs: Iterable[RunSummary], boot: BootstrapResult | None = None, calibrators: Sequence[str] = TRUST_CALIBRATORS
) -> dict[tuple[str, str, str, str], TrustCell]:
    """(backbone, OOD run dataset, method, prediction) -> seeds averaged cell of `OOD_NAMES` (as `trust_cells`;
    zero-shot under method "zero-shot"). Only OOD runs (`RunSummary.ood_for`) are read."""
    return trust_cells([s for s in runs if s.ood_for], boot, calibrators, per_run=run_ood)


def ood_groups(runs: Iterable[RunSummary]) -> dict[str, tuple[str, str]]:
    """OOD run dataset key -> (in-distribution set, OOD set name)."""
    return {s.key.dataset: (s.ood_for, ood_set(s)) for s in runs if s.ood_for}


def _ordered_groups(groups: dict[str, tuple[str, str]], present: set[str]) -> list[tuple[str, list[str]]]:
    """[(in-distribution set, [OOD run keys ordered by OOD set name])] in the paper's dataset order."""
    by_id: dict[str, list[str]] = {}
    for d in sorted(present, key=lambda d: groups[d][1]):
        by_id.setdefault(groups[d][0], []).append(d)
    order = [d for _, g in layout.order_datasets(by_id) for d in g]
    return [(i, by_id[i]) for i in order]


def ood_table(
    cells: dict[tuple[str, str, str, str], TrustCell],
    groups: dict[str, tuple[str, str]],
    backbone: str,
    level: float = 0.95,
    calibrators: Sequence[str] = TRUST_CALIBRATORS,
    ts_in_sample: str | None = None,
) -> pl.DataFrame:
    """The OOD table of one backbone, long format, the trust table's columns (`trust_tables.trust_table`).

    `group`: the in-distribution set; `dataset`: the OOD run's key (`column_label`: the OOD set's label) or "avg"
    (unweighted mean over the group's OOD sets where defined, `n_datasets` of `group_size`). Values in percent.
    `in_sample`: a temperature-scaling value of an in-distribution set its T was fitted on (`ts_in_sample`).
    """
    present = {k[1] for k in cells if k[0] == backbone}
    out = []
    block_pos: dict[str, int] = {}
    for row_pos, (block, block_label, row, row_label) in enumerate(_rows_of(cells, backbone, calibrators)):
        pos = dict(backbone=backbone, block=block, block_label=block_label,
                   block_pos=block_pos.setdefault(block, len(block_pos)), row=row, row_label=row_label,
                   row_pos=row_pos)
        for id_set, datasets in _ordered_groups(groups, present):
            own = row == "temperature" and id_set == ts_in_sample
            for metric in OOD_NAMES:
                parts, partial = [], []
                for d in datasets:
                    cell = cells.get((backbone, d, block, row))
                    raw = None if cell is None else cell.values[metric]
                    v = None if raw is None or not np.isfinite(raw) else raw * 100.0
                    rep = None if cell is None else cell.reps.get(metric)
                    why = "no run" if cell is None else cell.reasons.get(metric) if v is None else None
                    part = cell.partial if cell is not None and v is not None else None
                    partial += [f"{layout.dataset_label(groups[d][1])} {part}"] if part else []
                    out.append(_row(pos, id_set, d, layout.dataset_label(groups[d][1]), metric, v,
                                    _interval(v, rep, level, True), int(v is not None), None, own and v is not None,
                                    why, part))
                    parts.append((v, rep))
                v, rep, n = _average(parts)
                out.append(_row(pos, id_set, "avg", "Avg.", metric, v, _interval(v, rep, level, True), n,
                                len(datasets), own and v is not None,
                                None if v is not None else "undefined on every OOD set of the group",
                                "; ".join(partial) or None))
    return pl.DataFrame(out, schema=_TABLE_SCHEMA)


def _row(pos, group, dataset, column_label, metric, value, ci, n_datasets, group_size, in_sample, why,
         partial=None) -> dict:
    return dict(**pos, group=group, dataset=dataset, column_label=column_label, metric=metric,
                metric_label=ood_metric_label(metric), score=metric.rsplit("_", 1)[1], value=value, ci_low=ci[0],
                ci_high=ci[1], n_undefined=ci[2], n_datasets=n_datasets, group_size=group_size, in_sample=in_sample,
                missing_reason=why, partial=partial)


def ood_differences(
    cells: dict[tuple[str, str, str, str], TrustCell],
    groups: dict[str, tuple[str, str]],
    backbone: str,
    level: float = 0.95,
    comparisons: Sequence[tuple[str, str]] = TRUST_COMPARISONS,
) -> pl.DataFrame:
    """ZAEC minus each baseline per method, metric and OOD set (and the group average), points, paired intervals;
    the trust table's columns (`trust_tables.trust_differences`), averaged over the OOD sets where both sides are
    defined. Positive AUROC / AUPR and negative FPR95 differences favour ZAEC."""
    present = {k[1] for k in cells if k[0] == backbone}
    out = []
    for m in layout.order_methods({k[2] for k in cells if k[0] == backbone}):
        for a, b in comparisons:
            for id_set, datasets in _ordered_groups(groups, present):
                for metric in OOD_NAMES:
                    parts = []
                    for d in datasets:
                        diff = paired_difference(cells, (backbone, d, m), a, b, metric)
                        if diff is None:
                            continue
                        part = cells[(backbone, d, m, a)].partial
                        parts.append((*diff, f"{layout.dataset_label(groups[d][1])} {part}" if part else None))
                        out.append(_diff(backbone, m, id_set, d, layout.dataset_label(groups[d][1]), metric, a, b,
                                         *diff, level, 1, part))
                    if parts:
                        v, rep, n = _average([(v, r) for v, r, _ in parts])
                        partial = "; ".join(p for _, _, p in parts if p) or None
                        out.append(_diff(backbone, m, id_set, "avg", "Avg.", metric, a, b, v, rep, level, n,
                                         partial))
    return pl.DataFrame(out, schema=_DIFF_SCHEMA)


def _diff(backbone, method, group, dataset, column_label, metric, a, b, estimate, rep, level, n,
          partial=None) -> dict:
    lo, hi, und = _interval(estimate, rep, level, False)
    return dict(backbone=backbone, method=method, group=group, dataset=dataset, column_label=column_label,
                metric=metric, metric_label=ood_metric_label(metric),
                comparison=f"{layout.calibrator_label(a)} − {layout.calibrator_label(b)}", estimate=estimate,
                ci_low=lo, ci_high=hi, contains_zero=None if lo is None else bool(lo <= 0.0 <= hi),
                n_undefined=und, n_datasets=n, partial=partial)


def ood_sections(table: pl.DataFrame, diffs: pl.DataFrame) -> list[tuple[str, str, list[str], list[list[str]]]]:
    """(heading, name, header, rows) per in-distribution set and score: one column per (OOD set or Avg., metric),
    then ZAEC minus each baseline; for `render.trust_markdown` / `render.trust_latex`."""
    out = []
    for id_set in table["group"].unique(maintain_order=True).to_list():
        g, dg = table.filter(pl.col("group") == id_set), diffs.filter(pl.col("group") == id_set)
        heading = f"{layout.dataset_label(id_set)} (in-distribution) against"
        cols = g.select("dataset", "column_label").unique(maintain_order=True).rows()
        if len(cols) == 2:  # one OOD set: its average repeats it (the CSV keeps both)
            cols = [c for c in cols if c[0] != "avg"]
        for score in SCORES:
            keys = [f"{d}|ood_{m}_{score}" for d, _ in cols for m in OOD_METRICS]
            header = [f"{label} {_LABELS[m]}" for _, label in cols for m in OOD_METRICS]
            keyed = g.filter(pl.col("score") == score).with_columns(
                metric=pl.col("dataset") + "|" + pl.col("metric"))
            name = f"score {_SCORE_LABELS[score]}"
            out.append((heading, name, ["Method", "Calibrator", *header], render._pivot(
                keyed.sort("row_pos"), ["row_pos"], lambda r: [r["block_label"], r["row_label"]], keys,
                render._trust_value_cell)))
            dk = dg.filter(pl.col("metric").str.ends_with(score)).with_columns(
                metric=pl.col("dataset") + "|" + pl.col("metric"))
            if dk.height:
                out.append((heading, f"{name}: differences (points)", ["Method", "Difference", *header],
                            render._pivot(dk, ["method", "comparison"],
                                          lambda r: [layout.method_label(r["method"]), r["comparison"]], keys,
                                          render._trust_diff_cell)))
    return out


#: the predictions the OOD figure draws: the paired zero-shot, raw TTA and ZAEC
ROC_PANELS: tuple[str, ...] = ("zero-shot", "none", "zaec")


def roc_points(score, in_distribution) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ROC of one score, in-distribution positive, at every distinct threshold: (fpr, tpr, threshold), starting at
    (0, 0) (threshold +inf) and ending at (1, 1); a tied group is accepted whole, so the trapezoid area under these
    points is the AUROC with ties counted 1/2 (`calibrate.ood.ood_metrics`). The points of
    `sklearn.metrics.roc_curve(in_distribution, score, drop_intermediate=False)`.

    Example:
        >>> fpr, tpr, _ = roc_points([0.9, 0.5, 0.5, 0.1], [True, True, False, False])
        >>> fpr.tolist(), tpr.tolist()
        ([0.0, 0.0, 0.5, 1.0], [0.0, 0.5, 1.0, 1.0])
    """
    sc = ScoreCounts.of(score, in_distribution)
    n_id, n_ood = int(sc.n_ok.sum()), int(sc.n_err.sum())
    if not n_id or not n_ood:
        raise ValueError("an ROC curve needs in-distribution and out-of-distribution rows")
    tpr = np.r_[0.0, np.cumsum(sc.n_ok) / n_id]
    fpr = np.r_[0.0, np.cumsum(sc.n_err) / n_ood]
    return fpr, tpr, np.r_[np.inf, sc.score]


def _run_roc(s: RunSummary, panels: Sequence[str], score: str, ts_in_sample: str | None) -> list[pl.DataFrame]:
    """The ROC frames of one OOD run's predictions of `panels` (none for a run holding one kind of row only)."""
    ind = s.label >= 0
    if ind.all() or not ind.any():
        return []
    frames = []
    for name, _pred, conf, ent in _predictions(s, [p for p in panels if p != "zero-shot"]):
        if name not in panels:
            continue
        fpr, tpr, thr = roc_points(confidence_score(score, conf, ent), ind)
        frames.append(pl.DataFrame({
            "backbone": s.key.backbone, "dataset": s.key.dataset, "ood_for": s.ood_for, "ood_set": ood_set(s),
            "method": s.key.method, "seed": s.key.seed, "panel": name, "score": score, "point": np.arange(fpr.size),
            "fpr": fpr, "tpr": tpr, "threshold": thr,
            "auroc": OODStats().update(conf, ent, ind).compute()[f"ood_auroc_{score}"], "n_id": int(ind.sum()),
            "n_ood": int((~ind).sum()), "partial": s.partial,
            "in_sample": name == "temperature" and s.ood_for == ts_in_sample}))
    return frames


def ood_roc_curves(runs: Iterable[RunSummary], panels: Sequence[str] = ROC_PANELS, score: str = "msp",
                   ts_in_sample: str | None = None) -> pl.DataFrame:
    """The OOD figure's arrays: per OOD run (its lowest seed per backbone, OOD run and method) and prediction of
    `panels` present, the ROC curve of `score` (`roc_points`) and its AUROC (`calibrate.ood.ood_metrics`).

    Returns:
        Columns backbone, dataset (the OOD run's key), ood_for, ood_set, method, seed, panel, score, point, fpr, tpr,
        threshold, auroc (fractions), n_id, n_ood, partial (`RunSummary.partial`), in_sample (a temperature
        panel on a set its T was fitted on); runs holding one kind of row only are left out.
    """
    chosen: dict[tuple[str, str, str], RunSummary] = {}
    for s in sorted((s for s in runs if s.ood_for), key=lambda s: s.key.seed):
        chosen.setdefault((s.key.backbone, s.key.dataset, s.key.method), s)
    frames = []
    for bb, ds in sorted({k[:2] for k in chosen}):
        for m in layout.order_methods({k[2] for k in chosen if k[:2] == (bb, ds)}):
            frames += _run_roc(chosen[(bb, ds, m)], panels, score, ts_in_sample)
    schema = {"backbone": pl.Utf8, "dataset": pl.Utf8, "ood_for": pl.Utf8, "ood_set": pl.Utf8, "method": pl.Utf8,
              "seed": pl.Int64, "panel": pl.Utf8, "score": pl.Utf8, "point": pl.Int64, "fpr": pl.Float64,
              "tpr": pl.Float64, "threshold": pl.Float64, "auroc": pl.Float64, "n_id": pl.Int64, "n_ood": pl.Int64,
              "partial": pl.Utf8, "in_sample": pl.Boolean}
    return pl.concat([f.cast(schema) for f in frames]) if frames else pl.DataFrame(schema=schema)
