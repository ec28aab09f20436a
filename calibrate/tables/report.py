"""Write every table and figure of the paper (plus bootstrap intervals) from run summaries into one folder.

Items are named and numbered as the paper numbers them (Figure 1 the intro bars, 2a-2d, 3 the RN50 summary,
4 the Caltech101 boundary case, 5 the reliability diagrams, 6 the strength ablation; Tables 1-4), and the index
(`README.md`) lists them in the paper's order, each with its files or the reason it was skipped.

Each item is built by one builder function `(Context) -> Item | None` registered in `BUILDERS`; the list's order
is the index's order. `write_report` computes the shared inputs once (`prepare`: per-run metrics, cells, bootstrap
replicates), runs every builder and writes the index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import polars as pl

from calibrate.tables import builders, figures, layout, ood_tables, render, trust_tables
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


@dataclass
class Item:
    """One paper item: its files, or the reason it was skipped, notes about what it shows, and the caption written
    under it in the index (written items only)."""

    name: str
    what: str
    paths: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None
    caption: str = ""
    #: not an item of the paper: listed after the paper's items, under a heading that says so
    beyond_paper: bool = False


def written(name: str, what: str, paths: Sequence[Path], notes: Sequence[str] = (), caption: str = "",
            beyond_paper: bool = False) -> Item:
    """The index entry of an item whose files were written."""
    return Item(name, what, list(paths), list(notes), caption=caption, beyond_paper=beyond_paper)


def skipped(name: str, what: str, reason: str, notes: Sequence[str] = (), beyond_paper: bool = False) -> Item:
    """The index entry of an item that was not written, with the one-line reason."""
    return Item(name, what, [], list(notes), skipped=reason, beyond_paper=beyond_paper)


@dataclass
class Report:
    #: the items in the order of `BUILDERS` (the paper's order), then anything a builder added after them
    items: list[Item] = field(default_factory=list)
    #: notes not about one item (shards read, temperature scaling)
    general: list[str] = field(default_factory=list)

    def add(self, name: str, what: str, paths: Sequence[Path], notes: Sequence[str] = ()) -> None:
        self.items.append(written(name, what, paths, notes))

    def skip(self, name: str, what: str, reason: str, notes: Sequence[str] = ()) -> None:
        self.items.append(skipped(name, what, reason, notes))

    def ordered(self) -> list[Item]:
        """The items in the index's order: the order their builders run in."""
        return list(self.items)

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


#: the skip reason of every item that needs adapted (non-zero-shot) runs
NO_TTA = "no TTA method runs"


@dataclass(frozen=True)
class Context:
    """What every builder reads: the inputs of `write_report` and the tables computed once from them."""

    summaries: Summaries
    out: Path
    boot: BootstrapResult | None
    opts: ReportOptions
    runs: list[RunSummary]
    #: one row per run and calibrator (`builders.run_metrics`), fractions
    run_df: pl.DataFrame
    #: the runs' metrics averaged over seeds (`builders.cell_metrics`)
    cells: pl.DataFrame
    reps: builders.CellReplicates
    backbones: list[str]
    #: the cells of TTA methods (no zero-shot) and those methods, in the paper's order
    tta: pl.DataFrame
    tta_methods: list[str]
    #: the OOD runs (`RunSummary.ood_for`), kept out of `summaries`, `runs` and every item but the OOD table
    ood_runs: list[RunSummary] = field(default_factory=list)

    @property
    def ts_in_sample(self) -> str | None:
        """The dataset temperature scaling was fitted on (its cells are scored on their own fitting data)."""
        return None if self.opts.temperature_fixed else self.opts.ts_source


