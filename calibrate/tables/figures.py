"""Figures: the builders (`calibrate.tables.builders`) compute, `plot_*` functions draw (matplotlib, headless).

Every plot takes the DataFrame a builder made and writes one PNG atomically; the same DataFrame is written as the
figure's CSV, so the numbers drawn (the ECE printed on a reliability panel, too) are the numbers in the CSV.
Figures are built on `matplotlib.figure.Figure` directly, never through pyplot: headless on any machine, no global
backend switch, nothing left open.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib
import numpy as np
import polars as pl
from matplotlib.figure import Figure

from calibrate.tables import layout
from calibrate.tables.bootstrap import ZERO_SHOT
from calibrate.tables.render import IN_SAMPLE_MARK, PARTIAL_MARK
from schemas.atomic import atomic_path

CAL_COLORS = {"zero-shot": "#7f7f7f", "none": "#d62728", "temperature": "#9467bd", "sals": "#ff7f0e",
              "zaec": "#1f77b4"}
CAL_MARKERS = {"none": "o", "temperature": "D", "sals": "s", "zaec": "^", "zero-shot": "x"}


def save(fig, path: str | os.PathLike, dpi: int = 130) -> Path:
    """Save a figure as PNG atomically."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight")
    return path


def partial_runs(df: pl.DataFrame) -> dict[str, str]:
    """method -> what of it is partial (`--allow-partial`), from a figure frame's `partial` column: the distinct
    texts, each prefixed by its dataset's label where the frame has one (`DTD 150 of 400`); empty when none."""
    if "partial" not in df.columns or "method" not in df.columns:
        return {}
    out: dict[str, list[str]] = {}
    for r in df.filter(pl.col("partial").is_not_null()).iter_rows(named=True):
        d = r.get("dataset")
        text = r["partial"] if d in (None, "avg") or layout.dataset_label(d) in r["partial"] \
            else f"{layout.dataset_label(d)} {r['partial']}"
        out.setdefault(r["method"], [])
        if text not in out[r["method"]]:
            out[r["method"]].append(text)
    return {m: "; ".join(v) for m, v in out.items()}


def method_name(method: str, partial: Mapping[str, str]) -> str:
    """A method's display name in a figure, with PARTIAL_MARK when one of its drawn runs is partial."""
    return layout.method_label(method) + (PARTIAL_MARK if method in partial else "")


def _suptitle(fig, title: str, partial: Mapping[str, str]) -> None:
    """The figure's title, plus one line naming every partial run drawn and its n."""
    if partial:
        title += (f"\n{PARTIAL_MARK} partial run (--allow-partial), samples: "
                  + "; ".join(f"{layout.method_label(m)} {t}" for m, t in partial.items()))
    fig.suptitle(title, fontsize=10)


def _method_colors(methods: Sequence[str]) -> dict[str, tuple]:
    cmap = matplotlib.colormaps["tab10"]
    return {m: cmap(i % 10) for i, m in enumerate(methods)}


# ---------------------------------------------------------------------------------------------------------------
# Figure 1
# ---------------------------------------------------------------------------------------------------------------


