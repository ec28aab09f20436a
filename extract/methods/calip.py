"""CALIP: zero-shot enhancement of CLIP with parameter-free attention (Guo et al., AAAI'23; official code
`ZiyuGuo99/CALIP @83e21b6`, `run_imagenet.py`, `clip/model.py`).

docs/methods.md, "CALIP: parameter-free attention between the token map and the text".

Per sample, no state. With F_s (L, D) the image's spatial tokens and f the global token (token 0), both
L2-normalised per token (`extract.methods.tokens.token_map`), and T (K, D) the text prototypes:

    A   = 2 · F_s Tᵀ                                   (L, K)  (`run_imagenet.py:78`, the factor 2: `attn_scale`)
    T_a = F_sᵀ softmax_L(A)                            (D, K)  each class's attention-weighted spatial feature
    V_a = softmax_K(A) T;  v_a = mean_L V_a + max_L V_a (D,)   the text-aware visual feature
    logits = s·f·Tᵀ + β₂ · s·f·T_a + β₃ · s·v_a·Tᵀ     (K,)    s = the model's logit scale (official: 100)

The token map is not in the feature cache: the run hands CALIP the pixels of view 0 (`consumes="view_pixels"`,
`extract/run/pixels.py`) and CALIP runs the frozen encoder on them once more, a batch of samples per call, instead of
caching 1 + grid² tokens per image (docs/methods.md for the sizes and docs/benchmarks.md for the costs behind this
choice). The zero-shot row stays the cached view-0 feature's.

Where this differs from the official code: β₂, β₃ are fixed (TTABC's values, `ttabc/configs/algorithms.py`
@999b436 l.358-364) where the official script searches them on the test labels (`run_imagenet.py:95-122`); the
model's logit scale for the hard-coded 100; the encoder under the run's precision (autocast fp16 on CUDA, fp32
elsewhere) and the attention in fp32, where the official code runs OpenAI's fp16 weights and the attention in fp16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from extract.methods.base import MethodConfig, PromptSet, check_hparams_key, setting
from extract.methods.tokens import EncoderMethod, encoder_autocast, token_map, token_map_refusal


@dataclass(frozen=True)
class CALIPConfig(MethodConfig):
    """CALIP's settings: one row for every dataset and backbone (the official code has ImageNet only)."""

    n_views: int = setting(1, ge=1)  # the original image (`run_imagenet.py:31`, CLIP's preprocess); only view 0 is read
    augmix: bool = False
    # the 7 Tip-Adapter ImageNet templates (`class_template.py:167-175`), TDA's per-dataset templates elsewhere
    prompts: PromptSet = "dataset"
    cupl: bool = False
    # no state: each sample alone, so a resumed run loads the (empty) state of its last kept part instead of
    # replaying the prefix through the encoder
    episodic: bool = field(default=True, metadata={"fixed": True})
    # weights of the text-side and visual-side attention logits: TTABC's fixed values (`ttabc/configs/algorithms.py`
    # @999b436 l.362-363); the official script searches beta2 in [0.001, 2.0] and beta3 in [0.001, 0.1] (200 x 200
    # grid, `configs/imagenet.yaml:16-17`, `run_imagenet.py:97-98`) for the best test accuracy
    beta2: float = setting(1.0, ge=0)
    beta3: float = setting(0.01, ge=0)
    attn_scale: float = setting(2.0, gt=0)  # `A_weight = feat_v^T feat_t * 2` (`run_imagenet.py:78`)


def calip_logits(glob: torch.Tensor, spatial: torch.Tensor, text: torch.Tensor, scale: float, cfg: CALIPConfig
                 ) -> torch.Tensor:
    """CALIP's logits for B samples (the formula of the module docstring; `run_imagenet.py:73-93, 112-113`).

    Args:
        glob: (B, D) global tokens, spatial: (B, L, D) spatial tokens, text: (K, D); all L2-normalised.
        scale: the logit scale s.

    Returns:
        (B, K) logits in the inputs' dtype.
    """
    a = cfg.attn_scale * spatial @ text.T  # (B, L, K)
    text_a = spatial.transpose(1, 2) @ a.softmax(dim=1)  # (B, D, K): softmax over the L tokens, per class
    vis_a = a.softmax(dim=2) @ text  # (B, L, D): softmax over the K classes, per token
    vis_a = vis_a.mean(dim=1) + vis_a.amax(dim=1)  # (B, D)
    l1 = scale * (glob[:, None, :] @ text_a)[:, 0]  # (B, K)
    l2 = scale * vis_a @ text.T
    return scale * glob @ text.T + cfg.beta2 * l1 + cfg.beta3 * l2


class CALIP(EncoderMethod):
    """CALIP: per sample, parameter-free attention between the image's token map and the text prototypes."""

    key: ClassVar[str] = "calip"
    prefix_stable: ClassVar[bool] = True  # no state: each row reads its own sample only
    Config: ClassVar[type[MethodConfig]] = CALIPConfig
    image_towers: ClassVar[frozenset[str]] = frozenset({"vit", "resnet"})  # `token_map_refusal` on the loaded model
    tower_need: ClassVar[str] = "reads the token map of a ViT or ResNet image encoder"
    # Unseen data (`EncoderMethod`): the one row, with the 80 CLIP templates

    @classmethod
    def tower_refusal(cls, visual: Any) -> str | None:
        return token_map_refusal(visual)

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> CALIPConfig:
        check_hparams_key(hparams_key)
        return CALIPConfig()

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        b, v, _ = view_feats.shape
        dev = view_feats.device
        images = self.view0_pixels(self.n_seen, b, v, dev)
        with encoder_autocast(self.text_encoder, dev):
            tokens = token_map(self.visual, images)
        tokens = F.normalize(tokens.to(images.dtype), dim=-1)  # every token, as `run_imagenet.py:53`
        text = self.text_features.to(dev, images.dtype)
        return calip_logits(tokens[:, 0], tokens[:, 1:], text, self.logit_scale, self.config)  # type: ignore[arg-type]
