"""Tiny random second models for the methods that read files beyond the CLIP checkpoint (`external_files`), built
offline from configs: DiffTPT's image-variation pipeline (diffusers), PromptAlign's MaPLe prompts and statistics,
COSMIC's DINOv2 (a timm folder). Nothing is downloaded.

    pipe_dir = make_tiny_sd_pipeline(tmp_path / "sd")           # a diffusers folder, 32 px in, 16 px out
    TinyExternals(tmp_path, tiny_model).overrides("difftpt")    # the `--set` values that run it on the tiny model

The session fixture `tiny_externals` (tests/support/extract.py) is a `TinyExternals`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: the tiny pipeline's image-encoder input size (its conditioning image) and generated image size
TINY_SD_IN, TINY_SD_OUT = 32, 16


def make_tiny_sd_pipeline(path: Path, *, seed: int = 0) -> Path:
    """Write a `StableDiffusionImageVariationPipeline` folder with random weights: a 2-level UNet (8 x 8 latents,
    cross-attention width 16), a 2-level VAE (16 px images), a one-layer CLIP vision encoder with projection (32 px,
    transformers), the PNDM scheduler of lambdalabs/sd-image-variations-diffusers (scaled-linear betas 0.00085 to
    0.012, PRK steps skipped, steps offset 1) and a CLIP image processor; no safety checker."""
    import pytest
    import torch

    pytest.importorskip("diffusers", reason="DiffTPT's tests need the diffusion extra: pip install -e "
                                            "'.[extract,diffusion]' (make venv installs it)")
    pytest.importorskip("transformers", reason="DiffTPT's tests need the diffusion extra")
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionImageVariationPipeline, UNet2DConditionModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=4, norm_num_groups=4)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), latent_channels=4,
                        layers_per_block=1, norm_num_groups=4, sample_size=TINY_SD_OUT)
    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=TINY_SD_IN,
        patch_size=8, projection_dim=16))
    scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1)
    processor = CLIPImageProcessor(crop_size={"height": TINY_SD_IN, "width": TINY_SD_IN},
                                   size={"shortest_edge": TINY_SD_IN})
    pipe = StableDiffusionImageVariationPipeline(vae=vae, image_encoder=encoder, unet=unet, scheduler=scheduler,
                                                 safety_checker=None, feature_extractor=processor,
                                                 requires_safety_checker=False)
    pipe.save_pretrained(str(path))
    return Path(path)


#: the tiny DINOv2's width and input size: patches of 8 px on the tiny CLIP's 32 px views
TINY_DINO_DIM, TINY_DINO_SIZE = 24, 32


def make_tiny_dino_folder(path: Path, *, seed: int = 0, img_size: int = TINY_DINO_SIZE) -> Path:
    """A timm folder (`config.json` + `model.safetensors`) of DINOv2's ViT-L/14 with registers
    (`vit_large_patch14_reg4_dinov2`) shrunk by its config: 2 blocks of width 24, 2 heads, patches of 8 px at
    `img_size`, random weights (`pretrained=False`): `tools.dino_stand_in.write_dino_dir(tiny=True)`."""
    from tools.dino_stand_in import TINY_DINO_ARGS, write_dino_dir

    assert TINY_DINO_ARGS["embed_dim"] == TINY_DINO_DIM
    return write_dino_dir(path, tiny=True, img_size=img_size, seed=seed)


class TinyExternals:
    """The tiny external files of every method that declares some, built once each under `root` on first use;
    `overrides(key)` is the `--set` values that run the method with them on the tiny model (fewer generated views
    and diffusion steps than the official 63 and 50, so that a test stays fast)."""

    def __init__(self, root: Path, model: Any):
        self.root, self.model = Path(root), model
        self._made: dict[str, dict[str, str]] = {}

    def overrides(self, key: str) -> dict[str, str]:
        if key not in self._made:
            self._made[key] = self._make(key)
        return dict(self._made[key])

    def _make(self, key: str) -> dict[str, str]:
        if key == "difftpt":
            sd = make_tiny_sd_pipeline(self.root / "sd-pipeline")
            return {"sd_pipeline": str(sd), "diffusion_views": "3", "diffusion_steps": "3", "diffusion_batch": "3"}
        if key == "cosmic":
            return {"dino_weights": str(make_tiny_dino_folder(self.root / "dino"))}
        if key == "rlcf":  # the policy as its own reward model (a second CLIP: tests/extract/methods/test_rlcf.py)
            return {"reward_backbone": "policy"}
        raise KeyError(f"no tiny external files for method {key!r}: add them to tests/support/second_models.py")
