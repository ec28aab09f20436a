"""MTA — MeanShift for test-time augmentation (Zanella & Ben Ayed, CVPR'24; official code `MaxZanella/MTA @cafafdf`,
`mta.py` `solve_mta`). Episodic and training-free; docs/methods.md § MTA.

Per sample, from the V = 64 views' features f_v (the original + 63 crop+flip) and logits z_v = s·f_v·T̂ᵀ:

1. Bandwidth per view: h_v² = ½ · mean of the squared distances to its int(0.3·(V-1)) nearest other views.
2. Affinity A = softmax(z)·softmax(z)ᵀ (V×V); inlierness y = 1/V; mode m = f_0.
3. Five rounds of: (a) density d_v = exp(-‖f_v - m‖² / 2h_v²); up to five steps y ← softmax((d + λq·A·y) / λy),
   stopping early when ‖Δy‖ < 1e-6; (b) up to five steps m ← Σ d_v y_v f_v / Σ d_v y_v, re-normalised, with d
   recomputed at the current m, stopping early when ‖Δm‖ < 1e-6.
4. Output s·m·T̂ᵀ (logits).

Batched: every sample runs the same loop; a sample whose inner loop has stopped keeps its value while the others go
on (`_masked_steps`), so a chunk gives the rows of one-at-a-time runs. fp32 throughout (the official features are
normalised in fp32 under autocast and the loop runs outside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from extract.methods.base import MethodConfig, PromptSet, TTAMethod, check_hparams_key, setting


@dataclass(frozen=True)
class MTAConfig(MethodConfig):
    """MTA's knobs: one setting for every dataset (`main.py`, `mta.py`)."""

    n_views: int = 64  # -b 64: batch of the original + 63 views (`main.py`, README's commands)
    augmix: bool = False  # AugMixAugmenter(augmix=len(set_id) > 1 and args.tpt): crop+flip only under --mta
    prompts: PromptSet = "single"  # CoOp learner with --ctx_init a_photo_of_a: "a photo of a {}." (`main.py`)
    cupl: bool = False
    episodic: bool = field(default=True, metadata={"fixed": True})
    lambda_y: float = setting(0.2, gt=0)  # --lambda_y 0.2 (`main.py:347`, entropic term)
    lambda_q: float = setting(4.0, ge=0)  # --lambda_q 4 (`main.py:346`, quadratic term)
    neighbours_p: float = setting(0.3, gt=0, le=1)  # k = int(0.3 * (V - 1)) nearest views for the bandwidth (`mta.py`)
    max_iter: int = setting(5, ge=0)  # outer rounds and the cap of each inner loop (`mta.py`: max_iter = 5)
    threshold: float = setting(1e-6, ge=0)  # th: inner loops stop when the update's L2 norm falls below it (`mta.py`)


def _masked_steps(value: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor], n_steps: int,
                  threshold: float) -> torch.Tensor:
    """Run `value ← step(value)` at most `n_steps` times per row, each row stopping after the first step whose
    change has L2 norm < threshold (the official `while not converged` loops, one row per sample).

    Args:
        value: (B, ...) current values.
        step: maps (B, ...) -> (B, ...), row-wise independent.
        n_steps: the cap (5).
        threshold: the stopping tolerance.
    """
    active = torch.ones(value.shape[0], dtype=torch.bool, device=value.device)
    for _ in range(n_steps):
        new = step(value)
        shape = (-1,) + (1,) * (value.ndim - 1)
        changed = (new - value).flatten(1).norm(dim=1)
        value = torch.where(active.view(shape), new, value)
        active = active & ~(changed < threshold)
        if not bool(active.any()):
            break
    return value


class MTA(TTAMethod):
    """MeanShift mode of the view features with inlierness scores. Stateless; every sample is independent."""

    key: ClassVar[str] = "mta"
    prefix_stable: ClassVar[bool] = True  # each row is its own sample's mode
    Config: ClassVar[type[MethodConfig]] = MTAConfig
    unseen_like: ClassVar[str] = "imagenet"  # one setting for every dataset

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> MTAConfig:
        check_hparams_key(hparams_key)
        return MTAConfig()

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        cfg: MTAConfig = self.config  # type: ignore[assignment]
        dt = self.compute_dtype(view_feats)
        f = view_feats.to(dt)  # (B, V, D) L2-normalised
        t = self.text_features.to(dt)
        if f.shape[1] == 1:
            # one view: the mode is that view (the official bandwidth would average zero distances: NaN)
            return self.logit_scale * f[:, 0] @ t.T
        logits = self.logit_scale * f @ t.T  # (B, V, K)
        bw2 = self._bandwidth_sq(f, cfg.neighbours_p)  # (B, V)
        prob = logits.softmax(-1)
        affinity = prob @ prob.transpose(1, 2)  # (B, V, V)
        y = torch.full(f.shape[:2], 1.0 / f.shape[1], dtype=dt, device=f.device)
        mode = f[:, 0]

        def density(m: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B, V)
            return torch.exp(-(f - m[:, None]).norm(dim=-1) ** 2 / (2 * bw2))

        for _ in range(cfg.max_iter):
            d = density(mode)
            y = _masked_steps(
                y, lambda yy: (1 / cfg.lambda_y * (d + cfg.lambda_q * (affinity * yy[:, None, :]).sum(-1))).softmax(-1),
                cfg.max_iter, cfg.threshold)

            def mode_step(m: torch.Tensor) -> torch.Tensor:
                w = density(m) * y  # (B, V)
                new = (w[..., None] * f).sum(1) / w.sum(1, keepdim=True)
                return new / new.norm(dim=-1, keepdim=True)

            mode = _masked_steps(mode, mode_step, cfg.max_iter, cfg.threshold)
        return self.logit_scale * mode @ t.T

    @staticmethod
    def _bandwidth_sq(f: torch.Tensor, neighbours_p: float) -> torch.Tensor:
        """h_v² = ½ mean of the k smallest squared distances to the other views, k = int(p·(V-1)) (at least 1:
        with fewer than 5 views the official k = 0 averages nothing and gives NaN)."""
        k = max(1, int(neighbours_p * (f.shape[1] - 1)))
        dist = torch.cdist(f, f)  # (B, V, V), as the official code (its mm path for V > 25)
        nearest = torch.sort(dist, dim=-1).values[..., 1:k + 1] ** 2  # excludes the smallest (the view itself)
        return 0.5 * nearest.mean(-1)
