"""Tiny random second models for the methods that read files beyond the CLIP checkpoint (`external_files`), built
offline from configs: DiffTPT's image-variation pipeline (diffusers), PromptAlign's MaPLe prompts and statistics.
Nothing is downloaded.

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


def maple_shapes(model) -> tuple[int, int, int]:
    """(text width, vision width, image tokens without the prompts) of an open_clip CLIP (a `LoadedModel` or bare)."""
    m = getattr(model, "model", model)
    return m.ln_final.weight.shape[0], m.visual.conv1.out_channels, m.visual.positional_embedding.shape[0]


def make_tiny_maple(path: Path, model, *, n_ctx: int = 2, depth: int = 3, seed: int = 0,
                    fmt: str = "dassl") -> Path:
    """MaPLe's prompts for `model`, random: `prompt_learner.ctx` (n_ctx, Wt), `.proj.*` (Wt -> Wv),
    `.compound_prompts_text.i` and `.compound_prompt_projections.i.*` for i < depth − 1, beside the model's own
    `image_encoder.conv1.weight` (MaPLe's checkpoints hold the whole CLIP).

    fmt "dassl": as dassl's `save_checkpoint` writes it ({"state_dict", "epoch", "optimizer", "scheduler",
    "val_result"}), the scheduler entry holding a pickled torch LR scheduler object (with its optimiser), which
    `torch.load(weights_only=True)` refuses; "state_dict": the bare state dict (torch.save); "safetensors"."""
    import torch

    wt, wv, _ = maple_shapes(model)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    sd = {"prompt_learner.ctx": rnd(n_ctx, wt, std=0.5), "prompt_learner.proj.weight": rnd(wv, wt, std=0.2),
          "prompt_learner.proj.bias": rnd(wv)}
    for i in range(depth - 1):
        sd[f"prompt_learner.compound_prompts_text.{i}"] = rnd(n_ctx, wt, std=0.5)
        sd[f"prompt_learner.compound_prompt_projections.{i}.weight"] = rnd(wv, wt, std=0.2)
        sd[f"prompt_learner.compound_prompt_projections.{i}.bias"] = rnd(wv)
    sd["image_encoder.conv1.weight"] = getattr(model, "model", model).visual.conv1.weight.detach().clone()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    elif fmt == "state_dict":
        torch.save(sd, path)
    else:
        lin = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(lin.parameters(), lr=0.0026, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 2)
        torch.save({"state_dict": sd, "epoch": 2, "optimizer": opt.state_dict(),
                    "scheduler": {"successor": sched, "warmup_epoch": 1}, "val_result": None}, path)
    return path


def make_tiny_stats(prefix: Path, model, *, n_ctx: int = 2, layers: int | None = None, seed: int = 1
                    ) -> tuple[Path, Path]:
    """Random token statistics of the prompted image tower of `model` as PromptAlign reads them: two torch files
    `<prefix>_vis_means.pt`, `<prefix>_vis_vars.pt` with one (layers, T, Wv) tensor each (variances positive)."""
    import torch

    _, wv, n_img = maple_shapes(model)
    layers = layers if layers is not None else len(getattr(model, "model", model).visual.transformer.resblocks)
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(layers, n_img + n_ctx, wv, generator=g) * 0.3
    variances = torch.rand(layers, n_img + n_ctx, wv, generator=g) + 0.2
    paths = (Path(f"{prefix}_vis_means.pt"), Path(f"{prefix}_vis_vars.pt"))
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    torch.save(means, paths[0])
    torch.save(variances, paths[1])
    return paths


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
        if key == "promptalign":  # MaPLe as deep as the tiny model allows (its one vision block: shallow)
            depth = min(3, len(self.model.model.visual.transformer.resblocks))
            maple = make_tiny_maple(self.root / "maple" / "model.pth.tar-2", self.model, depth=depth)
            means, variances = make_tiny_stats(self.root / "stats" / "tiny", self.model)
            return {"maple_weights": str(maple), "vis_means": str(means), "vis_vars": str(variances)}
        if key == "rlcf":  # the policy as its own reward model (a second CLIP: tests/extract/methods/test_rlcf.py)
            return {"reward_backbone": "policy"}
        raise KeyError(f"no tiny external files for method {key!r}: add them to tests/support/second_models.py")