def plot_intro(bars: pl.DataFrame, path: str | os.PathLike, title: str) -> Path:
    """Figure 1: one panel per method; per dataset and the average, grouped bars of the ECE of raw TTA / SaLS /
    ZAEC (`builders.intro_bars`). An average over fewer datasets than the figure shows is labelled `Avg. (n/m)`."""
    methods = bars["method"].unique(maintain_order=True).to_list()
    partial = partial_runs(bars)
    cals = [c for c in layout.FIG1_CALIBRATORS if c in set(bars["calibrator"])]
    fig = Figure(figsize=(max(4.0, 0.55 * bars["dataset"].n_unique() + 1.5), 2.6 * len(methods) + 0.3),
                 layout="constrained")
    axes = fig.subplots(len(methods), 1, squeeze=False)
    width = 0.8 / max(len(cals), 1)
    for ax, m in zip(axes[:, 0], methods):
        part = bars.filter(pl.col("method") == m)
        datasets = [d for d in part["dataset"].unique(maintain_order=True).to_list() if d != "avg"] + ["avg"]
        x = np.arange(len(datasets))
        for k, c in enumerate(cals):
            vals = {r["dataset"]: r["ece"] for r in part.filter(pl.col("calibrator") == c).iter_rows(named=True)}
            ax.bar(x + (k - (len(cals) - 1) / 2) * width, [vals.get(d, np.nan) for d in datasets], width=width,
                   color=CAL_COLORS.get(c), label="raw TTA" if c == "none" else f"TTA + {layout.calibrator_label(c)}")
        avg = part.filter(pl.col("dataset") == "avg")
        n, size = int(avg["n_datasets"].min()), int(avg["group_size"][0])
        ticks = [layout.dataset_label(d) for d in datasets[:-1]] + ["Avg." if n >= size else f"Avg. ({n}/{size})"]
        ax.set_xticks(x, ticks, fontsize=8, rotation=30 if len(datasets) > 8 else 0)
        ax.axvline(len(datasets) - 1.5, color="#cccccc", lw=0.8)
        ax.set_ylabel("ECE (%)")
        ax.set_title(method_name(m, partial), fontsize=9)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(cals), fontsize=8)
    _suptitle(fig, title, partial)
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# Reliability diagrams: Figure 4 (boundary case) and Figure 5
# ---------------------------------------------------------------------------------------------------------------

#: what a reliability panel shows (the figures' captions in the index repeat it)
RELIABILITY_KEY = ("Blue bars: accuracy of each equal-width confidence bin; hatched red: the gap to the bin's mean "
                   "confidence; dashed: perfect calibration. The grey strip under each panel is the confidence "
                   "histogram: the share of the run's samples in each bin. Each panel's ECE is computed from "
                   "exactly the predictions it plots (one seed, the tables' ECE bins).")


def _reliability_grid(fig, nr: int, nc: int):
    """(nr, nc) diagram axes, each with a histogram strip below it sharing its x axis."""
    gs = fig.add_gridspec(2 * nr, nc, height_ratios=[4, 1] * nr)
    axes = [[fig.add_subplot(gs[2 * i, j]) for j in range(nc)] for i in range(nr)]
    strips = [[fig.add_subplot(gs[2 * i + 1, j], sharex=axes[i][j]) for j in range(nc)] for i in range(nr)]
    return axes, strips


def _draw_reliability(ax, strip, panel: pl.DataFrame | None) -> None:
    """One panel from `builders.reliability_table` rows of one panel: bars, gap, diagonal, the panel's own ECE, and
    the confidence histogram in `strip`."""
    ax.plot([0, 1], [0, 1], ls="--", color="k", lw=0.8)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    if panel is None or panel.is_empty():
        ax.text(0.5, 0.5, "n/a", ha="center", va="center", transform=ax.transAxes)
        strip.set_yticks([])
        return
    p = panel.sort("bin")
    left, width = p["lo"].to_numpy(), (p["hi"] - p["lo"]).to_numpy()
    ok = p["count"].to_numpy() > 0
    acc, conf = p["accuracy"].to_numpy(), p["confidence"].to_numpy()
    ax.bar(left[ok], acc[ok], width=width[ok], align="edge", color="#1f77b4", edgecolor="k", lw=0.5)
    ax.bar(left[ok], (conf - acc)[ok], bottom=acc[ok], width=width[ok], align="edge", fill=False, hatch="///",
           edgecolor="#d62728", lw=0.5)
    ax.text(0.04, 0.92, f"ECE {p['ece'][0]:.2f}", transform=ax.transAxes, fontsize=8, va="top",
            bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1.5))
    share = 100.0 * p["share"].to_numpy()
    strip.bar(left, share, width=width, align="edge", color="#7f7f7f", edgecolor="k", lw=0.3)
    strip.set_ylim(0, max(float(share.max()), 1.0) * 1.15)
    strip.tick_params(labelsize=6)
    ax.tick_params(labelbottom=False)


def _reliability_legend(ax) -> None:
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(facecolor="#1f77b4", edgecolor="k", label="accuracy"),
                       Patch(fill=False, hatch="///", edgecolor="#d62728", label="gap to confidence"),
                       Patch(facecolor="#7f7f7f", label="samples (%), strip")], fontsize=6, loc="lower right")