def prepare(summaries: Summaries, out: Path, boot: BootstrapResult | None, opts: ReportOptions) -> Context:
    """Create `out` and compute what several builders share: per-run metrics, cells, bootstrap replicates."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ood_runs = [s for s in summaries.runs.values() if s.ood_for]
    if ood_runs:  # their label -1 rows are no class: the paper's items and the trust table never see them
        summaries = Summaries({k: s for k, s in summaries.runs.items() if not s.ood_for}, summaries.temperatures,
                              summaries.notes)
    runs = list(summaries.runs.values())
    run_df = builders.run_metrics(runs, opts.n_bins)
    cells = builders.cell_metrics(run_df)
    tta = cells.filter(pl.col("method") != layout.ZERO_SHOT)
    return Context(summaries, out, boot, opts, runs, run_df, cells, builders.CellReplicates(boot),
                   summaries.backbones(), tta, layout.order_methods(tta["method"].unique().to_list()), ood_runs)


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


# ---------------------------------------------------------------------------------------------------------------
# Builders: one per index item, each `(Context) -> Item | None` (None: no entry at all). They run in the order of
# `BUILDERS`, which is also the order of the index.
# ---------------------------------------------------------------------------------------------------------------


def figure_1(ctx: Context) -> Item:
    """Figure 1: grouped ECE bars of raw TTA, SaLS and ZAEC on the fine-grained group, one panel per method."""
    opts, cells, out = ctx.opts, ctx.cells, ctx.out
    what = "ECE of raw TTA, SaLS and ZAEC per dataset of the fine-grained group"
    frames, paths, notes = [], [], []
    for bb in ctx.backbones:
        cb = ctx.tta.filter(pl.col("backbone") == bb)
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
        caption = ("Grouped bars of the ECE (%) of raw TTA, TTA + SaLS and TTA + ZAEC on each dataset of the "
                   "ImageNet and fine-grained group and their unweighted average, one panel per method (paper: TPT "
                   "and TDA; `--fig1-methods`). An average over fewer datasets than the panel shows reads Avg. "
                   "(n/m).")
        return written("Figure 1", what, [render.write_csv(pl.concat(frames), out / "fig1_intro.csv"), *paths],
                       notes, caption)
    return skipped("Figure 1", what, f"no runs of {_methods_text(opts.fig1_methods)} (choose with --fig1-methods)"
                   if ctx.tta_methods else NO_TTA)


_TABLE1_COLUMNS = {"backbone": "Backbone", "dataset": "Dataset", "_label": "Method", "ratio": "Ratio (%)",
                   "delta_confidence": "ΔConf.", "delta_entropy": "ΔH", "delta_ece": "ΔECE"}
_TABLE1_FORMATS = {"delta_confidence": lambda v: render.fmt(v, 2, True),
                   "delta_entropy": lambda v: render.fmt(v, 3, True),
                   "delta_ece": lambda v: render.fmt(v, 2, True), "delta_accuracy": lambda v: render.fmt(v, 2, True),
                   "method": layout.method_label, "dataset": layout.dataset_label}


def table_1(ctx: Context) -> Item:
    """Table 1 and Appendix C: raw TTA minus zero-shot within the prediction agreement / disagreement subsets."""
    papd = builders.pa_pd_table(ctx.runs, ctx.opts.n_bins)
    what = "prediction agreement (PA) and disagreement (PD; Appendix C) subsets"
    if not papd.height:
        return skipped("Table 1", what, NO_TTA)
    cols_pa, fm = _TABLE1_COLUMNS, _TABLE1_FORMATS
    cols_pd = {**cols_pa, "delta_accuracy": "ΔAcc."}
    shown = render.with_partial_label(papd)
    pa, pdd = shown.filter(pl.col("subset") == "PA"), shown.filter(pl.col("subset") == "PD")
    legend = render.partial_legend(shown, label="_label")
    md = ("# Table 1: prediction agreement (PA) and disagreement (PD)\n\n"
          "Changes are raw TTA minus zero-shot within each subset (confidence, accuracy and ECE in points, "
          "entropy in nats). Accuracy is unchanged within PA by construction." + (f" {legend}" if legend else "")
          + "\n\n## PA subset\n\n"
          + render.simple_markdown(pa, cols_pa, fm)
          + "\n## PD subset (Appendix C)\n\n" + render.simple_markdown(pdd, cols_pd, fm))
    tex = (render.simple_latex(pa, cols_pa, fm, caption="Prediction-agreement (PA) subset: raw TTA minus "
                               "zero-shot." + (f" {legend}" if legend else ""), midrule_on="dataset")
           + render.simple_latex(pdd, cols_pd, fm, caption="Prediction-disagreement (PD) subset.",
                                 midrule_on="dataset"))
    return written("Table 1", what, render.write_item(ctx.out, "table1_pa_pd", papd, md, tex))


def figure_2a(ctx: Context) -> Item:
    """Figure 2a: mean relative logit-range deviation (eq. 8) vs ECE, the paper's points and every other one."""
    cells, out = ctx.cells, ctx.out
    what = "mean relative logit-range deviation, eq. 8, vs ECE"
    allpts = builders.range_deviation_points(cells)
    if not allpts.height:
        return skipped("Figure 2a", what, NO_TTA)
    frames, paths, notes = [], [], []
    for bb in ctx.backbones:
        pts, missing = builders.range_figure_points(cells, bb)
        have = set(ctx.tta.filter(pl.col("backbone") == bb)["method"])
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
    caption = ("Each point: a method's predictions after one calibrator, x the mean relative logit-range "
               "deviation from the paired zero-shot logits (eq. 8, %), y the ECE (%); as the paper draws it, "
               "TPT + SaLS, TPT + ZAEC (grey arrow: the same TPT predictions, SaLS to ZAEC), O-TPT and A-TPT "
               "raw, averaged over the datasets all drawn points share. Every method and calibrator, per dataset "
               "and averaged, is in fig2a_all_points.csv.")
    return written("Figure 2a", what, [*head, *paths, render.write_csv(allpts, out / "fig2a_all_points.csv")],
                   notes, caption)


def _p_value(v: float | None) -> str:
    return render.fmt(v, 3) if v is None or v >= 1e-3 else f"{v:.1e}"


_CORRELATION_COLUMNS = {"backbone": "Backbone", "n": "n", "methods": "Methods", "pearson_r": "Pearson r",
                        "pearson_p": "p", "spearman_rho": "Spearman ρ", "spearman_p": "p (Spearman)"}
_CORRELATION_FORMATS = {"pearson_p": _p_value, "spearman_p": _p_value,
                        "pearson_r": lambda v: render.fmt(v, 3), "spearman_rho": lambda v: render.fmt(v, 3),
                        "methods": lambda v: ", ".join(layout.method_label(m) for m in v.split(","))}


