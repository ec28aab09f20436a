"""Write every table and figure of the paper (plus bootstrap intervals) from run summaries into one folder."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import polars as pl

from calibrate.tables import builders, figures, layout, render
from calibrate.tables.bootstrap import BootstrapResult
from calibrate.tables.data import Summaries

#: every calibrator spec the tables need, resolved before any shard is read
ALL_SPECS: tuple[str, ...] = (
    *layout.MAIN_CALIBRATORS,
    *(s for s in layout.SUBSET_SPECS.values() if s not in layout.MAIN_CALIBRATORS),
    *(layout.strength_spec(x) for x in layout.STRENGTHS if layout.strength_spec(x) not in layout.MAIN_CALIBRATORS),
)

#: the calibrators whose ECE the tables claim differences for (Tables 2/3 and 4): bootstrapped
BOOTSTRAP_SPECS: tuple[str, ...] = tuple(dict.fromkeys((*layout.MAIN_CALIBRATORS, *layout.SUBSET_SPECS.values())))


@dataclass(frozen=True)
class ReportOptions:
    """Knobs of `make tables` (defaults: the paper's settings, section 5 and TTABC)."""

    #: ECE bins (TTABC: 20 equal-width bins)
    n_bins: int = 20
    #: reliability-diagram bins (paper, Figure 4: 10, for visualisation only)
    reliability_bins: int = 10
    #: equal-frequency bins per sign subset of Figures 2c/2d
    gap_bins: int = 10
    #: dataset of Table 1, Figures 2c/2d and 4 (paper: ImageNet-A); another is picked when absent
    reference_dataset: str = layout.REFERENCE_DATASET
    #: the labelled source of temperature scaling (excluded when picking a substitute reference dataset)
    ts_source: str | None = "imagenet"


@dataclass
class Report:
    outputs: list[tuple[str, list[Path]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, title: str, paths: Sequence[Path]) -> None:
        self.outputs.append((title, list(paths)))


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _reference(present: Sequence[str], opts: ReportOptions) -> str | None:
    if opts.reference_dataset in present:
        return opts.reference_dataset
    ordered = [d for _, g in layout.order_datasets(present) for d in g]
    others = [d for d in ordered if d != opts.ts_source]
    return (others or ordered or [None])[0]


def write_report(
    summaries: Summaries,
    out: Path,
    boot: BootstrapResult | None = None,
    opts: ReportOptions = ReportOptions(),
    log: Callable[[str], None] = lambda s: None,
) -> Report:
    """Build and write every item; items without inputs are skipped with a one-line note."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(notes=list(summaries.notes))
    runs = list(summaries.runs.values())
    run_df = builders.run_metrics(runs, opts.n_bins)
    cells = builders.cell_metrics(run_df)
    reps = builders.CellReplicates(boot)
    rep.add("Metrics of every run and calibrator (fractions; the input of all tables)",
            [render.write_csv(run_df, out / "per_run_metrics.csv")])
    backbones = summaries.backbones()
    for bb in layout.BACKBONE_ORDER:
        if bb not in backbones:
            rep.notes.append(f"no {bb} shards: the paper's {bb} tables and figures are skipped")
    tta_methods = layout.order_methods(cells["method"].unique().to_list())

    # ---- Tables 2 and 3 ----------------------------------------------------------------------------------------
    for bb in backbones:
        s = slug(bb)
        main = builders.main_table(cells, bb, reps)
        caption = (f"Calibration of {bb}: accuracy and ECE (%) per TTA method and calibrator; best ECE per block "
                   "in bold; Avg. is the unweighted macro-average of each dataset group.")
        rep.add(f"Main table (Tables 2 and 3 layout), {bb}",
                render.write_item(out, f"main_{s}", main, render.main_markdown(main, f"Main table, {bb}"),
                                  render.main_latex(main, caption)))
        if boot is None:
            continue
        intervals = builders.main_intervals(cells, bb, reps)
        diffs = builders.main_differences(cells, bb, reps)
        n_ns = int(diffs["contains_zero"].sum()) if diffs.height else 0
        paths = render.write_item(
            out, f"main_{s}_ci", diffs,
            render.intervals_markdown(intervals, diffs, f"Bootstrap intervals, {bb}", boot.n_resamples, boot.level),
            render.intervals_latex(diffs, f"ECE differences ZAEC minus baseline (points), {bb}, with "
                                          f"{int(boot.level * 100)}% paired bootstrap intervals; "
                                          "† the interval contains zero."))
        paths.append(render.write_csv(intervals, out / f"main_{s}_ece_ci.csv"))
        rep.add(f"Bootstrap intervals of the main table, {bb} ({n_ns} of {diffs.height} differences not "
                "distinguishable from zero)", paths)
    if not tta_methods:
        rep.notes.append("main tables hold zero-shot rows only: no TTA method runs found")

    # ---- Table 1 / Appendix C ----------------------------------------------------------------------------------
    papd = builders.pa_pd_table(runs, opts.n_bins)
    if papd.height:
        cols_pa = {"backbone": "Backbone", "dataset": "Dataset", "method": "Method", "ratio": "Ratio (%)",
                   "delta_confidence": "ΔConf.", "delta_entropy": "ΔH", "delta_ece": "ΔECE"}
        cols_pd = {**cols_pa, "delta_accuracy": "ΔAcc."}
        fm = {"delta_confidence": lambda v: render.fmt(v, 2, True), "delta_entropy": lambda v: render.fmt(v, 3, True),
              "delta_ece": lambda v: render.fmt(v, 2, True), "delta_accuracy": lambda v: render.fmt(v, 2, True),
              "method": layout.method_label, "dataset": layout.dataset_label}
        pa, pdd = papd.filter(pl.col("subset") == "PA"), papd.filter(pl.col("subset") == "PD")
        md = ("# Table 1: prediction agreement (PA) and disagreement (PD)\n\n"
              "Changes are raw TTA minus zero-shot within each subset (confidence, accuracy and ECE in points, "
              "entropy in nats). Accuracy is unchanged within PA by construction.\n\n## PA subset\n\n"
              + render.simple_markdown(pa, cols_pa, fm)
              + "\n## PD subset (Appendix C)\n\n" + render.simple_markdown(pdd, cols_pd, fm))
        tex = (render.simple_latex(pa, cols_pa, fm, caption="Prediction-agreement (PA) subset: raw TTA minus "
                                   "zero-shot.", midrule_on="dataset")
               + render.simple_latex(pdd, cols_pd, fm, caption="Prediction-disagreement (PD) subset.",
                                     midrule_on="dataset"))
        rep.add("Table 1 and Appendix C: PA/PD subsets", render.write_item(out, "table1_pa_pd", papd, md, tex))
    else:
        rep.notes.append("Table 1 skipped: no TTA method runs")

    # ---- Figure 2a ---------------------------------------------------------------------------------------------
    rng = builders.range_deviation_points(cells)
    if rng.height:
        paths = [render.write_csv(rng, out / "fig2a_range_vs_ece.csv")]
        for bb in backbones:
            p = rng.filter((pl.col("backbone") == bb) & (pl.col("dataset") == "avg"))
            if p.height:
                paths.append(figures.plot_range_vs_ece(
                    p, out / f"fig2a_range_vs_ece_{slug(bb)}.png",
                    f"{bb}: logit-range deviation vs ECE (macro-average over datasets)"))
        rep.add("Figure 2a: logit-range deviation (eq. 8) vs ECE", paths)
    else:
        rep.notes.append("Figure 2a skipped: no TTA method runs")

    # ---- Figure 2b ---------------------------------------------------------------------------------------------
    pts = builders.entropy_ece_points(cells)
    if pts.height:
        corr = builders.correlations(pts)
        paths = [render.write_csv(pts, out / "fig2b_entropy_vs_ece.csv")]
        cc = {"backbone": "Backbone", "n": "n", "pearson_r": "Pearson r", "pearson_p": "p",
              "spearman_rho": "Spearman ρ", "spearman_p": "p (Spearman)"}
        pf = {"pearson_p": lambda v: render.fmt(v, 3) if v is None or v >= 1e-3 else f"{v:.1e}",
              "spearman_p": lambda v: render.fmt(v, 3) if v is None or v >= 1e-3 else f"{v:.1e}",
              "pearson_r": lambda v: render.fmt(v, 3), "spearman_rho": lambda v: render.fmt(v, 3)}
        paths += render.write_item(
            out, "fig2b_correlation", corr,
            "# Figure 2b: correlation of mean entropy change and ECE change\n\nOne point per dataset and method "
            "(raw TTA minus paired zero-shot); two-sided p-values.\n\n" + render.simple_markdown(corr, cc, pf),
            render.simple_latex(corr, cc, pf, caption="Correlation of mean normalised entropy change and ECE change "
                                "across dataset-method pairs."))
        by_bb = {r["backbone"]: r for r in corr.iter_rows(named=True)}
        for bb in backbones:
            p = pts.filter(pl.col("backbone") == bb)
            if p.height:
                paths.append(figures.plot_entropy_ece(p, by_bb.get(bb), out / f"fig2b_entropy_vs_ece_{slug(bb)}.png",
                                                      f"{bb}: entropy change vs ECE change"))
        rep.add("Figure 2b: mean entropy change vs ECE change, with correlations", paths)
    else:
        rep.notes.append("Figure 2b skipped: no TTA method runs with zero-shot pairs")

    # ---- Figures 2c/2d and 4 (reference dataset) ---------------------------------------------------------------
    gap_frames, paths2c, paths4 = [], [], []
    for bb in backbones:
        present = sorted({k.dataset for k in summaries.runs if k.backbone == bb and k.method != layout.ZERO_SHOT})
        ref = _reference(present, opts)
        if ref is None:
            rep.notes.append(f"Figures 2c/2d and 4 skipped for {bb}: no TTA method runs")
            continue
        if ref != opts.reference_dataset:
            rep.notes.append(f"{bb}: reference dataset {opts.reference_dataset!r} absent; Figures 2c/2d and 4 use "
                             f"{ref!r}")
        ref_runs = {}
        for s in sorted(summaries.select(backbone=bb, dataset=ref), key=lambda s: s.key.seed):
            if s.key.method != layout.ZERO_SHOT:
                ref_runs.setdefault(s.key.method, s)  # the lowest seed
        methods = layout.order_methods(ref_runs)
        g = pl.concat([builders.entropy_gap_bins(ref_runs[m], opts.gap_bins) for m in methods])
        gap_frames.append(g)
        paths2c.append(figures.plot_entropy_gap(g, out / f"fig2cd_entropy_gap_{slug(bb)}.png",
                                                f"{bb} on {ref}: confidence-accuracy gap per entropy bin"))
        cals = [c for c in ("none", "sals", "zaec") if all(c in ref_runs[m].calibrated for m in methods)]
        panels, eces = {}, {}
        for m in methods:
            s = ref_runs[m]
            for c in cals:
                panels[(c, m)] = figures.prepare_reliability(s.calibrated[c].confidence, s.tta_correct,
                                                             opts.reliability_bins)
                r = cells.filter((pl.col("backbone") == bb) & (pl.col("dataset") == ref) & (pl.col("method") == m)
                                 & (pl.col("calibrator") == c))
                if r.height:
                    eces[(c, m)] = float(r["ece"][0]) * 100.0
        paths4.append(figures.plot_reliability_grid(
            panels, methods, cals, out / f"fig4_reliability_{slug(bb)}.png",
            f"{bb} on {ref}: reliability ({opts.reliability_bins} bins; ECE with {opts.n_bins} bins)", eces))
    if gap_frames:
        paths2c.insert(0, render.write_csv(pl.concat(gap_frames), out / "fig2cd_entropy_gap.csv"))
        rep.add("Figures 2c/2d: confidence-accuracy gap by entropy-change bin", paths2c)
        rep.add("Figure 4: reliability diagrams (raw / SaLS / ZAEC by method)", paths4)

    # ---- Table 4 -----------------------------------------------------------------------------------------------
    frames, caption_sets = [], []
    for bb in backbones:
        present = cells.filter(pl.col("backbone") == bb)["dataset"].unique().to_list()
        datasets, preferred = builders.pick_datasets(present, layout.IMAGENET_FAMILY)
        t4 = builders.ablation_table(cells, bb, datasets, reps)
        if t4.height:
            frames.append(t4.with_columns(pl.lit(",".join(datasets)).alias("datasets")))
            caption_sets.append(f"{bb}: {', '.join(datasets)}" + ("" if preferred else " (no ImageNet-family data)"))
    if frames:
        t4 = pl.concat(frames)
        cols = {"backbone": "Backbone", "method": "Method", "subset": "Corrected subset", "ece": "ECE", "nll": "NLL"}
        fm = {"method": layout.method_label, "nll": lambda v: render.fmt(v, 3)}
        if boot is not None:
            t4 = t4.with_columns(
                pl.struct("ci_low", "ci_high").map_elements(
                    lambda r: f"[{render.fmt(r['ci_low'])}, {render.fmt(r['ci_high'])}]", return_dtype=pl.Utf8)
                .alias("_ci"),
                pl.struct("diff_zaec", "diff_ci_low", "diff_ci_high", "diff_contains_zero").map_elements(
                    lambda r: render.DASH if r["diff_zaec"] is None else
                    f"{render.fmt(r['diff_zaec'], signed=True)}{render.NS_MARK if r['diff_contains_zero'] else ''}"
                    f" [{render.fmt(r['diff_ci_low'], signed=True)}, {render.fmt(r['diff_ci_high'], signed=True)}]",
                    return_dtype=pl.Utf8).alias("_diff"))
            cols.update({"_ci": f"ECE {int(boot.level * 100)}% CI", "_diff": "ZAEC − row"})
        bold = {"ece": "bold_ece", "nll": "bold_nll"}
        text = "Macro-averages over " + "; ".join(caption_sets) + ". ECE in percent; best per method in bold."
        if boot is not None:
            text += (" Intervals: paired basic bootstrap (ZAEC − row: the ZAEC ECE minus this row's, points; "
                     "† the interval contains zero).")
        rep.add("Table 4: corrected-subset ablation", render.write_item(
            out, "table4_subset_ablation", t4.drop("_ci", "_diff", strict=False),
            "# Table 4: ablation of the corrected subset\n\n" + text + "\n\n"
            + render.simple_markdown(t4, cols, fm, bold),
            render.simple_latex(t4, cols, fm, bold, caption=text, midrule_on="method")))
    else:
        rep.notes.append("Table 4 skipped: no method has every subset variant on its datasets")

    # ---- Figure 5 ----------------------------------------------------------------------------------------------
    st = builders.strength_table(cells)
    if st.height:
        paths = [render.write_csv(st, out / "fig5_strength.csv")]
        for bb in backbones:
            p = st.filter(pl.col("backbone") == bb)
            if not p.height:
                continue
            datasets, preferred = builders.pick_datasets(p["dataset"].unique().to_list(), layout.STRENGTH_DATASETS)
            if not preferred:
                rep.notes.append(f"{bb}: Figure 5 datasets dtd/imagenet_v2 absent; showing every dataset")
            paths.append(figures.plot_strength(p, datasets, out / f"fig5_strength_{slug(bb)}.png",
                                               f"{bb}: ECE vs entropy-restoration strength"))
        rep.add("Figure 5: ECE vs restoration strength λ", paths)
    else:
        rep.notes.append("Figure 5 skipped: no TTA method runs")

    # ---- backbone summary (the paper's RN50 figure) -----------------------------------------------------------
    frames, paths = [], []
    for bb in backbones:
        present = cells.filter(pl.col("backbone") == bb)["dataset"].unique().to_list()
        datasets, preferred = builders.pick_datasets(present, layout.GROUPS["natural_shift"])
        sm = builders.backbone_summary(cells, bb, datasets)
        if not sm.height:
            rep.notes.append(f"summary figure skipped for {bb}: no method has every dataset")
            continue
        frames.append(sm.with_columns(pl.lit(",".join(datasets)).alias("datasets")))
        where = "natural-shift datasets" if preferred else "all datasets"
        paths.append(figures.plot_backbone_summary(sm, out / f"summary_{slug(bb)}.png",
                                                   f"{bb}: average ECE and mean entropy over {where}"))
    if frames:
        paths.insert(0, render.write_csv(pl.concat(frames), out / "summary.csv"))
        rep.add("Per-backbone summary: average ECE and mean entropy per calibrator (the paper's RN50 figure)", paths)

    write_index(out, rep, summaries, boot, opts)
    return rep


def write_index(
    out: Path, rep: Report, summaries: Summaries, boot: BootstrapResult | None, opts: ReportOptions
) -> Path:
    """results/README.md: what was read, the settings, and a link to every output."""
    keys = list(summaries.runs)
    lines = ["# Tables and figures\n",
             f"Generated by `zaec-calibrate tables` from {len(keys)} run(s): "
             f"{len({k.backbone for k in keys})} backbone(s), {len({k.dataset for k in keys})} dataset(s), "
             f"{len({k.method for k in keys})} method(s).\n",
             f"ECE: {opts.n_bins} equal-width bins (lo < conf <= hi). Accuracy, ECE and confidence in percent.",
             "Dataset groups follow the paper: natural shift (I-A, I-V, I-R, I-S; Table 2), ImageNet and the "
             "fine-grained sets (Table 3); any other dataset goes to `other`.\n"]
    if summaries.temperatures:
        lines.append("Temperature scaling, T fitted by NLL on: " + "; ".join(
            f"{src}: T = {t:.4g}" for src, t in sorted(summaries.temperatures.items())) + "\n")
    if boot is not None:
        lines.append(f"Uncertainty: paired bootstrap over samples, {boot.n_resamples} resamples, seed {boot.seed}, "
                     f"{int(boot.level * 100)}% basic (reverse-percentile) intervals.\n")
    else:
        lines.append("Uncertainty: bootstrap disabled (--bootstrap 0).\n")
    for title, paths in rep.outputs:
        links = ", ".join(f"[{p.name}]({p.name})" for p in paths)
        lines.append(f"- {title}: {links}")
        for p in paths:
            if p.suffix == ".png":
                lines.append(f"\n  ![{p.stem}]({p.name})\n")
    if rep.notes:
        lines.append("\n## Notes\n")
        lines += [f"- {n}" for n in rep.notes]
    return render.write_text(out / "README.md", "\n".join(lines) + "\n")
