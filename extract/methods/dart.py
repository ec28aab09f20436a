"""DART: dual-modal adaptive online prompting and knowledge retention (AAAI'24, `zhoujiahuan1991/AAAI2024-DART
@dbdfa2b`, `main.py`, `clip/my_clip_CSTP.py`, `utils/ema.py`, `data/datautils.py`; the command of `readme.md`).

Spec: docs/methods.md, "DART (`dart`)".

Prompts: a class-specific text context (K, 4, W) - the token embeddings at positions 1..4 of each class's own prompt
(`init_text_prompts`, CSTP) - and an image prompt: one key token and one value token added to the attention of
vision block 1 (prefix tuning, `ResidualAttentionBlock_forward_prefix`), drawn from U(−1, 1) once.

State over the stream: the image prompt, the exponential averages ("shadows") of the text contexts (K, 4, W) and of
the image prompt per class (K, 2, W) (`utils/ema.py`), the loss scale. Per sample with its 64 views:

1. Text context c = 0.1·shadow_text + 0.9·c_init (reset, then `Text_EMA.apply_shadow`); a fresh AdamW (lr 5e-3,
   weight decay 0.01) over c and the image prompt p.
2. One step on the marginal entropy of the int(64·0.1) = 6 views of lowest entropy of s·f_v(p)·t(c)ᵀ, where f_v(p)
   are the prompted image features (the image encoder runs on the views' pixels) and t(c) the text features.
3. The views again with the tuned c, p: ŷ₁ = argmax of the mean logits of their 6 most confident views;
   p ← 0.1·shadow_img[ŷ₁] + 0.9·p (`Image_EMA.apply_shadow_one`).
4. Prediction z = s·f_0(p)·t(c)ᵀ on the original view; ŷ = argmax z, w = max z;
   shadow_text[ŷ] ← d·shadow_text[ŷ] + (1 − d)·c[ŷ] and shadow_img[ŷ] ← d·shadow_img[ŷ] + (1 − d)·p with
   d = exp(−w / 5000) (`update_one_weight`, h = 5000 for both).

The official prompt text is `ctx_init.replace("-", " ").replace("CLS", name)` with `ctx_init = "a_photo_of_a_CLS"`:
its `.replace("_", " ")` is overwritten on the next line, so the prompt is "a_photo_of_a_goldfish" and its context
tokens 1..4 are "a", "_", "photo", "_" (CLIP's tokenizer splits "_" off). Kept (`template`); `--set
template="a photo of a CLS"` gives the evident intent.

The image encoder is prompted, so the method reads the views' pixels (`consumes = "view_pixels"`, as TTL). The blocks
before the prompted one run once per sample without gradient; their tokens feed every pass of that sample.

Numerics: fp32 weights and prompts; on CUDA with `amp`, autocast (fp16) and one dynamic loss scale emulating the
run's `GradScaler(init_scale=1000)` (a non-finite step is skipped and halves the scale; 2000 finite steps double it).
fp32 on the CPU. Where this differs from the official code: the image prompt is drawn from `image_prompt_seed`, not
from CUDA's generator after seeding; the re-evaluation of step 3 runs without gradient (the official builds an
unused graph; the same numbers); ties of the view selection are broken by view index (a stable sort).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch
import torch.nn.functional as F

from extract.methods.base import (
    IMAGENET_FAMILY,
    PROMPT_TUNING,
    VIT_TOWERS,
    MethodConfig,
    PromptSet,
    Ref,
    Towers,
    TTAMethod,
    check_hparams_key,
    check_ranges,
    setting,
    text_setting,
)
from extract.methods.common import marginal_entropy, n_confident, softmax_entropy
from extract.methods.tpt import MixedPrecision
from extract.methods.ttl import vision_tower
from extract.methods.view_pixels import ViewPixels


def dart_prompt(template: str, name: str) -> str:
    """DART's prompt of a class (`init_text_prompts`): `template.replace("-", " ").replace("CLS", name)`.

    >>> dart_prompt("a_photo_of_a_CLS", "goldfish")
    'a_photo_of_a_goldfish'
    """
    return template.replace("-", " ").replace("CLS", name)


def prefix_attention_block(blk: Any, x: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """open_clip's `ResidualAttentionBlock.forward` (batch first, no mask) with DART's prefix: one key token and one
    value token inserted after the class token into the keys and values (`ResidualAttentionBlock_forward_prefix`:
    `k = cat([q[0], prompt_k, q[1:]])`, `v` likewise, with q = ln_1(x); the prompt is not layer-normed and goes
    through the key / value projections as the other tokens).

    Args:
        blk: the block; x: (N, T, W) tokens; prompt: (2, W) the key and the value token.

    Returns:
        (N, T, W).
    """
    attn = blk.attn
    n, t, w = x.shape
    h = blk.ln_1(x)
    w_q, w_k, w_v = attn.in_proj_weight.chunk(3)
    b_q, b_k, b_v = attn.in_proj_bias.chunk(3) if attn.in_proj_bias is not None else (None, None, None)

    def with_token(tok: torch.Tensor) -> torch.Tensor:  # (N, T + 1, W)
        return torch.cat([h[:, :1], tok.to(h.dtype).expand(n, 1, w), h[:, 1:]], dim=1)

    q = F.linear(h, w_q, b_q)
    k = F.linear(with_token(prompt[0]), w_k, b_k)
    v = F.linear(with_token(prompt[1]), w_v, b_v)
    heads = attn.num_heads

    def split(z: torch.Tensor) -> torch.Tensor:  # (N, L, W) -> (N, H, L, W/H)
        return z.reshape(n, z.shape[1], heads, w // heads).transpose(1, 2)

    o = F.scaled_dot_product_attention(split(q), split(k), split(v))
    o = F.linear(o.transpose(1, 2).reshape(n, t, w), attn.out_proj.weight, attn.out_proj.bias)
    x = x + blk.ls_1(o)
    return x + blk.ls_2(blk.mlp(blk.ln_2(x)))


@dataclass(frozen=True)
class DARTConfig(MethodConfig):
    """DART's settings: `main.py` argparse defaults and the command of `readme.md`."""

    n_views: int = 64  # -b 64: the original + 63 views
    augmix: bool = True  # `AugMixAugmenter(..., augmix=len(set_id) > 1)`: set per dataset in `default_config`
    # the prompts are DART's own (`template`); the run's prototypes are only the anchor's
    prompts: PromptSet = field(default="single", metadata={"fixed": True})
    cupl: bool = field(default=False, metadata={"fixed": True})
    episodic: bool = field(default=False, metadata={"fixed": True})  # the prompts and their averages carry over
    template: str = text_setting("a_photo_of_a_CLS", nonempty=True)  # --ctx_init default ("CLS": the class name)
    n_ctx: int = setting(4, ge=1)  # --n_ctx 4: learnable tokens 1..4 of each class's prompt (--learnable_text a)
    lr: float = setting(5e-3, ge=0)  # --lr 5e-3
    weight_decay: float = setting(0.01, ge=0)  # torch.optim.AdamW default (`AdamW(trainable_param, args.lr)`)
    beta1: float = setting(0.9, ge=0, lt=1)
    beta2: float = setting(0.999, ge=0, lt=1)
    adam_eps: float = setting(1e-8, gt=0)
    tta_steps: int = setting(1, ge=1)  # --tta_steps 1 (0 would leave the official step 3 undefined)
    selection_p: float = setting(0.1, gt=0, le=1)  # --selection_p 0.1
    text_ema_w: float = setting(0.1, ge=0, le=1)  # readme: --text_prompt_ema_w=0.1
    text_ema_h: float = setting(5000.0, gt=0)  # readme: --text_prompt_ema_one_weight_h=5000
    image_ema_w: float = setting(0.1, ge=0, le=1)  # readme: --image_prompt_ema_w=0.1
    image_ema_h: float = setting(5000.0, gt=0)  # readme: --image_prompt_ema_h=5000
    # --image_prompt_layer [1]: the second vision block
    image_prompt_layer: int = setting(1, ge=0, le=Ref("vision_blocks", -1, of_model=True))
    # the generator of the image prompt's U(-1, 1) draw (the official draws it on CUDA after seeding 0)
    image_prompt_seed: int = setting(0, ge=0)
    amp: bool = True  # autocast + GradScaler(init_scale=1000) on CUDA (main.py); ignored on the CPU (fp32)
    grad_scale_init: float = setting(1000.0, gt=0)
    grad_scale_growth_interval: int = setting(2000, ge=1)  # GradScaler default
    # Execution only: run each prompt only up to its end-of-text token (exact under the causal mask;
    # extract/text_encoder.py). False runs the full sequences.
    text_shortcuts: bool = True