def figure_2b(ctx: Context) -> Item:
    """Figure 2b: mean entropy change vs ECE change per dataset and method, with Pearson and Spearman."""
    opts, out, tta_methods = ctx.opts, ctx.out, ctx.tta_methods
    what = "mean entropy change vs ECE change per dataset-method, with correlations"
    pooled = builders.pooled_methods(tta_methods, opts.fig2b_methods)
    pts = builders.entropy_ece_points(ctx.cells, pooled)
    if not pts.filter(pl.col("pooled")).height:
        return skipped("Figure 2b", what,
                       "no runs of the pooled methods with zero-shot pairs" if tta_methods else NO_TTA)
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
    cc, pf = _CORRELATION_COLUMNS, _CORRELATION_FORMATS
    paths += render.write_item(
        out, "fig2b_correlation", corr,
        "# Figure 2b: correlation of mean entropy change and ECE change\n\nOne point per dataset and method "
        "(raw TTA minus paired zero-shot); n points of the methods listed; two-sided p-values.\n\n"
        + render.simple_markdown(corr, cc, pf),
        render.simple_latex(corr, cc, pf, caption="Correlation of mean normalised entropy change and ECE change "
                            "across dataset-method pairs."))
    by_bb = {r["backbone"]: r for r in corr.iter_rows(named=True)}
    for bb in ctx.backbones:
        p = used.filter(pl.col("backbone") == bb)
        if p.height:
            paths.append(figures.plot_entropy_ece(p, by_bb.get(bb), out / f"fig2b_entropy_vs_ece_{slug(bb)}.png",
                                                  f"{bb}: entropy change vs ECE change"))
    caption = ("One point per dataset and TTA method: mean normalised entropy change (eq. 10) vs ECE change, raw "
               "TTA minus the paired zero-shot (points), least-squares line, Pearson and Spearman with two-sided "
               "p-values; n and the pooled methods are in the title and the correlation CSV (default: every "
               "method but the prompt-coupled calibration methods C-TPT, O-TPT, A-TPT; `--fig2b-methods`). The "
               "points CSV holds every method, `pooled` marks those in the statistic.")
    return written("Figure 2b", what, paths, notes, caption)


def _reference_runs(ctx: Context, drawn_by: str) -> tuple[list[tuple[str, str, dict[str, RunSummary]]], list[str]]:
    """(backbone, reference dataset, method -> its lowest-seed run there) per backbone with TTA runs, and the notes
    on substituted reference datasets, naming the item that draws them (`drawn_by`: "Figure 5 uses"): the runs
    Figures 2c/2d and 5 and the risk-coverage figure draw."""
    refs, notes = [], []
    for bb in ctx.backbones:
        present = sorted({k.dataset for k in ctx.summaries.runs if k.backbone == bb and k.method != layout.ZERO_SHOT})
        ref = _reference(present, ctx.opts)
        if ref is None:
            continue
        if ref != ctx.opts.reference_dataset:
            notes.append(f"{bb}: reference dataset {ctx.opts.reference_dataset!r} absent; {drawn_by} {ref!r}")
        refs.append((bb, ref, _lowest_seed(ctx.summaries, bb, ref)))
    return refs, notes


def figures_2cd(ctx: Context) -> Item:
    """Figures 2c/2d: confidence-accuracy gap by entropy-change bin, one run per method on the reference dataset."""
    what = "confidence-accuracy gap by entropy-change bin"
    refs, notes = _reference_runs(ctx, "Figures 2c/2d use")
    if not refs:
        return skipped("Figures 2c/2d", what, NO_TTA)
    frames, paths = [], []
    for bb, ref, ref_runs in refs:
        g = pl.concat([builders.entropy_gap_bins(ref_runs[m], ctx.opts.gap_bins)
                       for m in layout.order_methods(ref_runs)])
        frames.append(g)
        paths.append(figures.plot_entropy_gap(
            g, ctx.out / f"fig2cd_entropy_gap_{slug(bb)}.png",
            f"{bb} on {ref}: confidence-accuracy gap per entropy bin (one run per method)"))
    caption = ("Samples of one run per method on the reference dataset, split by the sign of the entropy "
               "change and cut into equal-frequency bins: mean entropy change vs the change in confidence "
               "minus the change in accuracy (points). The run plotted (lowest seed) is in the legend.")
    return written("Figures 2c/2d", what,
                   [render.write_csv(pl.concat(frames), ctx.out / "fig2cd_entropy_gap.csv"), *paths], notes, caption)


def _in_sample_caption(frames: Sequence[pl.DataFrame], what: str) -> str:
    """The caption's sentence on ‡ when a figure's frames (column `in_sample`) draw in-sample temperature scaling."""
    if not any(f["in_sample"].any() for f in frames):
        return ""
    return (f" {render.IN_SAMPLE_MARK} after Temp. Scal. in the legend (CSV column `in_sample`): {what} "
            "(`--ts-source`), scored in-sample.")


