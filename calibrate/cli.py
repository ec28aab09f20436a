"""`zaec-calibrate`: stream shards through the calibrators and write metric tables.

    zaec-calibrate PATH... [--calibrators none,temperature,sals,zaec] [--bins 20] [--binning width|mass]
                   [--out DIR] [--samples] [--ts-source imagenet] [--temperature T] [--drop-nonfinite]
                   [--allow-partial] [--score msp|negent] [--quiet]
    zaec-calibrate tables ...     (the paper's tables and figures: calibrate.tables.cli)

A user error ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from calibrate.cli_errors import USER_ERRORS, fail, run_app
from calibrate.console import KEY_HEADERS, cell, console_views, view_columns, view_title
from calibrate.run import DEFAULT_CALIBRATORS, DEFAULT_TS_SOURCE, RunReport, calibrate_paths, write_metrics
from schemas.atomic import check_output_dir

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

def render(report: RunReport, console: Console, score: str = "msp") -> None:
    """Print the views of `calibrate.console.console_views` (calibration; selective prediction and classwise
    calibration; OOD detection when an OOD run is present) as rich tables, then the notes."""
    columns = view_columns(score)
    for view, frame in console_views(report.metrics, score).items():
        table = Table(title=view_title(view, score), show_lines=False)
        for h in frame.columns:
            table.add_column(h, justify="left" if h in KEY_HEADERS[:2] else "right", no_wrap=h in KEY_HEADERS)
        for r in frame.iter_rows(named=True):
            table.add_row(*(str(r[h]) for h in KEY_HEADERS), *(cell(r[h], d) for h, (_, _, d) in columns[view].items()))
        console.print(table)
    for note in report.notes:
        console.print(f"note: {note}", markup=False, highlight=False)


@app.command()
def run(
    paths: List[Path] = typer.Argument(..., help="shard files or directories (searched recursively)"),
    calibrators: str = typer.Option(DEFAULT_CALIBRATORS, help="comma-separated calibrator specs, e.g. zaec:strength=0.5"),
    bins: int = typer.Option(20, help="number of ECE bins (TTABC: 20)"),
    binning: str = typer.Option("width", help="ECE/MCE binning: width (lo < conf <= hi) or mass (equal count)"),
    out: Path = typer.Option(Path("results"), help="output folder for metrics.parquet/csv"),
    samples: bool = typer.Option(False, "--samples", help="also write per-sample results under OUT/samples/"),
    ts_source: str = typer.Option(DEFAULT_TS_SOURCE, help="dataset whose labelled logits fit temperature scaling"),
    temperature: Optional[float] = typer.Option(None, help="fix the temperature-scaling T instead of fitting it"),
    drop_nonfinite: bool = typer.Option(False, "--drop-nonfinite", help="drop rows with NaN/inf logits (reported)"),
    allow_partial: bool = typer.Option(False, "--allow-partial",
                                       help="use runs whose shards hold fewer samples than their writer announced "
                                            "(each such run is noted); default: stop naming the run"),
    score: str = typer.Option("msp", help="confidence score of the printed selective-prediction and OOD columns: "
                                          "msp (max softmax probability) or negent (negative entropy); metrics.csv "
                                          "holds both"),
    quiet: bool = typer.Option(False, "--quiet", help="no table, no progress bar"),
) -> None:
    """Calibrate every run (backbone, dataset, method, seed) found under PATHS and write metric tables.

    Calibrators (--calibrators): none, temperature, sals, zaec, with options such as zaec:strength=0.5 or
    zaec:subset=all. The paper's tables and figures: zaec-calibrate tables SHARDS --out DIR (see
    zaec-calibrate tables --help).
    """
    err = Console(stderr=True, emoji=False)
    progress = Progress(
        TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"), TimeRemainingColumn(),
        console=err, transient=True, disable=quiet or not err.is_terminal,
    )
    task = progress.add_task("rows", total=None)
    try:
        view_columns(score)  # a bad --score stops here, before any shard is read
        check_output_dir(out, "--out")
        with progress:
            report = calibrate_paths(
                paths,
                calibrators=calibrators,
                n_bins=bins,
                binning=binning,
                ts_source=ts_source,
                temperature=temperature,
                drop_nonfinite=drop_nonfinite,
                allow_partial=allow_partial,
                samples_dir=out / "samples" if samples else None,
                progress=lambda n: progress.advance(task, n),
                on_total=lambda n: progress.update(task, total=n),
            )
            paths = write_metrics(report, out)
    except USER_ERRORS as e:
        fail("zaec-calibrate", e, err)
    if not quiet:
        console = Console(emoji=False, width=None if Console(emoji=False).is_terminal else 160)
        render(report, console, score)
        console.print(f"wrote {', '.join(str(p) for p in paths[:-1])} and {paths[-1]}", markup=False,
                      highlight=False)


def main(argv: Optional[List[str]] = None) -> None:
    """Console script `zaec-calibrate`; `zaec-calibrate tables ...` dispatches to the tables CLI."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "tables":
        from calibrate.tables.cli import main as tables_main  # imported only when used

        tables_main(args[1:])  # exits
    run_app(app, args, "zaec-calibrate")


if __name__ == "__main__":
    main()
