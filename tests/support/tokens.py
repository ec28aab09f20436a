"""Small open_clip models for the methods that work inside the image encoder (CALIP, TCA): a ViT deep enough for
TCA's condensed blocks 3, 6 and 9 and a ModifiedResNet with a 2 x 2 attention-pool grid, as `LoadedModel`s and as
`local-dir:` folders (the run's own loading path).

    model = deep_vit(dtype=torch.float64)            # LoadedModel, 10 blocks, 64 px, patch 8: 65 tokens
    folder = write_model_dir(tmp_path / "rn", rn_cfg(), "tiny-rn")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.extract import TINY_MEAN, TINY_STD, _build, tiny_model_cfg

TEXT_CFG = tiny_model_cfg()["text_cfg"]  # the tiny model's one-layer text tower
SIZE = 64  # pixels: a 8 x 8 patch grid (ViT) and a 2 x 2 attention-pool grid (ResNet)
LOGIT_SCALE = 37.5  # the tiny models' (`tests.support.extract._build`): not OpenAI's 100, so a hard-coded 100 shows


def vit_cfg(layers: int = 10) -> dict:
    """A ViT of width 32 (2 heads), `layers` blocks, patch 8 on 64 px, embedding 16."""
    return {"embed_dim": 16, "quick_gelu": True, "text_cfg": TEXT_CFG,
            "vision_cfg": {"image_size": SIZE, "layers": layers, "width": 32, "head_width": 16, "patch_size": 8}}


def rn_cfg() -> dict:
    """A ModifiedResNet of width 8 (one bottleneck per stage; attention pool of 256 channels, 4 heads) on 64 px."""
    return {"embed_dim": 16, "quick_gelu": True, "text_cfg": TEXT_CFG,
            "vision_cfg": {"image_size": SIZE, "layers": [1, 1, 1, 1], "width": 8}}


def build(cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The open_clip CLIP of `cfg` with random weights (BatchNorm statistics randomised too), eval mode."""
    model = _build(cfg, seed)
    with torch.no_grad():
        for mod in model.modules():  # a ResNet's fresh BatchNorms are the identity: give them statistics
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.running_mean.normal_(0, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
                mod.weight.uniform_(0.5, 1.5)
    return model.eval().requires_grad_(False).to(dtype)


def loaded(model, name: str):
    """`model` as the run hands it to a method (`extract.models.LoadedModel`, fp32 precision on the CPU)."""
    from extract.models import LoadedModel, Preprocess

    return LoadedModel(model, None, name, "none", name, True, Preprocess((SIZE, SIZE), TINY_MEAN, TINY_STD),
                       LOGIT_SCALE, torch.device("cpu"), "fp32", name)


def deep_vit(dtype: torch.dtype = torch.float32, layers: int = 10):
    return loaded(build(vit_cfg(layers), dtype=dtype), "tiny-deep-vit")


def tiny_rn(dtype: torch.dtype = torch.float32):
    return loaded(build(rn_cfg(), dtype=dtype), "tiny-rn")


def write_model_dir(path: Path, cfg: dict, name: str, seed: int = 0) -> Path:
    """A `local-dir:` folder (`open_clip_config.json` + safetensors) holding `build(cfg, seed)`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    doc = {"model_name": name, "model_cfg": cfg,
           "preprocess_cfg": {"mean": list(TINY_MEAN), "std": list(TINY_STD), "interpolation": "bicubic",
                              "resize_mode": "shortest"}}
    (path / "open_clip_config.json").write_text(json.dumps(doc))
    state = {k: v.detach().clone().contiguous() for k, v in build(cfg, seed).state_dict().items()}
    save_file(state, str(path / "open_clip_model.safetensors"))
    return path