def plot_reliability_grid(
    table: pl.DataFrame, methods: Sequence[str], calibrators: Sequence[str], path: str | os.PathLike, title: str
) -> Path:
    """Figure 5: rows calibrators (raw / SaLS / ZAEC), columns methods, from `builders.reliability_table` rows of
    one run per method (its seed is named in the column title)."""
    nr, nc = len(calibrators), len(methods)
    partial = partial_runs(table)
    fig = Figure(figsize=(2.6 * nc + 0.4, 3.1 * nr + 0.4), layout="constrained")
    axes, strips = _reliability_grid(fig, nr, nc)
    for j, m in enumerate(methods):
        pm = table.filter(pl.col("method") == m)
        for i, cal in enumerate(calibrators):
            _draw_reliability(axes[i][j], strips[i][j], pm.filter(pl.col("panel") == cal))
            if i == 0:
                seed = f" (seed {pm['seed'][0]})" if pm.height else ""
                axes[i][j].set_title(f"{method_name(m, partial)}{seed}", fontsize=9)
            if j == 0:
                axes[i][j].set_ylabel(f"{layout.calibrator_label(cal)}\naccuracy", fontsize=9)
                strips[i][j].set_ylabel("%", fontsize=7)
            if i == nr - 1:
                strips[i][j].set_xlabel("confidence", fontsize=9)
    _reliability_legend(axes[0][0])
    _suptitle(fig, title, partial)
    return save(fig, path)


def plot_boundary(table: pl.DataFrame, path: str | os.PathLike, title: str) -> Path:
    """Figure 4: zero-shot, raw method and method + ZAEC reliability panels of one run side by side."""
    panels = table["panel"].unique(maintain_order=True).to_list()
    partial = partial_runs(table)
    m = method_name(table["method"][0], partial)
    names = {ZERO_SHOT: "Zero-shot CLIP", "none": f"{m} (raw)"}
    fig = Figure(figsize=(2.8 * len(panels) + 0.4, 3.6), layout="constrained")
    axes, strips = _reliability_grid(fig, 1, len(panels))
    for j, panel in enumerate(panels):
        _draw_reliability(axes[0][j], strips[0][j], table.filter(pl.col("panel") == panel))
        axes[0][j].set_title(names.get(panel, f"{m} + {layout.calibrator_label(panel)}"), fontsize=9)
        strips[0][j].set_xlabel("confidence", fontsize=9)
    axes[0][0].set_ylabel("accuracy", fontsize=9)
    strips[0][0].set_ylabel("%", fontsize=7)
    _reliability_legend(axes[0][0])
    _suptitle(fig, title, partial)
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# Figure 2
# ---------------------------------------------------------------------------------------------------------------


def plot_range_vs_ece(points: pl.DataFrame, path: str | os.PathLike, title: str) -> Path:
    """Figure 2a as the paper draws it (`builders.range_figure_points`): one labelled point per (method,
    calibrator), x the mean relative logit-range deviation (eq. 8), y the ECE; grey arrows join the SaLS and ZAEC
    points of the same method (the same underlying predictions)."""
    colors = _method_colors(points["label"].to_list())
    partial = partial_runs(points)
    fig = Figure(figsize=(5.2, 4.0), layout="constrained")
    ax = fig.subplots()
    rows = list(points.iter_rows(named=True))
    for r in rows:
        ax.scatter(r["range_deviation"], r["ece"], color=colors[r["label"]],
                   marker=CAL_MARKERS.get(r["calibrator"], "o"), s=50, zorder=3)
        ax.annotate(r["label"] + (PARTIAL_MARK if r.get("partial") else ""), (r["range_deviation"], r["ece"]),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)  # named where it lies, as in the paper
    by = {(r["method"], r["calibrator"]): r for r in rows}
    for (m, c), a in by.items():
        b = by.get((m, "zaec"))
        if c == "sals" and b is not None:
            ax.annotate("", xy=(b["range_deviation"], b["ece"]), xytext=(a["range_deviation"], a["ece"]),
                        arrowprops=dict(arrowstyle="->", color="#999999", lw=1.2), zorder=2)
    ax.set_xlabel(r"mean relative logit-range deviation $\Delta_R$ (%)")
    ax.set_ylabel("ECE (%)")
    ax.margins(0.15)
    ax.set_title(title if not partial else title + f"\n{PARTIAL_MARK} partial run (--allow-partial), samples: "
                 + "; ".join(f"{layout.method_label(m)} {t}" for m, t in partial.items()), fontsize=9)
    return save(fig, path)