def figure_3(ctx: Context) -> Item:
    """Figure 3 (the paper's RN50 figure, for every backbone): average ECE and mean entropy per method."""
    cells, out = ctx.cells, ctx.out
    what = "average ECE and mean entropy per method and calibrator, the paper's RN50 figure for every backbone"
    frames, paths, notes = [], [], []
    for bb in ctx.backbones:
        present = cells.filter(pl.col("backbone") == bb)["dataset"].unique().to_list()
        datasets, preferred = builders.pick_datasets(present, layout.GROUPS["natural_shift"])
        sm = builders.backbone_summary(cells, bb, datasets, ts_in_sample=ctx.ts_in_sample)
        gone = builders.summary_left_out(cells, bb, datasets, sm)
        if gone.height:
            notes.append(f"{bb}: {gone.height} of {gone.height + sm['method'].n_unique()} method(s) left out, "
                         f"each without runs on a dataset the bars average ({', '.join(datasets)}): " + "; ".join(
                             f"{layout.method_label(r['method'])} (no {r['missing'].replace(',', ', ')})"
                             for r in gone.iter_rows(named=True)))
        if not sm.height:
            notes.append(f"{bb}: no method has every dataset")
            continue
        frames.append(sm.with_columns(pl.lit(",".join(datasets)).alias("datasets")))
        if sm["in_sample"].any():
            notes.append(f"{bb}: the Temp. Scal. bars ({render.IN_SAMPLE_MARK}) average over {ctx.ts_in_sample}, "
                         "the labelled set T was fitted on, so they are partly scored on their own fitting data")
        where = "natural-shift datasets" if preferred else "all datasets"
        title = f"{bb}: average ECE and mean entropy over {where}" + (
            f"\nleft out, without runs on every dataset: {', '.join(layout.method_label(m) for m in gone['method'])}"
            if gone.height else "")
        paths.append(figures.plot_backbone_summary(sm, out / f"fig3_summary_{slug(bb)}.png", title))
    if frames:
        caption = ("Average ECE (%) and mean entropy (nats) per method and calibrator over the natural-shift "
                   "datasets, zero-shot first (the paper draws it for RN50; here for every backbone). Every bar "
                   "averages the same datasets: a method without runs on one of them is left out, named with the "
                   "datasets it lacks in the notes below.")
        caption += _in_sample_caption(frames, "its average includes the dataset its T was fitted on")
        return written("Figure 3", what, [render.write_csv(pl.concat(frames), out / "fig3_summary.csv"), *paths],
                       notes, caption)
    return skipped("Figure 3", what, "; ".join(notes) if ctx.tta_methods else NO_TTA)


def tables_2_3(ctx: Context) -> Item:
    """Tables 2 and 3: accuracy and ECE per method and calibrator, one table per backbone."""
    paths = []
    for bb in ctx.backbones:
        main = builders.main_table(ctx.cells, bb, ctx.reps, ts_in_sample=ctx.ts_in_sample)
        caption = (f"Calibration of {bb}: accuracy and ECE (%) per TTA method and calibrator; best ECE per block "
                   "in bold, never an in-sample cell; Avg. is the unweighted macro-average of each dataset group.")
        paths += render.write_item(ctx.out, f"main_{slug(bb)}", main, render.main_markdown(main, f"Main table, {bb}"),
                                   render.main_latex(main, caption))
    return written("Tables 2 and 3", "accuracy and ECE per method and calibrator, datasets grouped as in the paper; "
                   "‡ marks temperature scaling scored on its own fitting data (never bold), Avg. (n/m) an average "
                   "over n of the group's m datasets",
                   paths, [] if ctx.tta_methods else ["main tables hold zero-shot rows only: " + NO_TTA])


def tables_2_3_intervals(ctx: Context) -> Item | None:
    """Paired bootstrap intervals of every ECE of Tables 2 and 3 and of ZAEC minus each baseline (no entry without
    a bootstrap)."""
    boot, out = ctx.boot, ctx.out
    if boot is None:
        return None
    paths, notes = [], []
    for bb in ctx.backbones:
        s = slug(bb)
        intervals = builders.main_intervals(ctx.cells, bb, ctx.reps, ts_in_sample=ctx.ts_in_sample)
        diffs = builders.main_differences(ctx.cells, bb, ctx.reps, ts_in_sample=ctx.ts_in_sample)
        n_ns = int(diffs["contains_zero"].sum()) if diffs.height else 0
        paths += render.write_item(
            out, f"main_{s}_ci", diffs,
            render.intervals_markdown(intervals, diffs, f"Bootstrap intervals, {bb}", boot.n_resamples, boot.level),
            render.intervals_latex(diffs, f"ECE differences ZAEC minus baseline (points), {bb}, with "
                                          f"{int(boot.level * 100)}% paired bootstrap intervals; "
                                          "† the interval contains zero."))
        paths.append(render.write_csv(intervals, out / f"main_{s}_ece_ci.csv"))
        notes.append(f"{bb}: {n_ns} of {diffs.height} differences not distinguishable from zero")
    return written("Tables 2 and 3, intervals", "paired bootstrap intervals of every ECE and of ZAEC minus each "
                   "baseline, beyond the paper", paths, notes)


