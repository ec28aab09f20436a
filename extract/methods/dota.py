"""DOTA — DistributiOnal Test-time Adaptation (Han et al., 2024; official code `skylineeeeen/DOTA @bc67d44`,
`dota.py`). Online and training-free; docs/methods.md, "DOTA (`dota`)".

State: per class k a mean μ_k (D), a count c_k and a covariance Σ_k (D×D); the shared precision
Λ = ((1-ε)·mean_k Σ_k + ε·I)⁻¹. Start (`dota.py` l.158-159 and `DOTA.__init__`): μ_k = 0.001 in every coordinate
(not the text prototypes), c_k = 1, Σ_k = σ·I, Λ = pinv(σ·I). Per sample (`run_test_dota` l.98-116):

1. The view summary of `utils.py:get_clip_logits_aug`: one view -> its logits z and feature; 64 views -> the
   int(64·0.1) = 6 lowest-entropy views, z = their mean logits, x̄ = the mean of their features, and each kept
   view with its own softmax p_v (the soft label it is fitted with).
2. DOTA scores s = x̄·W - ½·diag(MᵀW), W = Λ·M, M = (μ_1 .. μ_K) (`DOTA.predict`).
3. Output z + w·s with w = min(ρ·mean_k c_k / n, η), n the number of kept views.
4. Then (`DOTA.fit`, `DOTA.update`): with y_vk = p_v[k] and s_k = Σ_v y_vk,
   μ_k ← (Σ_v y_vk x_v + c_k μ_k) / (s_k + c_k);
   Σ_k ← (c_k Σ_k + Σ_v y_vk (x_v - μ_k)(x_v - μ_k)ᵀ) / (c_k + s_k), with the μ_k before this update;
   c_k ← c_k + s_k; Λ ← ((1-ε)·mean_k Σ_k + ε·I)⁻¹.

Numerics (`fp16`, default true, the official run): CLIP features, text prototypes, logits, soft labels, Λ, M, W and
the scores are float16 (`clip.load` on CUDA gives fp16 weights; `predict` casts Λ and M with `.half()`), μ, c and Σ
float32, the inverse in float32. Σ is one D×D matrix per class: 1 GB in float32 for ImageNet at D = 512.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Mapping

import torch

from extract.methods.base import MethodConfig, PromptSet, TTAMethod, check_hparams_key, setting
from extract.methods.common import summarise_views
from extract.methods.tda import TDA_IMAGENET80, TDA_MULTI_VIEW


@dataclass(frozen=True)
class DOTAConfig(MethodConfig):
    """DOTA's knobs; defaults are the ImageNet config (`configs/vit/imagenet.yaml`)."""

    n_views: int = 1  # ImageNet: CLIP's preprocess (`utils.py:build_test_data_loader`, TDA's loaders)
    augmix: bool = False
    prompts: PromptSet = "dataset"  # TDA's per-dataset templates (`datasets/*.py`, `clip_classifier`)
    cupl: bool = False
    selection_p: float = setting(0.1, gt=0, le=1)  # top 10% lowest-entropy views (`utils.py:get_clip_logits_aug`)
    epsilon: float = setting(1e-4, ge=0, le=1)  # ε: weight of I in the precision (`configs/vit/*.yaml` epsilon)
    sigma: float = setting(0.002, gt=0)  # σ: Σ_k starts at σ·I (`configs/vit/*.yaml` sigma)
    eta: float = setting(0.2, ge=0)  # η: the largest fusion weight (`configs/vit/*.yaml` eta)
    rho: float = setting(0.005, ge=0)  # ρ: fusion weight per unit of mean count (`configs/vit/*.yaml` rho)
    # μ_k starts as a constant vector, `torch.full(..., 0.001)` (`dota.py` l.158); "text": the text prototypes (the
    # DOTA class's own comment, and TTABC's newer `init_mu: clip_text`)
    init_mu: Literal["constant", "text"] = "constant"
    init_mu_value: float = setting(0.001)  # the constant (`dota.py` l.158)
    update_sigma: bool = True  # `streaming_update_Sigma=True` (`DOTA.__init__`); False keeps Σ_k = σ·I
    # float16 as the official run (module docstring); False: everything in float32 (a named deviation)
    fp16: bool = True