#: what DART does with the image tower (its `towers` and the check on the loaded model say it)
DART_USE = "prompts the attention of a ViT image encoder (a key and a value token in one block)"


class DART(ViewPixels, MixedPrecision, TTAMethod):
    """Online dual-modal prompting: per-sample tuning of class-specific text contexts and a visual prefix, both
    kept as per-class exponential averages that seed the next samples."""

    key: ClassVar[str] = "dart"
    prefix_stable: ClassVar[bool] = True  # the prompts and averages hold only samples already seen
    Config: ClassVar[type[MethodConfig]] = DARTConfig
    needs_text_encoder: ClassVar[bool] = True  # the runner passes the model (its image encoder is prompted)
    # the runner attaches a reader of the views' pixels (`ViewPixels`: `consumes = "view_pixels"`)
    pixels_use: ClassVar[str] = "prompts the image encoder"
    _state_fields: ClassVar[tuple[str, ...]] = ("image_prompt", "text_shadow", "image_shadow", "loss_scale",
                                                "skipped_steps")
    # unseen data: one setting for every set but the views; the fine-grained sets' AugMix views
    unseen_like: ClassVar[str] = "dtd"

    @classmethod
    def towers(cls, config: MethodConfig) -> Towers:
        # both towers: `vision_tower` and the `PromptTextEncoder` check the loaded model
        return dataclasses.replace(PROMPT_TUNING, image=VIT_TOWERS, image_use=DART_USE)

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        from extract.text_encoder import PromptTextEncoder

        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        cfg: DARTConfig = self.config  # type: ignore[assignment]
        if class_names is None or len(class_names) != self.n_classes:
            raise ValueError(f"{self.key} builds one prompt per class and needs the {self.n_classes} class_names")
        if "CLS" not in cfg.template:
            raise ValueError(f"{self.key}: template {cfg.template!r} has no 'CLS' for the class name")
        model = getattr(text_encoder, "model", text_encoder)
        self.visual = vision_tower(model, backbone, self.key, DART_USE)
        blocks = self.visual.transformer.resblocks
        check_ranges(cfg, self.key, {"vision_blocks": len(blocks)})  # a model whose config the plan could not read
        self.prompts = PromptTextEncoder(model, text_encoder.tokenizer, class_names, truncate=cfg.text_shortcuts,
                                         share_prefix=False, n_ctx=cfg.n_ctx,
                                         prompts=[dart_prompt(cfg.template, n) for n in class_names])
        self.text_init = self.prompts.ctx_init  # (K, n_ctx, W) fp32: each class's own tokens 1..n_ctx
        g = torch.Generator().manual_seed(cfg.image_prompt_seed)
        width = blocks[0].attn.embed_dim
        # (2, W): the key and the value token, U(-1, 1) (`torch.empty(...).uniform_(-1, 1)`), fp32
        self.image_prompt = (torch.rand(2, width, generator=g) * 2 - 1).to(self.prompts.device)
        self.text_shadow = self.text_init.clone()  # `Text_EMA` registers the initial context
        self.image_shadow = self.image_prompt[None].repeat(self.n_classes, 1, 1)  # `class_image_prompts`
        self._init_loss_scale()

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> DARTConfig:
        check_hparams_key(hparams_key)
        return DARTConfig(augmix=hparams_key not in IMAGENET_FAMILY)

    # -- pieces --------------------------------------------------------------------------------------------------
    def prefix_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) images -> (N, T, W) tokens entering the prompted block (frozen, no gradient)."""
        layer = self.config.image_prompt_layer  # type: ignore[attr-defined]
        with torch.no_grad(), self._autocast(images.device):
            x = self.visual._embeds(images)
            for blk in self.visual.transformer.resblocks[:layer]:
                x = blk(x)
        return x

    def features(self, tokens: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        """(N, T, W) prefix tokens and the (2, W) image prompt -> (N, D) L2-normalised image features."""
        blocks = self.visual.transformer.resblocks
        layer = self.config.image_prompt_layer  # type: ignore[attr-defined]
        x = prefix_attention_block(blocks[layer], tokens, prompt)
        for blk in blocks[layer + 1:]:
            x = blk(x)
        pooled, _ = self.visual._pool(x)
        if self.visual.proj is not None:
            pooled = pooled @ self.visual.proj
        return pooled / pooled.norm(dim=-1, keepdim=True)

    def _confident(self, logits: torch.Tensor) -> torch.Tensor:
        """The int(V·p) views of lowest entropy (TPT's `select_confident_samples`): (n, K) of (V, K)."""
        n = n_confident(logits.shape[0], self.config.selection_p)  # type: ignore[attr-defined]
        return logits[torch.argsort(softmax_entropy(logits.detach()), stable=True)[:n]]

    def _tune(self, tokens: torch.Tensor, ctx: torch.Tensor, prompt: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1-2 and the re-evaluation of step 3 for one sample: a fresh AdamW over the text context and the
        image prompt, `tta_steps` loss-scaled steps on the marginal entropy of the confident views.

        Returns:
            (tuned context (K, n_ctx, W), tuned prompt (2, W), its text features (K, D), the mean logits of the
            confident views after the last step (K,)).
        """
        cfg: DARTConfig = self.config  # type: ignore[assignment]
        dev = tokens.device
        amp = self._use_amp(dev)
        ctx = ctx.detach().clone().requires_grad_(True)
        prompt = prompt.detach().clone().requires_grad_(True)
        opt = torch.optim.AdamW([ctx, prompt], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                                weight_decay=cfg.weight_decay)  # `optimizer.load_state_dict(optim_state)`
        for _ in range(cfg.tta_steps):
            with self._autocast(dev):
                logits = self._logits(self.features(tokens, prompt), self.prompts(ctx))  # (V, K)
                loss = marginal_entropy(self._confident(logits)).float()
            self._scaled_step([ctx, prompt], loss, opt, amp)
        with torch.no_grad(), self._autocast(dev):  # step 3's views again, after the last step
            text = self.prompts(ctx)
            mean = self._confident(self._logits(self.features(tokens, prompt), text)).mean(0)
        return ctx.detach(), prompt.detach(), text, mean

    def _adapt_one(self, images: torch.Tensor) -> torch.Tensor:
        """One sample: (V, 3, S, S) views -> (K,) logits of the original view; updates the prompt and averages."""
        cfg: DARTConfig = self.config  # type: ignore[assignment]
        dev = images.device
        tokens = self.prefix_tokens(images)
        start = cfg.text_ema_w * self.text_shadow + (1.0 - cfg.text_ema_w) * self.text_init  # `apply_shadow`
        ctx, prompt, text, mean = self._tune(tokens, start, self.image_prompt)
        first = int(mean.argmax())
        prompt = cfg.image_ema_w * self.image_shadow[first] + (1.0 - cfg.image_ema_w) * prompt  # `apply_shadow_one`
        with torch.no_grad(), self._autocast(dev):
            z = self._logits(self.features(tokens[:1], prompt), text)[0]
        pred, weight = int(z.argmax()), float(z.max())
        d = math.exp(-weight / cfg.text_ema_h)  # `update_one_weight`
        self.text_shadow[pred] = d * self.text_shadow[pred] + (1.0 - d) * ctx[pred]
        d = math.exp(-weight / cfg.image_ema_h)
        self.image_shadow[pred] = d * self.image_shadow[pred] + (1.0 - d) * prompt
        self.image_prompt = prompt
        return z.float()

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        b, v, _ = view_feats.shape
        dev = view_feats.device
        dtype = self.visual.conv1.weight.dtype
        self._loss_scaling = self._use_amp(dev)
        if self.image_prompt.device != dev:  # (a state loaded on another device)
            for name in ("image_prompt", "text_shadow", "image_shadow", "text_init"):
                setattr(self, name, getattr(self, name).to(dev))
        out = []
        for i in range(b):  # one sample's views at a time: each sample starts from the averages the last one left
            out.append(self._adapt_one(self.views_of(self.n_seen + i, 1, v)[0].to(dev, dtype)))
        return torch.stack(out)
