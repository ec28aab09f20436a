"""Pure table builders: run summaries (and bootstrap replicates) in, polars DataFrames out.

Units: tables show percent for accuracy, ECE and confidence (like the paper), nats for entropy, percent for the
relative logit-range deviation (eq. 8). Several seeds of one (backbone, dataset, method) are averaged.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import polars as pl
from scipy import stats

from calibrate.metrics import ece, reliability
from calibrate.tables import layout
from calibrate.tables.bootstrap import ZERO_SHOT, BootstrapResult, basic_interval, bias_corrected
from calibrate.tables.data import RunSummary

_KEY = ["backbone", "dataset", "method", "seed"]
_CELL = ["backbone", "dataset", "method", "calibrator"]
_METRICS = ["accuracy", "ece", "nll", "mean_confidence", "mean_entropy", "range_deviation", "mean_delta_entropy"]


def _range_deviation(tta_range: np.ndarray, temperature: np.ndarray, zs_range: np.ndarray) -> float:
    """Eq. 8: mean_i |R(z_i / T_i) - R(z_i^ZS)| / R(z_i^ZS) * 100 over samples with a non-zero zero-shot range."""
    ok = zs_range > 0
    if not ok.any():
        return float("nan")
    dev = np.abs(tta_range[ok] / temperature[ok] - zs_range[ok]) / zs_range[ok]
    return float(dev.mean() * 100.0)


def run_metrics(runs: Iterable[RunSummary], n_bins: int = 20) -> pl.DataFrame:
    """One row per (run, calibrator), plus calibrator `zero-shot` for the run's paired zero-shot prediction.

    Columns: backbone, dataset, method, seed, calibrator, n, partial (`RunSummary.partial`: `150 of 400` for a
    partial run, else null), accuracy, ece (fractions), nll, mean_confidence (fraction), mean_entropy (nats),
    range_deviation (eq. 8, percent), mean_delta_entropy (eq. 10 mean; 0 for zero-shot).
    """
    rows = []
    for s in runs:
        k = s.key
        base = {"backbone": k.backbone, "dataset": k.dataset, "method": k.method, "seed": k.seed, "n": len(s),
                "partial": s.partial}
        zs_corr = s.zs_correct
        rows.append({**base, "calibrator": ZERO_SHOT, "accuracy": float(zs_corr.mean()),
                     "ece": float(ece(s.zs_confidence, zs_corr, n_bins)), "nll": float(s.zs_nll.mean()),
                     "mean_confidence": float(s.zs_confidence.mean()), "mean_entropy": float(s.zs_entropy.mean()),
                     "range_deviation": 0.0, "mean_delta_entropy": 0.0})
        corr = s.tta_correct
        log_k = np.log(s.num_classes) if s.num_classes > 1 else 1.0  # K = 1: both entropies are 0
        for spec, c in s.calibrated.items():
            rows.append({**base, "calibrator": spec, "accuracy": float(corr.mean()),
                         "ece": float(ece(c.confidence, corr, n_bins)), "nll": float(c.nll.mean()),
                         "mean_confidence": float(c.confidence.mean()), "mean_entropy": float(c.entropy.mean()),
                         "range_deviation": _range_deviation(s.tta_range, c.temperature, s.zs_range),
                         "mean_delta_entropy": float(((c.entropy - s.zs_entropy) / log_k).mean())})
    schema = {"backbone": pl.Utf8, "dataset": pl.Utf8, "method": pl.Utf8, "seed": pl.Int64, "n": pl.Int64,
              "partial": pl.Utf8, "calibrator": pl.Utf8, **{m: pl.Float64 for m in _METRICS}}
    return pl.DataFrame(rows, schema=schema).select(_KEY + ["calibrator", "n", "partial"] + _METRICS)


def partial_agg(col: str = "partial") -> pl.Expr:
    """Aggregation of the `partial` texts of several runs (seeds, datasets): the distinct ones joined by `; `, null
    when every run is whole (`RunSummary.partial`)."""
    joined = pl.col(col).drop_nulls().unique(maintain_order=True).str.join("; ")
    return pl.when(joined.str.len_chars() > 0).then(joined).otherwise(None).alias(col)


def cell_metrics(run_df: pl.DataFrame) -> pl.DataFrame:
    """Mean over seeds per (backbone, dataset, method, calibrator); adds n_seeds and the standard deviation over
    seeds of accuracy and ECE (`accuracy_std`, `ece_std`; null for one seed); `partial`: the partial seeds' counts
    (`partial_agg`), null when every seed is whole."""
    return (
        run_df.group_by(_CELL, maintain_order=True)
        .agg([pl.col(m).mean() for m in _METRICS] + [pl.col("n").mean().alias("n"), pl.len().alias("n_seeds"),
                                                     pl.col("accuracy").std().alias("accuracy_std"),
                                                     pl.col("ece").std().alias("ece_std"), partial_agg()])
        .sort(_CELL)
    )


def _partial_lookup(cells: pl.DataFrame) -> dict[tuple[str, str], str]:
    """(method, dataset) -> the `partial` text of its cells (any calibrator), for partial runs only."""
    if "partial" not in cells.columns:
        return {}
    return {(r["method"], r["dataset"]): r["partial"]
            for r in cells.filter(pl.col("partial").is_not_null()).iter_rows(named=True)}


def zero_shot_cells(cells: pl.DataFrame) -> pl.DataFrame:
    """Zero-shot metrics per (backbone, dataset): the `zero-shot` method's run where present, else the mean of the
    paired zero-shot predictions stored with every method (identical when all runs share the anchor)."""
    zs = cells.filter(pl.col("calibrator") == ZERO_SHOT)
    own = zs.filter(pl.col("method") == layout.ZERO_SHOT)
    rest = zs.join(own.select("backbone", "dataset"), on=["backbone", "dataset"], how="anti")
    both = pl.concat([own, rest])
    if "partial" not in both.columns:  # a hand-made cells frame (tests)
        both = both.with_columns(pl.lit(None, pl.Utf8).alias("partial"))
    return both.group_by(["backbone", "dataset"], maintain_order=True).agg(
        [pl.col(m).mean() for m in _METRICS] + [partial_agg()]).sort(["backbone", "dataset"])


class CellReplicates:
    """Bootstrap replicates per table cell: seeds averaged (each seed paired with its own zero-shot)."""

    def __init__(self, boot: BootstrapResult | None):
        self.boot = boot
        self._index: dict[tuple[str, str, str, str], list[np.ndarray]] = {}
        if boot is not None:
            for (key, cal), rep in boot.replicates.items():
                self._index.setdefault((key.backbone, key.dataset, key.method, cal), []).append(rep)

    def get(self, backbone: str, dataset: str, method: str, calibrator: str) -> np.ndarray | None:
        reps = self._index.get((backbone, dataset, method, calibrator))
        return None if not reps else np.mean(reps, axis=0)

    def zero_shot(self, backbone: str, dataset: str) -> np.ndarray | None:
        own = self.get(backbone, dataset, layout.ZERO_SHOT, ZERO_SHOT)
        if own is not None:
            return own
        reps = [np.mean(v, axis=0) for (b, d, m, c), v in self._index.items()
                if (b, d, c) == (backbone, dataset, ZERO_SHOT)]
        return None if not reps else np.mean(reps, axis=0)

    def interval(
        self, reps: np.ndarray | None, estimate: float | None, scale: float = 100.0, floor: float | None = None
    ) -> tuple[float | None, float | None]:
        """Basic bootstrap interval of `estimate` (already times `scale`) from replicates (fractions) times `scale`;
        `floor` clips the lower end (0 for an ECE, which cannot be negative)."""
        if reps is None or estimate is None or self.boot is None:
            return None, None
        lo, hi = basic_interval(estimate, np.asarray(reps) * scale, self.boot.level)
        lo = float(lo) if floor is None else max(float(lo), floor)
        return lo, float(hi)

    def centre(self, reps: np.ndarray | None, estimate: float | None, scale: float = 100.0,
               floor: float | None = None) -> float | None:
        """The bias-corrected value 2 x estimate - median of the replicates (x `scale`), the centre of `interval`
        (`bootstrap.bias_corrected`); `floor` clips it as `interval` clips its lower end."""
        if reps is None or estimate is None or self.boot is None:
            return None
        v = float(bias_corrected(estimate, np.asarray(reps) * scale))
        return v if floor is None else max(v, floor)


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.mean(vals)) if vals else None


def _bold_min(values: Sequence[float | None], decimals: int = 2) -> list[bool]:
    """True where a value equals the minimum at display precision (ties all bold)."""
    shown = [None if v is None or not np.isfinite(v) else round(v, decimals) for v in values]
    present = [v for v in shown if v is not None]
    if len(present) < 2:
        return [False] * len(values)
    best = min(present)
    return [v is not None and v == best for v in shown]


_MAIN_SCHEMA = {
    "backbone": pl.Utf8, "block": pl.Utf8, "block_label": pl.Utf8, "block_pos": pl.Int64, "row": pl.Utf8,
    "row_label": pl.Utf8, "row_pos": pl.Int64, "metric": pl.Utf8, "group": pl.Utf8, "dataset": pl.Utf8,
    "column_label": pl.Utf8, "col_pos": pl.Int64, "value": pl.Float64, "ci_low": pl.Float64, "ci_high": pl.Float64,
    "n_datasets": pl.Int64, "group_size": pl.Int64, "seed_std": pl.Float64, "n_seeds": pl.Int64,
    "in_sample": pl.Boolean, "bold": pl.Boolean, "bias_corrected": pl.Float64, "ci_excludes_estimate": pl.Boolean,
    "partial": pl.Utf8,
}


def _main_row_specs(
    cb: pl.DataFrame, backbone: str, replicates: CellReplicates, calibrators: Sequence[str]
) -> list[tuple]:
    """The rows of one backbone's main table, top to bottom: (block, block_label, row, row_label, metric, getter),
    where getter(dataset) -> (value in percent, bootstrap replicates or None, seed std or None, n_seeds or None,
    the cell's `partial` text or None)."""
    zs = zero_shot_cells(cb)
    methods = layout.order_methods(cb["method"].unique().to_list())
    lookup = {(r["dataset"], r["method"], r["calibrator"]): r for r in cb.iter_rows(named=True)}
    zs_lookup = {r["dataset"]: r for r in zs.iter_rows(named=True)}
    specs = []

    def zs_get(metric):
        def f(d):
            r = zs_lookup.get(d)
            v = None if r is None else r[metric] * 100.0
            return (v, replicates.zero_shot(backbone, d) if metric == "ece" else None, None, None,
                    None if r is None else r.get("partial"))
        return f

    specs.append((layout.ZERO_SHOT, f"Zero-shot {backbone}", "acc", "Acc.", "accuracy", zs_get("accuracy")))
    specs.append((layout.ZERO_SHOT, f"Zero-shot {backbone}", "ece", "ECE", "ece", zs_get("ece")))
    for m in methods:
        present = [c for c in calibrators if any(k[1] == m and k[2] == c for k in lookup)]

        def get(metric, cal, m=m):
            def f(d):
                r = lookup.get((d, m, cal))
                v = None if r is None else r[metric] * 100.0
                std = None if r is None or r.get(f"{metric}_std") is None else r[f"{metric}_std"] * 100.0
                return (v, replicates.get(backbone, d, m, cal) if metric == "ece" else None, std,
                        None if r is None else r.get("n_seeds"), None if r is None else r.get("partial"))
            return f

        specs.append((m, layout.method_label(m), "acc", "Acc.", "accuracy", get("accuracy", "none")))
        for c in present:
            specs.append((m, layout.method_label(m), c, f"+ {layout.calibrator_label(c)}", "ece", get("ece", c)))
    return specs


def _bold_block_minima(df: pl.DataFrame) -> pl.DataFrame:
    """`bold`: the lowest ECE per (method block, column) of a main table; sorted into reading order. In-sample cells
    (temperature scaling scored on its own fitting data) are never candidates: their ECE is not a held-out result."""
    bold = np.zeros(df.height, dtype=bool)
    ece_rows = df.with_row_index("_i").filter((pl.col("metric") == "ece") & (pl.col("block") != layout.ZERO_SHOT)
                                              & ~pl.col("in_sample"))
    for _, part in ece_rows.group_by(["block", "col_pos"]):
        marks = _bold_min(part["value"].to_list())
        bold[np.asarray(part["_i"].to_list())[marks]] = True
    return df.with_columns(pl.Series("bold", bold)).sort(["block_pos", "row_pos", "col_pos"])


def _bias_columns(replicates: CellReplicates, reps: np.ndarray | None, value: float | None, lo: float | None,
                  hi: float | None) -> dict:
    """`bias_corrected` (2 x value - median replicate, floored at 0 as the interval) and `ci_excludes_estimate`
    (the basic interval lies wholly below, or above, the value: `bootstrap.basic_interval` says when and why)."""
    return dict(bias_corrected=replicates.centre(reps, value, floor=0.0),
                ci_excludes_estimate=None if lo is None else bool(not lo <= value <= hi))


def main_table(
    cells: pl.DataFrame,
    backbone: str,
    replicates: CellReplicates | None = None,
    calibrators: Sequence[str] = layout.MAIN_CALIBRATORS,
    ts_in_sample: str | None = None,
) -> pl.DataFrame:
    """The paper's Tables 2/3 for one backbone, long format (one row per table cell), percent.

    Blocks: zero-shot (Acc., ECE) on top, then one block per TTA method (Acc., then ECE for each calibrator present).
    Columns: datasets grouped like the paper (`layout.order_datasets`), each group followed by its unweighted
    macro-average (`dataset == "avg"`, over the group's datasets present in that row; `n_datasets` counts them,
    `group_size` is the number the group holds: the paper's count for its groups, else the columns shown).
    `bold` marks the lowest ECE per method block and column (ties at two decimals all bold); zero-shot and in-sample
    cells are never bold.
    `ci_low`/`ci_high`: basic bootstrap interval of each ECE, floored at 0 (the average's from averaged replicates);
    `bias_corrected`: its centre 2 x ECE - median replicate; `ci_excludes_estimate`: the interval lies wholly below
    (or above) the ECE, where the bootstrap finds a bias larger than the sampling spread (`bootstrap.basic_interval`).
    `in_sample`: a temperature-scaling cell of dataset `ts_in_sample` (the labelled source T was fitted on, so it is
    scored on its own fitting data), or an average that includes one.
    `partial`: the cell's run is partial (`--allow-partial`): its count, e.g. `150 of 400` (an average: each partial
    dataset's, `DTD 150 of 400`); null for whole runs.
    """
    replicates = replicates or CellReplicates(None)
    cb = cells.filter(pl.col("backbone") == backbone)
    groups = layout.order_datasets(cb["dataset"].unique().to_list())
    specs = _main_row_specs(cb, backbone, replicates, calibrators)
    rows = []
    block_pos: dict[str, int] = {}
    for row_pos, (block, block_label, row, row_label, metric, getter) in enumerate(specs):
        bpos = block_pos.setdefault(block, len(block_pos))
        col = 0
        for group, datasets in groups:
            size = len(layout.GROUPS.get(group, datasets))
            vals, reps, fitted_here, partial = [], [], False, []
            for d in datasets:
                v, rep, std, n_seeds, part = getter(d)
                if part is not None and v is not None:
                    partial.append(f"{layout.dataset_label(d)} {part}")
                lo, hi = replicates.interval(rep, v, floor=0.0)
                own = row == "temperature" and d == ts_in_sample and v is not None
                fitted_here |= own
                rows.append(dict(backbone=backbone, block=block, block_label=block_label, block_pos=bpos, row=row,
                                 row_label=row_label, row_pos=row_pos, metric=metric, group=group, dataset=d,
                                 column_label=layout.dataset_label(d), col_pos=col, value=v, ci_low=lo, ci_high=hi,
                                 n_datasets=None if v is None else 1, group_size=None, seed_std=std,
                                 n_seeds=n_seeds, in_sample=own, bold=False,
                                 **_bias_columns(replicates, rep, v, lo, hi), partial=part if v is not None else None))
                vals.append(v)
                reps.append(rep)
                col += 1
            avg = _mean_or_none(vals)
            have = [r for v, r in zip(vals, reps) if v is not None]
            avg_rep = np.mean(have, axis=0) if have and all(r is not None for r in have) else None
            lo, hi = replicates.interval(avg_rep, avg, floor=0.0)
            rows.append(dict(backbone=backbone, block=block, block_label=block_label, block_pos=bpos, row=row,
                             row_label=row_label, row_pos=row_pos, metric=metric, group=group, dataset="avg",
                             column_label="Avg.", col_pos=col, value=avg, ci_low=lo, ci_high=hi,
                             n_datasets=sum(v is not None for v in vals), group_size=size, seed_std=None,
                             n_seeds=None, in_sample=fitted_here, bold=False,
                             **_bias_columns(replicates, avg_rep, avg, lo, hi),
                             partial="; ".join(partial) if partial and avg is not None else None))
            col += 1
    return _bold_block_minima(pl.DataFrame(rows, schema=_MAIN_SCHEMA))


#: the differences a main table claims: ZAEC against each other calibrator
COMPARISONS: tuple[tuple[str, str], ...] = (("zaec", "none"), ("zaec", "sals"), ("zaec", "temperature"))


def main_differences(
    cells: pl.DataFrame, backbone: str, replicates: CellReplicates, comparisons=COMPARISONS,
    ts_in_sample: str | None = None,
) -> pl.DataFrame:
    """ECE differences (percentage points) ZAEC minus each baseline, per method and column, with paired intervals.

    Columns: backbone, method, group, dataset ("avg" for the group macro-average), column_label, comparison,
    estimate, ci_low, ci_high, contains_zero (the interval includes 0: no claim of a difference), in_sample (a side
    is an in-sample cell of `main_table`: temperature scaling scored on its own fitting data `ts_in_sample`), partial
    (the cells' `partial`: a partial run's count).
    """
    main = main_table(cells, backbone, replicates, calibrators=layout.MAIN_CALIBRATORS, ts_in_sample=ts_in_sample)
    rows = []
    for block in main.filter(pl.col("block") != layout.ZERO_SHOT)["block"].unique(maintain_order=True):
        part = main.filter(pl.col("block") == block)
        for a, b in comparisons:
            pa, pb = part.filter(pl.col("row") == a), part.filter(pl.col("row") == b)
            if pa.is_empty() or pb.is_empty():
                continue
            for ra, rb in zip(pa.iter_rows(named=True), pb.iter_rows(named=True)):
                if ra["value"] is None or rb["value"] is None:
                    continue
                if ra["dataset"] == "avg":
                    ds = [d for d in part.filter((pl.col("group") == ra["group"]) & (pl.col("dataset") != "avg"))
                          ["dataset"].unique(maintain_order=True).to_list()]
                    ra_reps = [replicates.get(backbone, d, block, a) for d in ds]
                    rb_reps = [replicates.get(backbone, d, block, b) for d in ds]
                    pairs = [(x, y) for x, y in zip(ra_reps, rb_reps) if x is not None and y is not None]
                    diff = np.mean([x - y for x, y in pairs], axis=0) if pairs and len(pairs) == len(ds) else None
                    # both averages must span the same datasets for the difference to be a paired one
                    estimate = (ra["value"] - rb["value"]) if ra["n_datasets"] == rb["n_datasets"] else None
                else:
                    x = replicates.get(backbone, ra["dataset"], block, a)
                    y = replicates.get(backbone, ra["dataset"], block, b)
                    diff = None if x is None or y is None else x - y
                    estimate = ra["value"] - rb["value"]
                if estimate is None:
                    continue
                lo, hi = replicates.interval(diff, estimate)
                rows.append(dict(backbone=backbone, method=block, group=ra["group"], dataset=ra["dataset"],
                                 column_label=ra["column_label"], col_pos=ra["col_pos"],
                                 comparison=f"{layout.calibrator_label(a)} - {layout.calibrator_label(b)}",
                                 estimate=estimate, ci_low=lo, ci_high=hi,
                                 contains_zero=None if lo is None else bool(lo <= 0.0 <= hi),
                                 in_sample=bool(ra["in_sample"] or rb["in_sample"]),
                                 partial=ra["partial"] or rb["partial"]))
    schema = {"backbone": pl.Utf8, "method": pl.Utf8, "group": pl.Utf8, "dataset": pl.Utf8, "column_label": pl.Utf8,
              "col_pos": pl.Int64, "comparison": pl.Utf8, "estimate": pl.Float64, "ci_low": pl.Float64,
              "ci_high": pl.Float64, "contains_zero": pl.Boolean, "in_sample": pl.Boolean, "partial": pl.Utf8}
    return pl.DataFrame(rows, schema=schema)


def main_intervals(
    cells: pl.DataFrame, backbone: str, replicates: CellReplicates, ts_in_sample: str | None = None
) -> pl.DataFrame:
    """ECE cells of the main table with their intervals (the companion table): block, row, column, value, CI, and
    the marks of `main_table` (n_datasets, group_size, in_sample)."""
    main = main_table(cells, backbone, replicates, ts_in_sample=ts_in_sample)
    return main.filter(pl.col("metric") == "ece").select(
        "backbone", "block", "block_label", "block_pos", "row", "row_label", "row_pos", "group", "dataset",
        "column_label", "col_pos", "value", "ci_low", "ci_high", "bias_corrected", "ci_excludes_estimate",
        "n_datasets", "group_size", "in_sample", "partial")


# ---------------------------------------------------------------------------------------------------------------
# Table 1 and Appendix C: prediction agreement / disagreement
# ---------------------------------------------------------------------------------------------------------------


def pa_pd_rows(s: RunSummary, n_bins: int = 20) -> list[dict]:
    """PA (zero-shot and adapted top-1 agree) and PD subsets of one run: ratio and TTA-minus-zero-shot changes.

    Per subset: ratio (% of samples), delta_confidence and delta_accuracy (percentage points), delta_entropy
    (nats), delta_ece (points; each ECE computed within the subset with `n_bins` bins), and both ECEs.
    """
    agree = s.zs_pred == s.tta_pred
    out = []
    for subset, mask in (("PA", agree), ("PD", ~agree)):
        n = int(mask.sum())
        row = dict(backbone=s.key.backbone, dataset=s.key.dataset, method=s.key.method, seed=s.key.seed,
                   subset=subset, n=n, ratio=100.0 * n / max(len(s), 1), partial=s.partial)
        if n:
            zc, tc = s.zs_correct[mask], s.tta_correct[mask]
            zs_e = float(ece(s.zs_confidence[mask], zc, n_bins))
            tta_e = float(ece(s.tta_confidence[mask], tc, n_bins))
            row.update(delta_confidence=100.0 * float((s.tta_confidence[mask] - s.zs_confidence[mask]).mean()),
                       delta_accuracy=100.0 * float(tc.mean() - zc.mean()),
                       delta_entropy=float((s.tta_entropy[mask] - s.zs_entropy[mask]).mean()),
                       zs_ece=100.0 * zs_e, tta_ece=100.0 * tta_e, delta_ece=100.0 * (tta_e - zs_e))
        out.append(row)
    return out


_PAPD_VALUES = ["ratio", "delta_confidence", "delta_accuracy", "delta_entropy", "delta_ece", "zs_ece", "tta_ece"]


def pa_pd_table(runs: Iterable[RunSummary], n_bins: int = 20) -> pl.DataFrame:
    """Table 1 (PA) and its PD counterpart for every (backbone, dataset, method), seeds averaged; `partial`: the
    partial runs' counts (`partial_agg`), null when whole."""
    rows = [r for s in runs if s.key.method != layout.ZERO_SHOT for r in pa_pd_rows(s, n_bins)]
    schema = {"backbone": pl.Utf8, "dataset": pl.Utf8, "method": pl.Utf8, "seed": pl.Int64, "subset": pl.Utf8,
              "n": pl.Int64, "partial": pl.Utf8, **{v: pl.Float64 for v in _PAPD_VALUES}}
    df = pl.DataFrame(rows, schema=schema)
    return _order(
        df.group_by(["backbone", "dataset", "method", "subset"], maintain_order=True)
        .agg([pl.col("n").mean()] + [pl.col(v).mean() for v in _PAPD_VALUES] + [partial_agg()])
    ).sort(["_b", "_d", "_m", "subset"]).drop("_b", "_d", "_m")


def _order(df: pl.DataFrame) -> pl.DataFrame:
    """Add integer sort keys _b, _d, _m following the paper's backbone, dataset and method order."""
    if df.height == 0:
        return df.with_columns(pl.lit(0).alias("_b"), pl.lit(0).alias("_d"), pl.lit(0).alias("_m"))
    orders = {
        "_b": ("backbone", layout.order_backbones(df["backbone"].unique().to_list())),
        "_d": ("dataset", [d for _, g in layout.order_datasets(df["dataset"].unique().to_list()) for d in g]),
        "_m": ("method", layout.order_methods(df["method"].unique().to_list())),
    }
    return df.with_columns(
        pl.col(col).replace_strict({k: i for i, k in enumerate(keys)}, default=len(keys), return_dtype=pl.Int64)
        .alias(name)
        for name, (col, keys) in orders.items()
    )


# ---------------------------------------------------------------------------------------------------------------
# Figure 2
# ---------------------------------------------------------------------------------------------------------------


def range_deviation_points(cells: pl.DataFrame, calibrators: Sequence[str] = ("none", "sals", "zaec")) -> pl.DataFrame:
    """Figure 2a: eq. 8 range deviation (percent) vs ECE (percent) per backbone, method and calibrator.

    Per dataset rows plus `dataset == "avg"` rows (unweighted means over the datasets each method has).
    """
    df = cells.filter(pl.col("calibrator").is_in(list(calibrators)) & (pl.col("method") != layout.ZERO_SHOT))
    df = df.select("backbone", "dataset", "method", "calibrator", "range_deviation",
                   (pl.col("ece") * 100.0).alias("ece"))
    avg = df.group_by(["backbone", "method", "calibrator"], maintain_order=True).agg(
        pl.lit("avg").alias("dataset"), pl.col("range_deviation").mean(), pl.col("ece").mean())
    return pl.concat([df, avg.select(df.columns)])


def range_figure_points(
    cells: pl.DataFrame, backbone: str, points: Sequence[tuple[str, str]] = layout.FIG2A_POINTS
) -> tuple[pl.DataFrame, list[tuple[str, str]]]:
    """Figure 2a as the paper draws it: the (method, calibrator) `points` (TPT + SaLS, TPT + ZAEC, O-TPT, A-TPT),
    each eq. 8 range deviation (percent) vs ECE (percent), unweighted means over the datasets that every present
    point has, so that all points describe the same data; when the points share no dataset, each point's own.

    Returns:
        (frame, missing): frame columns backbone, method, calibrator, label, range_deviation, ece, n_datasets,
        datasets (comma-separated keys), partial (the partial runs averaged, e.g. `DTD 150 of 400`; null when whole),
        in `points` order; missing: the points without any run.
    """
    cb = cells.filter(pl.col("backbone") == backbone)
    have: dict[tuple[str, str], dict[str, dict]] = {}
    missing = []
    for m, c in points:
        part = cb.filter((pl.col("method") == m) & (pl.col("calibrator") == c))
        if part.height:
            have[(m, c)] = {r["dataset"]: r for r in part.iter_rows(named=True)}
        else:
            missing.append((m, c))
    common = set.intersection(*(set(v) for v in have.values())) if have else set()
    rows = []
    for (m, c), by_ds in have.items():
        ds = [d for _, g in layout.order_datasets(common or by_ds) for d in g]
        label = layout.method_label(m) if c == "none" else f"{layout.method_label(m)} + {layout.calibrator_label(c)}"
        partial = "; ".join(f"{layout.dataset_label(d)} {by_ds[d]['partial']}" for d in ds
                            if by_ds[d].get("partial")) or None
        rows.append(dict(backbone=backbone, method=m, calibrator=c, label=label,
                         range_deviation=float(np.mean([by_ds[d]["range_deviation"] for d in ds])),
                         ece=float(np.mean([by_ds[d]["ece"] for d in ds])) * 100.0, n_datasets=len(ds),
                         datasets=",".join(ds), partial=partial))
    schema = {"backbone": pl.Utf8, "method": pl.Utf8, "calibrator": pl.Utf8, "label": pl.Utf8,
              "range_deviation": pl.Float64, "ece": pl.Float64, "n_datasets": pl.Int64, "datasets": pl.Utf8,
              "partial": pl.Utf8}
    return pl.DataFrame(rows, schema=schema), missing


def pooled_methods(present: Iterable[str], chosen: Sequence[str] | None = None) -> list[str]:
    """Figure 2b's pooled methods: `chosen` where given (those present; "all": every present method), else every
    present TTA method except the prompt-coupled calibration methods (C-TPT, O-TPT, A-TPT): the paper's statistic is
    over its five TTA methods TPT, TPS, TDA, DPE, DLAE.

    Example:
        >>> pooled_methods(["otpt", "tda", "tpt", "mine", "zero-shot"])
        ['tpt', 'tda', 'mine']
    """
    present = layout.order_methods(present)
    if chosen is not None:
        return present if "all" in chosen else [m for m in present if m in set(chosen)]
    return [m for m in present if m not in layout.PROMPT_CALIBRATION_METHODS]


def entropy_ece_points(cells: pl.DataFrame, pooled: Sequence[str] | None = None) -> pl.DataFrame:
    """Figure 2b: one point per (backbone, dataset, method): mean normalised entropy change (eq. 10 mean) and
    ECE change (raw TTA minus the paired zero-shot, percentage points); `pooled` is True for the methods of the
    correlation (`pooled`; every method when None); `partial`: a partial run's count, else null."""
    raw = cells.filter((pl.col("calibrator") == "none") & (pl.col("method") != layout.ZERO_SHOT))
    zs = cells.filter(pl.col("calibrator") == ZERO_SHOT).select("backbone", "dataset", "method",
                                                                 pl.col("ece").alias("zs_ece"))
    df = raw.join(zs, on=["backbone", "dataset", "method"], how="inner")
    flag = pl.lit(True) if pooled is None else pl.col("method").is_in(list(pooled))
    partial = pl.col("partial") if "partial" in df.columns else pl.lit(None, pl.Utf8).alias("partial")
    return df.select("backbone", "dataset", "method", "mean_delta_entropy",
                     ((pl.col("ece") - pl.col("zs_ece")) * 100.0).alias("delta_ece"), flag.alias("pooled"), partial)


def correlations(points: pl.DataFrame, x: str = "mean_delta_entropy", y: str = "delta_ece") -> pl.DataFrame:
    """Pearson and Spearman correlation (with two-sided p-values) of y on x per backbone (null with < 3 points or a
    constant variable); `n` points of the methods named in `methods` (comma-separated, paper order)."""
    rows = []
    for bb in layout.order_backbones(points["backbone"].unique().to_list()):
        p = points.filter(pl.col("backbone") == bb)
        xs, ys = p[x].to_numpy(), p[y].to_numpy()
        methods = ",".join(layout.order_methods(p["method"].unique().to_list())) if "method" in p.columns else None
        row = dict(backbone=bb, n=len(xs), methods=methods, pearson_r=None, pearson_p=None, spearman_rho=None,
                   spearman_p=None)
        if len(xs) >= 3 and np.ptp(xs) > 0 and np.ptp(ys) > 0:
            pr = stats.pearsonr(xs, ys)
            sr = stats.spearmanr(xs, ys)
            row.update(pearson_r=float(pr.statistic), pearson_p=float(pr.pvalue),
                       spearman_rho=float(sr.statistic), spearman_p=float(sr.pvalue))
        rows.append(row)
    schema = {"backbone": pl.Utf8, "n": pl.Int64, "methods": pl.Utf8, "pearson_r": pl.Float64,
              "pearson_p": pl.Float64, "spearman_rho": pl.Float64, "spearman_p": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def entropy_gap_bins(s: RunSummary, n_bins: int = 10) -> pl.DataFrame:
    """Figures 2c/2d for one run: samples split by the sign of delta_i^H (reduced: < 0; not_reduced: >= 0), then
    `n_bins` equal-frequency bins within each (ordered by delta, ties by sample order); per bin the mean delta, the
    changes in confidence and accuracy (points) and their difference, the gap Delta G = Delta Conf - Delta Acc."""
    delta = s.delta_entropy
    d_conf = (s.tta_confidence - s.zs_confidence) * 100.0
    d_acc = (s.tta_correct.astype(np.float64) - s.zs_correct) * 100.0
    rows = []
    for subset, mask in (("reduced", delta < 0), ("not_reduced", delta >= 0)):
        idx = np.flatnonzero(mask)
        if idx.size == 0:
            continue
        order = idx[np.argsort(delta[idx], kind="stable")]
        for b, part in enumerate(np.array_split(order, min(n_bins, idx.size))):
            dc, da = float(d_conf[part].mean()), float(d_acc[part].mean())
            rows.append(dict(backbone=s.key.backbone, dataset=s.key.dataset, method=s.key.method, seed=s.key.seed,
                             subset=subset, bin=b, n=int(part.size), mean_delta_entropy=float(delta[part].mean()),
                             delta_confidence=dc, delta_accuracy=da, gap=dc - da, partial=s.partial))
    schema = {"backbone": pl.Utf8, "dataset": pl.Utf8, "method": pl.Utf8, "seed": pl.Int64, "subset": pl.Utf8,
              "bin": pl.Int64, "n": pl.Int64, "mean_delta_entropy": pl.Float64, "delta_confidence": pl.Float64,
              "delta_accuracy": pl.Float64, "gap": pl.Float64, "partial": pl.Utf8}
    return pl.DataFrame(rows, schema=schema)


# ---------------------------------------------------------------------------------------------------------------
# Figure 1, and the reliability diagrams of Figures 4 and 5
# ---------------------------------------------------------------------------------------------------------------


def intro_bars(
    cells: pl.DataFrame,
    backbone: str,
    methods: Sequence[str],
    datasets: Sequence[str],
    calibrators: Sequence[str] = layout.FIG1_CALIBRATORS,
) -> pl.DataFrame:
    """Figure 1: ECE (percent) of raw TTA / SaLS / ZAEC per dataset and their unweighted average, per method.

    Columns: backbone, method, calibrator, dataset (`datasets` order, then "avg"), ece, n_datasets (1 on a dataset
    row; on the "avg" row the datasets averaged, which can be fewer than `group_size` = len(datasets)), partial (a
    dataset row of a partial run: its count; null otherwise). Methods or calibrators without any run on `datasets`
    are left out.
    """
    cb = cells.filter((pl.col("backbone") == backbone) & pl.col("dataset").is_in(list(datasets)))
    lookup = {(r["method"], r["calibrator"], r["dataset"]): r["ece"] * 100.0 for r in cb.iter_rows(named=True)}
    partial = _partial_lookup(cb)
    rows = []
    for m in methods:
        for c in calibrators:
            vals = [(d, lookup[(m, c, d)]) for d in datasets if (m, c, d) in lookup]
            if not vals:
                continue
            rows += [dict(backbone=backbone, method=m, calibrator=c, dataset=d, ece=v, n_datasets=1,
                          group_size=len(datasets), partial=partial.get((m, d))) for d, v in vals]
            rows.append(dict(backbone=backbone, method=m, calibrator=c, dataset="avg",
                             ece=float(np.mean([v for _, v in vals])), n_datasets=len(vals),
                             group_size=len(datasets), partial=None))
    schema = {"backbone": pl.Utf8, "method": pl.Utf8, "calibrator": pl.Utf8, "dataset": pl.Utf8, "ece": pl.Float64,
              "n_datasets": pl.Int64, "group_size": pl.Int64, "partial": pl.Utf8}
    return pl.DataFrame(rows, schema=schema)


def reliability_table(s: RunSummary, panels: Sequence[str], n_bins: int = 10, ece_bins: int = 20) -> pl.DataFrame:
    """Reliability-diagram data of one run, one row per panel and equal-width bin (`calibrate.metrics.bin_index`).

    Args:
        s: the run (one seed: the figures plot one run, never a mean over seeds).
        panels: "zero-shot" (the paired zero-shot prediction) or calibrator specs of `s.calibrated`.
        n_bins: bins of the diagram (the paper: 10, for visualisation only).
        ece_bins: bins of the panel's ECE (the tables': 20).

    Returns:
        Columns backbone, dataset, method, seed, panel, bin, lo, hi, count, share (of the run's samples),
        confidence and accuracy (bin means; NaN in empty bins), the ECE (percent, `ece_bins` bins) of exactly
        the predictions the panel plots, and partial (`RunSummary.partial`).
    """
    frames = []
    for panel in panels:
        if panel == ZERO_SHOT:
            conf, corr = s.zs_confidence, s.zs_correct
        else:
            conf, corr = s.calibrated[panel].confidence, s.tta_correct
        r = reliability(conf, corr, n_bins)
        frames.append(pl.DataFrame({
            "backbone": s.key.backbone, "dataset": s.key.dataset, "method": s.key.method, "seed": s.key.seed,
            "panel": panel, "bin": np.arange(n_bins), "lo": r.edges[:-1], "hi": r.edges[1:],
            "count": r.count.astype(np.int64), "share": r.count / max(len(s), 1), "confidence": r.confidence,
            "accuracy": r.accuracy, "ece": 100.0 * float(ece(conf, corr, ece_bins)), "ece_bins": ece_bins,
            "partial": pl.Series([s.partial] * n_bins, dtype=pl.Utf8),
        }))
    return pl.concat(frames)


# ---------------------------------------------------------------------------------------------------------------
# Table 4, Figure 6, backbone summary (Figure 3)
# ---------------------------------------------------------------------------------------------------------------


def ablation_table(
    cells: pl.DataFrame, backbone: str, datasets: Sequence[str], replicates: CellReplicates | None = None
) -> pl.DataFrame:
    """Table 4: ECE (percent) and NLL of each corrected subset, macro-averaged over `datasets`, per method.

    Columns: backbone, method, subset, calibrator, ece, nll, n_datasets, bold_ece, bold_nll (lowest per method);
    with replicates also ci_low/ci_high of the ECE and the paired difference ZAEC minus this row (diff_zaec,
    diff_ci_low, diff_ci_high, diff_contains_zero; null on the ZAEC row); partial (the partial runs averaged, e.g.
    `DTD 150 of 400`; null when whole). A subset row is left out for a method missing it on any of the datasets.
    """
    replicates = replicates or CellReplicates(None)
    rows = []
    cb = cells.filter((pl.col("backbone") == backbone) & pl.col("dataset").is_in(list(datasets)))
    zaec_spec = layout.SUBSET_SPECS["Entropy-reduced (ZAEC)"]

    def avg_reps(m: str, spec: str) -> np.ndarray | None:
        reps = [replicates.get(backbone, d, m, spec) for d in datasets]
        return None if any(r is None for r in reps) else np.mean(reps, axis=0)

    for m in layout.order_methods(cb["method"].unique().to_list()):
        part = []
        z = avg_reps(m, zaec_spec)
        for subset, spec in layout.SUBSET_SPECS.items():
            r = cb.filter((pl.col("method") == m) & (pl.col("calibrator") == spec))
            if r.height != len(datasets) or r.height == 0:
                continue
            reps = avg_reps(m, spec)
            value = float(r["ece"].mean()) * 100.0
            lo, hi = replicates.interval(reps, value, floor=0.0)
            partial = [f"{layout.dataset_label(d)} {p}" for d, p in zip(r["dataset"], r["partial"]) if p] \
                if "partial" in r.columns else []
            part.append(dict(backbone=backbone, method=m, subset=subset, calibrator=spec, ece=value,
                             nll=float(r["nll"].mean()), n_datasets=r.height, ci_low=lo, ci_high=hi, diff_zaec=None,
                             diff_ci_low=None, diff_ci_high=None, diff_contains_zero=None,
                             partial="; ".join(partial) or None, _reps=reps))
        zrow = next((p for p in part if p["calibrator"] == zaec_spec), None)
        for p in part:
            if zrow is not None and p is not zrow:
                p["diff_zaec"] = zrow["ece"] - p["ece"]
                if z is not None and p["_reps"] is not None:
                    dlo, dhi = replicates.interval(z - p["_reps"], p["diff_zaec"])
                    if dlo is not None:
                        p.update(diff_ci_low=dlo, diff_ci_high=dhi, diff_contains_zero=bool(dlo <= 0.0 <= dhi))
        for p in part:
            del p["_reps"]
        be, bn = _bold_min([p["ece"] for p in part]), _bold_min([p["nll"] for p in part])
        rows += [dict(p, bold_ece=e, bold_nll=n) for p, e, n in zip(part, be, bn)]
    schema = {"backbone": pl.Utf8, "method": pl.Utf8, "subset": pl.Utf8, "calibrator": pl.Utf8, "ece": pl.Float64,
              "nll": pl.Float64, "n_datasets": pl.Int64, "ci_low": pl.Float64, "ci_high": pl.Float64,
              "diff_zaec": pl.Float64, "diff_ci_low": pl.Float64, "diff_ci_high": pl.Float64,
              "diff_contains_zero": pl.Boolean, "partial": pl.Utf8, "bold_ece": pl.Boolean, "bold_nll": pl.Boolean}
    return pl.DataFrame(rows, schema=schema)


def strength_table(cells: pl.DataFrame, strengths: Sequence[float] = layout.STRENGTHS) -> pl.DataFrame:
    """Figure 6: ECE (percent) per (backbone, dataset, method) and restoration strength lambda."""
    rows = []
    for lam in strengths:
        spec = layout.strength_spec(lam)
        part = cells.filter((pl.col("calibrator") == spec) & (pl.col("method") != layout.ZERO_SHOT))
        partial = pl.col("partial") if "partial" in part.columns else pl.lit(None, pl.Utf8).alias("partial")
        rows.append(part.select("backbone", "dataset", "method", pl.lit(float(lam)).alias("strength"),
                                pl.lit(spec).alias("calibrator"), (pl.col("ece") * 100.0).alias("ece"), partial))
    df = pl.concat(rows) if rows else pl.DataFrame()
    return _order(df).sort(["_b", "_d", "_m", "strength"]).drop("_b", "_d", "_m") if df.height else df


def backbone_summary(
    cells: pl.DataFrame, backbone: str, datasets: Sequence[str], calibrators: Sequence[str] = layout.MAIN_CALIBRATORS,
    ts_in_sample: str | None = None,
) -> pl.DataFrame:
    """Figure 3 (the paper draws it for RN50) for any backbone: average ECE (percent) and mean entropy (nats) over
    `datasets` per method and calibrator, with the paired zero-shot as calibrator `zero-shot`. Rows missing a dataset
    are left out. `in_sample`: a temperature-scaling average that includes `ts_in_sample`, the dataset its T was
    fitted on (scored on its own fitting data there, as `main_table` marks it)."""
    cb = cells.filter((pl.col("backbone") == backbone) & pl.col("dataset").is_in(list(datasets))
                      & (pl.col("method") != layout.ZERO_SHOT))
    rows = []
    for m in layout.order_methods(cb["method"].unique().to_list()):
        for c in (ZERO_SHOT, *calibrators):
            r = cb.filter((pl.col("method") == m) & (pl.col("calibrator") == c))
            if r.height != len(datasets) or r.height == 0:
                continue
            partial = [f"{layout.dataset_label(d)} {p}" for d, p in zip(r["dataset"], r["partial"]) if p] \
                if "partial" in r.columns else []
            rows.append(dict(backbone=backbone, method=m, calibrator=c, ece=float(r["ece"].mean()) * 100.0,
                             mean_entropy=float(r["mean_entropy"].mean()), n_datasets=r.height,
                             in_sample=c == "temperature" and ts_in_sample in datasets,
                             partial="; ".join(partial) or None))
    schema = {"backbone": pl.Utf8, "method": pl.Utf8, "calibrator": pl.Utf8, "ece": pl.Float64,
              "mean_entropy": pl.Float64, "n_datasets": pl.Int64, "in_sample": pl.Boolean, "partial": pl.Utf8}
    return pl.DataFrame(rows, schema=schema)


def summary_left_out(cells: pl.DataFrame, backbone: str, datasets: Sequence[str], summary: pl.DataFrame
                     ) -> pl.DataFrame:
    """The TTA methods of `backbone` that `backbone_summary` left out of Figure 3, and why: the datasets among
    `datasets` where the method has no run (every bar averages the same datasets, so a method missing one is not
    drawn rather than averaged over fewer).

    Returns:
        Columns backbone, method, missing (comma-separated dataset keys, layout order), n_missing, in the paper's
        method order; empty when every method is drawn.
    """
    cb = cells.filter((pl.col("backbone") == backbone) & (pl.col("method") != layout.ZERO_SHOT)
                      & (pl.col("calibrator") == "none"))
    drawn = set(summary["method"]) if summary.height else set()
    rows = []
    for m in layout.order_methods(cb["method"].unique().to_list()):
        if m in drawn:
            continue
        have = set(cb.filter(pl.col("method") == m)["dataset"])
        missing = [d for d in datasets if d not in have]
        rows.append(dict(backbone=backbone, method=m, missing=",".join(missing), n_missing=len(missing)))
    return pl.DataFrame(rows, schema={"backbone": pl.Utf8, "method": pl.Utf8, "missing": pl.Utf8,
                                      "n_missing": pl.Int64})


def pick_datasets(present: Iterable[str], preferred: Sequence[str]) -> tuple[list[str], bool]:
    """The preferred datasets that are present, or (when none is) every present dataset in layout order.
    Returns (datasets, used_preferred)."""
    present = list(present)
    chosen = [d for d in preferred if d in present]
    if chosen:
        return chosen, True
    return [d for _, g in layout.order_datasets(present) for d in g], False
