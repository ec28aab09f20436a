"""`zaec-extract`: run one TTA method over one dataset and write paired zero-shot/adapted logits as shards.

    zaec-extract --method dpe --dataset dtd [--backbone ViT-B-16] [--pretrained openai|FILE|local-dir:DIR]
                 [--data-root DIR] [--out DIR] [--seed S] [--device D] [--limit N] [--set key=value ...]
    zaec-extract --method tda --dataset folder:PATH [--dataset-name NAME] [--class-names FILE] ...
    zaec-extract --method tda --dataset inaturalist|folder:PATH --ood-for imagenet ...   (out-of-distribution run)
    zaec-extract --method tda --dataset folder:OOD --ood-for folder:PATH [--ood-for-name NAME] [--class-names FILE]

User errors (unknown names, missing data or weights, bad `--set`) end in one line on stderr and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List, Mapping, Optional

import typer

from extract.method_keys import METHOD_KEYS
from extract.defaults import DEFAULT_BACKBONE, DEFAULT_MAX_IMAGE_PIXELS
from extract.run.options import (
    ADAPT_BATCH_HELP,
    DEFAULT_ADAPT_BATCH,
    DEFAULT_ANCHOR,
    DEFAULT_BATCH_SIZE,
    DEFAULT_FINGERPRINT,
    DEFAULT_OUT,
    DEFAULT_PART_SIZE,
    DEFAULT_PRETRAINED,
    DEFAULT_SEED,
    MAX_CUDA_WORKERS,
    PART_SIZE_HELP,
)

app = typer.Typer(add_completion=False, help=__doc__, no_args_is_help=True, pretty_exceptions_enable=False)


def _user_errors() -> tuple[type[BaseException], ...]:
    from extract.cache import CacheError
    from extract.datasets import DatasetError
    from extract.models import ModelError
    from extract.prompts import PromptError
    from extract.run.options import RunError
    from schemas.shard import ShardError
    # ValueError: the method registry and `--set` conversion report unknown keys and bad values with it;
    # OSError: a folder that became unwritable or a full disk while writing (the message names the path)
    return (DatasetError, ModelError, PromptError, RunError, CacheError, ShardError, ValueError, OSError)


@app.command()
def extract(
    method: str = typer.Option(..., "--method", "-m", help=f"TTA method: {', '.join(METHOD_KEYS)}"),
    dataset: str = typer.Option(..., "--dataset", "-d",
                                help="dataset key (imagenet, dtd, imagenet_c:CORRUPTION:SEVERITY, ...), "
                                     "folder:PATH (one sub-folder per class) or split:FILE.json (a CoOp split)"),
    dataset_name: Optional[str] = typer.Option(None, help="name of a folder:/split: dataset in the shards "
                                                          "(default: the folder's name)"),
    class_names: Optional[Path] = typer.Option(None, help="class names of a folder:/split: dataset, label order: "
                                                          "one per line or a JSON list (an OOD run: of its "
                                                          "in-distribution set, --ood-for)"),
    ood_for: Optional[str] = typer.Option(None, "--ood-for", metavar="KEY",
                                          help="an out-of-distribution run: DATASET's images (label -1) mixed into "
                                               "the stream of the in-distribution set KEY (e.g. imagenet, or "
                                               "folder:PATH / split:FILE.json), all classified with KEY's classes, "
                                               "prompts and settings"),
    ood_for_name: Optional[str] = typer.Option(None, help="name of a folder:/split: in-distribution set of an OOD "
                                                          "run (default: the folder's name)"),
    backbone: Optional[str] = typer.Option(
        None, help=f"open_clip model name (ViT-B-16, RN50); default {DEFAULT_BACKBONE}, or the local-dir's model"),
    pretrained: str = typer.Option(DEFAULT_PRETRAINED, help="pretrained tag, checkpoint file, or local-dir:DIR"),
    data_root: Optional[Path] = typer.Option(None, help="folder holding the datasets (default: $ZAEC_DATA_ROOT, "
                                                          "else ./data)"),
    out: Path = typer.Option(DEFAULT_OUT, help="shard root"),
    seed: int = typer.Option(DEFAULT_SEED, help="seed of the stream order and the augmented views"),
    device: Optional[str] = typer.Option(None, help="torch device (default: cuda if available, else cpu)"),
    limit: Optional[int] = typer.Option(None, help="only the first N samples of the stream"),
    set_: List[str] = typer.Option([], "--set", help="override a config field: --set key=value (repeatable)"),
    anchor: str = typer.Option(DEFAULT_ANCHOR, help="zero-shot anchor: 'single' (\"a photo of a {}.\") or 'method' "
                                              "(the method's own prompts)"),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="keep the valid shards of an interrupted run"),
    force: bool = typer.Option(False, "--force", help="recompute a finished run"),
    cache_dir: Optional[Path] = typer.Option(None, help="feature cache (default: $ZAEC_CACHE_DIR, else data/cache)"),
    cupl_dir: Optional[Path] = typer.Option(None, help="folder of CuPL_prompts_*.json (default: $ZAEC_CUPL_DIR)"),
    descriptions_dir: Optional[Path] = typer.Option(None, help="folder of class-description files <dataset>.json "
                                                                "(AWT; default: $ZAEC_DESCRIPTIONS_DIR)"),
    tda_sh_filter: bool = typer.Option(False, "--tda-sh-filter",
                                       help="reproduce TDA's listing quirk on ImageNet-A/R/Sketch/V2 (drops file "
                                            "names containing 'sh'); off by default"),
    fingerprint: str = typer.Option(DEFAULT_FINGERPRINT,
                                    help="how image files are fingerprinted for the feature cache and the "
                                         "finished-run check: 'stat' (size and modification time, cheap) "
                                         "or 'content' (sha256 of every file)"),
    exif_transpose: bool = typer.Option(False, "--exif-transpose",
                                        help="turn photos as their EXIF orientation tag says (off by default: the "
                                             "official code and torchvision ignore EXIF)"),
    batch_size: int = typer.Option(DEFAULT_BATCH_SIZE, help="images per encoder call"),
    adapt_batch: int = typer.Option(DEFAULT_ADAPT_BATCH, help=ADAPT_BATCH_HELP),
    part_size: int = typer.Option(DEFAULT_PART_SIZE, help=PART_SIZE_HELP),
    workers: Optional[int] = typer.Option(None, help="image-loading processes (default: up to "
                                                           f"{MAX_CUDA_WORKERS} on CUDA, 0 on CPU)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar (warnings and errors still print)"),
    wait_lock: Optional[float] = typer.Option(None, metavar="SECONDS",
                                              help="while another process writes the same run: wait at most "
                                                   "SECONDS, then stop (0: stop at once; default: wait until it "
                                                   "finishes)"),
    max_image_pixels: int = typer.Option(DEFAULT_MAX_IMAGE_PIXELS, metavar="N",
                                         help="an image of more pixels stops the run with one line naming it "
                                              "(Pillow's decompression-bomb guard); 0: no limit"),
) -> None:
    """Run METHOD over DATASET and write shards under OUT.
    \f
    Length: a typer command declares each of its options as a parameter (one per line, with its help); the body
    is a few lines handing them to `_run`.
    """
    given = dict(locals())  # every option by its parameter name
    from rich.console import Console

    err = Console(stderr=True, emoji=False)
    try:
        paths = _run(given)
    except _user_errors() as e:
        from calibrate.cli_errors import fail  # the one user-error printer of every command (CPU-side, light)

        fail("zaec-extract", e, err, full=True)
    except KeyboardInterrupt:
        err.print("interrupted; rerun the same command to resume")
        raise typer.Exit(130)
    where = paths[0].parent if paths else given["out"]
    print(f"{len(paths)} shard(s) in {where}")  # plain: never wrapped, so scripts can parse the path


def _run(g: Mapping[str, Any]) -> list[Path]:
    """The command on its options (`g`, by parameter name): every name resolved before any file is read, then
    `run_extraction`; returns the shard paths."""
    from extract.run.options import parse_overrides
    from extract.runner import plan_run, run_extraction

    overrides = parse_overrides(g["set_"])
    dataset, ood_for = resolve_sets(g["dataset"], g["dataset_name"], g["class_names"], g["ood_for"],
                                    g["ood_for_name"])
    common = dict(backbone=g["backbone"], pretrained=g["pretrained"], seed=g["seed"], overrides=overrides,
                  anchor=g["anchor"], limit=g["limit"], ood_for=ood_for, adapt_batch=g["adapt_batch"],
                  part_size=g["part_size"])
    # resolve every name before any file is read (run_extraction repeats it; it is cheap)
    plan_run(g["method"], dataset, **common)
    return run_extraction(
        g["method"], dataset, **common, data_root=g["data_root"], out=g["out"], device=g["device"],
        resume=g["resume"], force=g["force"], cache_dir=g["cache_dir"], cupl_dir=g["cupl_dir"],
        descriptions_dir=g["descriptions_dir"], sh_filter=g["tda_sh_filter"], fingerprint=g["fingerprint"],
        exif_transpose=g["exif_transpose"], batch_size=g["batch_size"], workers=g["workers"],
        progress=not g["quiet"], wait_lock=g["wait_lock"], max_image_pixels=g["max_image_pixels"])


def resolve_sets(dataset: str, dataset_name: str | None, class_names: Path | None, ood_for: str | None,
                 ood_for_name: str | None) -> tuple[str, str | None]:
    """The registered keys of `--dataset` and `--ood-for`, registering a user's `folder:`/`split:` sets.

    In an OOD run the set with classes is the in-distribution one: `--class-names` (and `--ood-for-name`) go to
    `--ood-for`, `--dataset-name` names the OOD set. Nothing given is dropped: `--class-names` for a registered
    in-distribution key, or `--ood-for-name` without `--ood-for`, is a DatasetError.
    """
    from extract.datasets import DatasetError, resolve_dataset

    if ood_for is None:
        if ood_for_name is not None:
            raise DatasetError("--ood-for-name names the folder:/split: in-distribution set of an OOD run; no "
                               "--ood-for was given (name the dataset itself with --dataset-name)")
        return resolve_dataset(dataset, name=dataset_name, class_names=class_names), None
    if not ood_for.startswith(("folder:", "split:")) and (class_names is not None or ood_for_name is not None):
        given = "--class-names" if class_names is not None else "--ood-for-name"
        raise DatasetError(f"{given} applies to a folder:PATH or split:FILE.json in-distribution set; --ood-for "
                           f"{ood_for!r} is a registered key with its own class names (an OOD set has no classes)")
    if ood_for.startswith(("folder:", "split:")):
        ood_for = resolve_dataset(ood_for, name=ood_for_name, class_names=class_names)
    return resolve_dataset(dataset, name=dataset_name), ood_for  # a registered key: `plan` names a bad one


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point. A usage error (`--limit abc`, an unknown option) is one line on stderr, exit 2."""
    from calibrate.cli_errors import run_app  # the one place typer's usage errors become one line (CPU-side, light)

    run_app(app, list(argv if argv is not None else sys.argv[1:]) or ["--help"], "zaec-extract")


if __name__ == "__main__":
    main()
