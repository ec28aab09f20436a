"""DLAE — Dynamic Logits Adjustment and Exploration (Wu et al., CVPR'26; official code `whynotcooper/dlae @253163b`).

The official algorithm: docs/methods.md, "DLAE: logit adjustment, reflection and doubt". Built on DPE (`dpe.py`):
everything there applies, with these changes.

Extra online state: counter (K,) initialised to 1 and count = K (pseudo-label frequencies π = counter/count);
conf_mean (K,) running mean confidence per pseudo-class (init 0) with its counts; W₀ the initial prototypes.

Per sample (views x, stream position t):
1. Logits z = s·x·W'ᵀ (W' = normalize(W_g + R_t), zero residual). First confident-view pass on the
   un-adjusted z: ŷ₂, conf₂ = p̄[ŷ₂], dif = conf₂ - conf_mean[ŷ₂].
2. Logit adjustment, multiplicative on every view: z ← z ⊙ exp(-α_adj (1 - dif) π).
3. Second pass on the adjusted logits: f_x, z₀, p̄, ŷ, H.
4. Reflection: H₁ = H if ŷ = ŷ₂, else H·exp(-α₁ cos(W'_ŷ, W'_ŷ₂)).
5. counter[ŷ] += 1, count += 1, conf_mean[ŷ] ← running mean including p̄[ŷ].
6. Cache update with (f_x, H₁ in nats, t): when the class is full, first the "doubt" rule — every cached item j
   with f_j·W'_ŷ < f_j·W₀_ŷ (W' before this sample's step) gets H_j ← H_j·exp((t - t_j) ε), t_j ← t —
   then sort, replace the worst if H₁ is lower, sort.
7. DPE's residual step, with the cache residual's lr = lr_text (the official code never reads the image lr).
   (The official image prototype sums the first 3 items and divides by the item count, i.e. the mean at the
   capacity 3 used everywhere; we take the mean for any `shot_capacity`.)
8. Inference: steps 1-3 again with the stepped W' and the already-updated counters (`run_test_dlae`), on view 0 —
   all views for ImageNet-A — plus the cache logits; then DPE's global text evolution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from extract.methods.base import BackboneFamily, MethodConfig, backbone_family, check_hparams_key, setting
from extract.methods.common import ClassCache, ViewSummary, summarise_views
from extract.methods.dpe import DPE, DUAL_PROTOTYPE_PROMPTS, DualPrototypeConfig


@dataclass(frozen=True)
class DLAEConfig(DualPrototypeConfig):
    """DLAE's knobs; defaults are the ImageNet config for ViT-B/16 (DLAE `configs/imagenet.yaml`)."""

    n_views: int = 64  # ImageNet: 64 views, crop + flip only (DLAE `utils.py:build_test_data_loader`)
    augmix: bool = False  # get_preprocess(is_augmix=False) for I/A/V/K/UCF101 (DLAE `utils.py`)
    # DLAE `configs/imagenet.yaml` positive.alpha/beta 6/5, learning_rate.text 6e-4, align 0.5 (DPE's values).
    # The cache residual uses lr_text: `main_dlae.py` builds both AdamW groups with learning_rate.text.
    # α_adj: `belta[0]` for ViT, `alpha[0]` for RN50 (imagenet.yaml lists alpha twice: 0.8)
    adjust_alpha: float = setting(0.8, ge=0)
    # α₁: `alpha1[1]` for ViT, `alpha1[0]` for RN50 (DLAE `configs/imagenet.yaml`)
    reflection_alpha: float = setting(0.001, ge=0)
    doubt_rate: float = setting(0.0, ge=0)  # ε: `epoch[1]` for ViT, `epoch[0]` for RN50 (DLAE `configs/imagenet.yaml`)
    # Which column of the per-backbone tables was applied: "rn" for RN*, "vit" for ViT-B-16 and every other
    # name (e.g. the demo's small models) [ASSUMPTION for non-OpenAI backbones]. Recorded, not read.
    backbone_family: BackboneFamily = "vit"


