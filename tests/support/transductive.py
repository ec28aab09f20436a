"""What the tests of the transductive methods (StatA, TransCLIP, ZLaP) share: small synthetic units (random text
prototypes, features clustered around them) and one solve of a method over a whole unit."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

K, D = 5, 16


def make_text(seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(K, D) L2-normalised random prototypes, drawn in float64 and cast."""
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(K, D, generator=g, dtype=torch.float64), dim=-1).to(dtype)


def make_set(n: int, text: torch.Tensor, seed: int = 1, noise: float = 0.8, classes: int = K) -> torch.Tensor:
    """(n, 1, D) normalised features around the prototypes of random classes among the first `classes`, in the
    prototypes' dtype."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = text.double()[y] + noise * torch.randn(n, D, generator=g, dtype=torch.float64) / D ** 0.5
    return F.normalize(x, dim=-1).to(text.dtype)[:, None]


def solve(cls: type, x: torch.Tensor, text: torch.Tensor, scale: float = 100.0, **changes: Any
          ) -> tuple[torch.Tensor, Any]:
    """The rows of `cls` (its dtd defaults with `changes`) over the whole unit `x`, in the features' dtype (`adapt`
    itself returns float32), and the method."""
    cfg = dataclasses.replace(cls.default_config("dtd", "ViT-B-16"), **changes)
    m = cls(cfg, text, scale, backbone="ViT-B-16", dataset="dtd")
    m.attach_set(lambda a, b: x[a:b], len(x))
    return m._adapt(x), m


def assert_float32_matches(cls: type, ref: Any) -> None:
    """The run's numerics: float32 features and prototypes through `cls` against `ref` (a float64 transcription of
    the official solve returning z) on 40 samples: finite log-probabilities, probabilities within float32 rounding
    carried through the solve's 55 z-steps (10³ eps32), the same predictions."""
    text = make_text(dtype=torch.float32)
    x = make_set(40, text)
    want = ref(x[:, 0].double(), text.double())
    got = solve(cls, x, text)[0]
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double().exp(), want, rtol=0, atol=1e3 * torch.finfo(torch.float32).eps)
    assert torch.equal(got.argmax(1), want.argmax(1))
