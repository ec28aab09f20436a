"""The pixels a method reads besides the cached features (`TTAMethod.consumes_for`), drawn exactly as the encoding
pass draws them (`extract/run/encode.py` `_ViewData`: the same loader item, generator, seed and policy) and
finished on the model's device:

- "view_pixels" (TTL, which adapts the image encoder per sample): per stream position the original view and views
  1..63 (`ViewImages`);
- "batch_pixels" (Tent, SAR, DeYO, BATCLIP, ...: the image encoder adapted over batches of test images): per batch
  of stream positions the original views (`BatchPixels`), read ahead by loader processes where the run has them.

docs/architecture.md, "A method that adapts over batches"; docs/methods.md, "TTL: LoRA on the image encoder".
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from extract.datasets import DatasetError, TestSet
from extract.models import LoadedModel
from extract.run.encode import _ignore_sigint, _start_loader, _to_device, _ViewData
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


class BatchPixels:
    """`get(start, stop)` -> (stop − start, 3, S, S) float32 original views (view 0) of stream positions
    [start, stop) on the model's device: the pixels the encoding pass encodes into the cache's view 0 (a loader
    item of those positions, `ViewGenerator.original_raw`, then `finish` on the device).

    The calls of a run continue one another (batch after batch); the loader then reads ahead, one item per batch,
    in `workers` processes (0: in this process, nothing ahead). A call that does not continue the previous one (a
    resumed run, a replay) starts the loader again at its `start`. `close` stops the loader processes.

    Args:
        model: the run's model (its preprocessing and device). testset, perm: the test set and the stream.
        seed: the run's seed (view 0 draws nothing; kept for the generator's identity). stop: the run's last
            position + 1. workers: loader processes. An item holds the positions of one call (the method's batch),
            the width of the call that started the loader.
    """

    def __init__(self, model: LoadedModel, testset: TestSet, perm: np.ndarray, seed: int, *, stop: int,
                 workers: int = 0):
        self.model, self.testset, self.perm = model, testset, perm
        self.stop, self.workers = int(stop), int(workers)
        self.gen = ViewGenerator(model.preprocess, "single", seed=seed)
        self._it: Any = None
        self._next = -1  # the first position of the loader's next item

    def _start(self, start: int, width: int) -> None:
        self.close()
        items = [[(p, True, False) for p in range(s, min(s + width, self.stop))]
                 for s in range(start, self.stop, width)]
        dev = self.model.device
        loader = torch.utils.data.DataLoader(_ViewData(self.testset, self.perm, items, self.gen), batch_size=None,
                                             shuffle=False, num_workers=self.workers,
                                             pin_memory=dev.type == "cuda",
                                             worker_init_fn=_ignore_sigint if self.workers else None)
        self._it, self._next = _start_loader(loader), start

    def get(self, start: int, stop: int) -> torch.Tensor:
        if not 0 <= start < stop <= self.stop:
            raise ValueError(f"pixels of positions {start}..{stop - 1} asked for; the run has 0..{self.stop - 1}")
        if start != self._next or self._it is None:
            self._start(start, stop - start)
        positions, v0, _, _, _ = next(self._it)  # large images were reported by the encoding pass
        if isinstance(v0, str):  # an image that cannot be read (named in the message)
            raise DatasetError(v0)
        if positions != list(range(start, stop)):  # a call of another width than the previous ones
            self._start(start, stop - start)
            return self.get(start, stop)
        self._next = stop
        return self.gen.finish(_to_device(v0, self.model.device))

    def close(self) -> None:
        """Stop the loader processes (nothing to do without them)."""
        if self._it is not None:
            getattr(self._it, "_shutdown_workers", lambda: None)()
        self._it, self._next = None, -1


def attach_pixels(method: Any, consumes: str, model: LoadedModel, testset: TestSet, perm: np.ndarray,
                  policy: ViewPolicy, seed: int, *, stop: int, workers: int = 0) -> BatchPixels | None:
    """Give a method that reads pixels (`consumes`: "view_pixels" or "batch_pixels") its reader; nothing is read
    until it adapts. Returns the `BatchPixels` to close at the end of the run, else None."""
    if consumes == "view_pixels":
        method.attach_views(ViewImages(model, testset, perm, policy, seed).get)
    if consumes != "batch_pixels":
        return None
    reader = BatchPixels(model, testset, perm, seed, stop=stop, workers=workers)
    method.attach_pixels(reader.get)
    return reader
