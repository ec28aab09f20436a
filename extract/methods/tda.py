"""TDA — Training-free Dynamic Adapter (Karmanov et al., CVPR'24; official code `kdiAAA/TDA @e697fb0`).

The official algorithm: docs/methods.md, "TDA: caches and the negative cache band". Online and training-free: a
positive and a negative per-class feature cache persist along the stream; nothing is optimised. Per sample:

1. z₀, f, H, p̄, ŷ from the views (TDA `utils.py:get_clip_logits`): one view -> its logits, feature, softmax
   entropy; 64 views -> the 6 lowest-entropy views' mean logits, mean feature (not re-normalised), marginal
   entropy, mean softmax.
2. ĥ = H / log₂(K) — a quirk of the official code (H is in nats), kept.
3. Positive cache (capacity 3 per class, keyed by ŷ) gets (f, H) always; negative cache (capacity 2 per class,
   TDA `tda_runner.py:update_cache`) gets (f, H, 1[0.03 < p̄ < 1]) when 0.2 < ĥ < 0.5.
4. Cache logits after the update: z = z₀ + α⁺ Σ exp(-β⁺(1 - f·k)) onehot(c) - α⁻ Σ exp(-β⁻(1 - f·k)) mask.

Everything the caches do not influence (per-view logits, selection, entropies, gating) is computed for the whole
chunk at once; only the cache update and the cache logits run per sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import torch

from extract.methods.base import MethodConfig, PromptSet, Ref, TTAMethod, check_hparams_key, setting
from extract.methods.common import ClassCache, ViewSummary, summarise_views


@dataclass(frozen=True)
class TDAConfig(MethodConfig):
    """TDA's knobs; defaults are the ImageNet config (`configs/imagenet.yaml`, identical for RN50 and ViT-B/16)."""

    n_views: int = 1  # ImageNet: plain CLIP preprocess (TDA `utils.py:build_test_data_loader`)
    augmix: bool = False
    prompts: PromptSet = "dataset"  # TDA per-dataset templates (TDA `datasets/*.py`)
    cupl: bool = False
    selection_p: float = setting(0.1, gt=0, le=1)  # top 10% lowest-entropy views (TDA `utils.py:get_clip_logits`)
    pos_capacity: int = setting(3, ge=1)  # positive.shot_capacity (TDA `configs/*.yaml`)
    alpha: float = setting(2.0, ge=0)  # positive.alpha, ImageNet (TDA `configs/imagenet.yaml`)
    beta: float = setting(5.0, ge=0)  # positive.beta, ImageNet (TDA `configs/imagenet.yaml`)
    # negative.shot_capacity, per pseudo-class (TDA `configs/*.yaml`, `update_cache`)
    neg_capacity: int = setting(2, ge=1)
    neg_alpha: float = setting(0.117, ge=0)  # negative.alpha (TDA `configs/*.yaml`)
    neg_beta: float = setting(1.0, ge=0)  # negative.beta (TDA `configs/*.yaml`)
    # negative.entropy_threshold.lower, on H/log2(K) (TDA `configs/*.yaml`)
    neg_entropy_lower: float = setting(0.2, ge=0, le=Ref("neg_entropy_upper"))
    neg_entropy_upper: float = setting(0.5, ge=0, le=1)  # negative.entropy_threshold.upper (TDA `configs/*.yaml`)
    # negative.mask_threshold.lower (TDA `configs/*.yaml`)
    neg_mask_lower: float = setting(0.03, ge=0, le=Ref("neg_mask_upper"))
    neg_mask_upper: float = setting(1.0, ge=0, le=1)  # negative.mask_threshold.upper (TDA `configs/*.yaml`)


# Positive-cache (alpha, beta) per dataset (TDA `configs/*.yaml`, same for both backbones;
# docs/methods.md, "Per-dataset settings").
TDA_ALPHA_BETA: dict[str, tuple[float, float]] = {
    "imagenet": (2.0, 5.0), "imagenet_a": (2.0, 5.0), "imagenet_v2": (1.0, 8.0), "imagenet_r": (1.0, 8.0),
    "imagenet_sketch": (2.363, 7.45), "caltech101": (5.0, 5.0), "dtd": (2.0, 3.0), "eurosat": (4.0, 8.0),
    "fgvc_aircraft": (2.0, 2.0), "food101": (1.0, 1.0), "flowers102": (1.0, 5.0), "oxford_pets": (2.0, 7.0),
    "stanford_cars": (1.0, 7.0), "sun397": (2.0, 3.0), "ucf101": (3.0, 8.0),
}
# 64 AugMix views for the natural-shift sets; ImageNet and the 10 cross-domain sets use one view (TDA
# `utils.py:build_test_data_loader`).
TDA_MULTI_VIEW: frozenset[str] = frozenset({"imagenet_a", "imagenet_v2", "imagenet_r", "imagenet_sketch"})
# ImageNet-R and -Sketch use the 80 CLIP templates (TDA `datasets/imagenet_r.py`, `imagenet_sketch.py`).
TDA_IMAGENET80: frozenset[str] = frozenset({"imagenet_r", "imagenet_sketch"})


