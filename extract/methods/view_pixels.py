"""The views' pixels of a method that runs the image encoder itself (`consumes = "view_pixels"`: TTL, DART,
PromptAlign): the runner attaches a reader of the preprocessed views (`attach_views`; extract/run/pixels.py, the
same views as the encoding pass), and the method reads the stream positions it is at (`views_of`).
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch

from extract.methods.base import Consumes


class ViewPixels:
    """`attach_views` and `views_of` for a method that reads its views' pixels; put it before `TTAMethod` in the
    bases. `pixels_use` says what the method does with them (the error when no reader is attached)."""

    key: ClassVar[str]
    consumes: ClassVar[Consumes] = "view_pixels"
    pixels_use: ClassVar[str] = "runs the image encoder"
    _views: Callable[[int, int], torch.Tensor] | None = None

    def attach_views(self, reader: Callable[[int, int], torch.Tensor]) -> None:
        """`reader(start, stop)` -> (stop − start, V, 3, S, S) preprocessed views of those stream positions."""
        self._views = reader

    def views_of(self, start: int, n: int, v: int) -> torch.Tensor:
        """(n, v, 3, S, S) the views of stream positions [start, start + n), as the reader gives them.

        Raises:
            ValueError: one line when no reader is attached or its views are not of that shape.
        """
        if self._views is None:
            raise ValueError(f"{self.key} {self.pixels_use} and needs the views' pixels; the runner attaches them "
                             "(`attach_views`)")
        images = torch.as_tensor(self._views(start, start + n))
        if images.ndim != 5 or images.shape[:2] != (n, v):
            raise ValueError(f"{self.key}: view images of shape {tuple(images.shape)} for {n} "
                             f"sample{'' if n == 1 else 's'} of {v} views")
        return images