def figure_4(ctx: Context) -> Item:
    """Figure 4, the boundary case: zero-shot / raw / ZAEC reliability of one method on one dataset."""
    opts, out = ctx.opts, ctx.out
    what = f"boundary case, zero-shot / raw / ZAEC reliability of {opts.boundary_method} on {opts.boundary_dataset}"
    frames, paths, notes = [], [], []
    for bb in ctx.backbones:
        s = _lowest_seed(ctx.summaries, bb, opts.boundary_dataset).get(opts.boundary_method)
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
        caption = ("Boundary case: reliability diagrams of zero-shot CLIP, the raw method and method + ZAEC on one "
                   "dataset (paper: DPE on Caltech101, where zero-shot CLIP is underconfident; "
                   "`--boundary-dataset`, `--boundary-method`). " + figures.RELIABILITY_KEY)
        return written("Figure 4", what, [render.write_csv(pl.concat(frames), out / "fig4_boundary.csv"), *paths],
                       notes, caption)
    return skipped("Figure 4", what, f"no {opts.boundary_method} runs on {opts.boundary_dataset} (choose with "
                   "--boundary-dataset and --boundary-method)")


def figure_5(ctx: Context) -> Item:
    """Figure 5: reliability diagrams on the reference dataset, rows raw / SaLS / ZAEC, columns methods."""
    opts, out = ctx.opts, ctx.out
    what = "reliability diagrams, rows raw / SaLS / ZAEC, columns methods"
    refs, notes = _reference_runs(ctx, "Figure 5 uses")
    if not refs:
        return skipped("Figure 5", what, NO_TTA)
    frames, paths = [], []
    for bb, ref, ref_runs in refs:
        if opts.fig5_methods == ("all",):
            methods = layout.order_methods(ref_runs)
        else:
            methods = [m for m in opts.fig5_methods if m in ref_runs]
            absent = [m for m in opts.fig5_methods if m not in ref_runs]
            if absent:
                notes.append(f"{bb}: Figure 5 has no runs of {_methods_text(absent)} on {ref}")
        if not methods:
            continue
        cals = [c for c in ("none", "sals", "zaec") if all(c in ref_runs[m].calibrated for m in methods)]
        rel = pl.concat([builders.reliability_table(ref_runs[m], cals, opts.reliability_bins, opts.n_bins)
                         for m in methods])
        frames.append(rel)
        paths.append(figures.plot_reliability_grid(
            rel, methods, cals, out / f"fig5_reliability_{slug(bb)}.png",
            f"{bb} on {ref}: reliability ({opts.reliability_bins} bins; ECE of each panel, {opts.n_bins} bins)"))
    if not frames:
        return skipped("Figure 5", what, f"no runs of {_methods_text(opts.fig5_methods)} on the reference dataset "
                       "(choose with --fig5-methods, or 'all')")
    caption = ("Reliability diagrams on the reference dataset: rows raw TTA, TTA + SaLS, TTA + ZAEC; columns "
               "methods (paper: TPT, TDA, DPE; `--fig5-methods`), one run each (its seed in the column title). "
               + figures.RELIABILITY_KEY)
    return written("Figure 5", what, [render.write_csv(pl.concat(frames), out / "fig5_reliability.csv"), *paths],
                   notes, caption)


def _with_interval_text(t4: pl.DataFrame) -> pl.DataFrame:
    """Table 4 with the text columns `_ci` (the ECE's interval) and `_diff` (ZAEC minus the row, with its
    interval and † where it contains zero)."""
    return t4.with_columns(
        pl.struct("ece", "ci_low", "ci_high").map_elements(
            lambda r: render.interval_text(r["ece"], r["ci_low"], r["ci_high"]), return_dtype=pl.Utf8)
        .alias("_ci"),
        pl.struct("diff_zaec", "diff_ci_low", "diff_ci_high", "diff_contains_zero").map_elements(
            lambda r: render.DASH if r["diff_zaec"] is None else
            f"{render.fmt(r['diff_zaec'], signed=True)}{render.NS_MARK if r['diff_contains_zero'] else ''}"
            f" [{render.fmt(r['diff_ci_low'], signed=True)}, {render.fmt(r['diff_ci_high'], signed=True)}]",
            return_dtype=pl.Utf8).alias("_diff"))


def table_4(ctx: Context) -> Item:
    """Table 4: ablation of the corrected subset (ECE and NLL), macro-averaged over the ImageNet family."""
    cells, boot = ctx.cells, ctx.boot
    frames, caption_sets = [], []
    for bb in ctx.backbones:
        present = cells.filter(pl.col("backbone") == bb)["dataset"].unique().to_list()
        datasets, preferred = builders.pick_datasets(present, layout.IMAGENET_FAMILY)
        t4 = builders.ablation_table(cells, bb, datasets, ctx.reps)
        if t4.height:
            frames.append(t4.with_columns(pl.lit(",".join(datasets)).alias("datasets")))
            caption_sets.append(f"{bb}: {', '.join(datasets)}" + ("" if preferred else " (no ImageNet-family data)"))
    what = "ablation of the corrected subset, ECE and NLL"
    if not frames:
        return skipped("Table 4", what,
                       "no method has every subset variant on its datasets" if ctx.tta_methods else NO_TTA)
    t4 = render.with_partial_label(pl.concat(frames))
    cols = {"backbone": "Backbone", "_label": "Method", "subset": "Corrected subset", "ece": "ECE", "nll": "NLL"}
    fm = {"nll": lambda v: render.fmt(v, 3)}
    if boot is not None:
        t4 = _with_interval_text(t4)
        cols.update({"_ci": f"ECE {int(boot.level * 100)}% CI", "_diff": "ZAEC − row"})
    bold = {"ece": "bold_ece", "nll": "bold_nll"}
    text = "Macro-averages over " + "; ".join(caption_sets) + ". ECE in percent; best per method in bold."
    if boot is not None:
        text += (" Intervals: paired basic bootstrap (ZAEC − row: the ZAEC ECE minus this row's, points; "
                 "† the interval contains zero).")
        if render.excludes_estimate(t4.rename({"ece": "value"})):
            text += " " + render.BELOW_LEGEND
    if render.partial_legend(t4, label="_label"):
        text += " " + render.partial_legend(t4, label="_label")
    return written("Table 4", what, render.write_item(
        ctx.out, "table4_subset_ablation", t4.drop("_ci", "_diff", "_label", strict=False),
        "# Table 4: ablation of the corrected subset\n\n" + text + "\n\n"
        + render.simple_markdown(t4, cols, fm, bold),
        render.simple_latex(t4, cols, fm, bold, caption=text, midrule_on="method")))


