"""TTL: test-time low-rank adaptation of the image encoder (`Razaimam45/TTL-Test-Time-Low-Rank-Adaptation @cc754df`,
`ttl.py`, `deyo.py`, `clip/custom_clip.py`; docs/methods.md, "TTL: LoRA on the image encoder").

Per test sample (LoRA reset before every sample): LoRA of rank 16 and alpha 32 (scale 2) on the query and value
projections of the last 3 vision blocks (9-11 of ViT-B/16), A drawn once per run (`xavier_normal_`), B = 0. The 64
views (original + 63 crop+flip) go through the adapted encoder; with H_i the softmax entropy of view i's logits,
the views with H_i <= ln 1000 (all of them for K <= 1000) give

    L = mean_i H_i · exp(0.4 − H_i)         (the weight detached: DeYO's entropy re-weighting)

one AdamW step (lr 5e-3, weight decay 0.01) on A and B; the prediction is the adapted encoder's logits on the
original view against the frozen prompt features "a photo of a {class}.".

The image encoder is adapted, so the method cannot run from cached final features: the runner attaches a reader of
the views' pixels (`attach_views`; extract/run/pixels.py, the same views as the encoding pass). Per sample the
blocks before the LoRA blocks run once, without gradient, on the 64 views; their output tokens are the input of
every step and of the prediction (view 0). Caching those tokens instead is not worth it: 197 × 768 × 64 values per
ViT-B/16 sample (19 MB in fp16, about 1 TB for ImageNet) take longer to read back than the 9 blocks take to
recompute on a GPU (docs/benchmarks.md).

Precision: on CUDA with `amp`, autocast fp16 with fp32 weights and LoRA factors, and one dynamic loss scale
emulating GradScaler(init_scale=1000) for the run (skipped step and halved scale on a non-finite gradient, doubled
after 2000 finite steps); fp32 on the CPU.

Where this differs from the official code: open_clip's ViT with its fused input projection (the q and v slices of
`in_proj`, as TTA-VLM does) instead of HuggingFace's `openai/clip-vit-base-patch16` with separate q_proj/v_proj
(the same weights); A is drawn from `lora_seed`, not from the global RNG state after model creation; LoRA dropout
(0.05) is omitted, as the official model runs in eval mode where it is off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch
import torch.nn.functional as F

from extract.methods.base import (VIT_TOWERS, MethodConfig, PromptSet, Ref, Towers, TTAMethod, check_hparams_key,
                                  check_ranges, setting)
from extract.methods.tpt import MixedPrecision
from extract.methods.view_pixels import ViewPixels


@dataclass(frozen=True)
class TTLConfig(MethodConfig):
    """TTL's settings (scripts/test_ttl.sh; `ttl.py` argparse defaults where the script is silent)."""

    n_views: int = 64  # BS=64: the original + 63 views
    augmix: bool = False  # data/datautils.py:136 empties AugMix's operation list: crop+flip views on every set
    prompts: PromptSet = field(default="single", metadata={"fixed": True})  # CTX_INIT a_photo_of_a, no grad
    cupl: bool = field(default=False, metadata={"fixed": True})
    episodic: bool = field(default=True, metadata={"fixed": True})
    lr: float = setting(5e-3, ge=0)  # LR=5e-3
    weight_decay: float = setting(0.01, ge=0)  # torch.optim.AdamW default (`AdamW(parameters_to_optimize, lr=args.lr)`)
    beta1: float = setting(0.9, ge=0, lt=1)
    beta2: float = setting(0.999, ge=0, lt=1)
    adam_eps: float = setting(1e-8, gt=0)
    # TTA_STEPS=1; the loops nest (`test_time_tuning` x DeYO's steps): tta_steps² updates
    tta_steps: int = setting(1, ge=0)
    rank: int = setting(16, ge=1)  # LoraConfig(r=16) (`get_coop` drops --rank, so always 16)
    lora_alpha: float = setting(32.0, ge=0)  # LoraConfig(lora_alpha=32): scale alpha / r = 2
    # LAYER_RANGE=9,11: the last 3 of ViT-B/16's 12 vision blocks
    lora_blocks: int = setting(3, ge=1, le=Ref("vision_blocks", of_model=True))
    margin_e0: float = setting(0.4, ge=0)  # --deyo_margin_e0 0.4: weight 1 / exp(H - 0.4)
    # deyo.py: views with H <= ln 1000 (filter_ent=0, filter_plpd=0)
    entropy_filter: float = setting(math.log(1000), ge=0)
    # the generator of A (xavier_normal_); the official A comes from the global RNG, seed 0
    lora_seed: int = setting(0, ge=0)
    amp: bool = True  # autocast (fp16) + dynamic loss scale on CUDA; ignored on the CPU (fp32)
    grad_scale_init: float = setting(1000.0, gt=0)  # GradScaler(init_scale=1000)
    grad_scale_growth_interval: int = setting(2000, ge=1)  # GradScaler default


