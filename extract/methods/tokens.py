"""What a method that works inside the image encoder needs from open_clip's towers (CALIP, TCA; docs/methods.md,
"Methods inside the image encoder, training-free (CALIP, TCA)"): the token map before pooling, the checks that a
loaded tower is one whose forward the method re-writes, the precision the run encodes in, and `EncoderMethod`, the
base class of such a method (the model, the tower check, view 0's pixels).

The token map is each token of the last layer carried through the head as the pooled feature is:

* ViT (`open_clip.transformer.VisionTransformer`): every token after the final LayerNorm and the projection,
  ``ln_post(x) @ proj`` -> (N, 1 + grid², D); token 0 is the pooled (class-token) feature;
* ResNet (`open_clip.modified_resnet.ModifiedResNet`): every token through the attention pool, whose queries are
  the mean token and the HW spatial tokens (the pool's own forward keeps only the first) -> (N, 1 + HW, D).

Both are what CALIP's official `clip/model.py` (ZiyuGuo99/CALIP @83e21b6, l.66-89 and l.218-233) returns in place
of the pooled feature.
"""

from __future__ import annotations

import contextlib
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Sequence

import torch
import torch.nn.functional as F

from extract.methods.base import MethodConfig, Towers, TTAMethod
from extract.methods.view_pixels import ViewPixels


def encoder_autocast(loaded: Any, device: torch.device) -> Any:
    """The precision the run encodes its images in (`extract.models.LoadedModel.precision`): autocast fp16 for
    "amp" on CUDA, else none (fp32, or the weights' own dtype). A bare open_clip model (tests) runs in its dtype."""
    if getattr(loaded, "precision", "fp32") == "amp" and device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.float16)
    return contextlib.nullcontext()


def plain_vit_refusal(visual: Any) -> str | None:
    """Why `visual` is not open_clip's plain ViT (class token pooled after `ln_post`, batch-first blocks of
    `ResidualAttentionBlock` with a fused `nn.MultiheadAttention`), or None when it is."""
    from open_clip.transformer import ResidualAttentionBlock, VisionTransformer

    if not isinstance(visual, VisionTransformer):
        return f"a {type(visual).__name__ if visual is not None else 'missing'} image encoder"
    if visual.attn_pool is not None or visual.pool_type != "tok" or visual.final_ln_after_pool:
        return "a ViT pooled otherwise than by its class token after ln_post"
    if not getattr(visual.transformer, "batch_first", True) or not all(
            type(b) is ResidualAttentionBlock and isinstance(b.attn, torch.nn.MultiheadAttention)
            and b.attn._qkv_same_embed_dim for b in visual.transformer.resblocks):
        return "a ViT whose blocks are not open_clip's plain batch-first attention blocks"
    return None


def token_map_refusal(visual: Any) -> str | None:
    """Why `token_map` cannot read `visual`'s tokens, or None (a plain ViT or a ModifiedResNet)."""
    from open_clip.modified_resnet import ModifiedResNet

    if isinstance(visual, ModifiedResNet):
        return None
    return plain_vit_refusal(visual)


def _attnpool_tokens(pool: Any, x: torch.Tensor) -> torch.Tensor:
    """open_clip's `AttentionPool2d.forward` with every query kept: (N, C, H, W) -> (N, 1 + HW, D)."""
    x = x.flatten(2).permute(2, 0, 1)  # (HW, N, C)
    x = torch.cat([x.mean(dim=0, keepdim=True), x], dim=0) + pool.positional_embedding[:, None, :].to(x.dtype)
    out, _ = F.multi_head_attention_forward(
        query=x, key=x, value=x, embed_dim_to_check=x.shape[-1], num_heads=pool.num_heads,
        q_proj_weight=pool.q_proj.weight, k_proj_weight=pool.k_proj.weight, v_proj_weight=pool.v_proj.weight,
        in_proj_weight=None, in_proj_bias=torch.cat([pool.q_proj.bias, pool.k_proj.bias, pool.v_proj.bias]),
        bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0, out_proj_weight=pool.c_proj.weight,
        out_proj_bias=pool.c_proj.bias, use_separate_proj_weight=True, training=False, need_weights=False)
    return out.transpose(0, 1)


@torch.no_grad()
def token_map(visual: Any, images: torch.Tensor) -> torch.Tensor:
    """(N, 3, S, S) preprocessed images -> (N, T, D) tokens of the last layer through the head (not normalised):
    T = 1 + grid² for a ViT, 1 + HW for a ResNet; token 0 is the model's pooled image feature.

    Raises:
        ValueError: a tower `token_map_refusal` names.
    """
    from open_clip.modified_resnet import ModifiedResNet

    if isinstance(visual, ModifiedResNet):
        x = visual.stem(images)
        for layer in (visual.layer1, visual.layer2, visual.layer3, visual.layer4):
            x = layer(x)
        return _attnpool_tokens(visual.attnpool, x)
    why = plain_vit_refusal(visual)
    if why is not None:
        raise ValueError(f"the token map of {why} is not read")
    x = visual.ln_post(visual.transformer(visual._embeds(images)))
    return x @ visual.proj if visual.proj is not None else x


class EncoderMethod(ViewPixels, TTAMethod):
    """A method that runs the frozen image encoder itself on view 0's pixels (CALIP, TCA): the runner passes the
    model (`needs_text_encoder`) and attaches a reader of the views' pixels (`ViewPixels`: `consumes="view_pixels"`,
    `extract/run/pixels.py`); the tower is checked when the method is built, before any image is read.

    Subclasses define `image_towers` (the kinds of `extract.models.IMAGE_TOWERS` they run on: the plan's check,
    `towers`), `tower_refusal` (why a loaded tower cannot be used, or None: the last guard) and `tower_need` (what
    the method needs, for the one-line error).
    """

    needs_text_encoder: ClassVar[bool] = True
    image_towers: ClassVar[frozenset[str]]
    tower_need: ClassVar[str]
    # Unseen data: ImageNet's row; no per-dataset templates exist for a user's classes: the 80 CLIP templates
    unseen_like: ClassVar[str] = "imagenet"
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({"prompts": "imagenet80"})

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        self.visual = getattr(getattr(text_encoder, "model", text_encoder), "visual", None)
        why = self.tower_refusal(self.visual)
        if why is not None:  # one line, before any image is read
            raise ValueError(f"{self.key} {self.tower_need}; {backbone} has {why}")

    @classmethod
    def towers(cls, config: MethodConfig) -> Towers:
        return Towers(image=cls.image_towers, image_use=cls.tower_need)

    @classmethod
    def tower_refusal(cls, visual: Any) -> str | None:
        """Why the method cannot run on the image tower `visual`, or None."""
        raise NotImplementedError

    def view0_pixels(self, start: int, n: int, v: int, device: torch.device) -> torch.Tensor:
        """View 0 of stream positions [start, start + n): (n, 3, S, S) on `device` in the encoder's dtype."""
        return self.views_of(start, n, v)[:, 0].to(device, self.visual.conv1.weight.dtype)
