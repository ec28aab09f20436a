"""What every method that adapts over batches of test images shares (`consumes = "batch_pixels"`): its settings
(`BatchConfig`) and its side of the run's contract (`PixelBatchMethod`); docs/architecture.md, "A method that
adapts over batches".

The run cuts the stream into batches of `config.batch_size` consecutive positions (`adapt_width`; the last batch of
a run may be shorter) and calls `adapt` once per batch with the cached features of the batch's views, (B, V, D),
whose view 0 also gives the run's zero-shot rows. Before the first call it gives the method `reader(start, stop)`
for the batch's pixels (`attach_pixels`): the original views of those positions, preprocessed as the encoding pass
preprocesses them, on the model's device. The method reads positions [n_seen, n_seen + B) (`batch_images`), adapts
on them and returns the batch's (B, K) rows. The run passes the loaded model as `text_encoder` (the method adapts a
copy of its encoder: the shared model, which the zero-shot rows and the feature cache read, stays as loaded).

Its state after each part (`state_dict`: tensors, numbers, lists and dicts; loadable with `weights_only=True`) is
saved beside the part, and a resumed run loads it instead of replaying the kept prefix (`PlannedRun.restore`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import torch

from extract.methods.base import Consumes, MethodConfig, PromptSet, Towers, TTAMethod, setting


@dataclass(frozen=True)
class BatchConfig(MethodConfig):
    """Settings of a method that adapts over batches: one view (the batch's original images, whose cached
    features give the zero-shot rows), the prompt "a photo of a {}.", state carried across batches."""

    n_views: int = field(default=1, metadata={"fixed": True})
    augmix: bool = field(default=False, metadata={"fixed": True})
    prompts: PromptSet = field(default="single", metadata={"fixed": True})
    cupl: bool = field(default=False, metadata={"fixed": True})
    episodic: bool = field(default=False, metadata={"fixed": True})
    # samples adapted together: the stream is cut into batches [k·B, (k+1)·B), recorded with the run
    batch_size: int = setting(64, ge=1)


@contextlib.contextmanager
def batch_statistics_hint(key: str, n: int) -> Iterator[None]:
    """Turn torch's refusal of batch statistics over one value per channel (a forward of `n` images, one, through
    a ResNet whose last stage is 1x1 at its input size; RN50 at 224 px is 7x7) into one line saying what to change.
    The run refuses such a batch before the model loads (`Towers.batch_statistics`); this is the method's own guard.
    """
    try:
        yield
    except ValueError as e:
        if "more than 1 value per channel" not in str(e):
            raise
        raise ValueError(f"{key}: the image encoder's BatchNorms normalise with the statistics of the batch they see, "
                         f"and a batch of {n} image(s) leaves one value per channel in the ResNet's last stage (1x1 "
                         "at this input size; RN50 at 224 px keeps 7x7), as in the official code; choose a batch_size "
                         "that leaves no such batch at the end of the stream, or larger images") from None


class PixelBatchMethod(TTAMethod):
    """A method fed batches of pixels: `adapt_width` is the config's `batch_size`, the run attaches the pixel reader
    (`attach_pixels`) and passes the model (`needs_text_encoder`). Subclasses implement `_adapt` on one batch:
    (B, V, D) cached view features -> (B, K), reading the batch's pixels with `batch_images`."""

    consumes: ClassVar[Consumes] = "batch_pixels"
    needs_text_encoder: ClassVar[bool] = True  # the runner passes the model (its encoder is adapted, on a copy)

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, **kwargs: Any) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        self._pixels: Callable[[int, int], torch.Tensor] | None = None

    @classmethod
    def adapt_width(cls, config: MethodConfig) -> int | None:
        return int(config.batch_size)  # type: ignore[attr-defined]

    @classmethod
    def towers(cls, config: MethodConfig) -> Towers:
        # a ResNet's BatchNorms on the statistics of each batch (`normtta.configure_norms`, `norm_tuning.TunedCLIP`)
        return Towers(batch_statistics=True)

    def attach_pixels(self, reader: Callable[[int, int], torch.Tensor]) -> None:
        self._pixels = reader

    def batch_images(self, b: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """(b, 3, S, S) original views of stream positions [n_seen, n_seen + b) on `device` in `dtype`."""
        if self._pixels is None:
            raise ValueError(f"{self.key} adapts the image encoder over batches of pixels; the runner attaches them "
                             "(`attach_pixels`)")
        width = self.adapt_width(self.config)
        if width is not None and b > width:
            raise ValueError(f"{self.key}: an adapt call of {b} samples, more than its batch_size {width}")
        images = torch.as_tensor(self._pixels(self.n_seen, self.n_seen + b))
        if images.ndim != 4 or images.shape[0] != b or images.shape[1] != 3:
            raise ValueError(f"{self.key}: pixels of shape {tuple(images.shape)} for a batch of {b} samples; "
                             "expected (B, 3, S, S)")
        return images.to(device, dtype)
