"""What the methods inside the image encoder (CALIP, TCA) cost per sample on this machine, and what caching CALIP's
token map instead would cost (docs/benchmarks.md, "Methods inside the image encoder: cost per sample").

For each backbone (random open_clip weights; one torch thread, CPU time of this thread):

    pixels       a 500x375 JPEG read and preprocessed at the model's size by the run's own reader of view pixels
                 (`extract.run.pixels.ViewImages`, one sample at a time in the main process)
    encode       the frozen encoder's pooled feature per image, in batches of `--batch` (the encoding pass's forward)
    token map    the same forward keeping every token (`extract.methods.tokens.token_map`), per image, batched
    calip        CALIP's attention over one sample's token map at K classes (`calip_logits`), per sample
    memmap read  one sample's token map (T x D fp16) read back from a memory-mapped file in stream order (what a
                 cache would cost to read; the file was just written, so this is the page cache's speed, a floor)
    tca          (ViTs) TCA's condensing forward for one image (B = 1, the reservoir's context tokens on), and the
                 plain forward at B = 1 beside it, and TCA's reservoir step at K classes with a full reservoir

and the bytes a token-map cache holds per sample and for ImageNet's 50,000 images.

    python -m tools.bench_tokens [--backbones ViT-B-16,RN50] [--images 8] [--k 1000] [--repeat 3] [--json FILE]
    python -m tools.bench_tokens --tiny          # small models: the code path in seconds
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

#: ImageNet's validation images (the issue's reference size for a token-map cache)
IMAGENET_N = 50_000
#: small models for `--tiny`: a 10-block ViT (TCA condenses blocks 3, 6, 9) and a ResNet, 64 px
TINY_CFGS = {
    "ViT-B-16": {"embed_dim": 32, "quick_gelu": True, "vision_cfg": {"image_size": 64, "layers": 10, "width": 32,
                                                                    "head_width": 16, "patch_size": 8},
                 "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}},
    "RN50": {"embed_dim": 32, "quick_gelu": True, "vision_cfg": {"image_size": 64, "layers": [1, 1, 1, 1],
                                                                "width": 16},
             "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}},
}


def _cpu_ms(fn: Callable[[], Any], repeat: int) -> float:
    """CPU milliseconds of this thread per call of `fn`, after one untimed call."""
    fn()
    t = time.thread_time()
    for _ in range(repeat):
        fn()
    return 1000 * (time.thread_time() - t) / repeat


def _model(backbone: str, tiny: bool, work: Path) -> Any:
    """A random open_clip model of `backbone` (or its tiny stand-in) loaded as the run loads one."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    from extract.models import load_model

    cfg = TINY_CFGS[backbone] if tiny else open_clip.get_model_config(backbone)
    torch.manual_seed(0)
    path = work / f"model-{backbone}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "open_clip_config.json").write_text(json.dumps({"model_name": backbone, "model_cfg": cfg}))
    state = {k: v.contiguous() for k, v in open_clip.CLIP(**cfg).state_dict().items()}
    save_file(state, str(path / "open_clip_model.safetensors"))
    return load_model(None, f"local-dir:{path}", "cpu")


def pixel_ms(model: Any, work: Path, n: int, repeat: int) -> float:
    """The run's reader of view 0's pixels, per sample (JPEG decode and preprocess)."""
    from extract.datasets import load_testset
    from extract.run.pixels import ViewImages
    from extract.run.stream import stream_permutation
    from tools.bench_extract import write_image_set

    root = write_image_set(work / f"jpegs-{n}", n, n_classes=2, size=(500, 375), ext="jpg")
    ts = load_testset("dtd", root)
    reader = ViewImages(model, ts, stream_permutation("dtd", 1, n), "single", 1)
    return _cpu_ms(lambda: reader.get(0, n), repeat) / n


def memmap_ms(work: Path, n: int, t: int, d: int, repeat: int) -> float:
    """One sample's (T, D) fp16 token map read from a memory-mapped file, rows in stream order, per sample."""
    path = work / "tokens.npy"
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, t, d))
    arr[:] = np.random.default_rng(0).standard_normal((n, t, d)).astype(np.float16)
    arr.flush()
    del arr
    back = np.load(path, mmap_mode="r")
    return _cpu_ms(lambda: [np.array(back[i], dtype=np.float32) for i in range(n)], repeat) / n


