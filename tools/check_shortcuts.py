"""Do the TPT family's execution-only shortcuts change a result that matters? One run with them, one without.

The shortcuts (docs/methods.md, "Execution-only knobs") change no formula, but under fp16 autocast they change
which fp16 roundings happen (other summation orders, other batch shapes), and Adam's first step moves each context
coordinate by about lr * sign(gradient), so a coordinate whose gradient is near zero can flip. The logits then
differ by up to about 1% (measured under emulated autocast on the CPU). Whether that moves accuracy or calibration
is a question for a trained model on a GPU: this command runs a TPT-family method twice on the same features,
with the defaults and with `text_shortcuts=false, pass_memory_fraction=0` (the full 77-token text tower and the
`pass_budget` pass sizes), and prints accuracy, ECE and how far the logits moved.

    python -m tools.check_shortcuts --pretrained local-dir:data/models/fmnist-ViT --dataset fmnist_blur \
        --data-root data/datasets --device cuda --limit 1000 [--methods tpt,atpt] [--json FILE]

The demo's trained models and sets (`make demo`) are small real models with real accuracy and calibration; any
`local-dir:` model and dataset works. On the CPU (fp32) both runs agree to float32 rounding.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

#: the overrides that turn the execution-only shortcuts off
WITHOUT_SHORTCUTS = {"text_shortcuts": "false", "pass_memory_fraction": "0"}
#: ECE bins (TTABC: 20 equal-width bins)
ECE_BINS = 20


def _logits(paths: Sequence[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sample_id, label, adapted logits) of a run's shards, sorted by sample id."""
    from schemas.shard import read_shard

    shards = [read_shard(p) for p in paths]
    ids = np.concatenate([s.sample_id for s in shards])
    order = np.argsort(ids, kind="stable")
    return (ids[order], np.concatenate([s.label for s in shards])[order],
            np.concatenate([s.tta_logits for s in shards])[order].astype(np.float64))


def _metrics(labels: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    from calibrate.metrics import ece

    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    pred = p.argmax(axis=1)
    correct = pred == labels
    return {"accuracy": float(correct.mean()), "ece": float(ece(p.max(axis=1), correct, ECE_BINS))}


def compare(method: str, dataset: str, *, model: Any, data_root: Optional[Path], limit: Optional[int],
            work: Path, seed: int = 1, workers: Optional[int] = None) -> dict[str, Any]:
    """Both runs of `method` on `dataset` (same cached features), and how they differ."""
    from extract.runner import run_extraction

    runs = {}
    for name, overrides in (("shortcuts", {}), ("no_shortcuts", WITHOUT_SHORTCUTS)):
        paths = run_extraction(method, dataset, model=model, data_root=data_root, out=work / name, seed=seed,
                               limit=limit, overrides=overrides, cache_dir=work / "cache", workers=workers,
                               progress=False, force=True)
        runs[name] = _logits(paths)
    (ids_a, labels, a), (ids_b, _, b) = runs["shortcuts"], runs["no_shortcuts"]
    if not np.array_equal(ids_a, ids_b):
        raise RuntimeError("the two runs hold different samples")
    scale = float(np.abs(b).max())
    return {
        "method": method, "dataset": dataset, "n": int(len(labels)),
        "shortcuts": _metrics(labels, a), "no_shortcuts": _metrics(labels, b),
        "max_abs_logit_diff": float(np.abs(a - b).max()), "logit_scale_max": scale,
        "argmax_agreement": float((a.argmax(1) == b.argmax(1)).mean()),
    }


@app.command()
def main(
    pretrained: str = typer.Option(..., help="weights: `local-dir:DIR` (e.g. a demo model), a file or a tag"),
    dataset: str = typer.Option(..., help="dataset key (e.g. fmnist_blur for the demo's blurred set)"),
    data_root: Optional[Path] = typer.Option(None, help="datasets folder (the demo's: data/datasets)"),
    methods: str = typer.Option("tpt", help="comma-separated TPT-family methods (tpt, ctpt, otpt, atpt)"),
    device: Optional[str] = typer.Option(None, help="torch device (default: cuda if available)"),
    limit: Optional[int] = typer.Option(1000, help="first N stream positions (0: all)"),
    seed: int = typer.Option(1, help="run seed"),
    workers: Optional[int] = typer.Option(None, help="image-loading processes (default: 0 on CPU, up to 16 on "
                                                      "CUDA)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="also write the figures as JSON"),
) -> None:
    """Run each method with and without its execution-only shortcuts; print accuracy, ECE and logit changes."""
    from rich.console import Console
    from rich.table import Table

    from extract.cli import _user_errors
    from extract.methods import get_method
    from extract.models import load_model

    console, err = Console(emoji=False), Console(stderr=True, emoji=False)
    keys = [m.strip() for m in methods.split(",") if m.strip()]
    work = Path(tempfile.mkdtemp(prefix="zaec-shortcuts-"))
    try:
        for key in keys:
            if not get_method(key).needs_text_encoder:
                raise ValueError(f"--methods: {key} has no text-encoder shortcuts; expected TPT-family methods such "
                                 "as tpt, ctpt, otpt, atpt")
        model = load_model(None, pretrained, device)
        rows = [compare(key, dataset, model=model, data_root=data_root, limit=limit or None, work=work, seed=seed,
                        workers=workers) for key in keys]
    except _user_errors() as e:
        err.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    t = Table(title=f"{model.backbone} on {model.device.type} ({model.precision}): with / without the shortcuts")
    for col in ("method", "n", "accuracy", "ECE (%)", "max |logit diff|", "argmax agreement"):
        t.add_column(col, justify="right")
    for r in rows:
        s, o = r["shortcuts"], r["no_shortcuts"]
        t.add_row(r["method"], str(r["n"]), f"{100 * s['accuracy']:.2f} / {100 * o['accuracy']:.2f}",
                  f"{100 * s['ece']:.2f} / {100 * o['ece']:.2f}",
                  f"{r['max_abs_logit_diff']:.3g} (of {r['logit_scale_max']:.3g})", f"{r['argmax_agreement']:.4f}")
    console.print(t)
    if json_out is not None:
        from schemas.atomic import write_json_atomic
        write_json_atomic(json_out, {"device": model.device.type, "precision": model.precision,
                                     "backbone": model.backbone, "rows": rows})


def run(argv: list[str] | None = None) -> None:
    """Entry point: a usage error is one line on stderr, exit 2."""
    import sys

    from calibrate.cli_errors import run_app

    run_app(app, list(argv if argv is not None else sys.argv[1:]) or ["--help"], "python -m tools.check_shortcuts")


if __name__ == "__main__":
    run()
