"""`make bench-extract`: extraction-stage timings on the CPU with a small random CLIP and a synthetic image set.

Measured in one process, one run each (ratios, not absolute speeds, are the point):
    * encoding pass alone (fill an empty feature cache) vs one full zero-shot run from an empty cache;
    * TDA with an empty cache vs TDA after another method filled the cache (the cache speed-up);
    * the same for a 64-view (AugMix) method on a smaller set, where view generation dominates;
    * TPT and A-TPT samples/s from cached 64-view features (the text encoder's cost per sample).

    python -m extract.bench [--images 256] [--multi-view-images 8] [--image-size 64]
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def _model_dir(path: Path, image_size: int) -> Path:
    import open_clip
    import torch
    from safetensors.torch import save_file

    cfg = {"embed_dim": 128, "quick_gelu": True,
           "vision_cfg": {"image_size": image_size, "layers": 4, "width": 192, "head_width": 64, "patch_size": 8},
           "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 128, "heads": 2, "layers": 2}}
    torch.manual_seed(0)
    model = open_clip.CLIP(**cfg)
    path.mkdir(parents=True)
    (path / "open_clip_config.json").write_text(json.dumps({"model_name": "bench-vit", "model_cfg": cfg}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "open_clip_model.safetensors"))
    return path


def _dataset(root: Path, n: int, n_classes: int = 10, size: int = 96) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    img_dir = root / "dtd" / "images"
    test = []
    for i in range(n):
        c = i % n_classes
        rel = f"c{c}/{i}.png"
        (img_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(img_dir / rel)
        test.append([rel, c, f"class {c}"])
    (root / "dtd" / "split_zhou_DescribableTextures.json").write_text(json.dumps({"train": [], "val": [],
                                                                                  "test": test}))


def _tpt_rate(model, n_classes: int, n_samples: int, method_key: str = "tpt") -> float:
    """Samples/s of a TPT-family method on random 64-view features: the adaptation alone (text-encoder forward +
    backward and the prediction forward), as the runner feeds it from the feature cache, `adapt_batch` 64."""
    import torch
    import torch.nn.functional as F

    from extract.methods import get_method

    names = [f"class {c}" for c in range(n_classes)]
    text = model.text_prototypes([[f"a photo of a {n}."] for n in names])
    cls = get_method(method_key)
    method = cls(cls.default_config("dtd", model.backbone), text, model.logit_scale, backbone=model.backbone,
                 dataset="dtd", text_encoder=model, class_names=names)
    feats = F.normalize(torch.randn(n_samples, 64, text.shape[1], generator=torch.Generator().manual_seed(0)), dim=-1)
    method.adapt(feats[:2])  # warm-up, not timed
    t = time.perf_counter()
    for i in range(0, n_samples, 64):
        method.adapt(feats[i:i + 64])
    return n_samples / (time.perf_counter() - t)


@app.command()
def main(images: int = typer.Option(256, help="images in the single-view set"),
         multi_view_images: int = typer.Option(8, help="images for the 64-view measurement"),
         image_size: int = typer.Option(64, help="model input size"),
         batch_size: int = typer.Option(128, help="images per encoder call"),
         tpt_samples: int = typer.Option(64, help="samples for the TPT / A-TPT throughput line")) -> None:
    """Print timings and ratios measured in this one run."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from extract.cache import FeatureCache
    from extract.datasets import load_testset
    from extract.models import load_model
    from extract.runner import encode_pass, run_extraction, stream_permutation

    torch.set_num_threads(max(1, torch.get_num_threads()))
    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="zaec-bench-"))
    try:
        model = load_model(None, f"local-dir:{_model_dir(tmp / 'model', image_size)}", "cpu")
        model.encode_images(torch.zeros(batch_size, 3, image_size, image_size))  # warm-up, not timed
        rows = []
        for label, n, overrides in (("1", images, None),
                                    ("64 AugMix", multi_view_images, {"n_views": "64", "augmix": "true"})):
            root = tmp / f"data-{n}"
            _dataset(root, n)
            ts = load_testset("dtd", root)
            perm = stream_permutation("dtd", 1, len(ts))
            common = dict(data_root=root, model=model, progress=False, batch_size=batch_size, overrides=overrides)

            # encoding pass alone, into an empty cache
            cache = FeatureCache(tmp / f"enc-{n}", model.fingerprint, "dtd", ts.fingerprint(), 1, len(ts),
                                 int(model.model.text_projection.shape[1]), model.cache_dtype,
                                 stream_fp=f"bench-{n}")
            policy = "single" if overrides is None else "augmix"
            t0 = time.perf_counter()
            encode_pass(model, ts, perm, cache, policy, len(ts), seed=1, batch_size=batch_size)
            t_enc = time.perf_counter() - t0

            def timed(method: str, out: str, cache_dir: str) -> float:
                t = time.perf_counter()
                run_extraction(method, "dtd", out=tmp / out, cache_dir=tmp / cache_dir, **common)
                return time.perf_counter() - t

            t_zs_cold = timed("zero-shot", f"o1-{n}", f"c1-{n}")
            t_tda_cold = timed("tda", f"o2-{n}", f"c2-{n}")
            t_tda_warm = timed("tda", f"o3-{n}", f"c1-{n}")  # cache filled by the zero-shot run
            rows.append((label, n, t_enc, t_zs_cold, t_tda_cold, t_tda_warm))

        table = Table(title="extraction on the CPU (one run each; seconds)")
        for col in ("views", "images", "encode", "zs cold", "tda cold", "tda warm", "full/enc", "speed-up"):
            table.add_column(col, justify="right")
        for label, n, t_enc, t_zs, t_cold, t_warm in rows:
            table.add_row(label, str(n), f"{t_enc:.2f}", f"{t_zs:.2f}", f"{t_cold:.2f}", f"{t_warm:.2f}",
                          f"{t_zs / t_enc:.2f}x", f"{t_cold / t_warm:.1f}x")
        console.print(table)
        console.print("encode: the encoding pass alone into an empty cache; zs cold: a whole zero-shot run from an "
                      "empty cache; full/enc = zs cold / encode (close to 1: encoding dominates); speed-up = tda cold "
                      "/ tda warm, TDA from an empty cache vs after the zero-shot run filled it.")
        # A-TPT adds its K×K angular term to TPT's step: the ratio shows what that costs
        for k in (10, 100):
            rates = {key: _tpt_rate(model, k, tpt_samples, key) for key in ("tpt", "atpt")}
            console.print(f"TPT samples/s (CPU, small model): {rates['tpt']:.1f}; A-TPT {rates['atpt']:.1f} "
                          f"(atpt/tpt time {rates['tpt'] / rates['atpt']:.2f}x) (K = {k} classes, 64 views, "
                          "adaptation from cached features)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    app()