def encoder_costs(model: Any, images: Any, k: int, repeat: int) -> dict[str, Any]:
    """Per image: the pooled feature, the token map (batched), CALIP's attention at K classes; the map's size."""
    import torch
    import torch.nn.functional as F

    from extract.methods.calip import CALIPConfig, calip_logits
    from extract.methods.tokens import token_map

    visual = model.model.visual
    n = images.shape[0]
    with torch.no_grad():
        tokens = F.normalize(token_map(visual, images), dim=-1)
        text = F.normalize(torch.randn(k, tokens.shape[-1]), dim=-1)
        return {"encode_ms": _cpu_ms(lambda: model.encode_images(images), repeat) / n,
                "token_map_ms": _cpu_ms(lambda: token_map(visual, images), repeat) / n,
                "calip_ms": _cpu_ms(lambda: calip_logits(tokens[:, 0], tokens[:, 1:], text, 100.0, CALIPConfig()),
                                    repeat) / n,
                "tokens": int(tokens.shape[1]), "dim": int(tokens.shape[2])}


def tca_costs(model: Any, images: Any, k: int, repeat: int) -> dict[str, float]:
    """Per sample: TCA's forward with its context tokens on, the plain forward at B = 1, the reservoir step."""
    import torch
    import torch.nn.functional as F

    from extract.methods.tca import TCA

    cfg = TCA.default_config("imagenet", "ViT-B-16")
    text = F.normalize(torch.randn(k, model.model.visual.output_dim), dim=-1)
    m = TCA(cfg, text, 100.0, backbone="bench", dataset="imagenet", text_encoder=model)
    one = images[:1]
    feat, cls = m.forward(one)
    m.res_counts = [cfg.reservoir_size] * k  # a full reservoir, every class's context on
    m.res_tokens = cls[None, None].repeat(k, cfg.reservoir_size, 1, 1) + 0.01 * torch.randn(
        k, cfg.reservoir_size, *cls.shape)
    m.res_entropy = torch.rand(k, cfg.reservoir_size)
    m._refresh_context(None)
    with torch.no_grad():
        return {"tca_forward_ms": _cpu_ms(lambda: m.forward(one), repeat),
                "plain_b1_ms": _cpu_ms(lambda: model.encode_images(one), repeat),
                "tca_step_ms": _cpu_ms(lambda: m._step(feat, cls, text), repeat)}


def bench_backbone(backbone: str, *, tiny: bool, n: int, k: int, work: Path, repeat: int = 3) -> dict[str, Any]:
    """Every figure of one backbone (module docstring)."""
    import torch

    model = _model(backbone, tiny, work)
    s = model.preprocess.size[0]
    images = torch.randn(n, 3, s, s)
    out: dict[str, Any] = {"pixels_ms": pixel_ms(model, work, n, repeat), **encoder_costs(model, images, k, repeat)}
    out["memmap_ms"] = memmap_ms(work, max(n, 64), out["tokens"], out["dim"], repeat)
    out["cache_bytes_per_sample"] = 2 * out["tokens"] * out["dim"]  # fp16
    out["cache_bytes_imagenet"] = IMAGENET_N * out["cache_bytes_per_sample"]
    if model.model.visual.__class__.__name__ == "VisionTransformer":
        out.update(tca_costs(model, images, k, repeat))
    return out


@app.command()
def run(backbones: str = typer.Option("ViT-B-16,RN50", help="comma-separated open_clip architectures"),
        images: int = typer.Option(8, min=1, help="images per batch (pixels, encode, token map)"),
        k: int = typer.Option(1000, min=2, help="classes of CALIP's attention and TCA's reservoir"),
        tiny: bool = typer.Option(False, "--tiny", help="small models instead (a smoke run)"),
        repeat: int = typer.Option(3, min=1, help="timed calls per figure (after one untimed call)"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="also write the figures to this JSON file"))\
        -> None:
    """Print the figures (CPU ms per sample, one thread) and the size of a token-map cache."""
    import torch
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory(prefix="zaec-bench-tokens-") as tmp:
        for bb in (b.strip() for b in backbones.split(",") if b.strip()):
            results[bb] = bench_backbone(bb, tiny=tiny, n=images, k=k, work=Path(tmp), repeat=repeat)
    table = Table(title=f"inside the image encoder: CPU ms per sample, one thread (K = {k})")
    cols = ("pixels_ms", "encode_ms", "token_map_ms", "calip_ms", "memmap_ms", "tca_forward_ms", "plain_b1_ms",
            "tca_step_ms")
    table.add_column("backbone")
    for c in (*cols, "tokens x dim", "cache GB (ImageNet, fp16)"):
        table.add_column(c.removesuffix("_ms"), justify="right")
    for bb, r in results.items():
        table.add_row(bb, *(f"{r[c]:.3f}" if c in r else "-" for c in cols), f"{r['tokens']} x {r['dim']}",
                      f"{r['cache_bytes_imagenet'] / 1e9:.2f}")
    Console(emoji=False, width=200).print(table)
    if json_out is not None:
        json_out.write_text(json.dumps(results, indent=1))


def main(argv: list[str] | None = None) -> None:
    app(args=argv, prog_name="python -m tools.bench_tokens")


if __name__ == "__main__":
    main()
