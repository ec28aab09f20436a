"""`zaec-calibrate tables`: every table and figure of the paper from shards, with bootstrap intervals.

    zaec-calibrate tables SHARDS... [--out results] [--bootstrap 1000] [--seed 0] [--bins 20]
                          [--ts-source imagenet] [--temperature T] [--reference-dataset imagenet_a]
                          [--fig1-methods tpt,tda] [--fig2b-methods M,...|all] [--boundary-dataset caltech101]
                          [--boundary-method dpe] [--drop-nonfinite] [--allow-partial] [--quiet]

A user error ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from calibrate.cli_errors import USER_ERRORS, fail, run_app
from calibrate.tables import layout
from schemas.atomic import check_output_dir
from calibrate.tables.bootstrap import bootstrap_runs
from calibrate.tables.data import load_summaries
import polars as pl

from calibrate.tables.render import main_rich
from calibrate.tables.report import ALL_SPECS, BOOTSTRAP_SPECS, ReportOptions, slug, write_report

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


def method_list(text: str, option: str) -> tuple[str, ...]:
    """`tpt,tda` -> ("tpt", "tda"); an empty entry is a user error naming the option."""
    items = tuple(t.strip() for t in text.split(","))
    if not all(items):
        raise ValueError(f"{option} expects comma-separated method keys such as tpt,tda; got {text!r}")
    return items


def _check_numbers(*, bootstrap: int, level: float, bins: int, reliability_bins: int, gap_bins: int) -> None:
    """Raise ValueError naming the option when a count or the interval level is out of range."""
    if bootstrap < 0:
        raise ValueError(f"--bootstrap must be >= 0, got {bootstrap}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"--level must lie in (0, 1), got {level}")
    for name, v in (("--bins", bins), ("--reliability-bins", reliability_bins), ("--gap-bins", gap_bins)):
        if v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v}")


def _print_main_tables(backbones: List[str], out: Path) -> None:
    """Print each backbone's main table (accuracy and ECE) that the report wrote under ``out``."""
    console = Console(emoji=False, width=None if Console(emoji=False).is_terminal else 200)
    for bb in backbones:
        main = pl.read_csv(out / f"main_{slug(bb)}.csv") if (out / f"main_{slug(bb)}.csv").exists() else None
        if main is not None:
            console.print(main_rich(main, f"{bb}: accuracy and ECE (%)"))


@app.command()
def tables(
    shards: List[Path] = typer.Argument(..., help="shard files or directories (searched recursively)"),
    out: Path = typer.Option(Path("results"), help="output folder (CSV, Markdown, LaTeX, PNG and README.md)"),
    bootstrap: int = typer.Option(1000, help="paired bootstrap resamples for the intervals (0: no intervals)"),
    seed: int = typer.Option(0, help="seed of the bootstrap resamples"),
    level: float = typer.Option(0.95, help="interval level"),
    bins: int = typer.Option(20, help="ECE bins (TTABC: 20 equal-width bins)"),
    reliability_bins: int = typer.Option(10, help="bins of the reliability diagrams (paper, Figures 4 and 5: 10)"),
    gap_bins: int = typer.Option(10, help="equal-frequency bins per entropy-change sign (Figures 2c/2d)"),
    ts_source: str = typer.Option("imagenet", help="labelled source dataset of temperature scaling"),
    temperature: Optional[float] = typer.Option(None, help="fix the temperature-scaling T instead of fitting it"),
    reference_dataset: str = typer.Option(layout.REFERENCE_DATASET,
                                          help="dataset of Figures 2c/2d and 5 (paper: imagenet_a)"),
    fig1_methods: str = typer.Option(",".join(layout.FIG1_METHODS),
                                     help="comma-separated methods of Figure 1, one panel each (paper: tpt,tda)"),
    fig2b_methods: Optional[str] = typer.Option(
        None, help="comma-separated methods pooled in Figure 2b, or 'all' (default: every TTA method but the "
                   "prompt-coupled calibration methods ctpt, otpt, atpt)"),
    fig5_methods: str = typer.Option(",".join(layout.FIG5_METHODS),
                                     help="comma-separated methods of Figure 5, one column each (paper: tpt,tda,dpe), "
                                          "or 'all'"),
    boundary_dataset: str = typer.Option(layout.BOUNDARY_DATASET, help="dataset of Figure 4 (paper: caltech101)"),
    boundary_method: str = typer.Option(layout.BOUNDARY_METHOD, help="method of Figure 4 (paper: dpe)"),
    drop_nonfinite: bool = typer.Option(False, "--drop-nonfinite", help="drop rows with NaN/inf logits (reported)"),
    allow_partial: bool = typer.Option(False, "--allow-partial",
                                       help="use runs whose shards hold fewer samples than their writer announced "
                                            "(each such run is noted); default: stop naming the run"),
    quiet: bool = typer.Option(False, "--quiet", help="print only errors"),
) -> None:
    """Regenerate the paper's tables and figures from the shards under SHARDS into OUT."""
    err = Console(stderr=True, emoji=False)
    say = (lambda s: None) if quiet else (lambda s: err.print(s, markup=False, highlight=False))
    try:
        _check_numbers(bootstrap=bootstrap, level=level, bins=bins, reliability_bins=reliability_bins,
                      gap_bins=gap_bins)
        opts = ReportOptions(n_bins=bins, reliability_bins=reliability_bins, gap_bins=gap_bins,
                             reference_dataset=reference_dataset, ts_source=ts_source,
                             temperature_fixed=temperature is not None,
                             fig1_methods=method_list(fig1_methods, "--fig1-methods"),
                             fig2b_methods=None if fig2b_methods is None else method_list(fig2b_methods,
                                                                                          "--fig2b-methods"),
                             fig5_methods=method_list(fig5_methods, "--fig5-methods"),
                             boundary_dataset=boundary_dataset, boundary_method=boundary_method)
        check_output_dir(out, "--out")  # before the runs are read and the bootstrap runs
        t0 = time.perf_counter()
        progress = Progress(TextColumn("reading runs"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            console=err, transient=True, disable=quiet or not err.is_terminal)
        task = progress.add_task("runs", total=None)
        with progress:
            summaries = load_summaries(
                shards, ALL_SPECS, ts_source=ts_source, temperature=temperature, drop_nonfinite=drop_nonfinite,
                allow_partial=allow_partial,
                on_run=lambda key, i, n: progress.update(task, completed=i, total=n),
            )
        t1 = time.perf_counter()
        say(f"read {len(summaries.runs)} run(s) in {t1 - t0:.1f} s")
        boot = None
        if bootstrap:
            boot = bootstrap_runs(summaries.runs, BOOTSTRAP_SPECS, n_bins=bins, n_resamples=bootstrap,
                                  seed=seed, level=level)
            say(f"bootstrap: {bootstrap} resamples in {time.perf_counter() - t1:.1f} s")
        t2 = time.perf_counter()
        report = write_report(summaries, out, boot, opts)
        say(f"tables and figures in {time.perf_counter() - t2:.1f} s")
    except USER_ERRORS as e:
        fail("zaec-calibrate tables", e, err)
    if not quiet:
        _print_main_tables(summaries.backbones(), out)
    for note in report.notes:
        say(f"note: {note}")
    n_files = sum(len(p) for _, p in report.outputs)
    say(f"wrote {n_files} file(s) and {out / 'README.md'}")


def main(argv: Optional[List[str]] = None) -> None:
    run_app(app, list(sys.argv[1:] if argv is None else argv), "zaec-calibrate tables")


if __name__ == "__main__":
    main()
