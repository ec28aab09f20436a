"""What the tests of the transductive methods (StatA, TransCLIP, ZLaP) share: small synthetic units (random text
prototypes, features clustered around them, drawn as the online methods' tests draw theirs), one solve of a method
over a whole unit, and the official k-nearest-neighbour affinity the references build."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tests.support.online import clustered_views, prototypes

K, D = 5, 16


def make_text(seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(K, D) L2-normalised random prototypes, drawn in float64 and cast."""
    return prototypes(K, D, seed).to(dtype)


def make_set(n: int, text: torch.Tensor, seed: int = 1, noise: float = 0.8, classes: int = K) -> torch.Tensor:
    """(n, 1, D) normalised features around the prototypes of random classes among the first `classes`, drawn in
    float64 and cast to the prototypes' dtype."""
    return clustered_views(n, 1, text.double()[:classes], seed, noise)[0].to(text.dtype)


def ref_affinity(x: torch.Tensor, n_neighbors: int) -> torch.Tensor:
    """The official `build_affinity_matrix` (TransCLIP's `TransCLIP_utils.py`; StatA's solver builds the same) on
    (N, D) features, line by line: the dense (N, N) matrix W whose row i holds the cosines to its `n_neighbors`
    most similar other samples (the `n_neighbors + 1` largest without the first, the sample itself)."""
    n = x.shape[0]
    affinity = x.matmul(x.T)
    knn_index = affinity.topk(n_neighbors + 1, -1, largest=True).indices[:, 1:]
    rows = torch.arange(n).unsqueeze(1).repeat(1, n_neighbors).flatten()
    cols = knn_index.flatten()
    return torch.sparse_coo_tensor(torch.stack([rows, cols]), affinity[rows, cols], size=(n, n),
                                   check_invariants=False).to_dense()


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
