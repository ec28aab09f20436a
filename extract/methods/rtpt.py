"""R-TPT: TPT with a per-view entropy loss and a reliability-weighted ensemble of the tuned views
(`TomSheng21/R-TPT @e085f13`, `rtpt.py`; docs/methods.md, "R-TPT (`rtpt`)").

Per test sample (reset before every sample, as TPT): the 4-token context initialised from "a photo of a" is tuned
by one AdamW step (lr 5e-3, weight decay 0.01) on the mean *per-view* entropy of the int(64·0.1) = 6 lowest-entropy
views (chosen at step 0; TPT tunes on their marginal entropy instead). The prediction is not the original view's:

    S = F̂ F̂ᵀ (V×V cosines of the frozen view features), S_ij ← −inf where S_ij ≥ 1.0,
    score_i = mean of the 20 largest S_ij in row i,   w = softmax(score / 0.01),
    output = Σ_i w_i · s·f̂_i t̂(ctx')ᵀ                 (the tuned prompt's logits of all V views)

The `≥ 1.0` test is the official self-exclusion, and it depends on rounding: a unit vector's fp32 self-dot is 1
within a few ulp, so some views exclude themselves and the others count themselves among their 20 neighbours (a
score higher by about (1 − s_20)/20, several units after the division by 0.01). The official code runs fp32 (no
autocast, no GradScaler) and so does this default; it normalises the view features once
(`clip/custom_clip.py:356-360`) and S is formed from exactly those, so S here is one fp32 matrix product per sample
of the features as the encoder normalised them (`view_normalisation="once"`; a sample's weights never depend on the
other samples of a pass); "twice" re-normalises them first (zaec before issue 31). Features cached in float16
(an autocast encoding; the official run never holds them) are used as given. Which diagonal entries reach 1.0 still
depends on the matmul kernel (CPU vs CUDA, instruction set), as it does in the
official code; `self_exclusion="diagonal"` is the named deviation that always excludes the diagonal (and nothing
else), which removes that dependence.

Deviations for fewer views than the official 64 (never with the defaults): with V ≤ `top_k` the mean runs over
the V − 1 largest entries; with one view the weight is 1. When every score is −inf (all views identical: every
entry ≥ 1.0) the weights are uniform, where the official softmax gives NaN.

Everything else is TPT's machinery (`tpt.EpisodicTuner`): batched passes, the execution-only shortcuts, the
optional loss scale (off by default: `amp=False`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from extract.methods.base import IMAGENET_FAMILY, MethodConfig, Ref, check_hparams_key, setting
from extract.methods.common import softmax_entropy
from extract.methods.tpt import TPT, TPTConfig

#: "official": S_ij ≥ 1.0 is excluded (R-TPT `rtpt.py:get_top_sim`); "diagonal": exactly the diagonal.
SelfExclusion = Literal["official", "diagonal"]
ViewNormalisation = Literal["once", "twice"]


def reliability_weights(feats: torch.Tensor, top_k: int = 20, temperature: float = 0.01,
                        self_exclusion: SelfExclusion = "official", renormalise: bool = False) -> torch.Tensor:
    """R-TPT's view weights (`rtpt.py:get_top_sim` and the softmax after it).

    Each sample's (V, V) cosine matrix is its own matrix product (not one batched product), so a sample's weights
    are the same whatever else is in the batch.

    Args:
        feats: (G, V, D) view features, L2-normalised once as the official code holds them
            (`clip/custom_clip.py`: `image_features / image_features.norm(...)`); the `≥ 1.0` test reads their bits.
        top_k: neighbours averaged per view (20).
        temperature: softmax temperature of the scores (0.01).
        self_exclusion: "official" (entries ≥ 1.0 become −inf) or "diagonal" (the diagonal does).
        renormalise: divide the features by their norm again first, in their dtype (`RTPTConfig.view_normalisation`).

    Returns:
        (G, V) weights, each row summing to 1.

    Example:
        >>> f = torch.tensor([[[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]]])
        >>> w = reliability_weights(f, top_k=2, self_exclusion="diagonal")  # scores 0.4, 0.7, 0.3
        >>> w.argmax(-1).item(), round(float(w.sum()), 6)  # the view closest to the others
        (1, 1.0)
    """
    g, v, _ = feats.shape
    if v == 1:
        return torch.ones(g, 1, dtype=feats.dtype, device=feats.device)
    f = feats / feats.norm(dim=-1, keepdim=True) if renormalise else feats
    sim = torch.stack([fi @ fi.T for fi in f])  # (G, V, V), one product per sample
    score = neighbour_scores(sim, top_k, self_exclusion)
    w = torch.softmax(score / temperature, dim=-1)
    dead = torch.isneginf(score).all(-1, keepdim=True)  # every view excluded everywhere: uniform, not NaN
    return torch.where(dead, torch.full_like(w, 1.0 / v), w)


def neighbour_scores(sim: torch.Tensor, top_k: int = 20, self_exclusion: SelfExclusion = "official") -> torch.Tensor:
    """`get_top_sim`: entries excluded (−inf), then the mean of each row's `min(top_k, V − 1)` largest entries.

    Args:
        sim: (G, V, V) cosine matrices, V >= 2.
        top_k: neighbours averaged (20).
        self_exclusion: "official": entries ≥ 1.0 (a self-similarity that rounded to 1.0 or above, and any pair of
            views that equal to within rounding); "diagonal": exactly the diagonal.

    Returns:
        (G, V) scores (−inf where a row's top entries include an excluded one).

    Example:
        >>> s = torch.tensor([[[1.0, 0.5], [0.5, 0.99999994]]])  # the second self-similarity rounded below 1.0
        >>> neighbour_scores(s, top_k=1).tolist()  # ... so that view is its own nearest neighbour
        [[0.5, 0.9999999403953552]]
    """
    v = sim.shape[-1]
    if self_exclusion == "official":
        excluded = sim >= 1.0
    else:
        excluded = torch.eye(v, dtype=torch.bool, device=sim.device).expand_as(sim)
    return sim.masked_fill(excluded, float("-inf")).topk(min(top_k, v - 1), dim=-1).values.mean(-1)


@dataclass(frozen=True)
class RTPTConfig(TPTConfig):
    """R-TPT (`TomSheng21/R-TPT @e085f13`); the rest is TPT's harness as R-TPT's `rtpt.py` sets it."""

    # fp32 without autocast or a loss scale: `scaler = None` and no autocast in `rtpt.py:test_time_tuning`;
    # `convert_weights` is commented out in clip/model.py, so the weights are fp32
    amp: bool = False
    # 20 neighbours: `k = 20` hard-coded in `rtpt.py:get_top_sim`
    top_k: int = setting(20, ge=1, le=Ref("n_views", -1, floor=1))
    # softmax(score / 0.01): `rtpt.py:test_time_adapt_eval`
    temperature: float = setting(0.01, gt=0)
    # the `sim_matrix >= 1.0` test of `get_top_sim` ("official"), or always the diagonal (a named deviation)
    self_exclusion: SelfExclusion = "official"
    # "once": S from the view features as the encoder normalised them, as the official code does (it normalises
    # once, `clip/custom_clip.py:356-360`, and the `>= 1.0` self-exclusion reads exactly those bits). "twice":
    # re-normalise in the compute dtype first (zaec before issue 31; on once-normalised fp32 features with CLIP-like
    # cosines 39-51 of 64 self-similarities reach 1.0 where the official reaches 34-41, and the weights move by up
    # to 0.55x the largest weight). Features cached in float16 reproduce neither
    # (docs/methods.md, "R-TPT (`rtpt`)")
    view_normalisation: ViewNormalisation = "once"
    # n_views 64 (`-b 64`, README), lr 5e-3 (`--lr` default), weight decay 0.01 (AdamW default: only the lr is
    # passed), tta_steps 1, selection_p 0.1 (argparse defaults in rtpt.py), ctx_init "a photo of a" (README
    # `--ctx_init a_photo_of_a`): TPTConfig's values


class RTPT(TPT):
    """TPT with R-TPT's per-view entropy loss and reliability-weighted ensemble over the tuned views."""

    key: ClassVar[str] = "rtpt"
    prefix_stable: ClassVar[bool] = True  # episodic, as TPT
    Config: ClassVar[type[MethodConfig]] = RTPTConfig
    # unseen data: the fine-grained settings (AugMix views), as TPT

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> RTPTConfig:
        check_hparams_key(hparams_key)
        # `AugMixAugmenter(..., augmix=len(dset) > 1)` in rtpt.py: AugMix on the fine-grained sets, crop+flip on the
        # one-letter ImageNet-family sets; nothing else depends on the dataset
        return RTPTConfig(augmix=hparams_key not in IMAGENET_FAMILY)

    def _tuning_loss(self, chosen: torch.Tensor) -> torch.Tensor:
        # `rtpt.py:entropy_avg`: the mean of the selected views' own entropies
        return softmax_entropy(chosen).mean(-1)

    def _predict(self, feats: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        cfg: RTPTConfig = self.config  # type: ignore[assignment]
        again = cfg.view_normalisation == "twice"
        with torch.autocast(device_type=feats.device.type, enabled=False):
            w = reliability_weights(feats, cfg.top_k, cfg.temperature, cfg.self_exclusion, again)  # (G, V)
        logits = self._logits(feats, text)  # (G, V, K): the tuned prompt on every view
        return (w.to(logits.dtype)[:, None] @ logits)[:, 0]


__all__ = ["RTPT", "RTPTConfig", "neighbour_scores", "reliability_weights"]
