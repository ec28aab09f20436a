"""The views' pixels for a method that adapts the image encoder (TTL): per stream position, the original view and
views 1..63 drawn exactly as the encoding pass draws them (`extract/run/encode.py` `_ViewData`: same generator,
seed and policy), finished on the model's device (docs/methods.md, "TTL: LoRA on the image encoder")."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from extract.datasets import DatasetError, TestSet
from extract.models import LoadedModel
from extract.run.encode import _ViewData
from extract.views import ViewGenerator, ViewPolicy


class ViewImages:
    """`get(start, stop)` -> (stop − start, V, 3, S, S) float32 preprocessed views on the model's device."""

    def __init__(self, model: LoadedModel, testset: TestSet, perm: np.ndarray, policy: ViewPolicy, seed: int):
        self.model, self.policy = model, policy
        self.gen = ViewGenerator(model.preprocess, policy, seed=seed)
        self.data = _ViewData(testset, perm, [], self.gen)

    def _one(self, pos: int) -> torch.Tensor:
        self.data.items = [[(pos, True, self.policy != "single")]]
        _, v0, aug, coef, _ = self.data[0]
        if isinstance(v0, str):  # an image that cannot be read (named in the message)
            raise DatasetError(v0)
        dev = self.model.device
        views = [self.gen.finish(v0.to(dev))]
        if aug is not None:
            views.append(self.gen.finish(aug.to(dev), None if coef is None else coef.to(dev)))
        return torch.cat(views)

    def get(self, start: int, stop: int) -> torch.Tensor:
        return torch.stack([self._one(p) for p in range(start, stop)])


def attach_views(method: Any, model: LoadedModel, testset: TestSet, perm: np.ndarray, policy: ViewPolicy,
                 seed: int) -> None:
    """Give a method that consumes "view_pixels" its reader of the views' pixels (nothing is read until it adapts)."""
    if getattr(method, "consumes", "features") == "view_pixels":
        method.attach_views(ViewImages(model, testset, perm, policy, seed).get)