#: what TTL does with the image tower (its `towers` and the check on the loaded model say it)
TTL_USE = "adapts the attention of a ViT image encoder (LoRA on q, v of its last blocks)"


def vision_tower(model: Any, backbone: str, key: str = "ttl", why: str = TTL_USE) -> Any:
    """open_clip's VisionTransformer of `model`, or a one-line error naming why method `key` cannot adapt it (TTL;
    DART prompts the same blocks)."""
    from open_clip.transformer import ResidualAttentionBlock, VisionTransformer

    visual = getattr(model, "visual", None)
    if not isinstance(visual, VisionTransformer):
        kind = type(visual).__name__ if visual is not None else "no"
        raise ValueError(f"{key} {why}; {backbone} has a {kind} image encoder; use a ViT backbone such as ViT-B-16")
    blocks = visual.transformer.resblocks
    if not getattr(visual.transformer, "batch_first", True) or not all(
            type(b) is ResidualAttentionBlock and isinstance(b.attn, torch.nn.MultiheadAttention)
            and b.attn._qkv_same_embed_dim for b in blocks):
        raise ValueError(f"{key}: {backbone}'s vision blocks are not open_clip's plain batch-first attention blocks")
    return visual


def lora_attention_block(blk: Any, x: torch.Tensor, lora: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """open_clip's `ResidualAttentionBlock.forward` (batch first, no mask) with LoRA on the q and v projections.

    q = W_q·h + b_q + scale·B_q A_q h and v likewise, h = ln_1(x): peft's `Linear` on HuggingFace's q_proj/v_proj,
    here on the q and v slices of the fused `in_proj`.

    Args:
        blk: the block; x: (N, T, W) tokens; lora: (A_q, B_q, A_v, B_v), A (r, W), B (W, r).

    Returns:
        (N, T, W) the block's output.
    """
    attn = blk.attn
    a_q, b_q, a_v, b_v = lora
    h = blk.ln_1(x)
    q, k, v = F.linear(h, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    q = q + scale * F.linear(F.linear(h, a_q), b_q)
    v = v + scale * F.linear(F.linear(h, a_v), b_v)
    n, t, w = x.shape
    heads = attn.num_heads

    def split(z: torch.Tensor) -> torch.Tensor:  # (N, T, W) -> (N, H, T, W/H)
        return z.reshape(n, t, heads, w // heads).transpose(1, 2)

    o = F.scaled_dot_product_attention(split(q), split(k), split(v))
    o = F.linear(o.transpose(1, 2).reshape(n, t, w), attn.out_proj.weight, attn.out_proj.bias)
    x = x + blk.ls_1(o)
    return x + blk.ls_2(blk.mlp(blk.ln_2(x)))


class TTL(ViewPixels, MixedPrecision, TTAMethod):
    """TTL: per sample, LoRA on the last vision blocks tuned on DeYO-weighted entropy of the 64 views, episodic."""

    key: ClassVar[str] = "ttl"
    prefix_stable: ClassVar[bool] = True  # episodic; the views' pixels are read at the sample's own position
    Config: ClassVar[type[MethodConfig]] = TTLConfig
    needs_text_encoder: ClassVar[bool] = True  # the runner passes the model (its image encoder is adapted)
    # the runner attaches a reader of the views' pixels (`ViewPixels`: `consumes = "view_pixels"`)
    pixels_use: ClassVar[str] = "adapts the image encoder"
    _state_fields: ClassVar[tuple[str, ...]] = ("loss_scale", "skipped_steps")
    # Unseen data: TTL has one setting for every set
    unseen_like: ClassVar[str] = "dtd"

    @classmethod
    def towers(cls, config: MethodConfig) -> Towers:
        return Towers(image=VIT_TOWERS, image_use=TTL_USE)  # `vision_tower` checks the loaded model

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        cfg: TTLConfig = self.config  # type: ignore[assignment]
        self.visual = vision_tower(getattr(text_encoder, "model", text_encoder), backbone)
        blocks = self.visual.transformer.resblocks
        # the run's plan checked lora_blocks against the architecture's config where it could read one; this is the
        # check for a model whose config it could not (one line, before any image is read)
        check_ranges(cfg, self.key, {"vision_blocks": len(blocks)})  # as `extract.models.architecture_facts`
        self.first_lora = len(blocks) - cfg.lora_blocks
        width = blocks[0].attn.embed_dim
        g = torch.Generator().manual_seed(cfg.lora_seed)
        std = math.sqrt(2.0 / (cfg.rank + width))  # xavier_normal_ on A (r, W), gain 1
        # per LoRA block: (A_q, B_q, A_v, B_v), restored before every sample (`LoRA_AB.reset`)
        self.lora_init = [(torch.randn(cfg.rank, width, generator=g) * std, torch.zeros(width, cfg.rank),
                           torch.randn(cfg.rank, width, generator=g) * std, torch.zeros(width, cfg.rank))
                          for _ in range(self.first_lora, len(blocks))]
        self._init_loss_scale()
        self._lora_dev: list[tuple[torch.Tensor, ...]] | None = None  # `lora_init` on the adapting device

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> TTLConfig:
        check_hparams_key(hparams_key)
        return TTLConfig()  # one setting for every set (scripts/test_ttl.sh)

    def prefix_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) images -> (N, T, W) tokens entering the first LoRA block (frozen, no gradient)."""
        with torch.no_grad(), self._autocast(images.device):
            x = self.visual._embeds(images)
            for blk in self.visual.transformer.resblocks[:self.first_lora]:
                x = blk(x)
        return x

    def features(self, tokens: torch.Tensor, lora: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        """(N, T, W) prefix tokens -> (N, D) L2-normalised image features of the LoRA-adapted blocks + head."""
        cfg: TTLConfig = self.config  # type: ignore[assignment]
        x = tokens
        for blk, ab in zip(self.visual.transformer.resblocks[self.first_lora:], lora):
            x = lora_attention_block(blk, x, ab, cfg.lora_alpha / cfg.rank)
        pooled, _ = self.visual._pool(x)
        if self.visual.proj is not None:
            pooled = pooled @ self.visual.proj
        return F.normalize(pooled.float() if pooled.dtype == torch.float16 else pooled, dim=-1)

    def loss(self, logits: torch.Tensor) -> torch.Tensor | None:
        """DeYO's loss on (V, K) logits: mean over views with H <= entropy_filter of H / exp(H − margin_e0), the
        weight detached (deyo.py `forward_and_adapt_sar`); None when no view passes (no step)."""
        cfg: TTLConfig = self.config  # type: ignore[assignment]
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
        ent = ent[ent <= cfg.entropy_filter]
        if ent.numel() == 0:
            return None
        coeff = 1 / torch.exp(ent.detach() - cfg.margin_e0)
        return ent.mul(coeff).mean(0)

    def _adapt_one(self, images: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """One sample: (V, 3, S, S) views -> (K,) logits of view 0 after tuning."""
        cfg: TTLConfig = self.config  # type: ignore[assignment]
        dev = images.device
        amp = self._use_amp(dev)
        tokens = self.prefix_tokens(images)
        lora = [[p.clone().requires_grad_(True) for p in ab] for ab in self._lora_on(dev)]
        params = [p for ab in lora for p in ab]
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                                weight_decay=cfg.weight_decay)
        for _ in range(cfg.tta_steps ** 2):
            with self._autocast(dev):
                logits = self.logit_scale * self.features(tokens, lora) @ text.T
                loss = self.loss(logits)
            if loss is None:  # no view passed the filter: neither a step nor a scale update
                continue
            self._scaled_step(params, loss, opt, amp)
        with torch.no_grad(), self._autocast(dev):
            return (self.logit_scale * self.features(tokens[:1], lora) @ text.T)[0].float()

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        b, v, _ = view_feats.shape
        dev = view_feats.device
        dtype = self.visual.conv1.weight.dtype
        text = self.text_features.to(dev, dtype)  # the encoder's dtype (float64 prototypes in exact tests)
        # one sample's views at a time: a batch of 64 x 64 views at 224 px would be 2.5 GB
        return torch.stack([self._adapt_one(self.views_of(self.n_seen + i, 1, v)[0].to(dev, dtype), text)
                            for i in range(b)])

    def _lora_on(self, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
        """`lora_init` on `device`, copied there once (not 12 small copies per sample)."""
        if self._lora_dev is None or self._lora_dev[0][0].device != device:
            self._lora_dev = [tuple(p.to(device) for p in ab) for ab in self.lora_init]
        return self._lora_dev

    def summary(self) -> dict[str, Any]:
        """Steps skipped for a non-finite loss or gradient, and the loss scale now (also on the CPU, where it stays
        at `grad_scale_init`)."""
        return {"skipped_steps": int(self.skipped_steps), "loss_scale": float(self.loss_scale["scale"])}
