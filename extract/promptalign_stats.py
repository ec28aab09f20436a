"""`zaec-promptalign-stats`: PromptAlign's source statistics, the per-layer token means and variances of the
MaPLe-prompted image encoder over a folder of images (ImageNet), written as the two files PromptAlign reads
(`--set vis_means=... --set vis_vars=...`; docs/extract.md, "Files a method reads besides the CLIP checkpoint").

    zaec-promptalign-stats --maple-weights seed1/MultiModalPromptLearner/model.pth.tar-2 \\
        --dataset imagenet --data-root /data --out stats/imagenet        # -> stats/imagenet_vis_{means,vars}.pt

For every image: its original view (the run's view 0: resize the short side, centre crop, normalise), MaPLe's
prompts of `--maple-weights` in the image tower (`extract.methods.promptalign.maple_image_features`), and the input
tokens of every block (after the deep prompts replace the last n_ctx tokens), (T, W) per block. Over all images:
the mean and the population variance of each (block, token, channel), accumulated in float64 (batches merged with
Chan's update), written as two (blocks, T, W) float32 tensors with `torch.save` (the layout of PromptAlign's
`ImgNetpre_vis_means.pt` / `_vis_vars.pt`, read back with `weights_only=True`).

PromptAlign's repository publishes its files (docs/run.md links them) but not the script that made them; this is
the computation its loss implies (its `save_feature_maps` divides summed token features by the number of images).
Which ImageNet images the official files cover is not stated: `--dataset imagenet` takes the validation folder
(50,000 images); `--dataset folder:PATH` any folder of class folders; `--limit N` the first N of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from extract.defaults import DEFAULT_BACKBONE

PROG = "zaec-promptalign-stats"
app = typer.Typer(add_completion=False, help=__doc__, no_args_is_help=True, pretty_exceptions_enable=False)


class RunningMoments:
    """Mean and population variance of (T, W) arrays over a stream of batches, per position, in float64 (Chan et
    al.'s pairwise merge: exact up to rounding whatever the batching).

    >>> import torch
    >>> m = RunningMoments()
    >>> m.update(torch.tensor([[[1.0]], [[3.0]]])); m.update(torch.tensor([[[5.0]]]))
    >>> float(m.mean[0, 0]), float(m.var[0, 0])
    (3.0, 2.6666666666666665)
    """

    def __init__(self) -> None:
        self.n = 0
        self.mean: Any = None
        self.m2: Any = None

    def update(self, x: Any) -> None:
        """Add a batch (B, T, W) of samples."""
        x = x.detach().cpu().double()  # copied off the device in its own dtype (the conversion is exact)
        b = x.shape[0]
        mean_b = x.mean(0)
        m2_b = ((x - mean_b) ** 2).sum(0)
        if self.n == 0:
            self.n, self.mean, self.m2 = b, mean_b, m2_b
            return
        delta = mean_b - self.mean
        total = self.n + b
        self.mean = self.mean + delta * (b / total)
        self.m2 = self.m2 + m2_b + delta ** 2 * (self.n * b / total)
        self.n = total

    @property
    def var(self) -> Any:
        return self.m2 / self.n


def compute_stats(model: Any, prompts: Any, images: Any) -> tuple[Any, Any]:
    """(means, variances): (blocks, T, W) float32 over the images of `images` (an iterable of (B, 3, S, S)
    preprocessed batches), each block's input tokens under MaPLe's `prompts` (`maple_image_features`)."""
    import torch

    from extract.methods.promptalign import maple_image_features
    from extract.methods.tpt import amp_autocast

    visual = model.model.visual
    blocks = range(len(visual.transformer.resblocks))
    moments = [RunningMoments() for _ in blocks]
    amp = model.precision == "amp" and model.device.type == "cuda"  # the run's precision: autocast fp16 on CUDA
    with torch.no_grad():
        for x in images:
            with amp_autocast(amp):
                _, tokens = maple_image_features(visual, x.to(model.device), prompts, blocks)
            for m, t in zip(moments, tokens):
                m.update(t)
    means = torch.stack([m.mean for m in moments]).float()
    variances = torch.stack([m.var for m in moments]).float()
    return means, variances


def _batches(testset: Any, preprocess: Any, batch_size: int, limit: int | None) -> Any:
    import torch

    from extract.datasets import open_image
    from extract.views import ViewGenerator

    gen = ViewGenerator(preprocess, "single")
    n = len(testset) if limit is None else min(limit, len(testset))
    for i in range(0, n, batch_size):
        yield torch.stack([gen.original(open_image(p, exif_transpose=testset.exif_transpose,
                                                           max_pixels=testset.max_image_pixels))
                           for p in testset.paths[i:min(i + batch_size, n)]])


@app.command()
def stats(
    maple_weights: Path = typer.Option(..., help="MaPLe's checkpoint (dassl's model.pth.tar-N, or .safetensors)"),
    dataset: str = typer.Option("imagenet", help="the images: a dataset key (imagenet: its validation folder) or "
                                                 "folder:PATH"),
    data_root: Optional[Path] = typer.Option(None, help="folder holding the datasets (default: $ZAEC_DATA_ROOT, "
                                                          "else ./data)"),
    out: Path = typer.Option(..., help="output prefix: writes OUT_vis_means.pt and OUT_vis_vars.pt"),
    backbone: Optional[str] = typer.Option(None, help=f"open_clip model name (default {DEFAULT_BACKBONE})"),
    pretrained: str = typer.Option("openai", help="pretrained tag, checkpoint file, or local-dir:DIR"),
    n_ctx: int = typer.Option(2, help="MaPLe's context tokens (PromptAlign: 2)"),
    prompt_depth: int = typer.Option(3, help="MaPLe's prompt depth J (PromptAlign: 3)"),
    limit: Optional[int] = typer.Option(None, help="only the first N images of the test list"),
    batch_size: int = typer.Option(64, help="images per forward pass"),
    device: Optional[str] = typer.Option(None, help="torch device (default: cuda if available, else cpu)"),
) -> None:
    """Compute and write PromptAlign's source statistics (see the module docstring)."""
    from calibrate.cli_errors import fail

    try:
        paths = write_stats(maple_weights, dataset, data_root, out, backbone=backbone, pretrained=pretrained,
                            n_ctx=n_ctx, prompt_depth=prompt_depth, limit=limit, batch_size=batch_size, device=device)
    except _user_errors() as e:
        fail(PROG, e)
    typer.echo(f"wrote {paths[0]} and {paths[1]}")


def _user_errors() -> tuple[type[BaseException], ...]:
    from extract.datasets import DatasetError
    from extract.models import ModelError

    return (DatasetError, ModelError, ValueError, OSError)


def write_stats(maple_weights: Path, dataset: str, data_root: Path | None, out: Path, *, backbone: str | None,
                pretrained: str, n_ctx: int, prompt_depth: int, limit: int | None, batch_size: int,
                device: str | None) -> tuple[Path, Path]:
    """Load the model and MaPLe's prompts, compute the statistics over the dataset, write both files atomically;
    returns their paths."""
    import torch

    from extract.datasets import load_testset, resolve_dataset
    from extract.methods.promptalign import MaplePrompts, load_maple, maple_towers
    from extract.models import load_model
    from schemas.atomic import atomic_path

    if batch_size < 1 or (limit is not None and limit < 1):
        raise ValueError("--batch-size and --limit must be >= 1")
    testset = load_testset(resolve_dataset(dataset), data_root)  # before the model: a missing folder is said at once
    model = load_model(backbone, pretrained, device)
    _, visual = maple_towers(model.model, model.backbone)
    prompts = load_maple(str(maple_weights), n_ctx=n_ctx, depth=prompt_depth,
                         text_width=model.model.ln_final.weight.shape[0], vision_width=visual.conv1.out_channels)
    prompts = MaplePrompts.from_params([t.to(model.device) for t in prompts.params()])
    means, variances = compute_stats(model, prompts, _batches(testset, model.preprocess, batch_size, limit))
    paths = (Path(f"{out}_vis_means.pt"), Path(f"{out}_vis_vars.pt"))
    for path, t in zip(paths, (means, variances)):
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            torch.save(t.contiguous(), tmp)
    return paths


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (`zaec-promptalign-stats`): a usage error is one line on stderr, exit 2."""
    import sys

    from calibrate.cli_errors import run_app

    run_app(app, list(argv if argv is not None else sys.argv[1:]) or ["--help"], PROG)


if __name__ == "__main__":
    main()
