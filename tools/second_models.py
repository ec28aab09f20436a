"""Stand-ins for the files that methods read besides the CLIP checkpoint (`TTAMethod.external_files`), built offline
with random weights from configs, for the benches and the tests: DiffTPT's image-variation pipeline (diffusers),
PromptAlign's MaPLe prompts and token statistics, COSMIC's DINOv2 (a timm folder). They have the official files'
formats and layouts; a method's rows with them mean nothing, its cost (the same architecture, other numbers) does,
except where said.

    StandIns(work, model).overrides("promptalign")   # the `--set` values that run PromptAlign on `model`

Nothing here downloads anything. RLCF's reward model is another CLIP: `tools.bench_gpu.write_model_dir`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

#: the tiny pipeline's image-encoder input size (its conditioning image) and generated image size
TINY_SD_IN, TINY_SD_OUT = 32, 16


def write_sd_pipeline(path: Path, *, size: Literal["tiny", "official"] = "tiny", seed: int = 0) -> Path:
    """Write a `StableDiffusionImageVariationPipeline` folder with random weights and no safety checker.

    "tiny": a 2-level UNet (8 x 8 latents, cross-attention width 16), a 2-level VAE (16 px images), a one-layer CLIP
    vision encoder with projection (32 px), a CLIP image processor. "official": the architecture of
    lambdalabs/sd-image-variations-diffusers (revision v2.0): Stable Diffusion v1's UNet (860 M parameters, 64 x 64
    latents, cross-attention width 768), its VAE (512 px) and CLIP ViT-L/14's vision tower with projection (224 px)
    - about 4.4 GB of fp32 weights. Both: the PNDM scheduler of that repository (scaled-linear betas 0.00085 to
    0.012, PRK steps skipped, steps offset 1)."""
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionImageVariationPipeline, UNet2DConditionModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    tiny = size == "tiny"
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=4, norm_num_groups=4) if tiny else UNet2DConditionModel(
        sample_size=64, cross_attention_dim=768, attention_head_dim=8,
        block_out_channels=(320, 640, 1280, 1280), layers_per_block=2)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), latent_channels=4,
                        layers_per_block=1, norm_num_groups=4, sample_size=TINY_SD_OUT) if tiny else AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512), latent_channels=4, layers_per_block=2, sample_size=512)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=TINY_SD_IN, patch_size=8, projection_dim=16) if tiny else CLIPVisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=224,
        patch_size=14, projection_dim=768)
    side = TINY_SD_IN if tiny else 224
    pipe = StableDiffusionImageVariationPipeline(
        vae=vae, image_encoder=CLIPVisionModelWithProjection(vision), unet=unet,
        scheduler=PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                num_train_timesteps=1000, skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1),
        safety_checker=None, feature_extractor=CLIPImageProcessor(crop_size={"height": side, "width": side},
                                                                  size={"shortest_edge": side}),
        requires_safety_checker=False)
    pipe.save_pretrained(str(path))
    return Path(path)


def maple_shapes(model: Any) -> tuple[int, int, int]:
    """(text width, vision width, image tokens without the prompts) of an open_clip CLIP (a `LoadedModel` or bare)."""
    m = getattr(model, "model", model)
    return m.ln_final.weight.shape[0], m.visual.conv1.out_channels, m.visual.positional_embedding.shape[0]


def write_maple(path: Path, model: Any, *, n_ctx: int = 2, depth: int = 3, seed: int = 0,
                fmt: Literal["dassl", "state_dict", "safetensors"] = "dassl") -> Path:
    """Random MaPLe prompts for `model`: `prompt_learner.ctx` (n_ctx, Wt), `.proj.*` (Wt -> Wv),
    `.compound_prompts_text.i` and `.compound_prompt_projections.i.*` for i < depth − 1, beside the model's own
    `image_encoder.conv1.weight` (MaPLe's checkpoints hold the whole CLIP).

    fmt "dassl": as dassl's `save_checkpoint` writes MaPLe's ({"state_dict", "epoch", "optimizer", "scheduler",
    "val_result"}), the scheduler entry holding a pickled torch LR scheduler object (with its optimiser), which
    `torch.load(weights_only=True)` refuses; "state_dict": the bare state dict (torch.save); "safetensors"."""
    import torch

    wt, wv, _ = maple_shapes(model)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    sd = {"prompt_learner.ctx": rnd(n_ctx, wt, std=0.5), "prompt_learner.proj.weight": rnd(wv, wt, std=0.2),
          "prompt_learner.proj.bias": rnd(wv)}
    for i in range(depth - 1):
        sd[f"prompt_learner.compound_prompts_text.{i}"] = rnd(n_ctx, wt, std=0.5)
        sd[f"prompt_learner.compound_prompt_projections.{i}.weight"] = rnd(wv, wt, std=0.2)
        sd[f"prompt_learner.compound_prompt_projections.{i}.bias"] = rnd(wv)
    sd["image_encoder.conv1.weight"] = getattr(model, "model", model).visual.conv1.weight.detach().cpu().clone()
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


def write_stats(prefix: Path, model: Any, *, n_ctx: int = 2, layers: int | None = None, seed: int = 1
                ) -> tuple[Path, Path]:
    """Random token statistics of `model`'s prompted image tower as PromptAlign reads them: two torch files
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


#: COSMIC's tiny DINOv2 stand-in: 2 blocks of width 24, 2 heads, 8 px patches (any input size that is a multiple of 8)
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


class StandIns:
    """The stand-in files of every method that declares external files, built once each under `root` on first use
    for `model`; `overrides(key)` is the `--set` values that run the method with them.

    DiffTPT gets the tiny pipeline with `steps` diffusion steps (2 by default: its generation costs nothing like the
    real one's whatever the steps, so the sweep prices DiffTPT with its estimate, extract/sweep/cost.py
    `FIXED_PRICE`) and `views` generated views (None: the official 63, which its tuning's cost depends on).
    PromptAlign gets MaPLe prompts as deep as the model allows (3, the official depth, on a ViT with 3 blocks or more)
    and statistics of its shapes: the official architecture, hence its cost.
    RLCF: the policy as its own reward model. COSMIC gets a random DINOv2 folder (`write_dino_dir`): `dino="tiny"`
    (2 blocks: everything but the encoder's cost) or "official" (ViT-L/14 with registers: its cost too)."""

    def __init__(self, root: Path, model: Any, *, views: int | None = None, steps: int | None = 2,
                 dino: Literal["tiny", "official"] = "tiny"):
        self.root, self.model, self.views, self.steps, self.dino = Path(root), model, views, steps, dino
        self._made: dict[str, dict[str, str]] = {}

    def overrides(self, key: str) -> dict[str, str]:
        if key not in self._made:
            self._made[key] = self._make(key)
        return dict(self._made[key])

    def _make(self, key: str) -> dict[str, str]:
        if key == "difftpt":
            out = {"sd_pipeline": str(write_sd_pipeline(self.root / "sd-pipeline"))}
            if self.views is not None:
                out.update(diffusion_views=str(self.views), diffusion_batch=str(self.views))
            return out | ({"diffusion_steps": str(self.steps)} if self.steps is not None else {})
        if key == "promptalign":
            depth = min(3, len(getattr(self.model, "model", self.model).visual.transformer.resblocks))
            maple = write_maple(self.root / "maple" / "model.pth.tar-2", self.model, depth=depth)
            means, variances = write_stats(self.root / "stats" / "standin", self.model)
            return {"maple_weights": str(maple), "vis_means": str(means), "vis_vars": str(variances)}
        if key == "cosmic":
            return {"dino_weights": str(write_dino_dir(self.root / f"dino-{self.dino}", tiny=self.dino == "tiny"))}
        if key == "rlcf":
            return {"reward_backbone": "policy"}
        raise KeyError(f"no stand-in files for method {key!r}: add them to tools/second_models.py")