def plot_entropy_ece(points: pl.DataFrame, corr: Mapping | None, path: str | os.PathLike, title: str) -> Path:
    """Figure 2b: mean normalised entropy change vs ECE change, per dataset-method point, with a least-squares
    line and the correlations in the title."""
    methods = layout.order_methods(points["method"].unique().to_list())
    colors = _method_colors(methods)
    partial = partial_runs(points)
    fig = Figure(figsize=(5.2, 4.0), layout="constrained")
    ax = fig.subplots()
    for m in methods:
        p = points.filter(pl.col("method") == m)
        ax.scatter(p["mean_delta_entropy"], p["delta_ece"], color=colors[m], label=method_name(m, partial), s=30)
    x, y = points["mean_delta_entropy"].to_numpy(), points["delta_ece"].to_numpy()
    if len(x) >= 2 and np.ptp(x) > 0:
        slope, icpt = np.polyfit(x, y, 1)
        xs = np.linspace(x.min(), x.max(), 2)
        ax.plot(xs, slope * xs + icpt, color="k", lw=0.8, ls="--")
    ax.axhline(0, color="#cccccc", lw=0.6)
    ax.axvline(0, color="#cccccc", lw=0.6)
    text = title
    if corr and corr.get("pearson_r") is not None:
        text += (f"\nPearson r = {corr['pearson_r']:.3f} (p = {corr['pearson_p']:.2g}), "
                 f"Spearman ρ = {corr['spearman_rho']:.3f} (p = {corr['spearman_p']:.2g})")
    text += f"\nn = {points.height} dataset-method points of " + ", ".join(layout.method_label(m) for m in methods)
    if partial:
        text += (f"\n{PARTIAL_MARK} partial run (--allow-partial), samples: "
                 + "; ".join(f"{layout.method_label(m)} {t}" for m, t in partial.items()))
    ax.set_title(text, fontsize=8)
    ax.set_xlabel(r"mean normalised entropy change $\bar\delta^H$")
    ax.set_ylabel(r"$\Delta$ECE, TTA $-$ zero-shot (points)")
    ax.legend(fontsize=7)
    return save(fig, path)


def plot_entropy_gap(bins: pl.DataFrame, path: str | os.PathLike, title: str) -> Path:
    """Figures 2c and 2d side by side: per equal-frequency bin, mean delta^H vs Delta G = Delta Conf - Delta Acc,
    for entropy-reduced (c) and not-reduced (d) samples, one line per method (one run each, its seed in the legend)."""
    methods = layout.order_methods(bins["method"].unique().to_list())
    colors = _method_colors(methods)
    partial = partial_runs(bins)
    fig = Figure(figsize=(9.5, 3.8), layout="constrained")
    axes = fig.subplots(1, 2, squeeze=False)
    for ax, subset, name in ((axes[0][0], "reduced", r"(c) $\delta^H < 0$"),
                             (axes[0][1], "not_reduced", r"(d) $\delta^H \geq 0$")):
        drew = False
        for m in methods:
            p = bins.filter((pl.col("method") == m) & (pl.col("subset") == subset)).sort("bin")
            if p.height:
                drew = True
                ax.plot(p["mean_delta_entropy"], p["gap"], marker="o", ms=3, color=colors[m],
                        label=f"{method_name(m, partial)} (seed {p['seed'][0]})")
        ax.axhline(0, color="#cccccc", lw=0.6)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(r"bin mean $\delta^H$")
        ax.set_ylabel(r"$\Delta G$ = $\Delta$Conf $-$ $\Delta$Acc (points)")
        if drew:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    _suptitle(fig, title, partial)
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# Figure 6, and Figure 3 (the per-backbone summary)
# ---------------------------------------------------------------------------------------------------------------


