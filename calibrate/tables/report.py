"""Write every table and figure of the paper (plus bootstrap intervals) from run summaries into one folder.

Items are named and numbered as the paper numbers them (Figure 1 the intro bars, 2a-2d, 3 the RN50 summary,
4 the Caltech101 boundary case, 5 the reliability diagrams, 6 the strength ablation; Tables 1-4), and the index
(`README.md`) lists them in the paper's order, each with its files or the reason it was skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import polars as pl

from calibrate.tables import builders, figures, layout, render
from calibrate.tables.bootstrap import BootstrapResult
from calibrate.tables.data import RunSummary, Summaries

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
    #: reliability-diagram bins (paper, Figures 4 and 5: 10, for visualisation only)
    reliability_bins: int = 10
    #: equal-frequency bins per sign subset of Figures 2c/2d
    gap_bins: int = 10
    #: dataset of Table 1's reference, Figures 2c/2d and 5 (paper: ImageNet-A); another is picked when absent
    reference_dataset: str = layout.REFERENCE_DATASET
    #: the labelled source of temperature scaling (excluded when picking a substitute reference dataset)
    ts_source: str | None = "imagenet"
    #: the temperature was fixed (--temperature), not fitted: no cell is scored on its own fitting data
    temperature_fixed: bool = False
    #: Figure 1's methods, one panel each (paper: TPT and TDA)
    fig1_methods: tuple[str, ...] = layout.FIG1_METHODS
    #: Figure 2b's pooled methods; None: every TTA method but the prompt-coupled calibration methods; ("all",): all
    fig2b_methods: tuple[str, ...] | None = None
    #: Figure 5's columns (paper: TPT, TDA and DPE); ("all",): every TTA method of the reference dataset
    fig5_methods: tuple[str, ...] = layout.FIG5_METHODS
    #: Figure 4's dataset and method (paper: Caltech101 and DPE), independent of `reference_dataset`
    boundary_dataset: str = layout.BOUNDARY_DATASET
    boundary_method: str = layout.BOUNDARY_METHOD


#: the index lists items in the paper's order (then anything else)
PAPER_ORDER: tuple[str, ...] = (
    "Figure 1", "Table 1", "Figure 2a", "Figure 2b", "Figures 2c/2d", "Figure 3", "Tables 2 and 3",
    "Tables 2 and 3, intervals", "Figure 4", "Figure 5", "Table 4", "Figure 6", "Per-run metrics",
)

#: what each figure shows, written under it in the index
CAPTIONS: dict[str, str] = {
    "Figure 1": "Grouped bars of the ECE (%) of raw TTA, TTA + SaLS and TTA + ZAEC on each dataset of the "
                "ImageNet and fine-grained group and their unweighted average, one panel per method (paper: TPT "
                "and TDA; `--fig1-methods`). An average over fewer datasets than the panel shows reads Avg. (n/m).",
    "Figure 2a": "Each point: a method's predictions after one calibrator, x the mean relative logit-range "
                 "deviation from the paired zero-shot logits (eq. 8, %), y the ECE (%); as the paper draws it, "
                 "TPT + SaLS, TPT + ZAEC (grey arrow: the same TPT predictions, SaLS to ZAEC), O-TPT and A-TPT "
                 "raw, averaged over the datasets all drawn points share. Every method and calibrator, per dataset "
                 "and averaged, is in fig2a_all_points.csv.",
    "Figure 2b": "One point per dataset and TTA method: mean normalised entropy change (eq. 10) vs ECE change, raw "
                 "TTA minus the paired zero-shot (points), least-squares line, Pearson and Spearman with two-sided "
                 "p-values; n and the pooled methods are in the title and the correlation CSV (default: every "
                 "method but the prompt-coupled calibration methods C-TPT, O-TPT, A-TPT; `--fig2b-methods`). The "
                 "points CSV holds every method, `pooled` marks those in the statistic.",
    "Figures 2c/2d": "Samples of one run per method on the reference dataset, split by the sign of the entropy "
                     "change and cut into equal-frequency bins: mean entropy change vs the change in confidence "
                     "minus the change in accuracy (points). The run plotted (lowest seed) is in the legend.",
    "Figure 3": "Average ECE (%) and mean entropy (nats) per method and calibrator over the natural-shift datasets, "
                "zero-shot first (the paper draws it for RN50; here for every backbone).",
    "Figure 4": "Boundary case: reliability diagrams of zero-shot CLIP, the raw method and method + ZAEC on one "
                "dataset (paper: DPE on Caltech101, where zero-shot CLIP is underconfident; "
                "`--boundary-dataset`, `--boundary-method`). ",
    "Figure 5": "Reliability diagrams on the reference dataset: rows raw TTA, TTA + SaLS, TTA + ZAEC; columns "
                "methods (paper: TPT, TDA, DPE; `--fig5-methods`), one run each (its seed in the column title). ",
    "Figure 6": "ECE (%) vs restoration strength λ ∈ {0, 0.25, 0.5, 0.75, 1} (λ = 0 is raw TTA, 1 is ZAEC), one "
                "panel per dataset (paper: DTD and ImageNet-V2), one line per method.",
}


@dataclass
class Item:
    """One paper item: its files, or the reason it was skipped, and notes about what it shows."""

    name: str
    what: str
    paths: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None


@dataclass
class Report:
    items: list[Item] = field(default_factory=list)
    #: notes not about one item (shards read, temperature scaling)
    general: list[str] = field(default_factory=list)

    def add(self, name: str, what: str, paths: Sequence[Path], notes: Sequence[str] = ()) -> None:
        self.items.append(Item(name, what, list(paths), list(notes)))

    def skip(self, name: str, what: str, reason: str, notes: Sequence[str] = ()) -> None:
        self.items.append(Item(name, what, [], list(notes), skipped=reason))

    def ordered(self) -> list[Item]:
        rank = {n: i for i, n in enumerate(PAPER_ORDER)}
        return sorted(self.items, key=lambda it: rank.get(it.name, len(rank)))

    @property
    def outputs(self) -> list[tuple[str, list[Path]]]:
        """(title, files) of every item written."""
        return [(f"{it.name}: {it.what}", it.paths) for it in self.ordered() if it.skipped is None]

    @property
    def notes(self) -> list[str]:
        """Every note for the reader: general ones, then each item's notes and skip reasons, in the paper's order."""
        out = list(self.general)
        for it in self.ordered():
            out += [f"{it.name}: {n}" for n in it.notes]
            if it.skipped is not None:
                out.append(f"{it.name} skipped: {it.skipped}")
        return out


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _reference(present: Sequence[str], opts: ReportOptions) -> str | None:
    if opts.reference_dataset in present:
        return opts.reference_dataset
    ordered = [d for _, g in layout.order_datasets(present) for d in g]
    others = [d for d in ordered if d != opts.ts_source]
    return (others or ordered or [None])[0]


def _lowest_seed(summaries: Summaries, backbone: str, dataset: str) -> dict[str, RunSummary]:
    """method -> its run with the lowest seed on (backbone, dataset): figures plot one run, never a seed mean."""
    runs: dict[str, RunSummary] = {}
    for s in sorted(summaries.select(backbone=backbone, dataset=dataset), key=lambda s: s.key.seed):
        if s.key.method != layout.ZERO_SHOT:
            runs.setdefault(s.key.method, s)
    return runs


def _methods_text(methods: Sequence[str]) -> str:
    return ", ".join(f"{layout.method_label(m)} ({m})" if layout.method_label(m) != m else m for m in methods)


def write_report(
    summaries: Summaries,
    out: Path,
    boot: BootstrapResult | None = None,
    opts: ReportOptions = ReportOptions(),
) -> Report:
    """Build and write every item; items without inputs are skipped with a one-line reason in the index."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(general=list(summaries.notes))
    runs = list(summaries.runs.values())
    run_df = builders.run_metrics(runs, opts.n_bins)
    cells = builders.cell_metrics(run_df)
    reps = builders.CellReplicates(boot)
    rep.add("Per-run metrics", "every run and calibrator, as fractions: the input of all tables",
            [render.write_csv(run_df, out / "per_run_metrics.csv")])
    backbones = summaries.backbones()
    for bb in layout.BACKBONE_ORDER:
        if bb not in backbones:
            rep.general.append(f"no {bb} shards: the paper's {bb} tables and figures are skipped")
    tta = cells.filter(pl.col("method") != layout.ZERO_SHOT)
    tta_methods = layout.order_methods(tta["method"].unique().to_list())
    no_tta = "no TTA method runs"
    ts_in_sample = None if opts.temperature_fixed else opts.ts_source

    # ---- Tables 2 and 3 ----------------------------------------------------------------------------------------
    main_paths, ci_paths, ci_notes = [], [], []
    for bb in backbones:
        s = slug(bb)
        main = builders.main_table(cells, bb, reps, ts_in_sample=ts_in_sample)
        caption = (f"Calibration of {bb}: accuracy and ECE (%) per TTA method and calibrator; best ECE per block "
                   "in bold; Avg. is the unweighted macro-average of each dataset group.")
        main_paths += render.write_item(out, f"main_{s}", main, render.main_markdown(main, f"Main table, {bb}"),
                                        render.main_latex(main, caption))
        if boot is None:
            continue
        intervals = builders.main_intervals(cells, bb, reps, ts_in_sample=ts_in_sample)
        diffs = builders.main_differences(cells, bb, reps)
        n_ns = int(diffs["contains_zero"].sum()) if diffs.height else 0
        ci_paths += render.write_item(
            out, f"main_{s}_ci", diffs,
            render.intervals_markdown(intervals, diffs, f"Bootstrap intervals, {bb}", boot.n_resamples, boot.level),
            render.intervals_latex(diffs, f"ECE differences ZAEC minus baseline (points), {bb}, with "
                                          f"{int(boot.level * 100)}% paired bootstrap intervals; "
                                          "† the interval contains zero."))
        ci_paths.append(render.write_csv(intervals, out / f"main_{s}_ece_ci.csv"))
        ci_notes.append(f"{bb}: {n_ns} of {diffs.height} differences not distinguishable from zero")
    rep.add("Tables 2 and 3", "accuracy and ECE per method and calibrator, datasets grouped as in the paper; "
            "‡ marks temperature scaling scored on its own fitting data, Avg. (n/m) an average over n of the group's "
            "m datasets",
            main_paths, [] if tta_methods else ["main tables hold zero-shot rows only: " + no_tta])
    if boot is not None:
        rep.add("Tables 2 and 3, intervals", "paired bootstrap intervals of every ECE and of ZAEC minus each "
                "baseline, beyond the paper", ci_paths, ci_notes)

    # ---- Table 1 / Appendix C ----------------------------------------------------------------------------------
    papd = builders.pa_pd_table(runs, opts.n_bins)
    what = "prediction agreement (PA) and disagreement (PD; Appendix C) subsets"
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
        rep.add("Table 1", what, render.write_item(out, "table1_pa_pd", papd, md, tex))
    else:
        rep.skip("Table 1", what, no_tta)

    # ---- Figure 1 ----------------------------------------------------------------------------------------------
    what = "ECE of raw TTA, SaLS and ZAEC per dataset of the fine-grained group"
    frames, paths, notes = [], [], []
    for bb in backbones:
        cb = tta.filter(pl.col("backbone") == bb)
        datasets, preferred = builders.pick_datasets(cb["dataset"].unique().to_list(),
                                                     layout.GROUPS.get("fine_grained", ()))
        have = set(cb["method"])
        absent = [m for m in opts.fig1_methods if m not in have]
        bars = builders.intro_bars(cells, bb, [m for m in opts.fig1_methods if m in have], datasets)
        if absent:
            notes.append(f"{bb}: no runs of {_methods_text(absent)}")
        if bars.is_empty():
            continue
        if not preferred:
            notes.append(f"{bb}: no dataset of the fine-grained group; every dataset shown")
        frames.append(bars)
        paths.append(figures.plot_intro(bars, out / f"fig1_intro_{slug(bb)}.png",
                                        f"{bb}: ECE of raw TTA, SaLS and ZAEC"))
    if frames:
        rep.add("Figure 1", what, [render.write_csv(pl.concat(frames), out / "fig1_intro.csv"), *paths], notes)
    else:
        rep.skip("Figure 1", what, f"no runs of {_methods_text(opts.fig1_methods)} (choose with --fig1-methods)"
                 if tta_methods else no_tta)

    # ---- Figure 2a ---------------------------------------------------------------------------------------------
    what = "mean relative logit-range deviation, eq. 8, vs ECE"
    allpts = builders.range_deviation_points(cells)
    if allpts.height:
        frames, paths, notes = [], [], []
        for bb in backbones:
            pts, missing = builders.range_figure_points(cells, bb)
            have = set(tta.filter(pl.col("backbone") == bb)["method"])
            gone = list(dict.fromkeys(m for m, _ in missing if m not in have))
            if gone:
                notes.append(f"{bb}: no runs of {_methods_text(gone)}; drawn without "
                             + ("its point" if len(gone) == 1 else "their points"))
            rest = [f"{layout.method_label(m)} + {layout.calibrator_label(c)}" for m, c in missing if m in have]
            if rest:
                notes.append(f"{bb}: no {', '.join(rest)} point(s)")
            if pts.is_empty():
                continue
            if pts["datasets"].n_unique() > 1:
                notes.append(f"{bb}: the drawn points share no dataset; each point averages its own datasets")
            frames.append(pts)
            paths.append(figures.plot_range_vs_ece(
                pts, out / f"fig2a_range_vs_ece_{slug(bb)}.png",
                f"{bb}: logit-range deviation vs ECE (mean over {pts['n_datasets'].max()} dataset(s))"))
        head = [render.write_csv(pl.concat(frames), out / "fig2a_range_vs_ece.csv")] if frames else []
        if not frames:
            notes.append("none of the paper's points (TPT + SaLS, TPT + ZAEC, O-TPT, A-TPT) has runs; every "
                         "other method's points are in fig2a_all_points.csv")
        rep.add("Figure 2a", what, [*head, *paths, render.write_csv(allpts, out / "fig2a_all_points.csv")], notes)
    else:
        rep.skip("Figure 2a", what, no_tta)

    # ---- Figure 2b ---------------------------------------------------------------------------------------------
    what = "mean entropy change vs ECE change per dataset-method, with correlations"
    pooled = builders.pooled_methods(tta_methods, opts.fig2b_methods)
    pts = builders.entropy_ece_points(cells, pooled)
    if pts.filter(pl.col("pooled")).height:
        notes = []
        if opts.fig2b_methods is not None and "all" not in opts.fig2b_methods:
            absent = [m for m in opts.fig2b_methods if m not in tta_methods]
            if absent:
                notes.append(f"no runs of {_methods_text(absent)}")
        left = [m for m in tta_methods if m not in pooled]
        if left:
            notes.append(f"pooled {_methods_text(pooled)}; not pooled: {_methods_text(left)} "
                         "(their points are in the CSV; choose with --fig2b-methods)")
        used = pts.filter(pl.col("pooled"))
        corr = builders.correlations(used)
        paths = [render.write_csv(pts, out / "fig2b_entropy_vs_ece.csv")]
        cc = {"backbone": "Backbone", "n": "n", "methods": "Methods", "pearson_r": "Pearson r", "pearson_p": "p",
              "spearman_rho": "Spearman ρ", "spearman_p": "p (Spearman)"}
        pf = {"pearson_p": lambda v: render.fmt(v, 3) if v is None or v >= 1e-3 else f"{v:.1e}",
              "spearman_p": lambda v: render.fmt(v, 3) if v is None or v >= 1e-3 else f"{v:.1e}",
              "pearson_r": lambda v: render.fmt(v, 3), "spearman_rho": lambda v: render.fmt(v, 3),
              "methods": lambda v: ", ".join(layout.method_label(m) for m in v.split(","))}
        paths += render.write_item(
            out, "fig2b_correlation", corr,
            "# Figure 2b: correlation of mean entropy change and ECE change\n\nOne point per dataset and method "
            "(raw TTA minus paired zero-shot); n points of the methods listed; two-sided p-values.\n\n"
            + render.simple_markdown(corr, cc, pf),
            render.simple_latex(corr, cc, pf, caption="Correlation of mean normalised entropy change and ECE change "
                                "across dataset-method pairs."))
        by_bb = {r["backbone"]: r for r in corr.iter_rows(named=True)}
        for bb in backbones:
            p = used.filter(pl.col("backbone") == bb)
            if p.height:
                paths.append(figures.plot_entropy_ece(p, by_bb.get(bb), out / f"fig2b_entropy_vs_ece_{slug(bb)}.png",
                                                      f"{bb}: entropy change vs ECE change"))
        rep.add("Figure 2b", what, paths, notes)
    else:
        rep.skip("Figure 2b", what, "no runs of the pooled methods with zero-shot pairs" if tta_methods else no_tta)

    # ---- Figures 2c/2d and 5 (reference dataset) ---------------------------------------------------------------
    gap_frames, rel_frames, paths2c, paths5, notes, notes5 = [], [], [], [], [], []
    for bb in backbones:
        present = sorted({k.dataset for k in summaries.runs if k.backbone == bb and k.method != layout.ZERO_SHOT})
        ref = _reference(present, opts)
        if ref is None:
            continue
        if ref != opts.reference_dataset:
            notes.append(f"{bb}: reference dataset {opts.reference_dataset!r} absent; Figures 2c/2d and 5 use "
                         f"{ref!r}")
        ref_runs = _lowest_seed(summaries, bb, ref)
        methods = layout.order_methods(ref_runs)
        g = pl.concat([builders.entropy_gap_bins(ref_runs[m], opts.gap_bins) for m in methods])
        gap_frames.append(g)
        paths2c.append(figures.plot_entropy_gap(
            g, out / f"fig2cd_entropy_gap_{slug(bb)}.png",
            f"{bb} on {ref}: confidence-accuracy gap per entropy bin (one run per method)"))
        if opts.fig5_methods == ("all",):
            methods5 = methods
        else:
            methods5 = [m for m in opts.fig5_methods if m in ref_runs]
            absent = [m for m in opts.fig5_methods if m not in ref_runs]
            if absent:
                notes5.append(f"{bb}: Figure 5 has no runs of {_methods_text(absent)} on {ref}")
        if not methods5:
            continue
        cals = [c for c in ("none", "sals", "zaec") if all(c in ref_runs[m].calibrated for m in methods5)]
        rel = pl.concat([builders.reliability_table(ref_runs[m], cals, opts.reliability_bins, opts.n_bins)
                         for m in methods5])
        rel_frames.append(rel)
        paths5.append(figures.plot_reliability_grid(
            rel, methods5, cals, out / f"fig5_reliability_{slug(bb)}.png",
            f"{bb} on {ref}: reliability ({opts.reliability_bins} bins; ECE of each panel, {opts.n_bins} bins)"))
    what2c, what5 = ("confidence-accuracy gap by entropy-change bin",
                     "reliability diagrams, rows raw / SaLS / ZAEC, columns methods")
    if gap_frames:
        rep.add("Figures 2c/2d", what2c,
                [render.write_csv(pl.concat(gap_frames), out / "fig2cd_entropy_gap.csv"), *paths2c], notes)
        if rel_frames:
            rep.add("Figure 5", what5, [render.write_csv(pl.concat(rel_frames), out / "fig5_reliability.csv"),
                                        *paths5], notes + notes5)
        else:
            rep.skip("Figure 5", what5, f"no runs of {_methods_text(opts.fig5_methods)} on the reference dataset "
                     "(choose with --fig5-methods, or 'all')")
    else:
        rep.skip("Figures 2c/2d", what2c, no_tta)
        rep.skip("Figure 5", what5, no_tta)

    # ---- Figure 4: the boundary case ---------------------------------------------------------------------------
    what = f"boundary case, zero-shot / raw / ZAEC reliability of {opts.boundary_method} on {opts.boundary_dataset}"
    frames, paths, notes = [], [], []
    for bb in backbones:
        s = _lowest_seed(summaries, bb, opts.boundary_dataset).get(opts.boundary_method)
        if s is None:
            notes.append(f"{bb}: no {opts.boundary_method} runs on {opts.boundary_dataset}")
            continue
        t = builders.reliability_table(s, [layout.ZERO_SHOT, "none", "zaec"], opts.reliability_bins, opts.n_bins)
        frames.append(t)
        paths.append(figures.plot_boundary(
            t, out / f"fig4_boundary_{slug(opts.boundary_dataset)}_{slug(bb)}.png",
            f"{bb} on {opts.boundary_dataset}: {layout.method_label(opts.boundary_method)}, seed {s.key.seed} "
            f"({len(s)} samples; ECE of each panel, {opts.n_bins} bins)"))
    if frames:
        rep.add("Figure 4", what, [render.write_csv(pl.concat(frames), out / "fig4_boundary.csv"), *paths], notes)
    else:
        rep.skip("Figure 4", what, f"no {opts.boundary_method} runs on {opts.boundary_dataset} (choose with "
                 "--boundary-dataset and --boundary-method)")

    # ---- Table 4 -----------------------------------------------------------------------------------------------
    frames, caption_sets = [], []
    for bb in backbones:
        present = cells.filter(pl.col("backbone") == bb)["dataset"].unique().to_list()
        datasets, preferred = builders.pick_datasets(present, layout.IMAGENET_FAMILY)
        t4 = builders.ablation_table(cells, bb, datasets, reps)
        if t4.height:
            frames.append(t4.with_columns(pl.lit(",".join(datasets)).alias("datasets")))
            caption_sets.append(f"{bb}: {', '.join(datasets)}" + ("" if preferred else " (no ImageNet-family data)"))
    what = "ablation of the corrected subset, ECE and NLL"
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
        rep.add("Table 4", what, render.write_item(
            out, "table4_subset_ablation", t4.drop("_ci", "_diff", strict=False),
            "# Table 4: ablation of the corrected subset\n\n" + text + "\n\n"
            + render.simple_markdown(t4, cols, fm, bold),
            render.simple_latex(t4, cols, fm, bold, caption=text, midrule_on="method")))
    else:
        rep.skip("Table 4", what, "no method has every subset variant on its datasets" if tta_methods else no_tta)

    # ---- Figure 6 ----------------------------------------------------------------------------------------------
    what = "ECE vs entropy-restoration strength λ"
    st = builders.strength_table(cells)
    if st.height:
        paths, notes = [render.write_csv(st, out / "fig6_strength.csv")], []
        for bb in backbones:
            p = st.filter(pl.col("backbone") == bb)
            if not p.height:
                continue
            datasets, preferred = builders.pick_datasets(p["dataset"].unique().to_list(), layout.STRENGTH_DATASETS)
            if not preferred:
                notes.append(f"{bb}: the paper's datasets dtd/imagenet_v2 absent; every dataset shown")
            paths.append(figures.plot_strength(p, datasets, out / f"fig6_strength_{slug(bb)}.png",
                                               f"{bb}: ECE vs entropy-restoration strength"))
        rep.add("Figure 6", what, paths, notes)
    else:
        rep.skip("Figure 6", what, no_tta)

    # ---- Figure 3 (the paper's RN50 figure, for every backbone) ------------------------------------------------
    what = "average ECE and mean entropy per method and calibrator, the paper's RN50 figure for every backbone"
    frames, paths, notes = [], [], []
    for bb in backbones:
        present = cells.filter(pl.col("backbone") == bb)["dataset"].unique().to_list()
        datasets, preferred = builders.pick_datasets(present, layout.GROUPS["natural_shift"])
        sm = builders.backbone_summary(cells, bb, datasets)
        if not sm.height:
            notes.append(f"{bb}: no method has every dataset")
            continue
        frames.append(sm.with_columns(pl.lit(",".join(datasets)).alias("datasets")))
        where = "natural-shift datasets" if preferred else "all datasets"
        paths.append(figures.plot_backbone_summary(sm, out / f"fig3_summary_{slug(bb)}.png",
                                                   f"{bb}: average ECE and mean entropy over {where}"))
    if frames:
        rep.add("Figure 3", what, [render.write_csv(pl.concat(frames), out / "fig3_summary.csv"), *paths], notes)
    else:
        rep.skip("Figure 3", what, "; ".join(notes) if tta_methods else no_tta)

    write_index(out, rep, summaries, boot, opts)
    return rep


