"""Figures: `prepare_*` functions return arrays, `plot_*` functions draw them (matplotlib, headless Agg).

Every plot takes the DataFrame a builder made (or arrays from `prepare_reliability`) and writes one PNG atomically.
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
from matplotlib.lines import Line2D

from calibrate.metrics import reliability
from calibrate.tables import layout
from schemas.atomic import atomic_path

CAL_COLORS = {"zero-shot": "#7f7f7f", "none": "#d62728", "temperature": "#9467bd", "sals": "#ff7f0e",
              "zaec": "#1f77b4"}
#: height (in panel units) of the tallest possible confidence-histogram bar (all samples in one bin)
HIST_HEIGHT = 0.25
CAL_MARKERS = {"none": "o", "temperature": "D", "sals": "s", "zaec": "^", "zero-shot": "x"}


def save(fig, path: str | os.PathLike, dpi: int = 130) -> Path:
    """Save a figure as PNG atomically."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight")
    return path


def _method_colors(methods: Sequence[str]) -> dict[str, tuple]:
    cmap = matplotlib.colormaps["tab10"]
    return {m: cmap(i % 10) for i, m in enumerate(methods)}


# ---------------------------------------------------------------------------------------------------------------
# Figure 4: reliability diagrams
# ---------------------------------------------------------------------------------------------------------------


def prepare_reliability(confidence: np.ndarray, correct: np.ndarray, n_bins: int = 10) -> dict[str, np.ndarray]:
    """Per equal-width bin (convention of `calibrate.metrics.bin_index`): edges (M+1,), count (M,), mean confidence
    and accuracy (M,) (NaN in empty bins)."""
    r = reliability(confidence, correct, n_bins)
    return {"edges": r.edges, "count": r.count.astype(np.float64), "confidence": r.confidence, "accuracy": r.accuracy}


def plot_reliability_grid(
    panels: Mapping[tuple[str, str], dict[str, np.ndarray]],
    methods: Sequence[str],
    calibrators: Sequence[str],
    path: str | os.PathLike,
    title: str,
    ece_values: Mapping[tuple[str, str], float] | None = None,
) -> Path:
    """Rows: calibrators (raw / SaLS / ZAEC); columns: methods. Bars: bin accuracy; hatched: the gap to the bin's
    mean confidence; grey area: the confidence histogram (share of samples, 100% = a quarter of the height)."""
    nr, nc = len(calibrators), len(methods)
    fig = Figure(figsize=(2.6 * nc + 0.4, 2.6 * nr + 0.4), layout="constrained")
    axes = fig.subplots(nr, nc, squeeze=False, sharex=True, sharey=True)
    for i, cal in enumerate(calibrators):
        for j, m in enumerate(methods):
            ax = axes[i][j]
            p = panels.get((cal, m))
            ax.plot([0, 1], [0, 1], ls="--", color="k", lw=0.8)
            if p is not None:
                edges = p["edges"]
                width = np.diff(edges)
                left = edges[:-1]
                ok = p["count"] > 0
                acc = np.where(ok, p["accuracy"], 0.0)
                conf = np.where(ok, p["confidence"], 0.0)
                ax.bar(left[ok], acc[ok], width=width[ok], align="edge", color="#1f77b4", edgecolor="k", lw=0.5)
                ax.bar(left[ok], (conf - acc)[ok], bottom=acc[ok], width=width[ok], align="edge", fill=False,
                       hatch="///", edgecolor="#d62728", lw=0.5)
                # confidence histogram (share of samples per bin), drawn in the lowest quarter of the panel
                share = p["count"] / max(p["count"].sum(), 1.0) * HIST_HEIGHT
                ax.fill_between(np.r_[left, 1.0], np.r_[share, share[-1]], step="post", color="#444444", alpha=0.35,
                                lw=0, zorder=3)
                if ece_values and (cal, m) in ece_values:
                    ax.text(0.04, 0.9, f"ECE {ece_values[(cal, m)]:.2f}", transform=ax.transAxes, fontsize=8)
            else:
                ax.text(0.5, 0.5, "n/a", ha="center", va="center", transform=ax.transAxes)
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            if i == 0:
                ax.set_title(layout.method_label(m), fontsize=10)
            if j == 0:
                ax.set_ylabel(f"{layout.calibrator_label(cal)}\naccuracy", fontsize=9)
            if i == nr - 1:
                ax.set_xlabel("confidence", fontsize=9)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# Figure 2
# ---------------------------------------------------------------------------------------------------------------


