"""DPE — Dual Prototype Evolving (Zhang et al., NeurIPS'24; official code `zhangce01/DPE-CLIP @fecae5a`).

The official algorithm: docs/methods.md, "DPE: dual prototypes, one step per sample"; its numerics:
docs/methods.md, "DPE/DLAE numerics". Online state: the global text prototypes W_g (K, D), a positive cache (3 per
class) and the number n of global updates. Per sample x:

1. W' = normalize(W_g + R_t) with a zero text residual R_t; per-view logits s·x·W'ᵀ; confident-view summary
   (docs/methods.md, "Confident-view selection and marginal entropy"): f_x, z₀, H, ŷ.
2. Cache update with (f_x, H / log₂K) (TDA's rule). Image prototypes K_c = mean cached feature of class c, for
   the classes present; K' = normalize(K + R_i) with a zero cache residual R_i.
3. One AdamW step (fresh optimiser, lr per group, eps 1e-3, weight decay 0.1; fp16 residuals by default, see
   `residual_step`) on
   L = H(softmax(z₀ + α·exp(-β(1 - f_x·K'ᵀ))·onehot)) + λ·InfoNCE(K', W'[classes]) at temperature 0.01.
4. Output z = s·f·W'ᵀ + α·exp(-β(1 - f·K'ᵀ))·onehot with the stepped residuals, on view 0 — or, for ImageNet-A,
   on all views re-selected under W' (`all_view_inference`).
5. If H(softmax z) / log₂K < 0.1: n += 1, W_g ← W_g·n/(n+1) + W'/(n+1) — no re-normalisation (step 1 does it).

Nothing crosses samples except that state, so every step is per sample; the official hard-coded `100.` logit
scale is the model's own logit scale here.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Mapping

import torch
import torch.nn.functional as F

from extract.methods.base import (
    IMAGENET_FAMILY,
    MethodConfig,
    PromptSet,
    TTAMethod,
    check_hparams_key,
    setting,
)
from extract.methods.common import (
    ClassCache,
    ViewSummary,
    adamw_first_step,
    info_nce,
    marginal_entropy,
    summarise_views,
    torch_adamw_step,
)

ResidualStep = Literal["official_fp16", "exact"]


@dataclass(frozen=True)
class DualPrototypeConfig(MethodConfig):
    """Knobs shared by DPE and DLAE (DLAE is built on DPE's code); defaults are DPE's ImageNet config."""

    n_views: int = 64  # ImageNet family: 63 AugMix views + original (DPE `utils.py:get_preprocess`)
    augmix: bool = True  # AugMix on even for ImageNet (DPE `utils.py:get_preprocess`)
    prompts: PromptSet = "dataset"  # TDA's templates (DPE `datasets/*.py`)
    cupl: bool = True  # plus the CuPL GPT-3 sentences (DPE `utils.py:clip_classifier`)
    selection_p: float = setting(0.1, gt=0, le=1)  # top 10% lowest-entropy views (DPE `utils.py:get_clip_logits`)
    shot_capacity: int = setting(3, ge=1)  # positive.shot_capacity (DPE `configs/*.yaml`)
    alpha: float = setting(6.0, ge=0)  # positive.alpha, ImageNet (DPE `configs/imagenet.yaml`)
    beta: float = setting(5.0, ge=0)  # positive.beta, ImageNet (DPE `configs/imagenet.yaml`)
    lr_text: float = setting(6e-4, ge=0)  # learning_rate.text, ImageNet (DPE `configs/imagenet.yaml`)
    # learning_rate.align (λ of the InfoNCE term), ImageNet (DPE `configs/imagenet.yaml`)
    align: float = setting(0.5, ge=0)
    temperature: float = setting(0.01, gt=0)  # InfoNCE temperature (DPE `main_dpe.py:InfoNCELoss`)
    # (DPE `main_dpe.py`); the step of small gradients (docs/methods.md, "DPE/DLAE numerics")
    adamw_eps: float = setting(1e-3, gt=0)
    # (DPE `main_dpe.py`); no effect on zero residuals (docs/methods.md, "DPE/DLAE numerics")
    weight_decay: float = setting(0.1, ge=0)
    global_threshold: float = setting(0.1)  # evolve W_g when H/log2(K) is below this (DPE `main_dpe.py`)
    all_view_inference: bool = False  # ImageNet-A only: predict from all views (DPE `main_dpe.py`, dataset 'A')
    # How the residuals take their AdamW step. "official_fp16" (default, the numerics of the paper's numbers): the
    # residuals are fp16 parameters stepped by a real `torch.optim.AdamW`, whose fp16 second moment underflows for
    # |g| below about 5.5e-3 (step lr·g/eps instead of lr·g/(|g| + eps)); this is the optimiser's dtype, not
    # autocast, so it holds on the CPU too. The text residual's gradient is rounded as in the official code:
    # fl16(fl16(g_entropy) + fl16(g_align)), see `DPE._text_prototypes`. "exact": the step in the compute dtype,
    # `adamw_first_step` (a named deviation: what the official step would be without fp16 rounding).
    residual_step: ResidualStep = "official_fp16"
    # The rest of the official numerics: fp16 weights and features under CUDA autocast, without a gradient scaler
    # (docs/methods.md, "DPE/DLAE numerics"); the global prototypes become fp32 after their first update there,
    # as in the official code.
    # Off by default (fp32 features and prototypes, and the only option on the CPU).
    amp_fp16: bool = False


@dataclass(frozen=True)
class DPEConfig(DualPrototypeConfig):
    # learning_rate.image, ImageNet (DPE `configs/imagenet.yaml`; equal to text everywhere)
    lr_image: float = setting(6e-4, ge=0)


# (alpha, beta, lr_text = lr_image, align) per dataset (DPE `configs/*.yaml`, same for both backbones;
# docs/methods.md, "Per-dataset settings").
DPE_TABLE: dict[str, tuple[float, float, float, float]] = {
    "imagenet": (6.0, 5.0, 6e-4, 0.5), "imagenet_a": (6.0, 5.0, 3e-4, 2.5), "imagenet_v2": (3.0, 8.0, 5e-4, 0.5),
    "imagenet_r": (3.0, 8.0, 6e-4, 0.0), "imagenet_sketch": (7.0, 7.45, 6e-4, 0.2),
    "caltech101": (15.0, 5.0, 6e-4, 0.2), "dtd": (6.0, 3.0, 6e-4, 0.2), "eurosat": (3.0, 8.0, 5e-5, 0.2),
    "fgvc_aircraft": (6.0, 2.0, 6e-4, 0.2), "food101": (3.0, 1.0, 2e-4, 0.2), "flowers102": (2.5, 5.0, 1e-4, 0.2),
    "oxford_pets": (4.0, 7.0, 5e-5, 0.2), "stanford_cars": (3.0, 7.0, 1e-4, 1.5), "sun397": (6.0, 3.0, 2e-4, 0.2),
    "ucf101": (9.0, 8.0, 4e-4, 0.2),
}
# ImageNet-R/-Sketch use the 80 CLIP templates, Stanford Cars its own pair (DPE `datasets/*.py`).
DUAL_PROTOTYPE_PROMPTS: dict[str, PromptSet] = {
    "imagenet_r": "imagenet80", "imagenet_sketch": "imagenet80", "stanford_cars": "dpe_cars",
}


class DPE(TTAMethod):
    key: ClassVar[str] = "dpe"
    prefix_stable: ClassVar[bool] = True  # the prototypes move with samples already seen
    Config: ClassVar[type[MethodConfig]] = DPEConfig
    _state_fields: ClassVar[tuple[str, ...]] = ("cache", "w_global", "n_global_updates")
    # Unseen data (DLAE inherits this): ImageNet's row (DPE: alpha 6, beta 5, lr 6e-4, align 0.5 - TTABC's global
    # alpha/beta/align), one view as on DPE's ten fine-grained sets (64 AugMix views are an ImageNet-family choice),
    # the 80 CLIP templates as for ImageNet-R/-Sketch, and no CuPL (no GPT-3 sentences exist for unknown classes).
    unseen_like: ClassVar[str] = "imagenet"
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType(
        {"n_views": 1, "augmix": False, "prompts": "imagenet80", "cupl": False})
    # Reduced-precision mode (`amp_fp16`): the official CUDA fp16 autocast. Class attributes so that a test can
    # emulate the code path on the CPU with bfloat16.
    _amp_device_type: ClassVar[str] = "cuda"
    _amp_dtype: ClassVar[torch.dtype] = torch.float16

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> DPEConfig:
        check_hparams_key(hparams_key)
        alpha, beta, lr, align = DPE_TABLE[hparams_key]
        multi = hparams_key in IMAGENET_FAMILY  # 64 AugMix views for I/A/V/R/K, CLIP preprocess otherwise
        return DPEConfig(
            n_views=64 if multi else 1,
            augmix=multi,
            prompts=DUAL_PROTOTYPE_PROMPTS.get(hparams_key, "dataset"),
            cupl=True,
            alpha=alpha,
            beta=beta,
            lr_text=lr,
            lr_image=lr,
            align=align,
            all_view_inference=hparams_key == "imagenet_a",
        )

    def __init__(self, config: DualPrototypeConfig, text_features: torch.Tensor, logit_scale: float, **kwargs) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.cache: ClassCache | None = None
        self.w_global: torch.Tensor | None = None  # (K, D) global text prototypes W_g, not re-normalised
        self.n_global_updates = 0
        self._present: list[int] = []
        self._present_idx: torch.Tensor | None = None

    # ------------------------------------------------------------------ hooks DLAE overrides
    @property
    def lr_image(self) -> float:
        return self.config.lr_image

    def _init_state(self, device: torch.device, dtype: torch.dtype) -> None:
        self.w_global = self.text_features.to(device=device, dtype=dtype).clone()
        self.cache = ClassCache(self.n_classes, self.config.shot_capacity, self.dim, device=device, dtype=dtype)

    def _train_summary(self, x: torch.Tensor, w: torch.Tensor, t: int) -> ViewSummary:
        """Views -> summary under W' (with gradient); updates the cache. Steps 1-2 of
        docs/methods.md, "DPE: dual prototypes, one step per sample"."""
        logits = self.logit_scale * x @ w.T  # (V, K); official: 100. * image_features @ clip_weights
        s = summarise_views(x[None], logits[None], self.config.selection_p)
        # Cache score: entropy / log2(K) (DPE `get_entropy`; same order as raw nats).
        self.cache.update(int(s.pred[0]), s.feats[0], s.entropy[0] / math.log2(self.n_classes))
        return s

    def _inference(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (K,), query feature (D,)) under the stepped W'. Step 5 of
        docs/methods.md, "DPE: dual prototypes, one step per sample"."""
        if self.config.all_view_inference:
            s = summarise_views(x[None], (self.logit_scale * x @ w.T)[None], self.config.selection_p)
            return s.logits[0], s.feats[0]
        return self.logit_scale * x[0] @ w.T, x[0]

    # ------------------------------------------------------------------ the shared per-sample loop
    def _dtype_for(self, view_feats: torch.Tensor) -> torch.dtype:
        return self._amp_dtype if self.config.amp_fp16 else self.compute_dtype(view_feats)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.config.amp_fp16:
            return torch.autocast(self._amp_device_type, dtype=self._amp_dtype)
        return contextlib.nullcontext()

    def _present_classes(self) -> torch.Tensor:
        present = self.cache.present()
        if present != self._present:
            self._present = present
            self._present_idx = torch.tensor(present, dtype=torch.long, device=self.cache.keys.device)
        return self._present_idx

    @staticmethod
    def _text_prototypes(w_loc: torch.Tensor, r_text: torch.Tensor) -> torch.Tensor:
        """W' = normalize(W_g + R_t), (K, D) (DPE `main_dpe.py:TextResidue.forward`, DLAE `main_dlae.py` likewise).

        The official step builds W' anew for each use: once for the views' logits (the entropy term) and once for
        the alignment term. Each use is its own addition W_g + R_t, so autograd casts each term's gradient to the
        fp16 residual's dtype on its own and then sums the two in fp16: the residual gets
        fl16(fl16(g_entropy) + fl16(g_align)), not fl16(g_entropy + g_align) as one shared W' would give. `_step`
        calls this once per use to keep that order of roundings (docs/methods.md, "DPE/DLAE numerics"); in exact
        arithmetic the two are the same.
        """
        return F.normalize(w_loc + r_text, dim=-1)

    def _cache_logits(
        self, z: torch.Tensor, f: torch.Tensor, keys: torch.Tensor, classes: torch.Tensor
    ) -> torch.Tensor:
        """z + α·exp(-β(1 - f·keysᵀ)) scattered onto `classes` (DPE `compute_cache_logits` with one-hot values)."""
        c = self.config
        # Under autocast exp() runs in fp32; the official one-hot matmul brings it back to the logits' dtype.
        return z.index_add(0, classes, (c.alpha * torch.exp(-c.beta * (1.0 - keys @ f))).to(z.dtype))

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        if self.config.amp_fp16 and view_feats.device.type != self._amp_device_type:
            raise ValueError("amp_fp16 runs the official CUDA fp16 autocast and needs CUDA inputs; got "
                             f"{view_feats.device} (set amp_fp16=false)")
        dt = self._dtype_for(view_feats)
        if self.w_global is None:
            self._init_state(view_feats.device, dt)
        feats = view_feats.to(dt)
        out = [self._step(feats[i], self.n_seen + i) for i in range(feats.shape[0])]
        return torch.stack(out)

    def _step(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """One sample: x (V, D) normalised views at stream position t -> (K,) adapted logits."""
        c = self.config
        w_loc = self.w_global  # detached: W_g never carries autograd history
        # Official: both residuals are created as fp16 parameters (`TextResidue`, `PositiveCacheResidue`), whatever
        # the dtype of W_g; W' = normalize(W_g + R) then has the promoted dtype.
        rdt = torch.float16 if c.residual_step == "official_fp16" else w_loc.dtype
        r_text = torch.zeros(w_loc.shape, dtype=rdt, device=w_loc.device, requires_grad=True)
        with torch.enable_grad(), self._autocast():
            w = self._text_prototypes(w_loc, r_text)  # W' (K, D) of the views' logits (the entropy term)
            s = self._train_summary(x, w, t)
            classes = self._present_classes()
            protos = self.cache.class_means(classes)  # (P, D) image prototypes, not normalised
            r_cache = torch.zeros(protos.shape, dtype=rdt, device=protos.device, requires_grad=True)
            keys = F.normalize(protos + r_cache, dim=-1)
            z = self._cache_logits(s.logits[0], s.feats[0], keys, classes)
            loss = marginal_entropy(z[None])  # official avg_entropy of one row = H(softmax z)
            if c.align != 0.0:
                # One-directional: image prototypes are the queries, text prototypes the keys (DPE `main_dpe.py`).
                # W' built again for this term, as the official step loop does (`_text_prototypes`): its fp16
                # gradient is rounded apart from the entropy term's.
                w_align = self._text_prototypes(w_loc, r_text)
                loss = loss + c.align * info_nce(keys, w_align[classes], c.temperature)
            g_text, g_cache = torch.autograd.grad(loss, [r_text, r_cache])
        # A fresh AdamW per sample, one step from zero (docs/methods.md, "DPE/DLAE numerics").
        with torch.no_grad(), self._autocast():
            if c.residual_step == "official_fp16":
                r_text, r_cache = torch_adamw_step([r_text, r_cache], [g_text, g_cache], [c.lr_text, self.lr_image],
                                                   c.adamw_eps, c.weight_decay)
            else:
                r_text = adamw_first_step(r_text.detach(), g_text, c.lr_text, c.adamw_eps, c.weight_decay)
                r_cache = adamw_first_step(r_cache.detach(), g_cache, self.lr_image, c.adamw_eps, c.weight_decay)
            w_new = self._text_prototypes(w_loc, r_text)
            z, f = self._inference(x, w_new)
            final = self._cache_logits(z, f, F.normalize(protos.detach() + r_cache, dim=-1), classes)
            # Global text evolution (DPE `main_dpe.py`): a cumulative average, W_g deliberately not re-normalised. Its
            # dtype is the promoted one, as in the official code: under autocast W' comes out of F.normalize in
            # fp32, so fp16 prototypes become fp32 at their first update.
            if float(marginal_entropy(final[None].float())) / math.log2(self.n_classes) < c.global_threshold:
                self.n_global_updates += 1
                n = self.n_global_updates
                self.w_global = w_loc * (n / (n + 1)) + w_new * (1 / (n + 1))
        return final.float()