def figure_6(ctx: Context) -> Item:
    """Figure 6: ECE vs the entropy-restoration strength λ, one panel per dataset, one line per method."""
    what = "ECE vs entropy-restoration strength λ"
    st = builders.strength_table(ctx.cells)
    if not st.height:
        return skipped("Figure 6", what, NO_TTA)
    paths, notes = [render.write_csv(st, ctx.out / "fig6_strength.csv")], []
    for bb in ctx.backbones:
        p = st.filter(pl.col("backbone") == bb)
        if not p.height:
            continue
        datasets, preferred = builders.pick_datasets(p["dataset"].unique().to_list(), layout.STRENGTH_DATASETS)
        if not preferred:
            notes.append(f"{bb}: the paper's datasets dtd/imagenet_v2 absent; every dataset shown")
        paths.append(figures.plot_strength(p, datasets, ctx.out / f"fig6_strength_{slug(bb)}.png",
                                           f"{bb}: ECE vs entropy-restoration strength"))
    caption = ("ECE (%) vs restoration strength λ ∈ {0, 0.25, 0.5, 0.75, 1} (λ = 0 is raw TTA, 1 is ZAEC), one "
               "panel per dataset (paper: DTD and ImageNet-V2), one line per method.")
    return written("Figure 6", what, paths, notes, caption)


def per_run_metrics(ctx: Context) -> Item:
    """Every run and calibrator's metrics, the input of all tables."""
    in_sample = (pl.col("calibrator") == "temperature") & (pl.col("dataset") == ctx.ts_in_sample) \
        if ctx.ts_in_sample is not None else pl.lit(False)
    return written("Per-run metrics", "every run and calibrator, as fractions: the input of all tables; "
                   "`in_sample` marks temperature scaling scored on its own fitting data",
                   [render.write_csv(ctx.run_df.with_columns(in_sample.alias("in_sample")),
                                     ctx.out / "per_run_metrics.csv")])


#: the trust table's column sets, one Markdown/LaTeX table each (every column is in the CSV)
TRUST_METRIC_SETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("confidence score max softmax probability (MSP); classwise and top-label ECE",
     ("aurc_msp", "eaurc_msp", "auroc_msp", "fpr95_msp", "cw_ece_15w", "tl_ece_15w")),
    ("confidence score negative entropy (−H)", ("aurc_negent", "eaurc_negent", "auroc_negent", "fpr95_negent")),
)
TRUST_NAME = "Selective prediction and classwise calibration"
TRUST_CAPTION = (
    "Percent; per dataset group the unweighted average over its datasets (as Tables 2 and 3), zero-shot on top, "
    "then per method raw TTA (None), SaLS, ZAEC and temperature scaling. AURC: selective risk averaged over all "
    "coverage levels, lower is better; E-AURC: AURC minus the lowest AURC possible at the run's accuracy; AUROC: "
    "misclassification detection (correct = positive; ties count 1/2), higher is better; FPR95: share of the "
    "misclassified samples accepted at the highest threshold accepting 95% of the correct ones, lower is better. "
    "The score each is computed from is in the column name: MSP (max softmax probability) or −H (negative "
    "entropy). cw-ECE: classwise ECE, tl-ECE: top-label ECE, both 15 equal-width bins. Intervals: paired basic "
    "bootstrap over samples with the resamples of the ECE intervals, clipped to [0, 100] (none for cw-ECE, whose "
    "bootstrap needs every class's probability per sample); differences are ZAEC minus None and minus Temp. Scal., "
    "† where the interval contains zero. – : undefined (e.g. AUROC without a misclassified sample), the reason in "
    "the index's notes.")


