"""A stand-in for COSMIC's DINOv2 folder, built offline with random weights for the benches and the tests: a timm
folder of DINOv2's ViT-L/14 with registers (`vit_large_patch14_reg4_dinov2`), in the layout the real one has
(`config.json` + `model.safetensors`, as `huggingface-cli download timm/vit_large_patch14_reg4_dinov2.lvd142m`
writes it). COSMIC's rows with it mean nothing; its cost does (the official architecture), or, tiny, the cost of
everything but the encoder.

    write_dino_dir(work / "dino", tiny=False)   # ViT-L/14, 304 M parameters, 1.2 GB of float32 weights
"""

from __future__ import annotations

import json
from pathlib import Path

#: the tiny stand-in: 2 blocks of width 24, 2 heads, 8 px patches (any input size that is a multiple of 8)
TINY_DINO_ARGS = {"patch_size": 8, "embed_dim": 24, "depth": 2, "num_heads": 2}
DINO_ARCH = "vit_large_patch14_reg4_dinov2"


def write_dino_dir(path: Path, *, tiny: bool, img_size: int | None = None, seed: int = 0) -> Path:
    """Write the stand-in folder (random weights drawn from `seed`): tiny (`TINY_DINO_ARGS`, at `img_size`, default
    32) or DINOv2's ViT-L/14 with registers at its own 518 px (the runner builds it at the policy's input size)."""
    import timm
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    args = {**TINY_DINO_ARGS, "img_size": img_size or 32} if tiny else {"img_size": img_size or 518}
    model = timm.create_model(DINO_ARCH, pretrained=False, num_classes=0, **args)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    size = args["img_size"]
    cfg = {"architecture": DINO_ARCH, "num_classes": 0, "model_args": args,
           "pretrained_cfg": {"input_size": [3, size, size], "num_classes": 0, "crop_pct": 1.0,
                              "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}
    (path / "config.json").write_text(json.dumps(cfg))
    return Path(path)
