"""``python -m tools.demo``: the embedded demo (what ``make demo`` runs). See ``tools.demo``.

A user error (missing Fashion-MNIST files, an unknown method or set) ends in one line on stderr and exit status 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tools.demo.run import DemoConfig

_DEFAULTS = DemoConfig()
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


def _split(value: Optional[str]) -> Optional[tuple[str, ...]]:
    return None if value is None else tuple(v.strip() for v in value.split(",") if v.strip())


@app.command()
def demo(
    fmnist_dir: Path = typer.Option(_DEFAULTS.fmnist_dir, help="folder with the four Fashion-MNIST idx files (plain "
                                    "or .gz); `bash data/fetch_fmnist.sh DIR` fills it"),
    data_root: Path = typer.Option(_DEFAULTS.data_root, help="where the test sets are written (fashion-mnist/<set>/)"),
    models_dir: Path = typer.Option(_DEFAULTS.models_dir, help="where the trained models are saved (local-dir format)"),
    work_dir: Path = typer.Option(_DEFAULTS.work_dir, help="shards, feature cache and metrics of the demo"),
    results: Path = typer.Option(_DEFAULTS.results, help="tables, figures and demo_summary.md"),
    n_images: int = typer.Option(_DEFAULTS.n_images or 0, help="images per set: the first N test images (0: all "
                                                               "10,000; large values take hours on a CPU)"),
    methods: Optional[str] = typer.Option(None, help="comma-separated TTA methods, or 'all' for every registered "
                                                     "one (default: the paper's methods and the TTA-VLM ones that "
                                                     "fit a 10-minute first run)"),
    sets: str = typer.Option(",".join(_DEFAULTS.sets), help="comma-separated sets; 'clean' is required"),
    seed: int = typer.Option(_DEFAULTS.seed, help="seed of the stream order and the augmented views"),
    train_budget: float = typer.Option(_DEFAULTS.train_budget, help="scale of the training images (1.0: 60,000)"),
    bootstrap: int = typer.Option(_DEFAULTS.bootstrap, help="bootstrap resamples of the tables' intervals"),
    device: str = typer.Option(_DEFAULTS.device, help="torch device of the extraction"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: all cores)"),
    workers: int = typer.Option(_DEFAULTS.workers, help="image-loading processes of the encoding pass"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bars"),
) -> None:
    """Train two small CLIP-architecture models on Fashion-MNIST and run the whole zaec pipeline on them."""
    from rich.console import Console

    from tools.demo.fmnist import FashionMNISTError
    from tools.demo.run import DemoError, run_demo

    err = Console(stderr=True, emoji=False)
    cfg = DemoConfig(
        fmnist_dir=fmnist_dir, data_root=data_root, models_dir=models_dir, work_dir=work_dir, results=results,
        n_images=n_images or None, sets=_split(sets) or (), methods=_split(methods), seed=seed,
        train_budget=train_budget, bootstrap=bootstrap, device=device, threads=threads, workers=workers,
        progress=not quiet,
    )
    user_errors: tuple[type[BaseException], ...] = (FashionMNISTError, ValueError, DemoError, OSError)
    try:
        from extract.cli import _user_errors

        user_errors = user_errors + _user_errors()
    except ImportError:
        pass
    out = Console(emoji=False)
    if not out.is_terminal:  # piped or logged: wide enough for the tables, fixed so logs look alike
        out = Console(emoji=False, width=110)
    try:
        run_demo(cfg, console=out)
    except user_errors as e:
        msg = str(e).strip() or type(e).__name__
        err.print(f"demo: error: {msg}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:
        err.print("demo: interrupted; run it again to resume (finished work is kept)", markup=False)
        raise typer.Exit(130)


def main() -> None:
    app(prog_name="python -m tools.demo")


if __name__ == "__main__":
    main()