class TDA(TTAMethod):
    key: ClassVar[str] = "tda"
    prefix_stable: ClassVar[bool] = True  # the caches hold only samples already seen
    Config: ClassVar[type[MethodConfig]] = TDAConfig
    _state_fields: ClassVar[tuple[str, ...]] = ("pos", "neg")
    # Unseen data: ImageNet's row (alpha 2, beta 5, one view), the one config TTABC applies to every dataset
    # (`ttabc/model_selection/tda.py`); the 80 CLIP templates, as TDA uses them where no dataset template fits (R/K).
    unseen_like: ClassVar[str] = "imagenet"
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({"prompts": "imagenet80"})

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> TDAConfig:
        check_hparams_key(hparams_key)
        alpha, beta = TDA_ALPHA_BETA[hparams_key]
        multi = hparams_key in TDA_MULTI_VIEW
        return TDAConfig(
            n_views=64 if multi else 1,
            augmix=multi,
            prompts="imagenet80" if hparams_key in TDA_IMAGENET80 else "dataset",
            alpha=alpha,
            beta=beta,
        )

    def __init__(self, config: TDAConfig, text_features: torch.Tensor, logit_scale: float, **kwargs) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.pos: ClassCache | None = None
        self.neg: ClassCache | None = None

    def _init_caches(self, device: torch.device, dtype: torch.dtype) -> None:
        c, k, d = self.config, self.n_classes, self.dim
        self.pos = ClassCache(k, c.pos_capacity, d, device=device, dtype=dtype)
        self.neg = ClassCache(k, c.neg_capacity, d, device=device, dtype=dtype, extras={"mask": ((k,), dtype)})

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        c = self.config
        dt = self.compute_dtype(view_feats)
        if self.pos is None:
            self._init_caches(view_feats.device, dt)
        assert self.pos is not None and self.neg is not None
        feats = view_feats.to(dt)  # (B, V, D), L2-normalised
        w = self.text_features.to(dt)  # (K, D)
        # The official code multiplies by a hard-coded 100. (= exp(logit_scale) of OpenAI CLIP); we use the model's.
        logits = self.logit_scale * feats @ w.T  # (B, V, K)
        s = self._summarise(feats, logits)  # batched over the chunk
        extra = self._chunk_extra(feats, logits)
        h_norm = s.entropy / math.log2(self.n_classes)  # quirk kept: nats / log2(K) (TDA `utils.py:get_entropy`)
        neg_gate = ((h_norm > c.neg_entropy_lower) & (h_norm < c.neg_entropy_upper)).tolist()
        neg_mask = ((s.prob > c.neg_mask_lower) & (s.prob < c.neg_mask_upper)).to(dt)  # (B, K)
        preds = s.pred.tolist()
        out = s.logits.clone()
        for i, y in enumerate(preds):  # sequential by nature: the caches change after every sample
            f = s.feats[i]
            self.pos.update(y, f, s.entropy[i])
            if neg_gate[i]:
                self._update_negative(y, f, s.entropy[i], neg_mask[i])
            out[i] += c.alpha * self._positive_affinity(i, f, extra)
            if len(self.neg):
                a = self._cache_affinity(self.neg, f, c.neg_beta)  # (K, cap)
                out[i] -= c.neg_alpha * torch.einsum("kj,kjc->c", a, self.neg.extras["mask"].to(a.dtype))
        return out

    # Steps a method built on TDA's caches (BoostAdapter) replaces; TDA's own are below.

    def _summarise(self, feats: torch.Tensor, logits: torch.Tensor) -> ViewSummary:
        """The sample's feature, logits, entropy, probabilities and pseudo-label (§1.3) for the whole chunk."""
        return summarise_views(feats, logits, self.config.selection_p)

    def _chunk_extra(self, feats: torch.Tensor, logits: torch.Tensor) -> Any:
        """Anything else the per-sample steps need, computed for the whole chunk at once (TDA: nothing)."""
        return None

    def _update_negative(self, y: int, f: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        """Offer an item to the negative cache (TDA: the lowest-entropy items stay)."""
        assert self.neg is not None
        self.neg.update(y, f, entropy, mask=mask)

    def _positive_affinity(self, i: int, f: torch.Tensor, extra: Any) -> torch.Tensor:
        """(K,) Σ_j exp(-β(1 - f·k_j)) over class c's positive-cache items, for sample i of the chunk."""
        assert self.pos is not None
        return self._cache_affinity(self.pos, f, self.config.beta).sum(1)

    def _cache_affinity(self, cache: ClassCache, f: torch.Tensor, beta: float) -> torch.Tensor:
        """(K, capacity) exp(-β(1 - f·k)) over a cache's slots, zero in empty ones (BoostAdapter's fp16 path forms
        it as its official code does)."""
        return cache.affinity_weights(f, beta)
