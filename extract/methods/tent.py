"""Tent on CLIP: entropy minimisation of the image encoder's normalisation layers over batches of test images
(TTABC `ttabc/model_selection/tent.py`; BATCLIP's port `classification/methods/tent.py`; the original
DequanWang/tent `tent.py`; docs/methods.md, "Tent (`tent`)").

Per batch of 64 test images (the stream cut into consecutive batches, the adaptation carried across them): one step
of AdamW (lr 5e-3, weight decay 1e-4) on the mean softmax entropy of the batch's logits, which trains the weight and
bias of every normalisation layer of the image encoder (ViT: its LayerNorms; RN50: its BatchNorms, which normalise
with the batch's statistics); the batch's rows are then the logits of a second forward of the updated encoder
(`predict`). The core (the adapted copy, its layers, the precision) is `extract.methods.normtta`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from extract.methods.base import MethodConfig, check_hparams_key
from extract.methods.normtta import NormConfig, NormTTA
from extract.methods.panda import PandaFields


@dataclass(frozen=True)
class TentConfig(PandaFields, NormConfig):
    """Tent's settings: TTABC `ttabc/configs/algorithms.py` "tent" (AdamW, batch 64, not episodic) and `main.py`
    (lr 5e-3, one step); the fields and their sources are `NormConfig`'s, Panda's `PandaFields`' (TTABC `panda.py`
    is Tent with Panda)."""


class Tent(NormTTA):
    """Tent: per batch, one entropy-minimisation step on the image encoder's normalisation layers, online
    (`NormTTA`'s batch loop with its `entropy_step`)."""

    key: ClassVar[str] = "tent"
    # a batch's rows read that batch and the ones before it; a --limit that ends inside a batch shortens it (the
    # run then refuses to serve it from a longer run: RunDir.shorter_refusal)
    prefix_stable: ClassVar[bool] = True
    Config: ClassVar[type[MethodConfig]] = TentConfig
    # Unseen data: Tent has one setting for every set
    unseen_like: ClassVar[str] = "dtd"

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> TentConfig:
        check_hparams_key(hparams_key)
        return TentConfig()