def trust_table(ctx: Context) -> Item:
    """Beyond the paper: selective prediction and classwise calibration per method and calibrator, with paired
    intervals of every metric and of ZAEC minus raw / minus temperature scaling, one table per backbone."""
    what = ("AURC, E-AURC, misclassification AUROC and FPR95 (scores MSP and negative entropy), classwise and "
            "top-label ECE per method, raw / SaLS / ZAEC / temperature scaling, with paired bootstrap intervals")
    cells = trust_tables.trust_cells(ctx.runs, ctx.boot)
    if not cells:
        return skipped(TRUST_NAME, what, "no runs", beyond_paper=True)
    level = ctx.boot.level if ctx.boot is not None else 0.95
    paths, notes = [], []
    for bb in ctx.backbones:
        table = trust_tables.trust_table(cells, bb, level, ts_in_sample=ctx.ts_in_sample)
        diffs = trust_tables.trust_differences(cells, bb, level)
        sections = render.trust_sections(table, diffs, TRUST_METRIC_SETS)
        legend = " ".join(render.marks_legend(table))
        paths += render.write_item(
            ctx.out, f"trust_{slug(bb)}", table,
            render.trust_markdown(sections, f"{TRUST_NAME}, {bb} (beyond the paper)",
                                  " ".join([TRUST_CAPTION, legend])),
            render.trust_latex(sections, f"{TRUST_NAME}, {bb}. {TRUST_CAPTION} {legend}".strip()))
        paths.append(render.write_csv(diffs, ctx.out / f"trust_{slug(bb)}_diff.csv"))
        notes += trust_tables.missing_notes(table)
    if ctx.boot is None:
        notes.append("no intervals: bootstrap disabled (--bootstrap 0)")
    return written(TRUST_NAME, what, paths, notes, TRUST_CAPTION, beyond_paper=True)


def risk_coverage_figure(ctx: Context) -> Item:
    """Beyond the paper: risk-coverage curves of one run per method on the reference dataset (as Figure 5)."""
    what = "risk vs coverage of zero-shot, raw, SaLS, ZAEC and temperature scaling on the reference dataset"
    refs, notes = _reference_runs(ctx, "the risk-coverage figure uses")
    frames, paths = [], []
    for bb, ref, ref_runs in refs:
        curves = trust_tables.risk_coverage_curves(ref_runs, ts_in_sample=ctx.ts_in_sample)
        if not curves.height:
            continue
        frames.append(curves)
        paths.append(figures.plot_risk_coverage(
            curves, ctx.out / f"risk_coverage_{slug(bb)}.png",
            f"{bb} on {ref}: risk vs coverage, score max softmax probability (AURC in %)"))
    if not frames:
        return skipped("Risk-coverage figure", what, NO_TTA, beyond_paper=True)
    caption = ("Selective risk (error rate among the accepted samples) vs coverage when the most confident samples "
               "(max softmax probability) are accepted first, one panel per method (its lowest-seed run on the "
               "reference dataset, `--reference-dataset`), one line per prediction with its AURC (%) in the legend; "
               "dotted: the oracle that accepts every correct sample first, over the whole coverage range (panel "
               "`oracle` in the CSV). Tied confidences are accepted together, so a prediction's curve starts at the "
               "share of its most confident tied group (e.g. every top probability exactly 1.0).")
    caption += _in_sample_caption(frames, "scored on the labelled data its T was fitted on")
    return written("Risk-coverage figure", what,
                   [render.write_csv(pl.concat(frames), ctx.out / "risk_coverage.csv"), *paths], notes, caption,
                   beyond_paper=True)


OOD_NAME = "Out-of-distribution detection"
OOD_CAPTION = (
    "Percent; one table per in-distribution set and confidence score, a column group per OOD set it was mixed with "
    "and their unweighted average (Avg.). Zero-shot on top, then per method raw TTA (None), SaLS, ZAEC and "
    "temperature scaling. In-distribution is the positive class and the score is the confidence (as MCM): MSP (max "
    "softmax probability) or −H (negative entropy). AUROC: probability that an in-distribution image is more "
    "confident than an OOD one (ties 1/2), higher is better; FPR95: share of the OOD images accepted at the highest "
    "threshold accepting 95% of the in-distribution ones, lower is better; AUPR: average precision with "
    "in-distribution positive, higher is better. Each run is one mixed stream adapted online; accuracy and ECE of "
    "its in-distribution rows are in per_run_metrics of `zaec-calibrate`, not here. Intervals: paired basic "
    "bootstrap over the run's images; differences are ZAEC minus None and minus Temp. Scal., † where the interval "
    "contains zero. – : undefined (a run holding one kind of image only), the reason in the index's notes.")


def ood_table(ctx: Context) -> Item:
    """Beyond the paper: in- vs out-of-distribution detection (AUROC, FPR95, AUPR; MSP and −H) per method and
    calibrator on the OOD runs, with paired intervals and ZAEC minus raw / minus temperature scaling."""
    what = ("in- vs out-of-distribution AUROC, FPR95 and AUPR (scores MSP and negative entropy) per method, "
            "raw / SaLS / ZAEC / temperature scaling, on the OOD runs")
    if not ctx.ood_runs:
        return skipped(OOD_NAME, what, "no OOD runs (shards with 'zaec:ood_for'; docs/contract.md)",
                       beyond_paper=True)
    cells = ood_tables.ood_cells(ctx.ood_runs, ctx.boot)
    groups = ood_tables.ood_groups(ctx.ood_runs)
    level = ctx.boot.level if ctx.boot is not None else 0.95
    paths, notes = [], []
    for bb in layout.order_backbones({s.key.backbone for s in ctx.ood_runs}):
        table = ood_tables.ood_table(cells, groups, bb, level, ts_in_sample=ctx.ts_in_sample)
        diffs = ood_tables.ood_differences(cells, groups, bb, level)
        sections = ood_tables.ood_sections(table, diffs)
        legend = " ".join(render.marks_legend(table))
        paths += render.write_item(
            ctx.out, f"ood_{slug(bb)}", table,
            render.trust_markdown(sections, f"{OOD_NAME}, {bb} (beyond the paper)", " ".join([OOD_CAPTION, legend])),
            render.trust_latex(sections, f"{OOD_NAME}, {bb}. {OOD_CAPTION} {legend}".strip()))
        paths.append(render.write_csv(diffs, ctx.out / f"ood_{slug(bb)}_diff.csv"))
        notes += trust_tables.missing_notes(table)
    if ctx.boot is None:
        notes.append("no intervals: bootstrap disabled (--bootstrap 0)")
    return written(OOD_NAME, what, paths, notes, OOD_CAPTION, beyond_paper=True)


