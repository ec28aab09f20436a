"""A-TPT: TPT with an angular-diversity term on the class text features (`MB-Shihab-Aaqil-Ahamed/A-TPT @d76ecf6`;
docs/methods.md, "A-TPT: angular diversity and its two signs").

The official repository is a fork of C-TPT: same views, prompt learner, optimiser, loss scale and prediction; only
the regulariser differs. With T̂ the (K, D) L2-normalised text features of the current context, each class's
nearest other class by cosine gives c_i = max_{j≠i} T̂_i·T̂_j, its angle θ_i = arccos(clamp(c_i, −τ, τ)), and

    AD = (1/K) Σ_i θ_i        (radians; the mean over classes of the nearest-neighbour angle, not a global min)

Loss per step: marginal entropy of the 6 most confident views −λ·AD (the paper: push the nearest classes apart).

The sign. The paper and the official natural-shift entry point (`tpt_classification.py`, ImageNet-A/-V2/-R/-Sketch)
subtract λ·AD; the official fine-grained + ImageNet entry point (`atpt_classification.py`) *adds* it at HEAD (it
pulls each class towards its nearest neighbour), and the two lines have had opposite signs in every commit. `sign`
picks: "paper" (default, −λ·AD everywhere; also TTABC's re-implementation) or "official_head" (+λ·AD where the
fine-grained script runs, −λ·AD where the natural-shift script runs: the official scripts exactly). `script` says
which entry point a dataset belongs to and `direction` (derived, recorded in the shard's method config) says which
term ran.

Deliberate deviations (numerics only):
    * AD is computed in float32 outside autocast, from the text features of the entropy forward re-normalised in
      float32, for both entry points (the tuner passes them as float32 whatever the features' dtype;
      `angular_diversity` itself keeps a float64 input in float64). The official fine-grained path runs a second,
      fp32 text forward for it (the same values up to the fp16 rounding of the entropy forward's features; its
      gradient then runs back through that fp32 forward, here through the autocast one, under the loss scale); the
      official natural-shift path forms the cosine matrix under autocast in fp16, where τ = 0.99999 rounds to 1.0, so
      the clamp no longer bounds θ away from 0 and any cosine above ~0.99976 reads as exactly 1 (θ = 0). In fp32
      the clamp works as written: θ ≥ arccos(0.99999) = 0.004472 and clamped rows get zero gradient either way.
    * With several samples tuned in one pass (`pass_budget`), AD is taken per sample over that sample's own K×K
      cosine matrix and the per-sample losses are summed (as for C-TPT/O-TPT), so the batched step equals G
      separate steps.
    * `lambda_term` 0 builds no term, so that `atpt` is then `tpt` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from extract.methods.base import MethodConfig, check_hparams_key, setting
from extract.methods.tpt import NATURAL_SHIFT, TPT, TPTConfig

#: "paper": −λ·AD on every dataset; "official_head": the official scripts at HEAD (+λ·AD on ImageNet and the
#: fine-grained sets, −λ·AD on ImageNet-A/-V2/-R/-Sketch).
ATPTSign = Literal["paper", "official_head"]
#: The official entry point a dataset runs under: "fg" (`atpt_classification.py`, scripts/test_tpt_atpt_fg.sh:
#: ImageNet + the 10 fine-grained sets) or "ds" (`tpt_classification.py`, scripts/test_tpt_atpt_ds.sh: A/V2/R/K).
ATPTScript = Literal["fg", "ds"]
#: The term that runs: "expand" (loss − λ·AD: nearest-class angles pushed up) or "contract" (loss + λ·AD).
ATPTDirection = Literal["expand", "contract"]


def angular_diversity(text: torch.Tensor, tau: float = 0.99999) -> torch.Tensor:
    """A-TPT's angular diversity: the mean over classes of the angle to the nearest other class (A-TPT
    `clip/custom_clip.py`).

    S = T̂T̂ᵀ with T̂ the rows of `text` L2-normalised; the diagonal is taken out as in the official code (S − 2·diag(S),
    so a unit vector's self-cosine reads −1 and is never a row maximum); c_i = max_j S_ij (ties: torch's `max`);
    AD = mean_i arccos(clamp(c_i, −τ, τ)). Each (K, D) slice is reduced on its own: with a stack of G samples'
    features no pair crosses two samples. Computed in float32 whatever the autocast state (float64 stays float64).

    Args:
        text: (..., K, D) class text features (re-normalised here; the official code normalises them twice too).
        tau: clamp bound τ < 1: it keeps arccos' derivative finite at a cosine of 1 (duplicate class names).

    Returns:
        (...,) AD in radians, in [arccos τ, π − arccos τ].

    Example:
        >>> import math
        >>> t = torch.tensor([[1.0, 0.0], [math.cos(0.3), math.sin(0.3)], [math.cos(1.0), math.sin(1.0)]])
        >>> round(float(angular_diversity(t)), 6)  # nearest-neighbour angles (0.3, 0.3, 0.7)
        0.433333
    """
    dtype = torch.promote_types(text.dtype, torch.float32)
    with torch.autocast(device_type=text.device.type, enabled=False):
        t = F.normalize(text.to(dtype), p=2, dim=-1)
        s = t @ t.transpose(-1, -2)  # (..., K, K) cosines
        s = s - 2.0 * torch.diag_embed(torch.diagonal(s, dim1=-2, dim2=-1))  # self-cosine 1 -> -1
        nearest = s.max(dim=-1).values  # (..., K) cosine to the nearest other class
        return torch.acos(nearest.clamp(-tau, tau)).mean(-1)


@dataclass(frozen=True)
class ATPTConfig(TPTConfig):
    """A-TPT (`MB-Shihab-Aaqil-Ahamed/A-TPT @d76ecf6`; λ per dataset: docs/methods.md, "Per-dataset settings").
    Everything else is TPT's (C-TPT's harness: lr 5e-3, AdamW weight decay 0.01, 64 views, p 0.1, one step, ctx
    "a photo of a", GradScaler(1000))."""

    # λ = 80: ImageNet + fine-grained (scripts/test_tpt_atpt_fg.sh `--lambda_term 80`); 10: A/V2/R/Sketch
    # (scripts/test_tpt_atpt_ds.sh `--lambda_term 10`). The same for RN50 and ViT-B/16 (one value per script).
    lambda_term: float = setting(80.0, ge=0)
    # τ = 0.99999: atpt_classification.py `--tau_term` default and fg script; hard-coded `tau_ = 0.99999` in
    # clip/custom_clip.py on the ds path (its `--tau_term` is parsed but unused)
    tau: float = setting(0.99999, gt=0, lt=1)
    # "paper" (default): −λ·AD everywhere (paper, ds script, TTABC `ttabc/model_selection/atpt.py`).
    # "official_head": +λ·AD under the fg script (atpt_classification.py at HEAD: `loss += (-lambda_) *
    # min_ang_norm_mean`, min_ang_norm_mean = −AD), −λ·AD under the ds script (tpt_classification.py at HEAD),
    # to reproduce the official scripts exactly. Do not mix the two in one table.
    sign: ATPTSign = "paper"
    # which official script a dataset runs under (set per dataset by `ATPT.default_config`)
    script: ATPTScript = "fg"
    # derived from `sign` and `script` (not settable); recorded in the shard metadata with them
    direction: ATPTDirection = field(default="expand", init=False, metadata={"fixed": True})

    def __post_init__(self) -> None:
        official_fg = self.sign == "official_head" and self.script == "fg"
        object.__setattr__(self, "direction", "contract" if official_fg else "expand")
        super().__post_init__()


class ATPT(TPT):
    """TPT with A-TPT's angular-diversity term: loss = marginal entropy ∓ λ·AD(T̂) (− by default, see `sign`)."""

    key: ClassVar[str] = "atpt"
    prefix_stable: ClassVar[bool] = True  # episodic, as TPT
    Config: ClassVar[type[MethodConfig]] = ATPTConfig

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> ATPTConfig:
        check_hparams_key(hparams_key)
        shift = hparams_key in NATURAL_SHIFT
        # views: the fg script runs without --I_augmix (`augmix = len(set_id) > 1`: crop+flip on ImageNet, AugMix on
        # the fine-grained sets); the ds script passes --I_augmix (AugMix on A/V2/R/Sketch), as C-TPT/O-TPT
        return ATPTConfig(augmix=hparams_key != "imagenet", lambda_term=10.0 if shift else 80.0,
                          script="ds" if shift else "fg")

    def _regulariser(self, text: torch.Tensor) -> torch.Tensor | None:
        cfg: ATPTConfig = self.config  # type: ignore[assignment]
        if cfg.lambda_term == 0:
            # λ = 0 is TPT bit for bit: no term at all. An added zero term would give the same values but make
            # autograd sum two gradients into the text features, which changes their memory layout and so the
            # last bits of the text-encoder backward.
            return None
        term = cfg.lambda_term * angular_diversity(text, cfg.tau)  # (G,), one value per sample
        return -term if cfg.direction == "expand" else term


__all__ = ["ATPT", "ATPTConfig", "angular_diversity"]