def write_index(
    out: Path, rep: Report, summaries: Summaries, boot: BootstrapResult | None, opts: ReportOptions
) -> Path:
    """results/README.md: what was read, the settings, and every paper item in the paper's order with its files (or
    why it was skipped), its caption and its notes."""
    keys = list(summaries.runs)
    lines = ["# Tables and figures\n",
             f"Generated by `zaec-calibrate tables` from {len(keys)} run(s): "
             f"{len({k.backbone for k in keys})} backbone(s), {len({k.dataset for k in keys})} dataset(s), "
             f"{len({k.method for k in keys})} method(s).\n",
             f"ECE: {opts.n_bins} equal-width bins (lo < conf <= hi). Accuracy, ECE and confidence in percent.",
             "Dataset groups follow the paper: natural shift (I-A, I-V, I-R, I-S; Table 2), ImageNet and the "
             "fine-grained sets (Table 3); any other dataset goes to `other`. Items are numbered as in the paper.\n"]
    if summaries.temperatures:
        lines.append("Temperature scaling, T fitted by NLL on: " + "; ".join(
            f"{src}: T = {t:.4g}" for src, t in sorted(summaries.temperatures.items())) + "\n")
    if boot is not None:
        lines.append(f"Uncertainty: paired bootstrap over samples, {boot.n_resamples} resamples, seed {boot.seed}, "
                     f"{int(boot.level * 100)}% basic (reverse-percentile) intervals.\n")
    else:
        lines.append("Uncertainty: bootstrap disabled (--bootstrap 0).\n")
    lines.append("## Paper items\n")
    for it in rep.ordered():
        if it.skipped is not None:
            lines.append(f"- **{it.name}**: {it.what}. Skipped: {it.skipped}")
        else:
            links = ", ".join(f"[{p.name}]({p.name})" for p in it.paths)
            lines.append(f"- **{it.name}**: {it.what}. Files: {links}")
            caption = CAPTIONS.get(it.name, "")
            if it.name in ("Figure 4", "Figure 5"):
                caption += figures.RELIABILITY_KEY
            if caption:
                lines.append(f"\n  {caption}")
        lines += [f"  - note: {n}" for n in it.notes]
        for p in it.paths:
            if p.suffix == ".png":
                lines.append(f"\n  ![{p.stem}]({p.name})\n")
    if rep.general:
        lines.append("\n## Notes\n")
        lines += [f"- {n}" for n in rep.general]
    return render.write_text(out / "README.md", "\n".join(lines) + "\n")