def plot_range_vs_ece(points: pl.DataFrame, path: str | os.PathLike, title: str) -> Path:
    """Figure 2a: relative logit-range deviation (eq. 8) vs ECE; one colour per method, one marker per calibrator;
    grey arrows from SaLS to ZAEC on the same predictions."""
    methods = layout.order_methods(points["method"].unique().to_list())
    colors = _method_colors(methods)
    fig = Figure(figsize=(5.2, 4.0), layout="constrained")
    ax = fig.subplots()
    for m in methods:
        part = {r["calibrator"]: r for r in points.filter(pl.col("method") == m).iter_rows(named=True)}
        for cal, r in part.items():
            ax.scatter(r["range_deviation"], r["ece"], color=colors[m], marker=CAL_MARKERS.get(cal, "o"), s=40,
                       zorder=3)
        if "sals" in part and "zaec" in part:
            a, b = part["sals"], part["zaec"]
            ax.annotate("", xy=(b["range_deviation"], b["ece"]), xytext=(a["range_deviation"], a["ece"]),
                        arrowprops=dict(arrowstyle="->", color="#999999", lw=1.0), zorder=2)
    handles = [Line2D([], [], color=colors[m], marker="o", ls="", label=layout.method_label(m)) for m in methods]
    handles += [Line2D([], [], color="k", marker=CAL_MARKERS.get(c, "o"), ls="", label=layout.calibrator_label(c))
                for c in points["calibrator"].unique(maintain_order=True).to_list()]
    ax.legend(handles=handles, fontsize=7, loc="best")
    ax.set_xlabel(r"relative logit-range deviation $\Delta_R$ (%)")
    ax.set_ylabel("ECE (%)")
    ax.set_title(title, fontsize=9)
    return save(fig, path)


def plot_entropy_ece(points: pl.DataFrame, corr: Mapping | None, path: str | os.PathLike, title: str) -> Path:
    """Figure 2b: mean normalised entropy change vs ECE change, per dataset-method point, with a least-squares
    line and the correlations in the title."""
    methods = layout.order_methods(points["method"].unique().to_list())
    colors = _method_colors(methods)
    fig = Figure(figsize=(5.2, 4.0), layout="constrained")
    ax = fig.subplots()
    for m in methods:
        p = points.filter(pl.col("method") == m)
        ax.scatter(p["mean_delta_entropy"], p["delta_ece"], color=colors[m], label=layout.method_label(m), s=30)
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
                 f"Spearman ρ = {corr['spearman_rho']:.3f} (p = {corr['spearman_p']:.2g}), n = {corr['n']}")
    ax.set_title(text, fontsize=8)
    ax.set_xlabel(r"mean normalised entropy change $\bar\delta^H$")
    ax.set_ylabel(r"$\Delta$ECE, TTA $-$ zero-shot (points)")
    ax.legend(fontsize=7)
    return save(fig, path)


def plot_entropy_gap(bins: pl.DataFrame, path: str | os.PathLike, title: str) -> Path:
    """Figures 2c and 2d side by side: per equal-frequency bin, mean delta^H vs Delta G = Delta Conf - Delta Acc,
    for entropy-reduced (c) and not-reduced (d) samples, one line per method."""
    methods = layout.order_methods(bins["method"].unique().to_list())
    colors = _method_colors(methods)
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
                        label=layout.method_label(m))
        ax.axhline(0, color="#cccccc", lw=0.6)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(r"bin mean $\delta^H$")
        ax.set_ylabel(r"$\Delta G$ = $\Delta$Conf $-$ $\Delta$Acc (points)")
        if drew:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# Figure 5 and the backbone summary
# ---------------------------------------------------------------------------------------------------------------


def plot_strength(table: pl.DataFrame, datasets: Sequence[str], path: str | os.PathLike, title: str) -> Path:
    """Figure 5: ECE vs restoration strength lambda, one panel per dataset, one line per method."""
    methods = layout.order_methods(table["method"].unique().to_list())
    colors = _method_colors(methods)
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
                ax.plot(p["strength"], p["ece"], marker="o", ms=3, color=colors[m], label=layout.method_label(m))
        ax.set_title(layout.dataset_label(d), fontsize=9)
        ax.set_xlabel(r"restoration strength $\lambda$")
        ax.set_ylabel("ECE (%)")
        if k == 0 and ax.lines:
            ax.legend(fontsize=7)
    for k in range(n, rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def plot_backbone_summary(summary: pl.DataFrame, path: str | os.PathLike, title: str) -> Path:
    """The paper's RN50 figure: grouped bars of average ECE (left) and mean entropy (right) per method, one bar per
    calibrator (zero-shot first)."""
    methods = layout.order_methods(summary["method"].unique().to_list())
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
            ax.bar(x + (k - (len(cals) - 1) / 2) * width, vals, width=width, color=CAL_COLORS.get(c), label=name)
        ax.set_xticks(x, [layout.method_label(m) for m in methods])
        ax.set_ylabel(label)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)
