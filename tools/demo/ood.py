"""The demo's out-of-distribution pair (issue 24): Fashion-MNIST's clean test set against synthetic geometric shapes.

No second image set ships with Debian besides Fashion-MNIST itself (`apt-cache search mnist` lists only
`dataset-fashion-mnist`), so the OOD images are generated here: on a black 32x32 canvas, one to three filled
rectangles, discs or rings of random size, place and grey level, seeded, stored as RGB like the demo's sets
(`tools.demo.images.to_rgb_uint8`). They are the registered OOD set `demo_shapes`::

    <data_root>/demo-ood/shapes/images/<index:05d>.png      32x32 RGB
    <data_root>/demo-ood/shapes/shapes.json                 how many, the seed

The pair runs for `OOD_METHODS` only (zero-shot and TDA: the baseline and one online method, which stores what it
sees, OOD images included), on both backbones, with as many shapes as Fashion-MNIST images, into its own shard root
(`work_dir/ood-shards`) so that the paper's tables and findings stay on the Fashion-MNIST sets. `ood_sentence` turns
`zaec-calibrate`'s OOD columns into one sentence: does ZAEC help or hurt OOD detection here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import polars as pl

from tools.demo.verdict import raw_vs_zaec
from tools.demo.images import IMAGE_SIZE, to_rgb_uint8
from schemas.atomic import atomic_dir

OOD_KEY = "demo_shapes"
ID_KEY = "fmnist"
#: the methods the OOD pair runs (a few only: the demo's first run must stay short on a CPU)
OOD_METHODS: tuple[str, ...] = ("zero-shot", "tda")
SHAPES_DIR = Path("demo-ood") / "shapes"
RECORD = "shapes.json"


def shapes(n: int, seed: int = 0, size: int = IMAGE_SIZE) -> np.ndarray:
    """(n, size, size) float32 grey images in [0, 1]: one to three filled rectangles, discs or rings each.

    Example:
        >>> shapes(2, seed=0).shape
        (2, 32, 32)
    """
    rng = np.random.default_rng([seed, n])
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    out = np.zeros((n, size, size), np.float32)
    for img in out:  # a handful of shapes per image; the loop is over n <= 10,000 small canvases
        for _ in range(int(rng.integers(1, 4))):
            cy, cx = rng.uniform(4, size - 4, 2)
            r = rng.uniform(3, size / 3)
            kind = int(rng.integers(0, 3))
            if kind == 0:  # axis-aligned rectangle with its own aspect ratio
                h = r * rng.uniform(0.4, 1.0)
                mask = (np.abs(yy - cy) <= h) & (np.abs(xx - cx) <= r)
            else:  # disc, or ring of width 2 px
                d = np.hypot(yy - cy, xx - cx)
                mask = d <= r if kind == 1 else (d <= r) & (d >= r - 2)
            img[mask] = rng.uniform(0.4, 1.0)
    return out


def shapes_dir(data_root: str | Path) -> Path:
    """The folder of the demo's OOD set (the registry's `demo_shapes` layout)."""
    return Path(data_root) / SHAPES_DIR


def write_shapes(data_root: str | Path, n: int, seed: int = 0) -> Path:
    """Write `n` shape images unless the same are there; atomic (a folder appears whole). Returns the folder."""
    from PIL import Image

    out = shapes_dir(data_root)
    want = {"n": int(n), "seed": int(seed), "size": IMAGE_SIZE}
    try:
        if json.loads((out / RECORD).read_text(encoding="utf-8")) == want:
            return out
    except (OSError, ValueError):
        pass
    rgb = to_rgb_uint8(shapes(n, seed))
    with atomic_dir(out) as tmp:
        (tmp / "images").mkdir()
        for i, img in enumerate(rgb):
            Image.fromarray(img, "RGB").save(tmp / "images" / f"{i:05d}.png")
        (tmp / RECORD).write_text(json.dumps(want), encoding="utf-8")
    return out


def ood_sentence(metrics: pl.DataFrame) -> str:
    """One sentence: does ZAEC help or hurt telling Fashion-MNIST from the shapes (beyond the paper)?

    Per (backbone, method) of the OOD runs (dataset `<ood>@<id>`), the max-softmax OOD AUROC and FPR95 of
    `zaec-calibrate` (`ood_auroc_msp`, `ood_fpr95_msp`), raw (`none`) and `zaec`, over the TTA methods (not the
    zero-shot run, which ZAEC leaves unchanged). ZAEC "helps" when it raises AUROC and lowers FPR95 in most pairs
    and on average, "hurts" when it lowers AUROC and raises FPR95 in most pairs and on average, "mixed" when those
    disagree, otherwise neither clearly (`verdict.raw_vs_zaec`).
    Pairs with an undefined metric (NaN) are left out.
    """
    head = "OOD detection (beyond the paper; Fashion-MNIST against synthetic shapes): "
    need_cols = {"dataset", "backbone", "method", "calibrator", "ood_auroc_msp", "ood_fpr95_msp"}
    if not need_cols <= set(metrics.columns):
        return head + "undecided, the metrics table has no ood_auroc_msp/ood_fpr95_msp columns."
    # a zero-shot run's adapted logits are its zero-shot logits, which ZAEC leaves unchanged: only the TTA methods
    # can say whether ZAEC helps or hurts (their ties would only dilute the count)
    rows = metrics.filter(pl.col("dataset").str.contains("@", literal=True) & (pl.col("method") != "zero-shot")
                          & pl.col("calibrator").is_in(["none", "zaec"]))
    c = raw_vs_zaec(rows, ("ood_auroc_msp", "ood_fpr95_msp"), higher_is_better=(True, False))
    if c is None:
        return head + "undecided, no OOD run has raw and ZAEC rows with defined metrics."
    (au0, au1), (fpr0, fpr1) = c.means["ood_auroc_msp"], c.means["ood_fpr95_msp"]
    return head + (
        f"{c.says('OOD detection')} here ({', '.join(c.methods)}; {c.n} backbone-method pairs): AUROC "
        f"{100 * au0:.1f}% raw -> {100 * au1:.1f}% with ZAEC (higher is "
        f"better; higher in {c.better['ood_auroc_msp']} of {c.n}), FPR at 95% TPR {100 * fpr0:.1f}% -> "
        f"{100 * fpr1:.1f}% (lower is better; lower in {c.better['ood_fpr95_msp']} of {c.n}), both from the max "
        "softmax probability.")


def run_ood_pair(cfg: Any, model_dirs: Mapping[str, Path], *, say: Callable[..., Any],
                 log: Callable[[str], None]) -> str:
    """Write the shapes, run `OOD_METHODS` on the pair for every backbone, calibrate, and return `ood_sentence`
    (a sentence saying it was skipped when the demo did not write the clean set).

    Args:
        cfg: the demo's `DemoConfig` (data_root, work_dir, shards, cache, seed, device, workers).
        model_dirs: backbone name -> its local-dir model folder.
        say: the demo's console print; log: where the extractor's one-line notes go.
    """
    from calibrate.run import calibrate_paths, write_metrics
    from extract.datasets import load_testset
    from tools.demo.shifts import is_written
    from extract.runner import run_extraction

    if not is_written(cfg.data_root, "clean"):
        return "OOD detection (beyond the paper): not run, the demo's sets do not include the clean set (fmnist)."
    n_id = len(load_testset(ID_KEY, cfg.data_root))
    write_shapes(cfg.data_root, n_id)
    root = Path(cfg.work_dir) / "ood-shards"
    for name, folder in model_dirs.items():
        for method in OOD_METHODS:
            run_extraction(method, OOD_KEY, ood_for=ID_KEY, pretrained=f"local-dir:{folder}", data_root=cfg.data_root,
                           out=root, seed=cfg.seed, device=cfg.device, cache_dir=cfg.cache, workers=cfg.workers,
                           progress=False, log=log, on_changed="recompute")
    # temperature scaling is fitted on the clean runs' shards (its labelled source), as for the shifted sets
    sources = [p for m in OOD_METHODS for p in Path(cfg.shards).glob(f"backbone=*/dataset={ID_KEY}/method={m}")]
    report = calibrate_paths([root, *sources], calibrators="none,temperature,sals,zaec", ts_source=ID_KEY)
    write_metrics(report, Path(cfg.work_dir) / "ood-calibrate")
    sentence = ood_sentence(report.metrics)
    say(f"  {OOD_KEY}@{ID_KEY}: {', '.join(OOD_METHODS)} x {len(model_dirs)} backbones, {n_id} + {n_id} images; "
        f"metrics in {Path(cfg.work_dir) / 'ood-calibrate' / 'metrics.csv'}", highlight=False)
    return sentence


def append_to_summary(path: Path, sentence: str) -> None:
    """Add the OOD sentence to the demo's summary file as its last paragraph (the file was just written whole)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(f"\n{sentence}\n")
