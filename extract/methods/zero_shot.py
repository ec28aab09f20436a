"""Zero-shot CLIP: the frozen model, one prompt, the original view (the anchor of every shard)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from extract.methods.base import MethodConfig, PromptSet, TTAMethod, check_hparams_key


@dataclass(frozen=True)
class ZeroShotConfig(MethodConfig):
    n_views: int = 1  # the original view only (docs/methods.md, "The zero-shot baseline")
    augmix: bool = False
    prompts: PromptSet = "single"  # "a photo of a {}." (C-TPT `--run_type baseline`)
    cupl: bool = False


class ZeroShot(TTAMethod):
    """logits = logit_scale · f̂₀ · t̂ᵀ for the original view f̂₀; stateless."""

    key: ClassVar[str] = "zero-shot"
    prefix_stable: ClassVar[bool] = True  # each row is its own sample's zero-shot logits
    Config: ClassVar[type[MethodConfig]] = ZeroShotConfig
    unseen_like: ClassVar[str] = "imagenet"  # the same config for every dataset

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> ZeroShotConfig:
        check_hparams_key(hparams_key)
        return ZeroShotConfig()

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        dt = self.compute_dtype(view_feats)
        return self.logit_scale * view_feats[:, 0].to(dt) @ self.text_features.to(dt).T