# (epsilon, eta, rho) per dataset (`configs/vit/<file>.yaml`; sigma is 0.002 in every file). The repository has
# ViT-B/16 configs only (`--backbone` choices: ViT-B/16); other backbones use the same rows.
DOTA_TABLE: dict[str, tuple[float, float, float]] = {
    "imagenet": (1e-4, 0.2, 0.005), "imagenet_a": (1e-4, 0.5, 0.02), "imagenet_v2": (1e-4, 0.1, 0.01),
    "imagenet_r": (1e-4, 0.3, 0.0025), "imagenet_sketch": (1e-4, 0.8, 0.03), "caltech101": (0.002, 0.3, 0.02),
    "dtd": (1e-4, 0.3, 0.02), "eurosat": (1e-4, 3.0, 0.05), "fgvc_aircraft": (1e-4, 0.2, 0.01),
    "food101": (4e-5, 0.1, 0.01), "flowers102": (1e-4, 0.2, 0.02), "oxford_pets": (1e-4, 0.3, 0.02),
    "stanford_cars": (1e-4, 0.3, 0.01), "sun397": (1e-4, 0.2, 0.01), "ucf101": (1e-4, 0.4, 0.02),
}


class DOTA(TTAMethod):
    key: ClassVar[str] = "dota"
    prefix_stable: ClassVar[bool] = True  # the Gaussians are fitted on samples already seen
    Config: ClassVar[type[MethodConfig]] = DOTAConfig
    _state_fields: ClassVar[tuple[str, ...]] = ("mu", "count", "sigma", "lam")
    # Unseen data: DTD's row (ε 1e-4, η 0.3, ρ 0.02, one view), the row TTABC applies to every dataset
    # (`ttabc/configs/algorithms.py` dota), with the 80 CLIP templates (DTD's "{} texture." names no object).
    unseen_like: ClassVar[str] = "dtd"
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({"prompts": "imagenet80"})

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> DOTAConfig:
        check_hparams_key(hparams_key)
        epsilon, eta, rho = DOTA_TABLE[hparams_key]
        multi = hparams_key in TDA_MULTI_VIEW  # 63 AugMix views + the original for A/V2/R/Sketch (`get_ood_preprocess`)
        return DOTAConfig(n_views=64 if multi else 1, augmix=multi, epsilon=epsilon, eta=eta, rho=rho,
                          prompts="imagenet80" if hparams_key in TDA_IMAGENET80 else "dataset")

    def __init__(self, config: DOTAConfig, text_features: torch.Tensor, logit_scale: float, **kwargs: Any) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.mu: torch.Tensor | None = None  # (K, D) class means
        self.count: torch.Tensor | None = None  # (K,) c_k
        self.sigma: torch.Tensor | None = None  # (K, D, D) class covariances
        self.lam: torch.Tensor | None = None  # (D, D) the shared precision Λ, float16 under `fp16`

    def _dtypes(self, view_feats: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
        """(features/logits/Λ dtype, state dtype): float16/float32 under `fp16`, else the compute dtype twice
        (float64 inputs stay float64: exact references in tests)."""
        dt = self.compute_dtype(view_feats)
        return (torch.float16 if self.config.fp16 and dt != torch.float64 else dt), dt

    def _init_state(self, device: torch.device, low: torch.dtype, wide: torch.dtype) -> None:
        c: DOTAConfig = self.config  # type: ignore[assignment]
        k, d = self.n_classes, self.dim
        if c.init_mu == "text":
            self.mu = self.text_features.to(device, wide).clone()
        else:
            # `torch.full((d, k), 0.001)` in torch's default dtype, float32, whatever the state's dtype
            self.mu = torch.full((k, d), c.init_mu_value, device=device, dtype=torch.float32).to(wide)
        self.count = torch.ones(k, device=device, dtype=wide)
        self.sigma = (c.sigma * torch.eye(d, device=device, dtype=wide)).repeat(k, 1, 1)
        # `torch.pinverse(overall_Sigma.double()).half()`: the first Λ is the pseudo-inverse, later ones `inverse`
        self.lam = torch.linalg.pinv(self.sigma.mean(0).double()).to(low)

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        c: DOTAConfig = self.config  # type: ignore[assignment]
        low, wide = self._dtypes(view_feats)
        if self.mu is None:
            self._init_state(view_feats.device, low, wide)
        feats = view_feats.to(low)  # (B, V, D): the fp16 features of the official run
        # `100. * image_features @ clip_weights`: the scaled features are rounded first (the model's scale here)
        logits = (self.logit_scale * feats) @ self.text_features.to(low).T  # (B, V, K)
        s = summarise_views(feats, logits, c.selection_p)  # batched: the selection reads only the text side
        idx = s.selected[..., None]
        kept = torch.gather(feats, 1, idx.expand(-1, -1, feats.shape[-1]))  # (B, n, D) the kept views
        soft = torch.gather(logits, 1, idx.expand(-1, -1, logits.shape[-1])).softmax(-1)  # (B, n, K) `prob_map`
        out = torch.empty_like(s.logits)
        for b in range(feats.shape[0]):  # sequential by nature: Λ and μ change after every sample
            out[b] = s.logits[b] + self._fusion_weight(kept.shape[1]).to(low) * self._scores(s.feats[b])
            self._fit(kept[b], soft[b])
        return out

    def _fusion_weight(self, n_kept: int) -> torch.Tensor:
        """w = min(ρ·mean(c) / n, η) as a 0-dim tensor of the state's dtype (`run_test_dota` l.105); the official
        0-dim CUDA tensor meets the float16 scores in their dtype, hence the caller's cast."""
        assert self.count is not None
        return torch.clamp(self.config.rho * self.count.mean() / n_kept, max=self.config.eta)

    def _scores(self, x: torch.Tensor) -> torch.Tensor:
        """(K,) x·W - ½·diag(MᵀW) with W = Λ·M, in Λ's dtype (`DOTA.predict`)."""
        assert self.mu is not None and self.lam is not None
        m = self.mu.T.to(self.lam.dtype)  # (D, K) `self.mu.transpose(1, 0).half()`
        w = self.lam @ m  # (D, K)
        return x @ w - 0.5 * (m * w).sum(0)

    def _fit(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """`DOTA.fit` then `DOTA.update` on the kept views x (n, D) with their soft labels y (n, K), in the official
        order of operations: the float16 sums first, promoted to the state's dtype where they meet it."""
        assert self.mu is not None and self.count is not None and self.sigma is not None
        c: DOTAConfig = self.config  # type: ignore[assignment]
        s = y.sum(0)  # (K,)
        new_mu = (y.T @ x + self.count[:, None] * self.mu) / (s[:, None] + self.count[:, None])
        if c.update_sigma:
            diff = (x[:, None, :] - self.mu[None]).transpose(0, 1)  # (K, n, D)
            weighted = y.T[..., None] * diff  # (K, n, D)
            # (c·Σ + Δ) / (c + s) with Δ_k = Σ_v weighted_vk (x_v - μ_k)ᵀ (`einsum('bji,bjk->jik')`), in place in that
            # order: Δ is added by the batched product itself, never stored (1 GB at ImageNet's K = 1000, D = 512)
            self.sigma.mul_(self.count[:, None, None])
            self.sigma.baddbmm_(weighted.transpose(1, 2), diff)
            self.sigma.div_((self.count + s)[:, None, None])
        self.mu, self.count = new_mu, self.count + s
        eye = torch.eye(self.dim, device=x.device, dtype=self.sigma.dtype)
        lam = torch.linalg.inv((1 - c.epsilon) * self.sigma.mean(0) + c.epsilon * eye)
        self.lam = lam.to(self.lam.dtype if self.lam is not None else lam.dtype)

    def summary(self) -> dict[str, Any]:
        """The fusion weight the next sample gets with one kept view (w grows with the counts up to η)."""
        if self.count is None:
            return {}
        return {"fusion_weight_one_view": float(self._fusion_weight(1))}