def plot_strength(table: pl.DataFrame, datasets: Sequence[str], path: str | os.PathLike, title: str) -> Path:
    """Figure 6: ECE vs restoration strength lambda, one panel per dataset, one line per method."""
    methods = layout.order_methods(table["method"].unique().to_list())
    colors = _method_colors(methods)
    partial = partial_runs(table.filter(pl.col("dataset").is_in(list(datasets))))
    n = len(datasets)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig = Figure(figsize=(3.6 * cols, 3.0 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for k, d in enumerate(datasets):
        ax = axes[k // cols][k % cols]
        for m in methods:
            p = table.filter((pl.col("dataset") == d) & (pl.col("method") == m)).sort("strength")
            if p.height:
                ax.plot(p["strength"], p["ece"], marker="o", ms=3, color=colors[m], label=method_name(m, partial))
        ax.set_title(layout.dataset_label(d), fontsize=9)
        ax.set_xlabel(r"restoration strength $\lambda$")
        ax.set_ylabel("ECE (%)")
    # one legend for every method drawn in any panel (a method absent from the first panel still gets its entry)
    entries = {lab: h for ax in axes.flat for h, lab in zip(*ax.get_legend_handles_labels())}
    if entries:
        axes[0][0].legend(list(entries.values()), list(entries), fontsize=7)
    for k in range(n, rows * cols):
        axes[k // cols][k % cols].axis("off")
    _suptitle(fig, title, partial)
    return save(fig, path)


def plot_backbone_summary(summary: pl.DataFrame, path: str | os.PathLike, title: str) -> Path:
    """Figure 3 (the paper's RN50 figure, drawn for any backbone): grouped bars of average ECE (left) and mean
    entropy (right) per method, one bar per calibrator (zero-shot first); a calibrator whose average is scored
    in-sample (column `in_sample`) carries ‡ in the legend."""
    methods = layout.order_methods(summary["method"].unique().to_list())
    partial = partial_runs(summary)
    cals = [c for c in ("zero-shot", *layout.MAIN_CALIBRATORS) if c in summary["calibrator"].to_list()]
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    axes = fig.subplots(1, 2, squeeze=False)
    width = 0.8 / max(len(cals), 1)
    x = np.arange(len(methods))
    for ax, col, label in ((axes[0][0], "ece", "average ECE (%)"), (axes[0][1], "mean_entropy", "mean entropy (nats)")):
        for k, c in enumerate(cals):
            vals = []
            for m in methods:
                r = summary.filter((pl.col("method") == m) & (pl.col("calibrator") == c))
                vals.append(r[col][0] if r.height else np.nan)
            name = "Zero-shot" if c == "zero-shot" else layout.calibrator_label(c)
            if "in_sample" in summary.columns and summary.filter(pl.col("calibrator") == c)["in_sample"].any():
                name += f" {IN_SAMPLE_MARK} (in-sample)"  # averaged over its own fitting set (`builders.backbone_summary`)
            ax.bar(x + (k - (len(cals) - 1) / 2) * width, vals, width=width, color=CAL_COLORS.get(c), label=name)
        ax.set_xticks(x, [method_name(m, partial) for m in methods])
        ax.set_ylabel(label)
    axes[0][0].legend(fontsize=7)
    _suptitle(fig, title, partial)
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# beyond the paper: risk-coverage curves
# ---------------------------------------------------------------------------------------------------------------


def plot_risk_coverage(curves: pl.DataFrame, path: str | os.PathLike, title: str) -> Path:
    """Risk vs coverage (`trust_tables.risk_coverage_curves`), one panel per method (one run each, its seed in the
    panel title), one step line per prediction (zero-shot, raw, SaLS, ZAEC, temperature scaling) with its AURC in
    the legend; the dotted line is the oracle (all correct samples accepted first) of the raw prediction."""
    methods = curves["method"].unique(maintain_order=True).to_list()
    partial = partial_runs(curves)
    in_sample = curves["in_sample"] if "in_sample" in curves.columns else pl.Series([False] * curves.height)
    curves = curves.with_columns(in_sample.alias("in_sample"))
    cols = min(len(methods), 4)
    rows = (len(methods) + cols - 1) // cols
    fig = Figure(figsize=(3.4 * cols, 3.0 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for k, m in enumerate(methods):
        ax = axes[k // cols][k % cols]
        part = curves.filter(pl.col("method") == m)
        for panel in part["panel"].unique(maintain_order=True).to_list():
            p = part.filter(pl.col("panel") == panel).sort("point")
            if panel == "oracle":  # over the whole coverage range (`trust_tables.risk_coverage_curves`)
                ax.plot(p["coverage"] * 100.0, p["risk"] * 100.0, ls=":", lw=0.8, color="#555555", label="oracle")
                continue
            label = ("zero-shot" if panel == ZERO_SHOT else layout.calibrator_label(panel)) + (
                f" {IN_SAMPLE_MARK}" if p["in_sample"].any() else "")
            ax.step(p["coverage"] * 100.0, p["risk"] * 100.0, where="post", lw=1.1,
                    color=CAL_COLORS.get(panel), label=f"{label} (AURC {100.0 * p['aurc'][0]:.2f})")
            # where the curve starts: late when the most confident tied group is large (top probability 1.0)
            ax.plot(p["coverage"][0] * 100.0, p["risk"][0] * 100.0, marker="o", ms=2.5, color=CAL_COLORS.get(panel))
        ax.set_title(f"{method_name(m, partial)} (seed {part['seed'][0]}, {part['n'][0]} samples)", fontsize=9)
        ax.set_xlabel("coverage (%)")
        ax.set_ylabel("selective risk (%)")
        ax.set_xlim(0, 100)
        ax.legend(fontsize=6)
    for k in range(len(methods), rows * cols):
        axes[k // cols][k % cols].axis("off")
    _suptitle(fig, title, partial)
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# beyond the paper: out-of-distribution ROC curves
# ---------------------------------------------------------------------------------------------------------------


def plot_ood_roc(curves: pl.DataFrame, path: str | os.PathLike, title: str) -> Path:
    """OOD detection (`ood_tables.ood_roc_curves`): one panel per (OOD run, method), one ROC line per prediction
    (zero-shot, raw, ZAEC) with its AUROC in the legend, in-distribution positive; dashed: chance."""
    keys = curves.select("dataset", "method").unique(maintain_order=True).rows()
    partial = partial_runs(curves.with_columns(pl.col("ood_set").alias("_set")).drop("dataset")
                           .rename({"_set": "dataset"}))
    cols = min(len(keys), 4)
    rows = (len(keys) + cols - 1) // cols
    fig = Figure(figsize=(3.2 * cols, 3.1 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for k, (ds, m) in enumerate(keys):
        ax = axes[k // cols][k % cols]
        part = curves.filter((pl.col("dataset") == ds) & (pl.col("method") == m))
        ax.plot([0, 100], [0, 100], ls="--", lw=0.8, color="#999999")
        for panel in part["panel"].unique(maintain_order=True).to_list():
            p = part.filter(pl.col("panel") == panel).sort("point")
            label = "zero-shot" if panel == ZERO_SHOT else layout.calibrator_label(panel)
            label += f" {IN_SAMPLE_MARK}" if p["in_sample"].any() else ""
            ax.plot(p["fpr"] * 100.0, p["tpr"] * 100.0, lw=1.1, color=CAL_COLORS.get(panel),
                    label=f"{label} (AUROC {100.0 * p['auroc'][0]:.2f})")
        r = part.row(0, named=True)
        ax.set_title(f"{method_name(m, partial)} (seed {r['seed']}): {layout.dataset_label(r['ood_for'])} vs "
                     f"{r['ood_set']}\n{r['n_id']} ID + {r['n_ood']} OOD images", fontsize=8)
        ax.set_xlabel("OOD images accepted, FPR (%)", fontsize=8)
        ax.set_ylabel("in-distribution accepted, TPR (%)", fontsize=8)
        ax.set_xlim(0, 100)
        ax.set_ylim(0, 100)
        ax.legend(fontsize=6, loc="lower right")
    for k in range(len(keys), rows * cols):
        axes[k // cols][k % cols].axis("off")
    _suptitle(fig, title, partial)
    return save(fig, path)
