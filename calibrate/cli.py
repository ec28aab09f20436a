"""`zaec-calibrate`: stream shards through the calibrators and write metric tables.

    zaec-calibrate PATH... [--calibrators none,temperature,sals,zaec] [--bins 20] [--binning width|mass]
                   [--out DIR] [--samples] [--ts-source imagenet] [--temperature T] [--drop-nonfinite]
                   [--allow-partial]
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
from calibrate.run import DEFAULT_CALIBRATORS, DEFAULT_TS_SOURCE, RunReport, calibrate_paths, write_metrics
from schemas.atomic import check_output_dir

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

PERCENT = ("accuracy", "ece", "mce", "ece_mass", "mean_confidence")


def _count(r: dict) -> str:
    """The `n` cell: `5 of 24` where the run covers part of its announced test set (a `--limit` run, partial)."""
    n, total = r["n"], r.get("n_total")
    return str(n) if total is None or n == total else f"{n} of {total}"


def render(report: RunReport, console: Console) -> None:
    """Print the metrics as a rich table (percent for accuracy/ECE/MCE/confidence, like the paper) and the notes."""
    df = report.metrics
    table = Table(title="zaec-calibrate", show_lines=False)
    heads = ["backbone", "dataset", "method", "seed", "calibrator", "n", "acc %", "ECE %", "MCE %", "ECE-mass %",
             "NLL", "Brier", "conf %", "H (nats)"]
    for h in heads:
        table.add_column(h, justify="left" if h in heads[:5] else "right")
    for r in df.iter_rows(named=True):
        table.add_row(
            r["backbone"], r["dataset"], r["method"], str(r["seed"]), r["calibrator"], _count(r),
            *(f"{100 * r[c]:.2f}" for c in ("accuracy", "ece", "mce", "ece_mass")),
            f"{r['nll']:.3f}", f"{r['brier']:.3f}", f"{100 * r['mean_confidence']:.2f}", f"{r['mean_entropy']:.3f}",
        )
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
        check_output_dir(out, "--out")  # before any shard is read
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
            pq_path, csv_path = write_metrics(report, out)
    except USER_ERRORS as e:
        fail("zaec-calibrate", e, err)
    if not quiet:
        console = Console(emoji=False, width=None if Console(emoji=False).is_terminal else 160)
        render(report, console)
        console.print(f"wrote {pq_path} and {csv_path}", markup=False, highlight=False)


def main(argv: Optional[List[str]] = None) -> None:
    """Console script `zaec-calibrate`; `zaec-calibrate tables ...` dispatches to the tables CLI."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "tables":
        from calibrate.tables.cli import main as tables_main  # imported only when used

        tables_main(args[1:])  # exits
    run_app(app, args, "zaec-calibrate")


if __name__ == "__main__":
    main()