# dataset: (alpha, beta, lr_text, align, adjust_alpha RN/ViT, reflection_alpha RN/ViT, doubt_rate RN/ViT)
# (DLAE `configs/*.yaml` @253163b; RN50 reads alpha[0]/alpha1[0]/epoch[0], ViT belta[0]/alpha1[1]/epoch[1]).
_Pair = tuple[float, float]
DLAE_TABLE: dict[str, tuple[float, float, float, float, _Pair, _Pair, _Pair]] = {
    "imagenet": (6.0, 5.0, 6e-4, 0.5, (0.8, 0.8), (0.001, 0.001), (0.0, 0.0)),
    "imagenet_a": (6.0, 5.0, 3e-4, 2.5, (0.5, 1.0), (0.5, 0.3), (1e-5, 1e-5)),
    "imagenet_v2": (3.0, 8.0, 5e-4, 0.5, (3.0, 2.5), (0.5, 0.5), (0.0, 2e-3)),
    "imagenet_r": (3.0, 8.0, 6e-4, 0.0, (1.1, 0.8), (0.3, 0.3), (5e-3, 1e-5)),
    "imagenet_sketch": (7.0, 7.45, 6e-4, 0.2, (3.0, 3.0), (0.5, 1.0), (1e-6, 5e-3)),
    "caltech101": (15.0, 5.0, 6e-4, 0.2, (0.0, 0.3), (0.0, 0.3), (1e-6, 5e-4)),
    "dtd": (6.0, 3.0, 6e-4, 0.2, (2.1, 2.0), (0.5, 0.5), (0.02, 0.02)),
    "eurosat": (5.0, 8.0, 5e-5, 0.2, (2.0, 1.0), (1.5, 0.3), (1e-6, 1e-6)),
    "fgvc_aircraft": (6.0, 2.0, 6e-4, 0.2, (2.0, 2.5), (0.5, 0.5), (5e-3, 5e-3)),
    "food101": (3.0, 1.0, 2e-4, 0.2, (3.5, 3.0), (0.5, 0.5), (5e-3, 5e-3)),
    "flowers102": (8.0, 5.0, 2e-4, 0.2, (2.5, 2.0), (0.0, 0.5), (1e-5, 1e-5)),
    "oxford_pets": (4.0, 7.0, 1e-4, 0.3, (1.8, 1.0), (0.0, 0.0), (1e-6, 1e-6)),
    "stanford_cars": (3.0, 7.0, 1e-4, 1.5, (3.3, 3.2), (0.5, 0.5), (5e-3, 1e-2)),
    "sun397": (3.0, 7.0, 1e-4, 1.5, (3.3, 3.2), (0.5, 0.5), (5e-3, 1e-2)),
    "ucf101": (9.0, 8.0, 4e-4, 0.2, (2.7, 3.0), (0.5, 0.5), (1e-5, 1e-5)),
}
# Views (DLAE `utils.py:build_test_data_loader`): 64 crop+flip, 64 AugMix, or the CLIP preprocess.
DLAE_CROP_FLIP: frozenset[str] = frozenset({"imagenet", "imagenet_a", "imagenet_v2", "imagenet_sketch", "ucf101"})
DLAE_AUGMIX: frozenset[str] = frozenset({"imagenet_r", "dtd", "fgvc_aircraft", "stanford_cars", "sun397", "food101"})


