"""BCA — Bayesian Class Adaptation (Zhou et al., CVPR'25, "Bayesian Test-Time Adaptation for Vision-Language
Models"). The official repository (buerzlh/Bayesian-Test-Time-Adaptation-for-Vision-Language-Models) could not be
read here; the reference is TTABC's re-implementation (walawalagoose/TTABC `ttabc/model_selection/bca.py`
`BCAState`, settings `ttabc/configs/algorithms.py` bca). Online and training-free; docs/methods.md, "BCA (`bca`)".

State: class centres μ_m (K, D, from the text prototypes), a likelihood-to-class table P(y|μ_m) (K×K, from the
identity) and two per-class counts c1 (20000) and c2 (1). Per sample (`bca_step`):

1. P(x|μ_m) = s·x·μ_mᵀ per view; with several views the int(V·0.1) lowest-entropy ones are kept
   (`select_confident_samples`), x̄ = their mean feature (not re-normalised) and P their mean logits.
2. Output f = softmax(P) @ P(y|μ) (a distribution over classes), with the state before this sample.
3. With p = max f, y = argmax f: if p > threshold1 (0.05), μ_y ← normalize((c1_y μ_y + x̄) / (c1_y + 1)),
   c1_y += 1; if p > threshold2 (0.65), P(y|μ)_y ← (c2_y P(y|μ)_y + f) / (c2_y + 1), c2_y += 1.

Output (`output_kind = "log_probs"`): log f; where float32 f underflows to 0 the row holds its exact log,
logsumexp_m(log softmax(P)_m + log P(y|μ)_m), finite since the diagonal of P(y|μ) stays positive.
Numerics: float32 (TTABC runs `bca_step` outside autocast on features normalised in float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import torch

from extract.methods.base import (
    IMAGENET_FAMILY,
    MethodConfig,
    OutputKind,
    PromptSet,
    TTAMethod,
    check_hparams_key,
    setting,
)
from extract.methods.common import summarise_views


@dataclass(frozen=True)
class BCAConfig(MethodConfig):
    """BCA's knobs: TTABC's `algorithms.py` bca row (one setting for every dataset)."""

    # tpt=True, batch 64: the original + 63 views (`ttabc/utils/load_data.py`), AugMix off the ImageNet family
    n_views: int = 64
    augmix: bool = False
    prompts: PromptSet = "single"  # TTABC's `ClipZeroShot`: "a photo of a {}."
    cupl: bool = False
    selection_p: float = setting(0.1, gt=0, le=1)  # selection_p
    threshold1: float = setting(0.05, ge=0, le=1)  # update the centre of the predicted class above this confidence
    init_count1: int = setting(20000, ge=0)  # c1: the text prototype's weight in the centre
    threshold2: float = setting(0.65, ge=0, le=1)  # update the class table above this confidence
    init_count2: int = setting(1, ge=0)  # c2: the identity's weight in the class table


class BCA(TTAMethod):
    key: ClassVar[str] = "bca"
    prefix_stable: ClassVar[bool] = True  # centres and table move with samples already seen
    Config: ClassVar[type[MethodConfig]] = BCAConfig
    output_kind: ClassVar[OutputKind] = "log_probs"
    _state_fields: ClassVar[tuple[str, ...]] = ("mu", "table", "count1", "count2")
    # one setting for every dataset; unseen data as the fine-grained sets (AugMix views)
    unseen_like: ClassVar[str] = "dtd"
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> BCAConfig:
        check_hparams_key(hparams_key)
        # TTABC: `AugMixAugmenter(augmix=len(set_id) > 1)`, single letters for the ImageNet family (no --I_augmix)
        return BCAConfig(augmix=hparams_key not in IMAGENET_FAMILY)

    def __init__(self, config: BCAConfig, text_features: torch.Tensor, logit_scale: float, **kwargs: Any) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.mu: torch.Tensor | None = None  # (K, D) class centres
        self.table: torch.Tensor | None = None  # (K, K) P(y | μ_m), rows sum to 1
        self.count1: list[int] = [config.init_count1] * self.n_classes
        self.count2: list[int] = [config.init_count2] * self.n_classes

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        c: BCAConfig = self.config  # type: ignore[assignment]
        dt = self.compute_dtype(view_feats)
        if self.mu is None:
            self.mu = self.text_features.to(view_feats.device, dt, copy=True)
            self.table = torch.eye(self.n_classes, device=view_feats.device, dtype=dt)
        assert self.table is not None
        feats = view_feats.to(dt)
        out = torch.empty(feats.shape[0], self.n_classes, device=feats.device, dtype=dt)
        for b in range(feats.shape[0]):  # sequential by nature: the centres select the next sample's views
            logits = self.logit_scale * feats[b:b + 1] @ self.mu.T  # (1, V, K) `P_x_um`
            s = summarise_views(feats[b:b + 1], logits, c.selection_p)
            f = s.logits.softmax(-1) @ self.table  # (1, K)
            log_f = f.log()
            if bool((f == 0).any()):  # underflow: the exact log in log space
                log_f = torch.where(f > 0, log_f, self._exact_log(s.logits))
            out[b] = log_f[0]
            p, y = f.max(), int(f.argmax())  # `torch.max(output, dim=1)`: compared in f's dtype
            if bool(p > c.threshold1):
                self._update_centre(y, s.feats[0])
            if bool(p > c.threshold2):
                self.table[y] = (self.count2[y] * self.table[y] + f[0]) / (self.count2[y] + 1)
                self.count2[y] += 1
        return out

    def _update_centre(self, y: int, x: torch.Tensor) -> None:
        """`update_centers`: μ_y ← c1·μ_y + x, c1 += 1, μ_y ← μ_y / c1, μ_y ← μ_y / ‖μ_y‖, in that order."""
        assert self.mu is not None
        centre = (self.count1[y] * self.mu[y] + x) / (self.count1[y] + 1)
        self.count1[y] += 1
        self.mu[y] = centre / torch.norm(centre)

    def _exact_log(self, logits: torch.Tensor) -> torch.Tensor:
        """(1, K) log f in log space: logsumexp_m(log softmax(P)_m + log table_mc)."""
        assert self.table is not None
        return (logits.log_softmax(-1)[0][:, None] + self.table.log()).logsumexp(0)[None]

    def summary(self) -> dict[str, Any]:
        """How many centre and table updates the stream made."""
        k, c = self.n_classes, self.config
        return {"centre_updates": sum(self.count1) - k * c.init_count1,  # type: ignore[attr-defined]
                "table_updates": sum(self.count2) - k * c.init_count2}  # type: ignore[attr-defined]