OOD_FIGURE_NAME = "Out-of-distribution ROC figure"


def ood_figure(ctx: Context) -> Item | None:
    """Beyond the paper: ROC curves of in- vs out-of-distribution detection, raw vs ZAEC (and zero-shot), one panel
    per OOD run and method (no entry without an OOD run: the OOD table's entry says why)."""
    if not ctx.ood_runs:
        return None
    what = "in- vs out-of-distribution ROC curves of zero-shot, raw and ZAEC, one panel per OOD run and method"
    frames, paths, notes = [], [], []
    for bb in layout.order_backbones({s.key.backbone for s in ctx.ood_runs}):
        curves = ood_tables.ood_roc_curves([s for s in ctx.ood_runs if s.key.backbone == bb],
                                           ts_in_sample=ctx.ts_in_sample)
        if not curves.height:
            notes.append(f"{bb}: no OOD run holds both in- and out-of-distribution images")
            continue
        frames.append(curves)
        paths.append(figures.plot_ood_roc(curves, ctx.out / f"ood_roc_{slug(bb)}.png",
                                          f"{bb}: in- vs out-of-distribution ROC, score max softmax probability"))
    if not frames:
        return skipped(OOD_FIGURE_NAME, what, "; ".join(notes), beyond_paper=True)
    caption = ("ROC of telling in-distribution images (positive) from OOD ones by the confidence (max softmax "
               "probability), one panel per OOD run (its lowest seed) and method: the paired zero-shot, raw TTA "
               "(None) and ZAEC, each with its AUROC (%) in the legend, equal to the OOD table's; dashed: chance. "
               "Tied confidences are accepted together (one point per distinct confidence). The drawn points are "
               "in ood_roc.csv (`fpr`, `tpr`, `threshold`, fractions).")
    return written(OOD_FIGURE_NAME, what, [render.write_csv(pl.concat(frames), ctx.out / "ood_roc.csv"), *paths],
                   notes, caption, beyond_paper=True)


Builder = Callable[[Context], "Item | None"]

#: every item of the report, in the order of the index (the paper's order). A new table or figure is one builder
#: function `(Context) -> Item | None` plus one entry here; `write_report` runs them in this order.
BUILDERS: list[Builder] = [
    figure_1, table_1, figure_2a, figure_2b, figures_2cd, figure_3, tables_2_3, tables_2_3_intervals, figure_4,
    figure_5, table_4, figure_6, per_run_metrics, trust_table, risk_coverage_figure, ood_table, ood_figure,
]


def write_report(
    summaries: Summaries,
    out: Path,
    boot: BootstrapResult | None = None,
    opts: ReportOptions = ReportOptions(),
) -> Report:
    """Run every builder of `BUILDERS` and write the index; items without inputs are skipped with a one-line
    reason in the index."""
    ctx = prepare(summaries, out, boot, opts)
    rep = Report(general=list(summaries.notes))
    for bb in layout.BACKBONE_ORDER:
        if bb not in ctx.backbones:
            rep.general.append(f"no {bb} shards: the paper's {bb} tables and figures are skipped")
    for build in BUILDERS:
        item = build(ctx)
        if item is not None:
            rep.items.append(item)
    write_index(ctx.out, rep, summaries, boot, opts)
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
                     f"{int(boot.level * 100)}% basic (reverse-percentile) intervals, which correct binned ECE's "
                     "upward bias (Kumar et al., 2019), so an interval can lie wholly below its estimate (marked "
                     f"{render.BELOW_MARK}; docs/tables.md, \"Uncertainty\").\n")
    else:
        lines.append("Uncertainty: bootstrap disabled (--bootstrap 0).\n")
    lines.append("## Paper items\n")
    beyond = False
    for it in rep.ordered():
        if it.beyond_paper and not beyond:
            beyond = True
            lines.append("\n## Beyond the paper\n")
            lines.append("The paper reports ECE, NLL and accuracy only; these items go beyond it (docs/tables.md, "
                         "\"Beyond the paper\").\n")
        if it.skipped is not None:
            lines.append(f"- **{it.name}**: {it.what}. Skipped: {it.skipped}")
        else:
            links = ", ".join(f"[{p.name}]({p.name})" for p in it.paths)
            lines.append(f"- **{it.name}**: {it.what}. Files: {links}")
            if it.caption:
                lines.append(f"\n  {it.caption}")
        lines += [f"  - note: {n}" for n in it.notes]
        for p in it.paths:
            if p.suffix == ".png":
                lines.append(f"\n  ![{p.stem}]({p.name})\n")
    if rep.general:
        lines.append("\n## Notes\n")
        lines += [f"- {n}" for n in rep.general]
    return render.write_text(out / "README.md", "\n".join(lines) + "\n")