class DLAE(DPE):
    key: ClassVar[str] = "dlae"
    prefix_stable: ClassVar[bool] = True  # DPE's state plus running counts of samples already seen
    Config: ClassVar[type[MethodConfig]] = DLAEConfig
    _state_fields: ClassVar[tuple[str, ...]] = DPE._state_fields + ("w0", "counter", "count", "conf_mean", "conf_count")

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> DLAEConfig:
        check_hparams_key(hparams_key)
        family = backbone_family(backbone)
        col = 0 if family == "rn" else 1
        alpha, beta, lr, align, adj, refl, doubt = DLAE_TABLE[hparams_key]
        multi = hparams_key in DLAE_CROP_FLIP or hparams_key in DLAE_AUGMIX
        return DLAEConfig(
            n_views=64 if multi else 1,
            augmix=hparams_key in DLAE_AUGMIX,
            prompts=DUAL_PROTOTYPE_PROMPTS.get(hparams_key, "dataset"),
            # ViT-B/16 on EuroSAT skips the CuPL sentences (DLAE `utils.py:clip_classifier`).
            cupl=not (hparams_key == "eurosat" and family == "vit"),
            alpha=alpha,
            beta=beta,
            lr_text=lr,
            align=align,
            all_view_inference=hparams_key == "imagenet_a",
            adjust_alpha=adj[col],
            reflection_alpha=refl[col],
            doubt_rate=doubt[col],
            backbone_family=family,
        )

    def __init__(self, config: DLAEConfig, text_features: torch.Tensor, logit_scale: float, **kwargs) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.w0: torch.Tensor | None = None
        self.counter: torch.Tensor | None = None
        self.count = self.n_classes
        self.conf_mean: torch.Tensor | None = None
        self.conf_count: torch.Tensor | None = None

    @property
    def lr_image(self) -> float:
        return self.config.lr_text  # `main_dlae.py`: both AdamW groups use learning_rate.text

    def _init_state(self, device: torch.device, dtype: torch.dtype) -> None:
        super()._init_state(device, dtype)
        k = self.n_classes
        # Cached items carry their insertion/re-scoring time t_j (int64: exact at any stream length).
        self.cache = ClassCache(k, self.config.shot_capacity, self.dim, device=device, dtype=dtype,
                                extras={"time": ((), torch.int64)})
        self.w0 = self.text_features.to(device=device, dtype=dtype).clone()  # W₀ for the doubt test
        # Counters and running confidences stay in >= float32 even under amp_fp16 (official: int32 / float32).
        sdt = torch.promote_types(dtype, torch.float32)
        self.counter = torch.ones(k, device=device, dtype=torch.int64)  # pseudo-label counts, init 1 (`Init_counter`)
        self.count = k  # total, init K
        self.conf_mean = torch.zeros(k, device=device, dtype=sdt)  # `Init_conf`
        self.conf_count = torch.zeros(k, device=device, dtype=sdt)  # `Init_confcount`

    def _adjusted_summary(self, x: torch.Tensor, logits: torch.Tensor) -> tuple[ViewSummary, ViewSummary]:
        """Two confident-view passes around the logit adjustment (DLAE `get_clip_logits_2/3`).

        Returns:
            (summary of the un-adjusted logits, summary of the adjusted logits).
        """
        c = self.config
        raw = summarise_views(x[None], logits[None], c.selection_p)
        y2 = int(raw.pred[0])
        dif = raw.prob[0, y2] - self.conf_mean[y2]
        prior = self.counter.to(self.conf_mean.dtype) / self.count  # π
        factor = torch.exp(-c.adjust_alpha * (1.0 - dif) * prior)  # `Logits_adjustment`
        adjusted = logits * factor.to(logits.dtype)
        return raw, summarise_views(x[None], adjusted[None], c.selection_p)

    def _train_summary(self, x: torch.Tensor, w: torch.Tensor, t: int) -> ViewSummary:
        c = self.config
        raw, s = self._adjusted_summary(x, self.logit_scale * x @ w.T)  # official: 100. * image_features @ W'
        y, y2 = int(s.pred[0]), int(raw.pred[0])
        h = s.entropy[0]
        if y != y2:  # reflection: soften the entropy of a prediction the adjustment changed
            wd = w.detach()
            h = h * torch.exp(-c.reflection_alpha * F.cosine_similarity(wd[y], wd[y2], dim=0))
        # Counters see this sample before the cache update and before inference (`main_dlae.py:run_test_dlae`).
        self.counter[y] += 1
        self.count += 1
        conf = s.prob[0, y].to(self.conf_mean.dtype)
        self.conf_mean[y] = (self.conf_mean[y] * self.conf_count[y] + conf) / (self.conf_count[y] + 1)
        self.conf_count[y] += 1
        self._cache_insert(y, s.feats[0], h, w.detach(), t)
        return s

    def _cache_insert(self, y: int, f: torch.Tensor, h: torch.Tensor, w: torch.Tensor, t: int) -> None:
        """DLAE `update_cache`: doubt re-scoring of a full class, then TDA's keep-the-lowest rule. Scores in nats."""
        cache, c = self.cache, self.config
        if cache.counts[y] == cache.capacity:
            keys = cache.keys[y]  # (cap, D)
            doubt = keys @ w[y] < keys @ self.w0[y]  # W' = normalize(W_g), zero residual (`main_dlae.py`)
            times = cache.extras["time"][y]
            wide = torch.promote_types(cache.scores.dtype, torch.float32)  # t - t_j overflows fp16 past 65504
            decay = torch.exp((t - times).to(wide) * c.doubt_rate)  # `exp_loss`
            cache.scores[y] = torch.where(doubt, cache.scores[y] * decay, cache.scores[y])
            cache.extras["time"][y] = torch.where(doubt, torch.full_like(times, t), times)
            cache.sort_class(y)
        cache.update(y, f, h, time=torch.tensor(t, device=f.device))

    def _inference(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xin = x if self.config.all_view_inference else x[:1]  # ImageNet-A: all views; otherwise view 0
        _, s = self._adjusted_summary(xin, self.logit_scale * xin @ w.T)
        return s.logits[0], s.feats[0]
