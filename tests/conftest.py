"""Shared fixtures (keep minimal; helpers may append).

The extraction stage's fixtures (`tiny_model_dir`, `tiny_model`, `one_thread`) live in tests/support/extract.py,
registered here as a plugin: a test names them as arguments and imports nothing. Helpers that several test modules
share live in tests/support/ too; no test module imports from another.
"""

from __future__ import annotations

import numpy as np
import pytest

from schemas.shard import ShardMeta

pytest_plugins = ["tests.support.extract"]


@pytest.fixture
def make_meta():
    """Factory for a valid ShardMeta: make_meta(dataset="dtd", k=5, method="tda", seed=1, **overrides)."""

    def _make(dataset: str = "dtd", k: int = 5, method: str = "tda", seed: int = 1, **kw) -> ShardMeta:
        args = dict(
            backbone="ViT-B-16", pretrained="openai", dataset=dataset, method=method, seed=seed,
            class_names=tuple(f"c{i}" for i in range(k)), method_config={"alpha": 1}, zs_prompts={"t": ["a {}"]},
        )
        args.update(kw)
        return ShardMeta(**args)

    return _make


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)
